"""Request bodies of /v1/responses (OpenAI's Responses API), validated into the gateway's one ``Job``.

The Responses API is a chat under other names: ``instructions`` is a system message, ``input`` (a string,
or items: messages with ``input_text`` / ``output_text`` parts, ``function_call`` and
``function_call_output``: gateway/openai/responses/items.py) the conversation's new turn, a
``previous_response_id`` the stored conversation before it, ``max_output_tokens`` the completion's length,
``text.format`` its structured output and ``tools`` (flat: ``{"type": "function", "name", "description",
"parameters", "strict"}``) chat's function tools. So a request is rewritten as a /v1/chat/completions body
and validated by that route's own rules (gateway/openai/chat/request.py, gateway/openai/tools/calling.py): one
validation, one job
path; its refusals are renamed to this API's fields (``messages`` -> ``input``, ``response_format`` ->
``text.format``, ``tools.<i>.function.name`` -> ``tools.<i>.name``, ...).

Shared with chat under the same names: ``model``, ``temperature``, ``top_p``, ``user``, ``service_tier``
and the fleet's extensions (``timeout``, ``top_k``, ``seed``, ``priority``, ``min_p``, ...), and
``parallel_tool_calls``. ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function",
"name"}``; a hosted tool (``web_search``, ``file_search``, ...) is a 400 naming it. Accepted at their
neutral values only: ``truncation``, ``include``, ``reasoning``, ``background``. Any other field is a 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.openai.chat.request import FROM_TABLE, STRICT, ChatCompletionRequest, Job, parse
from batchfleet.gateway.openai.responses.items import Item, chat_messages, check_outputs, parse_items
from batchfleet.gateway.strict import refuse_non_neutral

# fields a chat completions body takes under the same name and meaning
SHARED = frozenset({"model", "temperature", "user", "service_tier", "timeout", "top_k", "priority", *FROM_TABLE})
# chat's field names -> this API's, in the refusals chat's validation writes
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format json_schema": "text.format",
           "response_format": "text.format", "messages": "input"}
FLATTENED = re.compile(r"\b(tools\.\d+|tool_choice)\.function\b")  # chat's nesting, which this API has not
NEUTRAL = {"truncation": ("disabled",), "include": ([],), "reasoning": ({},), "background": (False,)}


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
    input: StrictStr | list[Any]  # items: gateway/openai/responses/items.py
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    text: TextConfig | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = True  # OpenAI's default
    previous_response_id: StrictStr | None = Field(default=None, min_length=1, max_length=200)
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, max_length=16)
    parallel_tool_calls: StrictBool | None = None
    tools: list[Any] | None = None  # chat's function tools, flat (checked by chat's rules: ``chat_tools``)
    tool_choice: StrictStr | dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None  # a routing hint; the fleet's prefix cache needs none
    safety_identifier: StrictStr | None = None
    # neutral-only (NEUTRAL)
    truncation: StrictStr | None = None
    include: list[Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: StrictBool | None = None


@dataclass(frozen=True)
class ResponsesCall:
    """A validated request: its own fields, the shared ones (a chat body's), the new turn's messages, and
    its tool fields in chat's spelling (``tooling``)."""

    request: ResponsesRequest
    shared: dict[str, Any]
    messages: list[dict[str, Any]]
    tooling: dict[str, Any] = field(default_factory=dict)
    items: list[Item] = field(default_factory=list)  # the input's items (none for a text input)

    def job(self, history: list[dict[str, Any]], timeout_cap: float, default_max_tokens: int) -> Job:
        """The job: ``instructions``, then ``history`` (the stored conversation this one continues), then
        the new turn; chat's validation with this API's field names in its refusals."""
        req = self.request
        check_outputs(self.items, history)
        head = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
        body: dict[str, Any] = {**self.shared, **self.tooling, "messages": head + history + self.messages,
                                "stream": bool(req.stream)}
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens
        fmt = self.format()
        if fmt is not None:
            body["response_format"] = fmt
        try:
            job = parse(ChatCompletionRequest, body).to_job(timeout_cap, default_max_tokens)
        except APIError as exc:
            raise _renamed(exc) from None
        tools = None if job.tools is None else replace(job.tools, flat=True)  # refusals name tools.<i>.parameters
        guide_param = "tools" if tools is not None and tools.constrained else (
            None if job.guide is None else "text.format")
        return replace(job, prompt_field="input", max_tokens_field="max_output_tokens", tools=tools,
                       guide_param=guide_param)

    def format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``: json_schema's fields move under ``json_schema``."""
        fmt = None if self.request.text is None else self.request.text.format
        if fmt is None or fmt.get("type") != "json_schema":
            return fmt
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

    def echo(self) -> dict[str, Any]:
        """The request fields a response object repeats (OpenAI's defaults where unset)."""
        req, shared = self.request, self.shared
        tools = [{"type": "function", "name": t.get("name"), "description": t.get("description"),
                  "parameters": t.get("parameters"), "strict": t.get("strict")} for t in req.tools or ()]
        return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "store": req.store is not False,
                "temperature": shared.get("temperature", 1.0), "top_p": shared.get("top_p", 1.0),
                "text": {"format": self.format_echo()}, "tool_choice": req.tool_choice or "auto", "tools": tools,
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
    request: ResponsesRequest = parse(ResponsesRequest, own)
    refuse_non_neutral({k: getattr(request, k) for k in NEUTRAL if k in request.model_fields_set}, NEUTRAL)
    if request.input == "" or request.input == []:
        raise invalid("input must not be empty", "input")
    items = [] if isinstance(request.input, str) else parse_items(request.input)
    messages = chat_messages(items) if items else [{"role": "user", "content": request.input}]
    tooling: dict[str, Any] = {}
    if request.tools is not None:
        tooling["tools"] = chat_tools(request.tools)
    if request.tool_choice is not None:
        tooling["tool_choice"] = chat_tool_choice(request.tool_choice)
    if request.parallel_tool_calls is not None:
        tooling["parallel_tool_calls"] = request.parallel_tool_calls
    return ResponsesCall(request, shared, messages, tooling, items)


def chat_tools(tools: list[Any]) -> list[Any]:
    """Flat function tools in chat's nesting (``{"type": "function", "function": {...}}``), checked later by
    chat's rules; any other tool type is a 400 naming it: the fleet runs no hosted tools."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"tools.{i}: tools of type {str(kind)[:60]!r} are not supported: this gateway serves "
                          "function tools ({\"type\": \"function\", \"name\", \"parameters\"}), not hosted "
                          "ones (web_search, file_search, code_interpreter, mcp, ...)", f"tools.{i}.type")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    """``tool_choice`` in chat's spelling: a named function moves under ``function``; a hosted tool's
    choice (or allowed_tools, mcp, custom, ...) is a 400."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise invalid(f"tool_choice of type {str(kind)[:60]!r} is not supported: give 'none', 'auto', 'required' "
                      "or {\"type\": \"function\", \"name\": ...}", "tool_choice")
    return {"type": "function", "function": {k: v for k, v in choice.items() if k != "type"}}


def _renamed(exc: APIError) -> APIError:
    message, param = FLATTENED.sub(r"\1", exc.message), exc.param
    for ours, theirs in RENAMED.items():
        message = message.replace(ours, theirs)
        if param is not None and (param == ours or param.startswith(ours + ".")):
            param = theirs + param[len(ours):]
    param = None if param is None else FLATTENED.sub(r"\1", param)
    return APIError(exc.status, message, exc.type, exc.code, param, exc.headers)
