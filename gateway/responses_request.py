"""Request bodies of /v1/responses (OpenAI's Responses API), validated into the gateway's one ``Job``.

The Responses API is a chat under other names: ``instructions`` is a system message, ``input`` (a string,
or message items with ``input_text`` / ``output_text`` parts) the conversation's new turn, a
``previous_response_id`` the stored conversation before it, ``max_output_tokens`` the completion's length
and ``text.format`` its structured output. So a request is rewritten as a /v1/chat/completions body and
validated by that route's own rules (gateway/schemas.py): one validation, one job path; its refusals are
renamed to this API's fields (``messages`` -> ``input``, ``response_format`` -> ``text.format``, ...).

Shared with chat under the same names: ``model``, ``temperature``, ``top_p``, ``user``, ``service_tier``
and the fleet's extensions (``timeout``, ``top_k``, ``seed``, ``priority``, ``min_p``, ...). Accepted at
their neutral values only: ``tools`` (function tools are not served here yet: a 400 says so),
``tool_choice``, ``truncation``, ``include``, ``reasoning``, ``background``. Any other field is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.schemas import FROM_TABLE, STRICT, ChatCompletionRequest, Job, parse
from batchfleet.gateway.strict import refuse_non_neutral

# fields a chat completions body takes under the same name and meaning
SHARED = frozenset({"model", "temperature", "user", "service_tier", "timeout", "top_k", "priority", *FROM_TABLE})
# chat's field names -> this API's, in the refusals chat's validation writes
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format json_schema": "text.format",
           "response_format": "text.format", "messages": "input"}
NEUTRAL = {"tools": ([],), "tool_choice": ("none", "auto"), "truncation": ("disabled",), "include": ([],),
           "reasoning": ({},), "background": (False,)}
TEXT_PARTS = ("input_text", "output_text")


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an earlier answer's output_text part, sent back as it came
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    """An input item: a message (``type`` "message" or absent). ``id`` and ``status``: an earlier output
    item sent back as it came (LangChain does)."""

    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def chat(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class TextConfig(BaseModel):
    model_config = STRICT
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None  # the neutral value: the fleet's models have one verbosity


class StreamOptions(BaseModel):
    model_config = STRICT
    include_obfuscation: StrictBool | None = None  # random padding against length side channels: none sent


class ResponsesRequest(BaseModel):
    """The body's own fields (the shared ones are checked by chat's validation, ``SHARED``)."""

    model_config = STRICT
    input: StrictStr | list[InputMessage]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    text: TextConfig | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = True  # OpenAI's default
    previous_response_id: StrictStr | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, max_length=16)
    parallel_tool_calls: StrictBool | None = None
    prompt_cache_key: StrictStr | None = None  # a routing hint; the fleet's prefix cache needs none
    safety_identifier: StrictStr | None = None
    # neutral-only (NEUTRAL)
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    truncation: StrictStr | None = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: StrictBool | None = None


@dataclass(frozen=True)
class ResponsesCall:
    """A validated request: its own fields, the shared ones (a chat body's), the new turn's messages."""

    request: ResponsesRequest
    shared: dict[str, Any]
    messages: list[dict[str, Any]]

    def job(self, history: list[dict[str, Any]], timeout_cap: float, default_max_tokens: int) -> Job:
        """The job: ``instructions``, then ``history`` (the stored conversation this one continues), then
        the new turn; chat's validation with this API's field names in its refusals."""
        req = self.request
        head = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
        body: dict[str, Any] = {**self.shared, "messages": head + history + self.messages, "stream": bool(req.stream)}
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens
        fmt = self.format()
        if fmt is not None:
            body["response_format"] = fmt
        try:
            job = parse(ChatCompletionRequest, body).to_job(timeout_cap, default_max_tokens)
        except APIError as exc:
            raise _renamed(exc) from None
        return replace(job, prompt_field="input", max_tokens_field="max_output_tokens",
                       guide_param=None if job.guide is None else "text.format")

    def format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``: json_schema's fields move under ``json_schema``."""
        fmt = None if self.request.text is None else self.request.text.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def echo(self) -> dict[str, Any]:
        """The request fields a response object repeats (OpenAI's defaults where unset)."""
        req, shared = self.request, self.shared
        return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "store": req.store is not False,
                "temperature": shared.get("temperature", 1.0), "top_p": shared.get("top_p", 1.0),
                "text": {"format": self.format_echo()}, "tool_choice": req.tool_choice or "auto", "tools": [],
                "truncation": "disabled", "user": shared.get("user"), "background": False,
                "reasoning": {"effort": None, "summary": None}, "service_tier": shared.get("service_tier", "default"),
                "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier}

    def format_echo(self) -> dict[str, Any]:
        fmt = None if self.request.text is None else self.request.text.format
        return fmt or {"type": "text"}


def parse_call(body: Any) -> ResponsesCall:
    """A decoded /v1/responses body, checked (a 400 naming the first bad field otherwise)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    shared = {k: v for k, v in body.items() if k in SHARED}
    own = {k: v for k, v in body.items() if k not in SHARED}
    if own.get("tools"):
        raise invalid("function tools are not supported on /v1/responses yet: send the request without "
                      "'tools' (or use /v1/chat/completions)", "tools")
    _check_items(own.get("input"))
    request: ResponsesRequest = parse(ResponsesRequest, own)
    refuse_non_neutral({k: getattr(request, k) for k in NEUTRAL if k in request.model_fields_set}, NEUTRAL)
    if request.input == "" or request.input == []:
        raise invalid("input must not be empty", "input")
    items = [InputMessage(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    return ResponsesCall(request, shared, [m.chat() for m in items])


def _check_items(items: Any) -> None:
    """Input items this gateway cannot serve, named before the schema's generic refusal."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind not in (None, "message"):
            raise invalid(f"input item type {str(kind)[:60]!r} is not supported: this gateway serves message "
                          "items with text content (function tools are not supported on /v1/responses yet)",
                          f"input.{i}.type")
        parts = item.get("content")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                raise invalid(f"content part type {str(part.get('type'))[:60]!r} is not supported: the fleet's "
                              "models read text (input_text, output_text)", f"input.{i}.content.{j}.type")


def _renamed(exc: APIError) -> APIError:
    message, param = exc.message, exc.param
    for ours, theirs in RENAMED.items():
        message = message.replace(ours, theirs)
        if param is not None and (param == ours or param.startswith(ours + ".")):
            param = theirs + param[len(ours):]
    return APIError(exc.status, message, exc.type, exc.code, param, exc.headers)
