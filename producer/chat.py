"""Chat messages -> prompt text with the fleet's chat template (Jinja2, Hugging Face semantics).

Rendered producer-side, like tokenization, so a prompt is routed to its bucket by its real token length.
The template comes from the fleet description (workers publish their tokenizer's template), runs in
Jinja2's sandbox (a template is data, never trusted code) and is compiled once per template text. As
transformers' ``apply_chat_template``: the template gets ``messages`` (each with its ``role``, ``content``
and, where given, ``name``, ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
"arguments": <object>}}]``) and ``tool_call_id``), ``tools`` (JSON schemas of functions, or None), and
``tojson`` writes as transformers' does (no HTML escaping, keys in order).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from batchfleet.common.errors import InvalidRequest

MAX_MESSAGES = 1024
ROLES = ("system", "user", "assistant", "tool")
OPTIONAL = ("name", "tool_call_id")  # string fields a message may carry besides role and content


@dataclass(frozen=True)
class Chat:
    """A chat prompt with the tools its template renders (``tools``: OpenAI's ``[{"type": "function",
    "function": {"name", "description", "parameters"}}]``, as transformers' templates take them)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None


def is_messages(prompt: object) -> bool:
    """Whether a prompt is a list of chat messages (dicts) rather than text or token ids."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)


def check_messages(messages: Sequence[Mapping]) -> list[dict[str, Any]]:
    """Validated copies: each message has a known role and string content (an assistant's may be None
    beside its ``tool_calls``: rendered as ""), and its optional fields their types."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {ROLES}, got {role!r}"[:200])
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string")
        message: dict[str, Any] = {"role": role, "content": content}
        for key in OPTIONAL:
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise InvalidRequest(f"messages[{i}].{key} must be a string")
                message[key] = m[key]
        if calls:
            message["tool_calls"] = check_calls(calls, i)
        out.append(message)
    return out


def check_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as templates read them: arguments as an object (OpenAI sends its
    JSON text; transformers' templates write ``arguments | tojson``)."""
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise InvalidRequest(f"messages[{index}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        name, args = (fn.get("name"), fn.get("arguments")) if isinstance(fn, Mapping) else (None, None)
        if isinstance(args, str):
            args = loads_object(args)
        if not isinstance(name, str) or not isinstance(args, Mapping) or not isinstance(call.get("id", ""), str):
            raise InvalidRequest(f"messages[{index}].tool_calls[{j}] must have an id, and a function with a name "
                                 "and arguments (a JSON object, or its text)")
        out.append({"id": call.get("id", ""), "type": "function", "function": {"name": name, "arguments": args}})
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def loads_object(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` holds (a tool call's arguments), or None: not JSON (Python's own NaN and
    Infinity, and numbers past a float's range, included: the template's ``tojson`` would write them as no
    JSON), not an object, or nested too deeply."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation
        raise InvalidRequest(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)  # transformers' (Llama 3.x templates call it)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise InvalidRequest(f"the fleet's chat template does not compile: {exc}") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson``: plain JSON (Jinja2's own escapes HTML characters and sorts keys). What JSON
    cannot hold (an undefined variable) is the template's error, as any other."""
    from jinja2.exceptions import TemplateError

    try:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TemplateError(f"tojson: {exc}"[:300]) from None


def render(template: str, messages: Sequence[Mapping], bos_token: str = "", eos_token: str = "",
           tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (and ``tools``, where the template renders them), ending with the
    assistant turn's header (``add_generation_prompt``: what a generation needs; off only to count a
    conversation's own tokens, vLLM's ``/tokenize``)."""
    if not template:
        raise InvalidRequest("the fleet's model has no chat template: send a text prompt instead")
    from jinja2.exceptions import TemplateError

    try:
        return _compile(template).render(messages=check_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token,
                                         tools=None if not tools else [dict(t) for t in tools])
    except TemplateError as exc:
        raise InvalidRequest(f"chat template failed: {exc}") from None
