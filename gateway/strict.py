"""The gateway's strictness rules, in one place (docs/GATEWAY.md's table is written from these).

A request field is one of three kinds:

* honoured: the fleet does what it asks (``HONOURED``, validated by the schemas' types and, for the
  generation parameters, the fleet's one table of bounds: common/wire/params.py);
* neutral only: the fleet cannot do it, but standard clients send its "off" value (``n: 1``,
  ``logprobs: null``, ``presence_penalty: 0``, ...): accepted at exactly these values (``NEUTRAL``),
  any other value is a 400 naming the field;
* anything else, an unknown field included: a 400 naming the field.

No coercion anywhere: ``"temperature": "0.5"`` or ``true`` is a 400, as is ``"n": true`` (in Python
``True == 1``: the comparison here also requires the same type). Bodies are decoded here too
(``read_json``, ``strict_json``: strict JSON, bounded in size and depth), for the routes and for batch lines;
a route's JSON body must say so (``Content-Type: application/json``, as every OpenAI client sends): any
other media type, or none, is a 415. Query parameters too: ``limit`` is digits only (``1e3``, ``1.5``,
empty: a 400), ``order`` exactly ``asc`` or ``desc`` (``query_limit``, ``query_order``), never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from batchfleet.gateway.errors import APIError, invalid

# fields whose value the fleet honours, per endpoint ("both" = completions and chat)
HONOURED: dict[str, str] = {
    "model": "both", "prompt": "completions", "messages": "chat", "max_tokens": "both",
    "max_completion_tokens": "chat", "temperature": "both", "top_p": "both", "top_k": "both", "min_p": "both",
    "seed": "both", "stop": "both", "stream": "both", "stream_options": "both", "timeout": "both",
    "repetition_penalty": "both", "min_tokens": "both", "ignore_eos": "both", "user": "both",
    "n": "both", "logprobs": "both", "top_logprobs": "chat", "response_format": "both", "guided_json": "both",
    "guided_regex": "both", "guided_choice": "both", "guided_grammar": "both", "structured_outputs": "both",
    "service_tier": "both", "priority": "both", "presence_penalty": "both", "frequency_penalty": "both",
    "logit_bias": "both", "tools": "chat", "tool_choice": "chat", "parallel_tool_calls": "chat",
    "echo": "completions",  # chat's echo (vLLM's extension) is neutral only: NEUTRAL_CHAT
}

# neutral-only fields: the values accepted (null always is); each tuple is (value, ...) compared by type too
NEUTRAL_COMMON: dict[str, tuple[Any, ...]] = {
    "stop_token_ids": ([],),  # vLLM
    "skip_special_tokens": (True,),  # vLLM: the fleet's text never holds special tokens
    "spaces_between_special_tokens": (True,),  # vLLM
    "include_stop_str_in_output": (False,),  # vLLM: a matched stop string is cut (OpenAI's semantics)
}
NEUTRAL_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    **NEUTRAL_COMMON,
    "best_of": (1,),
    "suffix": ("",),
}
NEUTRAL_CHAT: dict[str, tuple[Any, ...]] = {
    **NEUTRAL_COMMON,
    "functions": ([],),  # OpenAI's deprecated spelling of tools: use tools
    "function_call": ("none", "auto"),
    "store": (False,),
    "metadata": ({},),
    "modalities": (["text"],),
    "add_generation_prompt": (True,),  # vLLM: the template always ends with the assistant's header
    "continue_final_message": (False,),  # vLLM
    "echo": (False,),  # vLLM's chat extension
}
# vLLM's /tokenize of chat messages (gateway/openai/chat/tokenize.py): no template but the fleet's, no media
NEUTRAL_TOKENIZE_CHAT: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "mm_processor_kwargs": ({},),
    "media_io_kwargs": ({},),
}
# per message of a chat request
NEUTRAL_MESSAGE: dict[str, tuple[Any, ...]] = {
    "function_call": (),  # OpenAI's deprecated spelling of tool_calls
    "refusal": (),
}


def same(value: Any, neutral: Any) -> bool:
    """``value == neutral`` with the same type all the way down (``True`` is not ``1``, ``1`` is ``1.0``
    only for float fields, which the schema already made floats)."""
    if type(value) is not type(neutral):
        return False
    if isinstance(value, dict):
        return value.keys() == neutral.keys() and all(same(value[k], neutral[k]) for k in value)
    if isinstance(value, list):
        return len(value) == len(neutral) and all(same(a, b) for a, b in zip(value, neutral))
    return value == neutral


def refuse_non_neutral(values: dict[str, Any], rules: dict[str, tuple[Any, ...]], where: str = "") -> None:
    """400 naming the first field of ``values`` (the fields a request set) not at a neutral value."""
    for name, neutral in rules.items():
        value = values.get(name)
        if value is None or any(same(value, n) for n in neutral):
            continue
        accepted = ", ".join(["null", *(_json(n) for n in neutral)])
        raise invalid(f"'{where}{name}' is not supported with this value (accepted: {accepted})", where + name)


def _json(value: Any) -> str:
    return json.dumps(value)


async def read_json(request: Any, most: int) -> Any:
    """A starlette request's body as JSON, refusing a body over ``most`` bytes (the gateway's
    ``--max-body-kb``) before reading it (its Content-Length) or before reading all of it (a chunked one),
    and any body not sent as JSON (415) before reading it. The first check of every request: a hostile
    body is refused before it costs a parse, a template or the tokenizer."""
    check_json_type(request.headers.get("content-type"))
    length = request.headers.get("content-length")
    if length is not None and length.isascii() and length.isdigit() and int(length) > most:
        raise too_large(most)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > most:
            raise too_large(most)
    return strict_json(body)


def too_large(most: int) -> APIError:
    return APIError(413, f"request body over {most} bytes (the gateway's --max-body-kb)", "invalid_request_error",
                    "body_too_large")


def check_json_type(content_type: str | None) -> None:
    """415 unless the media type is JSON: ``application/json`` or a ``+json`` type, any parameters (a
    ``charset`` included) allowed."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"got {content_type[:100]!r}" if content_type else "none was sent"
    raise APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' ({got})",
                   "invalid_request_error", "unsupported_media_type")


def strict_json(data: bytes | str) -> Any:
    """Decode a JSON document as a request body: a 400 for anything but JSON (NaN and Infinity included,
    which Python's json accepts) or for nesting ~1000 deep (no request needs that)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None


def query_limit(request: Any, default: int, most: int) -> int:
    """A list route's ``limit`` query parameter: ``default`` when absent, else an integer written in digits
    in [1, most]; anything else is a 400 naming it."""
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise invalid(f"limit must be an integer in [1, {most}]", "limit")
    return int(raw)


def query_order(request: Any, default: str = "desc") -> str:
    """A list route's ``order`` query parameter: ``asc`` or ``desc`` (OpenAI's, lower case), ``default``
    when absent; anything else is a 400 naming it."""
    raw = request.query_params.get("order")
    if raw is None:
        return default
    if raw not in ("asc", "desc"):
        raise invalid(f"order must be 'asc' or 'desc', got {raw[:50]!r}", "order")
    return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
