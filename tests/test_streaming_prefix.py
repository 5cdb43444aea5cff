"""Streamed text is always a prefix of the final text (worker/requests/streaming.py), whatever bytes the model emits:
a property test over random token streams of the byte-level tokenizer (one token per byte, so invalid and
truncated UTF-8 sequences are everywhere), with special tokens (no bytes) mixed in and the engine's
progress arriving in random chunks."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfleet.common.wire.protocol import decode_reply
from batchfleet.worker.engine.tokenizer import BYTE_OFFSET
from batchfleet.worker.requests.streaming import StreamPublisher

pytestmark = pytest.mark.integration  # the byte-level tokenizer: transformers (not a unit test's import)


@functools.cache
def tokenizer():
    """The byte-level tokenizer (transformers), built at first use: collecting imports neither torch nor it."""
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer()


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


# bytes that make UTF-8 hard: ASCII, continuation bytes, 2/3/4-byte leads, never-valid bytes
HARD_BYTES = [0x41, 0x20, 0x80, 0x8F, 0xBF, 0xC3, 0xC0, 0xE6, 0xE2, 0xED, 0xF0, 0xF4, 0xF8, 0xFF]
token = st.one_of(st.integers(0, BYTE_OFFSET - 1),  # special tokens: decode to nothing
                  st.integers(0, 255).map(lambda b: BYTE_OFFSET + b),
                  st.sampled_from(HARD_BYTES).map(lambda b: BYTE_OFFSET + b))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(token, min_size=1, max_size=80), data=st.data())
def test_streamed_text_is_a_prefix_of_the_final_text(tokens: list[int], data) -> None:
    # the engine's progress as seen at each delta: growing prefixes of the output, in random steps
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(tokens)), max_size=len(tokens)))) | {len(tokens)})
    pub = StreamPublisher(decode, 0.0)
    pub.track("j", "j", "inbox", (), 0.0)
    sent = ""
    for n in cuts:
        for _, _, payload in pub.deltas({"j": tokens[:n]}, float(n)):
            delta = decode_reply(payload)
            assert delta.offset == len(sent)
            sent += delta.text
            assert decode(tokens[:n]).startswith(sent)  # already at that step, not only at the end
    final = decode(tokens)
    assert final.startswith(sent), (tokens, cuts)


def test_valid_text_is_not_held_back_at_the_end() -> None:
    text = "naïve 日本 🙂"
    tokens = [BYTE_OFFSET + b for b in text.encode()]
    pub = StreamPublisher(decode, 0.0)
    pub.track("j", "j", "inbox", (), 0.0)
    sent = "".join(decode_reply(p).text for n in range(1, len(tokens) + 1)
                   for _, _, p in pub.deltas({"j": tokens[:n]}, float(n)))
    assert sent == text
