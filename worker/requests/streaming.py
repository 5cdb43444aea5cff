"""Streamed output: turns the tokens a running request has generated so far into text deltas (pure: no
Redis, no torch; the tokenizer is passed in).

Incremental detokenization keeps two offsets per request (as vLLM does): text is decoded from a small
window that starts a few tokens before the new ones, so a token whose text depends on its left context
(a leading space, a byte of a multi-byte character) decodes right, and the cost per delta does not grow
with the output. Text is held back while it ends in an incomplete UTF-8 character (U+FFFD) and, when
the request has stop strings, while its tail could still become one (the final text is cut there). So
deltas concatenate to a prefix of the final ``Result.text``; the client adds the rest from the Result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from batchfleet.common.wire.protocol import Delta

REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 8  # a UTF-8 character spans at most 4 bytes; special tokens between them add no bytes


@dataclass
class _Detok:
    """One streamed request's detokenization state."""

    job_id: str  # what its deltas name (the publisher knows the request by its run id: worker/requests/table.py)
    reply_key: str
    stop_holdback: int  # chars kept back: longest stop string - 1
    prefix: int = 0  # window start (token index)
    read: int = 0  # tokens whose text is in ``text``
    text: str = ""  # detokenized so far (may end with held-back chars)
    sent: int = 0  # chars of ``text`` sent
    tokens_sent: int = 0
    seq: int = 0
    due_at: float = 0.0
    pending_tokens: list[int] = field(default_factory=list)


class StreamPublisher:
    """Which running requests stream, and the deltas due for them (at most one per ``interval_s`` each)."""

    def __init__(self, decode: Callable[[list[int]], str], interval_s: float) -> None:
        self.decode = decode  # token ids -> text, special tokens skipped (the engine's final-text decode)
        self.interval_s = interval_s
        self._jobs: dict[str, _Detok] = {}

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._jobs

    def track(self, run_id: str, job_id: str, reply_key: str, stop: tuple[str, ...], now: float) -> None:
        """Start streaming a request that has just started running (known by its run id; its deltas name
        ``job_id``)."""
        holdback = max((len(s) for s in stop), default=1) - 1
        self._jobs[run_id] = _Detok(job_id, reply_key, holdback, due_at=now)

    def forget(self, run_id: str) -> None:
        """The request finished, failed or was cancelled: its final reply carries the rest."""
        self._jobs.pop(run_id, None)

    def due(self, now: float) -> list[str]:
        """Streamed requests whose next delta may be sent now."""
        return [j for j, d in self._jobs.items() if d.due_at <= now]

    def due_deltas(self, now: float, running: Callable[[str], bool],
                   progress: Callable[[list[str]], dict[str, list[int]]]) -> list[tuple[str, str, bytes]]:
        """The deltas due now for requests still ``running``; ``progress`` (the engine's) gives their tokens."""
        due = [j for j in self.due(now) if running(j)]
        return self.deltas(progress(due), now) if due else []

    def deltas(self, progress: dict[str, list[int]], now: float) -> list[tuple[str, str, bytes]]:
        """(job id, reply key, encoded Delta) for each request in ``progress`` (run id -> its generated tokens
        so far) whose text grew since its last delta."""
        out = []
        for run_id, tokens in progress.items():
            d = self._jobs.get(run_id)
            if d is None:
                continue
            d.due_at = now + self.interval_s
            self._advance(d, tokens)
            safe = len(d.text) - d.stop_holdback
            if safe <= d.sent:
                continue
            logprobs = getattr(tokens, "logprobs", None)  # sampling.Generated of a request that asked
            if logprobs is not None:
                logprobs = list(logprobs[d.tokens_sent:len(tokens)])
            delta = Delta(d.job_id, d.seq, d.sent, d.text[d.sent:safe], list(tokens[d.tokens_sent:]), logprobs)
            d.sent, d.tokens_sent, d.seq = safe, len(tokens), d.seq + 1
            out.append((d.job_id, d.reply_key, delta.encode()))
        return out

    def _advance(self, d: _Detok, tokens: list[int]) -> None:
        """Decode what the tokens since ``d.read`` add to the text, up to the last closed character.

        Invariants: ``d.text`` is exactly the decode of ``tokens[:d.read]``, and ``d.read`` (so also
        ``d.prefix``, an earlier ``read``) is a closed boundary: no later byte can change the text before
        it. A cut is closed when its text ends in a whole character; when it ends in U+FFFD (a character
        whose last bytes may still come, or invalid bytes), it is closed only if the bytes after it did not
        join it: the window decodes to the same text split there or not (an incomplete sequence followed
        by a byte continuing it decodes differently split). Up to MAX_HELD_TOKENS tokens are held back
        while no cut is closed; the final reply carries whatever is held at the end.
        """
        if len(tokens) <= d.read:
            return
        before = self.decode(tokens[d.prefix:d.read])
        whole: str | None = None
        for held in range(MAX_HELD_TOKENS + 1):
            cut = len(tokens) - held
            if cut <= d.read:
                return  # every new token may still belong to an unfinished character: wait for more
            after = self.decode(tokens[d.prefix:cut])
            if not after.endswith(REPLACEMENT):
                break
            if held:
                rest = self.decode(tokens[cut:])
                whole = self.decode(tokens[d.prefix:]) if whole is None else whole
                if rest and after + rest == whole:
                    break
        else:
            return
        if not after.startswith(before):
            return  # a window that re-decodes differently: wait for more context
        d.text += after[len(before):]
        # the next window starts at the tokens just decoded: enough left context for their successors
        d.prefix, d.read = d.read, cut
