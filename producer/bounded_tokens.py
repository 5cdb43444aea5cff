"""Tokenizing a prompt's text with an early stop: a text is tokenized a prefix at a time, the first of
PREFIX_CHARS_PER_TOKEN characters per token the largest bucket holds, each next one 4x longer, until the
whole text; a prefix that already holds more tokens than the largest bucket is PromptTooLong at once. So a
hostile text (a 3 MB body cost 9-18 s of CPU before its 400; a tool with a 200,000-entry enum, rendered
into the prompt, 28 s) costs the tokenizer a bounded prefix, not its size; a text that fits costs at most
a third more than tokenizing it once.

A token may span many characters, so no character count alone can refuse a text: only tokens are counted.
The tokens of a prefix ending within PREFIX_TAIL_CHARS of its cut are not: the cut word (or a special
token cut in two) may tokenize otherwise than in the whole text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchfleet.common.errors import PromptTooLong

PREFIX_CHARS_PER_TOKEN = 8
PREFIX_TAIL_CHARS = 1024


def bounded_ids(encoding: Callable[[str, bool], Any], text: str, most: int,
                add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (``encoding(text, add_special_tokens)``: the tokenizer's Encoding, with character
    ``offsets``); PromptTooLong as soon as a prefix of it holds more than ``most`` tokens."""
    cut = (most + 1) * PREFIX_CHARS_PER_TOKEN + PREFIX_TAIL_CHARS
    while cut < len(text):
        offsets = encoding(text[:cut], add_special_tokens).offsets
        if sum(1 for _, end in offsets if end <= cut - PREFIX_TAIL_CHARS) > most:
            raise PromptTooLong(f"prompt has more than {most} tokens in its first {cut} characters (of "
                                f"{len(text)}); the largest bucket is {most}")
        cut *= 4
    return encoding(text, add_special_tokens).ids
