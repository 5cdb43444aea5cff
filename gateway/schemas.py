"""Request bodies of /v1/completions and /v1/chat/completions (OpenAI's field names), validated into one
``Job``: what AsyncClient is asked for. Anything the fleet cannot honour is refused with a 400 naming the
field, never silently ignored (penalties, tools, ...); fields that change nothing (``user``, ``model``
when it names this fleet) are accepted.

Honoured beyond text: ``n`` (n jobs, choice i seeded ``seed + i``), ``logprobs`` (completions: k;
chat: ``logprobs: true`` + ``top_logprobs: k``), ``response_format`` (json_object, json_schema) and
vLLM's structured-output extensions (``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``, or ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}``).

Two extensions, both optional: ``timeout`` (seconds; at most the gateway's --request-timeout, HTTP 504
past it) and ``top_k`` (0 = off), as vLLM and others accept it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from batchfleet.common.guided import Guide, GuideError, from_options
from batchfleet.common.protocol import MAX_LOGPROBS, MIN_TEMPERATURE
from batchfleet.gateway.errors import invalid

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
MAX_N = 32  # choices per request: each is a job of its own
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
    n: int = 1
    guide: Guide | None = None  # structured output (compiled by the caller, off the event loop)
    guide_param: str | None = None  # the request field it came from, for a 400
    logprobs: int | None = None  # k alternatives per token (None: no logprobs)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def options(self) -> dict[str, Any]:
        """As ``from_options`` keywords."""
        out = {"guided_json": self.json_, "guided_regex": self.regex, "guided_choice": self.choice,
               "guided_grammar": self.grammar}
        if self.json_object:
            out["response_format"] = {"type": "json_object"}
        return {k: v for k, v in out.items() if v is not None}


class _Common(BaseModel):
    """Fields both endpoints share; unknown fields are ignored (clients send vendor extras)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: StrictStr | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    timeout: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None

    def refuse_unsupported(self) -> None:
        """400 for features the fleet does not implement (silently dropping them would change answers)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise invalid(f"{name} is not supported", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")

    def guide(self) -> tuple[Guide | None, str | None]:
        """The structured output asked for (shape-checked, not compiled) and the field it came from."""
        options = {"response_format": self.response_format, "guided_json": self.guided_json,
                   "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
                   "guided_grammar": self.guided_grammar}
        options = {k: v for k, v in options.items() if v is not None}
        if self.structured_outputs is not None:
            if options:
                raise invalid(f"give structured_outputs or {', '.join(sorted(options))}, not both",
                              "structured_outputs")
            options = self.structured_outputs.options()
            if len(options) != 1:
                raise invalid("structured_outputs must set exactly one of json, regex, choice, grammar, "
                              "json_object", "structured_outputs")
        try:
            guide = from_options(**options)
        except GuideError as exc:
            raise invalid(str(exc), "structured_outputs" if self.structured_outputs else exc.param) from None
        return guide, ("structured_outputs" if self.structured_outputs else next(iter(options), None))

    def job(self, prompt: Any, max_tokens: int, timeout_cap: float, logprobs: int | None = None) -> Job:
        self.refuse_unsupported()
        guide, guide_param = self.guide()
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
            "logprobs": logprobs,
        }
        return Job(prompt=prompt, params=params, stream=bool(self.stream),
                   include_usage=bool(self.stream and self.stream_options and self.stream_options.include_usage),
                   timeout=min(self.timeout or timeout_cap, timeout_cap), model=self.model, n=self.n or 1,
                   guide=guide, guide_param=guide_param, logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # k: the token's and its top k
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
        return self.job(prompt, self.max_tokens or OPENAI_DEFAULT_MAX_TOKENS, timeout_cap, self.logprobs)


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
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def to_job(self, timeout_cap: float, default_max_tokens: int) -> Job:
        if self.tools or self.functions:
            raise invalid("tools and function calling are not supported", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return self.job([m.rendered() for m in self.messages], max_tokens, timeout_cap,
                        (self.top_logprobs or 0) if self.logprobs else None)


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
