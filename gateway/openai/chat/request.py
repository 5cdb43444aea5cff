"""Request bodies of /v1/completions and /v1/chat/completions (OpenAI's field names), validated into one
``Job``: what AsyncClient is asked for (its ``Params``, built once here, is the object the wire Request
encodes: gateway/service.py ``job_asks``). Strict (gateway/strict.py has the rules): pydantic's strict mode
(no coercion: ``"0.5"`` or ``true`` is not a number), unknown fields forbidden, and the fields the fleet
cannot honour accepted only at their neutral values; every refusal is a 400 naming the field.

Honoured beyond text: ``n`` (n jobs, choice i seeded ``seed + i``), ``logprobs``, ``response_format`` and
vLLM's structured outputs (``guided_*`` or ``structured_outputs``), completions' ``echo`` (not with ``logprobs``:
the prompt's log-probabilities are not computed). Extensions: ``timeout`` (s; at most
--request-timeout, 504 past it), vLLM's ``top_k`` (0 or -1 = off), ``priority`` (a 64-bit integer: > 0 ->
background) and every other parameter of the fleet's table by its name (``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ...: ``FROM_TABLE``). OpenAI's ``service_tier`` picks the priority: ``flex``
-> background, ``auto`` / ``default`` -> interactive (common/wire/priority.py). Chat messages:
gateway/openai/chat/messages.py; chat ``tools``, ``tool_choice``, ``parallel_tool_calls``:
gateway/openai/tools/calling.py (a chat job's prompt is then a producer ``Chat``: the messages and the tools its
template renders).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, create_model

from batchfleet.common.errors import PromptTooLong
from batchfleet.common.wire.guided import Guide, GuideError, from_options
from batchfleet.common.wire.params import FIELDS, MIN_TEMPERATURE, ParamError, Params
from batchfleet.common.wire.priority import priority_of
from batchfleet.gateway.errors import invalid
from batchfleet.gateway.openai.chat.messages import Message, conversation
from batchfleet.gateway.openai.tools.calling import Tool, ToolChoice, ToolPlan, plan
from batchfleet.gateway.strict import NEUTRAL_CHAT, NEUTRAL_COMPLETIONS, refuse_non_neutral
from batchfleet.producer.chat import Chat

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's range (the fleet's own goes to 100: common/wire/params.py)
# parameters this surface spells or maps its own way; every other field of the fleet's table is taken as named
SPELLED_HERE = {"max_new_tokens", "temperature", "top_k", "stop", "logprobs", "guide"}
MAX_N = 32  # choices per request: each is a job of its own
TokenIds = list[StrictInt]


@dataclass(frozen=True)
class Job:
    """One validated request: the prompt (text, token ids or chat messages), its generation parameters (the
    fleet's one type, checked once, here: the client gets this object in an Ask, gateway/service.py ``job_asks``,
    and the wire Request encodes it; its guide is compiled there, off the event loop) and its priority."""

    prompt: str | list[int] | list[dict[str, str]]
    params: Params
    priority: str
    stream: bool
    include_usage: bool
    timeout: float
    model: str | None
    prompt_field: str = "prompt"  # the fields a PromptTooLong names: the prompt's, or the length's
    max_tokens_field: str = "max_tokens"
    n: int = 1
    guide_param: str | None = None  # the request field the guide came from, for a 400
    tools: ToolPlan | None = None  # a chat request's tools (gateway/openai/tools/calling.py)
    echo: bool = False  # completions: the answer's text starts with the prompt's

    @property
    def guide(self) -> Guide | None:  # the body's structured output (a forced tool call's is made by job_asks)
        return self.params.guide

    @property
    def logprobs(self) -> int | None:  # k alternatives per token (None: no logprobs)
        return self.params.logprobs


STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
Number = float  # in strict mode a float field takes JSON numbers (ints too), never strings or booleans


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: StrictBool | None = None
    continuous_usage_stats: Literal[False] | None = None  # vLLM: usage in every chunk (not supported)


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one of its constraints."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
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


# each scalar parameter of the fleet's table not spelled here is a field of its own name: a new row of
# common/wire/params.py FIELDS is accepted here, and bounded there (``params``), with no line of this file
_KINDS = {"int": StrictInt, "number": Number, "bool": StrictBool}
FROM_TABLE = {name: (_KINDS[b.kind] | None, None) for name, b in FIELDS.items()
              if b.kind in _KINDS and name not in SPELLED_HERE}


class _Declared(BaseModel):
    """Fields both endpoints share (honoured, or neutral-only: see gateway/strict.py), beside FROM_TABLE's."""

    model_config = STRICT
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    model: StrictStr | None = None
    # bounds: the fleet's one table (common/wire/params.py, checked in ``params``); here only OpenAI's own rules
    temperature: Number | None = Field(default=None, ge=0.0, le=OPENAI_MAX_TEMPERATURE)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    stop: StrictStr | list[StrictStr] | None = Field(default=None)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    timeout: Number | None = Field(default=None, gt=0.0)
    user: StrictStr | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None
    priority: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # 64 bits, as every integer
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[StrictStr, Number] | None = None  # token id (decimal text) -> bias: common/wire/params.py
    # neutral-only (gateway/strict.py)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None

    def resolved_priority(self) -> str:
        """The priority: from ``priority`` (vLLM's int, the body's field) if given, else from ``service_tier``,
        else interactive; a clash is a 400."""
        tier = priority_of(self.service_tier or "auto")
        if self.priority is None:
            return tier
        priority = priority_of(self.priority)
        if self.service_tier is not None and priority != tier:
            raise invalid(f"priority {self.priority} ({priority}) contradicts service_tier "
                          f"{self.service_tier!r} ({tier})", "priority")
        return priority

    def guide(self) -> tuple[Guide | None, str | None]:
        """The structured output asked for (shape-checked, not compiled) and the field it came from."""
        names = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
        options = {k: v for k in names if (v := getattr(self, k)) is not None}
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

    def params(self, max_tokens: int, logprobs: int | None, names: dict[str, str], guide: Guide | None) -> Params:
        """The request's generation parameters as the fleet's one type (common/wire/params.py), checked against
        its table once, here: a 400 naming the request's own field (``names``: the fleet's name -> the
        request's). ``guide``: the structured output (``guide()``), not compiled yet."""
        temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's default
        if temperature < MIN_TEMPERATURE:  # OpenAI accepts any t >= 0; the fleet's sampler, t = 0 or >= 1e-3
            temperature = 0.0  # which is what such a t means: the most likely token
        given = {k: v for k in FROM_TABLE if (v := getattr(self, k)) is not None}
        try:  # vLLM's top_k -1 = off = the fleet's 0
            return Params(max_new_tokens=max_tokens, temperature=temperature, logprobs=logprobs,
                          top_k=max(self.top_k or 0, 0), stop=self.stop or (), logit_bias=self.logit_bias or (),
                          guide=guide, **given)
        except ParamError as exc:
            message = str(exc)
            for ours, theirs in names.items():
                message = message.replace(ours, theirs)
            raise invalid(message, names.get(exc.field, exc.field),
                          "context_length_exceeded" if isinstance(exc, PromptTooLong) else "invalid_request") from None

    def job(self, prompt: Any, max_tokens: int, timeout_cap: float, logprobs: int | None = None,
            names: dict[str, str] | None = None) -> Job:
        refuse_non_neutral({k: getattr(self, k) for k in self.model_fields_set}, self.NEUTRAL)
        guide, guide_param = self.guide()
        params = self.params(max_tokens, logprobs, {"max_new_tokens": "max_tokens", **(names or {})}, guide)
        return Job(prompt=prompt, params=params, priority=self.resolved_priority(), stream=bool(self.stream),
                   include_usage=bool(self.stream and self.stream_options and self.stream_options.include_usage),
                   timeout=min(self.timeout or timeout_cap, timeout_cap), model=self.model, n=self.n or 1,
                   guide_param=guide_param)


