"""JSON as a model wrote it, read without rewriting it: a JSON object's members each with its value and its
text as written (``members``, ``whole``), a JSON list of objects (``listed``), and whether every number of
a parsed value fits a double (``fits``). The tool-call parsers (gateway/openai/tools/parsers.py) pass a
call's arguments on as this text: Python's json would read ``2E0017489145`` as inf and, written back, make
it ``Infinity``, which no strict parser (JavaScript, Go, Rust) reads. ``NaN`` and ``Infinity``, which
Python's json accepts, are no JSON here. Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _int(text: str) -> int | float:
    """A JSON integer; past 400 digits (far past a double's range, and near Python's own limit on int()) a
    float, which is then infinite."""
    return int(text) if len(text) <= 400 else float(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


MAX_DOUBLE = int(sys.float_info.max)
# JSON as written (Python's json also reads NaN and Infinity, which no other parser does: refused)
DECODER = json.JSONDecoder(parse_int=_int, parse_constant=_no_constant)
BLANK = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def members(text: str, at: int = 0) -> tuple[dict[str, tuple[Any, str]], int]:
    """The JSON object at ``at`` (whitespace before it skipped): each member's value and its text as
    written, and where the object ends. ValueError when there is none."""
    at = BLANK.match(text, at).end()  # type: ignore[union-attr]
    if not text.startswith("{", at):
        raise ValueError("not a JSON object")
    found: dict[str, tuple[Any, str]] = {}
    at = BLANK.match(text, at + 1).end()  # type: ignore[union-attr]
    if text.startswith("}", at):
        return found, at + 1
    while True:
        key, at = DECODER.raw_decode(text, at)
        if not isinstance(key, str):
            raise ValueError("a member's name must be a string")
        at = BLANK.match(text, at).end()  # type: ignore[union-attr]
        if not text.startswith(":", at):
            raise ValueError("':' expected")
        start = BLANK.match(text, at + 1).end()  # type: ignore[union-attr]
        value, at = DECODER.raw_decode(text, start)
        found[key] = (value, text[start:at])
        at = BLANK.match(text, at).end()  # type: ignore[union-attr]
        if text.startswith("}", at):
            return found, at + 1
        if not text.startswith(",", at):
            raise ValueError("',' or '}' expected")
        at = BLANK.match(text, at + 1).end()  # type: ignore[union-attr]


def whole(text: str) -> dict[str, tuple[Any, str]] | None:
    """The members of ``text`` when it is one JSON object (whitespace around it allowed), else None."""
    try:
        found, end = members(text)
    except (ValueError, RecursionError):
        return None
    return found if not text[end:].strip(" \t\n\r") else None


def fits(value: Any) -> bool:
    """Whether every number in a parsed JSON value fits a double (Python's json reads ``1e400`` as inf)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):
        return abs(value) <= MAX_DOUBLE
    if isinstance(value, dict):
        return all(fits(v) for v in value.values())
    if isinstance(value, list):
        return all(fits(v) for v in value)
    return True


def listed(text: str, read: Callable[[dict[str, tuple[Any, str]]], T | None]) -> list[T | None]:
    """``read`` of each object (its ``members``) of the JSON list that is the whole ``text``, None for an item
    that is no object; ValueError when ``text`` is no such list."""
    if not text.startswith("["):
        raise ValueError("not a JSON list")
    calls: list[T | None] = []
    at = BLANK.match(text, 1).end()  # type: ignore[union-attr]
    if text.startswith("]", at):
        at += 1  # an empty list: no call
    else:
        while True:
            if text.startswith("{", at):
                item, at = members(text, at)
                calls.append(read(item))
            else:
                _, at = DECODER.raw_decode(text, at)
                calls.append(None)
            at = BLANK.match(text, at).end()  # type: ignore[union-attr]
            if text.startswith("]", at):
                at += 1
                break
            if not text.startswith(",", at):
                raise ValueError("',' or ']' expected")
            at = BLANK.match(text, at + 1).end()  # type: ignore[union-attr]
    if text[at:].strip(" \t\n\r"):
        raise ValueError("text after the list")
    return calls
