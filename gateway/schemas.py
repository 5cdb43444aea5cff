"""Request bodies of /v1/completions and /v1/chat/completions (OpenAI's field names), validated into one
``Job``: what AsyncClient is asked for. Anything the fleet cannot honour is refused with a 400 naming the
field, never silently ignored (``n`` > 1, logprobs, penalties, tools, ...); fields that change nothing
(``user``, ``model`` when it names this fleet) are accepted.

Extensions, all optional: ``timeout`` (seconds; at most the gateway's --request-timeout, HTTP 504 past
it), ``top_k`` (0 = off) and ``priority`` (vLLM's integer: lower is more urgent), as vLLM accepts them.
OpenAI's ``service_tier`` picks the priority class: ``flex`` -> batch, ``auto`` / ``default`` ->
interactive (common/lanes.py); ``priority`` > 0 -> batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from batchfleet.common.lanes import lane_of
from batchfleet.common.protocol import MIN_TEMPERATURE
from batchfleet.gateway.errors import invalid

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
TokenIds = list[StrictInt]
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Job:
    """One validated request: the prompt (text, token ids or chat messages) and AsyncClient's parameters."""

    prompt: str | list[int] | list[dict[str, str]]
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    timeout: float
    model: str | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (clients send vendor extras)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    user: StrictStr | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None
    priority: StrictInt | None = None

    def refuse_unsupported(self) -> None:
        """400 for features the fleet does not implement (silently dropping them would change answers)."""
        if self.n not in (None, 1):
            raise invalid("only n=1 is supported: send one request per completion", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise invalid(f"{name} is not supported", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.logprobs not in (None, False, 0):
            raise invalid("logprobs are not supported", "logprobs")

    def lane(self) -> str:
        """The priority class: ``priority`` (vLLM's integer) when given, else ``service_tier``, else
        interactive; both given and disagreeing is a 400."""
        tier = lane_of(self.service_tier or "auto")
        if self.priority is None:
            return tier
        lane = lane_of(self.priority)
        if self.service_tier is not None and lane != tier:
            raise invalid(f"priority {self.priority} (class {lane}) contradicts service_tier "
                          f"{self.service_tier!r} (class {tier})", "priority")
        return lane

    def job(self, prompt: Any, max_tokens: int, timeout_cap: float) -> Job:
        self.refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's default
        if temperature < MIN_TEMPERATURE:  # OpenAI accepts any t >= 0; the fleet's sampler, t = 0 or >= 1e-3
            temperature = 0.0  # which is what such a t means: the most likely token
        params: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": stop or None,
            "priority": self.lane(),
        }
        return Job(prompt=prompt, params=params, stream=bool(self.stream),
                   include_usage=bool(self.stream and self.stream_options and self.stream_options.include_usage),
                   timeout=min(self.timeout or timeout_cap, timeout_cap), model=self.model)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def to_job(self, timeout_cap: float) -> Job:
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise invalid("only best_of=1 is supported", "best_of")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:  # a batch of prompts: n choices would need n jobs and a merged answer
                raise invalid("send one prompt per request (a list of prompts is not supported)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return self.job(prompt, self.max_tokens or OPENAI_DEFAULT_MAX_TOKENS, timeout_cap)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def rendered(self) -> dict[str, str]:
        """{"role", "content"} as the chat template expects: text parts joined, OpenAI's
        ``developer`` role as ``system``."""
        if self.role not in ROLES:
            raise invalid(f"unsupported message role {self.role!r} (use system, user or assistant)", "messages")
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": ROLES[self.role], "content": content}


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def to_job(self, timeout_cap: float, default_max_tokens: int) -> Job:
        if self.tools or self.functions:
            raise invalid("tools and function calling are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise invalid("only response_format {\"type\": \"text\"} is supported", "response_format")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return self.job([m.rendered() for m in self.messages], max_tokens, timeout_cap)


def parse(model: type[_Common], body: Any) -> Any:
    """Validate a decoded JSON body; a 400 naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None  # deeper parts name union members: noise
        raise invalid(f"invalid value for '{param}': {err['msg']}", param) from None