_Common = create_model("_Common", __base__=_Declared, **FROM_TABLE)  # type: ignore[call-overload]


class CompletionRequest(_Common):  # type: ignore[misc,valid-type]
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = NEUTRAL_COMPLETIONS

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = None
    logprobs: StrictInt | None = None  # k: the token's and its top k
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def to_job(self, timeout_cap: float) -> Job:
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:  # a batch of prompts: n choices would need n jobs and a merged answer
                raise invalid("send one prompt per request (a list of prompts is not supported)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        max_tokens = OPENAI_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if self.echo and self.logprobs is not None:  # OpenAI's echo + logprobs scores the prompt's tokens too
            raise invalid("echo with logprobs is not supported: the fleet computes the log-probabilities of the "
                          "tokens it generates, not of the prompt's; ask for one of them", "echo")
        return replace(self.job(prompt, max_tokens, timeout_cap, self.logprobs), echo=bool(self.echo))


class ChatCompletionRequest(_Common):  # type: ignore[misc,valid-type]
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = NEUTRAL_CHAT

    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    echo: StrictBool | None = None

    def max_tokens_field(self) -> str:
        """The field that set the completion's length (named when it is too large)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_job(self, timeout_cap: float, default_max_tokens: int) -> Job:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise invalid(f"max_completion_tokens ({self.max_completion_tokens}) and max_tokens ({self.max_tokens}) "
                          "differ: give one of them", "max_completion_tokens")
        max_tokens = next(n for n in (self.max_completion_tokens, self.max_tokens, default_max_tokens) if n is not None)
        # the request's own fields first, then each message's
        job = self.job([], max_tokens, timeout_cap, (self.top_logprobs or 0) if self.logprobs else None,
                       {"max_new_tokens": self.max_tokens_field(), "logprobs": "top_logprobs"})
        tools = plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        if tools is not None and tools.constrained and job.guide is not None:
            raise invalid(f"tool_choice {tools.choice!r} constrains the answer to tool calls: give it or "
                          f"{job.guide_param}, not both", "tool_choice")
        if tools is not None and tools.constrained and self.stop:  # a stop string would cut the forced call
            raise invalid(f"stop cannot be used with tool_choice {tools.choice!r} (the answer is tool calls, "
                          "which end by themselves)", "stop")
        tools = tools.beside(job.guide) if tools is not None else None
        messages = conversation(self.messages)
        return replace(job, prompt=messages if tools is None else Chat(messages, tools.tools), prompt_field="messages",
                       max_tokens_field=self.max_tokens_field(), tools=tools,
                       guide_param="tools" if tools is not None and tools.constrained else job.guide_param)


def parse(model: type[BaseModel], body: Any, where: str = "") -> Any:
    """Validate a decoded JSON body; a 400 naming the first bad field otherwise (``where``: the path of
    ``body`` in the request, ``input.3.`` for one of its items)."""
    if not isinstance(body, dict):
        raise invalid(f"{where.rstrip('.') or 'the request body'} must be a JSON object", where.rstrip(".") or None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        loc = [str(part) for part in first["loc"]]
        if first["type"] == "extra_forbidden":  # the whole path of an unknown field: messages.0.foo
            param = where + ".".join(loc)
            raise invalid(f"unknown field '{param}': not supported by this gateway", param) from None
        # a union's members each fail: the deepest failure of the same field says most (an image part
        # fails at messages.0.content.list[TextPart].0.type, not at "not a string")
        deepest = max((e for e in errors if e["loc"][:1] == first["loc"][:1]), key=lambda e: len(e["loc"]))
        param = where + loc[0] if loc else where.rstrip(".") or None  # deeper parts name union members: noise
        path = where + ".".join(str(p) for p in deepest["loc"])
        raise invalid(f"invalid value for '{path}': {deepest['msg']}"[:500], param) from None


def request_job(chat: bool, body: Any, timeout_cap: float, chat_max_tokens: int) -> Job:
    """A decoded request body of /v1/chat/completions (``chat``) or /v1/completions as a validated Job, or
    the 400 the gateway answers: the one path for the HTTP routes and for batch input lines."""
    if chat:
        return parse(ChatCompletionRequest, body).to_job(timeout_cap, chat_max_tokens)
    return parse(CompletionRequest, body).to_job(timeout_cap)
