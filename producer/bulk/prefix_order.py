"""The order the bulk runner (``batchfleet bulk``, the gateway's batches) submits lines in: lines whose
prompts start alike go one after another (within each window of lines), so one worker's batch shares its
prefix and the workers' prefix cache keeps what the next lines need. Pure: no I/O, no tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from batchfleet.producer.chat import Chat

T = TypeVar("T")
PREFIX_KEY_CHARS = 64  # about one KV block (16 tokens) of English text
PREFIX_KEY_TOKENS = 16


def prefix_key(prompt: object) -> str | None:
    """What two prompts must share to share a leading KV block, without tokenizing: the first
    PREFIX_KEY_CHARS characters of a text (of the messages as JSON, for chat), the first 16 token ids."""
    if isinstance(prompt, str):
        return "s" + prompt[:PREFIX_KEY_CHARS]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return "t" + ",".join(map(str, prompt[:PREFIX_KEY_TOKENS]))
    if isinstance(prompt, Chat):  # templates render the tools first (a system turn): they lead the key
        prompt = [list(prompt.tools or ()), list(prompt.messages)]
    try:
        return "m" + json.dumps(prompt, sort_keys=True)[:PREFIX_KEY_CHARS]
    except (TypeError, ValueError):
        return None


def submission_order(items: list[Any], window: int) -> list[Any]:
    """The order to submit ``items`` (each with its ``key``, a ``prefix_key`` or None) in: each run of
    ``window`` consecutive items grouped by key (groups in order of first appearance, items in input order
    within a group). Grouping never reaches past ``window`` items, so the line written next is always among
    those submitted."""
    out: list[Any] = []
    for start in range(0, len(items), window):
        out += grouped(items[start:start + window], lambda item: item.key)
    return out


def grouped(items: list[T], key: Callable[[T], object | None]) -> list[T]:
    """``items`` grouped by ``key`` (groups in order of first appearance, items in order within a group;
    a None key is a group of its own)."""
    groups: dict[object, list[T]] = {}
    for i, item in enumerate(items):
        k = key(item)
        groups.setdefault(k if k is not None else ("item", i), []).append(item)
    return [item for group in groups.values() for item in group]
