"""Incremental detokenization (worker/requests/streaming.py), pure: with the byte-level tokenizer every byte is one
token, so multi-byte characters always arrive split across tokens."""

from __future__ import annotations

import functools
import random

import pytest

from batchfleet.common.wire.protocol import decode_reply
from batchfleet.worker.requests.streaming import StreamPublisher

pytestmark = pytest.mark.integration  # the byte-level tokenizer: transformers (not a unit test's import)

@functools.cache
def tokenizer():
    """The byte-level tokenizer (transformers), built at first use: collecting imports neither torch nor it."""
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer()


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def stream(tokens: list[int], stop: tuple[str, ...] = ()) -> list[str]:
    """Deltas when every step adds one token and a delta may go out after each."""
    pub = StreamPublisher(decode, 0.0)
    pub.track("j", "j", "inbox", stop, 0.0)
    out = []
    for n in range(1, len(tokens) + 1):
        out += [decode_reply(payload).text for _, _, payload in pub.deltas({"j": tokens[:n]}, float(n))]
    return out


def test_valid_text_streams_whole_characters_only():
    text = "héllo 日本語 ж€ 🙂 ok"
    tokens = [4 + b for b in text.encode()]
    deltas = stream(tokens)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert len(deltas) >= len(text) - 8  # one delta per character, give or take the held-back ones


def test_invalid_bytes_do_not_stall_the_stream_and_stay_a_prefix():
    for seed in range(200):
        rnd = random.Random(seed)
        tokens = [rnd.randrange(4, 260) for _ in range(rnd.randrange(1, 150))]
        sent = "".join(stream(tokens))
        full = decode(tokens)
        assert full.startswith(sent)
        # at most the last 3 tokens' text is held back at the end (the final reply carries it)
        assert len(sent) >= len(decode(tokens[:-3])) - 3 if len(tokens) > 3 else True


def test_text_that_may_become_a_stop_string_is_held_back():
    # the engine finishes the request on the token completing "END" (final text "abc "): until then the
    # last len("END") - 1 characters may be the start of it and are held back
    tokens = [4 + b for b in b"abc EN"]
    assert "".join(stream(tokens, stop=("END",))) == "abc "
