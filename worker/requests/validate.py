"""Validation: turns raw stream entries into engine requests, or into the error that answers them (pure).

Every entry ends in exactly one of three ways: a GenRequest to run, an Error reply to the id it names,
or (no usable id, so nobody to answer) the dead-letter stream. A structured-output guide is judged here
only when its verdict is cached: compiling a new one may take up to about a second, so it is left to the
guide-check thread (``Accepted.unchecked``, worker/requests/guidecheck.py), never to the loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfleet.common.errors import INVALID_REQUEST, PROMPT_TOO_LONG, ProtocolError
from batchfleet.common.keys import Keys, valid_job_id
from batchfleet.common.wire.guided import Guide
from batchfleet.common.wire.priority import LEVEL
from batchfleet.common.wire.protocol import Error, Request
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.transport.base import Entry


@dataclass(frozen=True)
class Limits:
    """What the served model and config accept."""

    max_seq_len: int
    vocab_size: int


@dataclass(frozen=True)
class Accepted:
    """A valid request: its entry, decoded request and what the engine runs."""

    entry: Entry
    request: Request
    gen: GenRequest
    enqueued_at: float  # this host's clock, from the entry id's Redis timestamp; never in the future
    deadline: float | None  # enqueued_at + timeout (this host's clock); None: no deadline
    # its guide, while nobody knows whether it compiles: it must pass ``Guide.check()`` before it runs
    unchecked: Guide | None = None

    @property
    def reply_key(self) -> str:
        return self.request.reply_key


@dataclass(frozen=True)
class Rejected:
    """An invalid entry and the error that answers it."""

    entry: Entry
    error: Error | None  # None: no usable id or reply key, dead-letter instead
    reason: str
    reply_key: str = ""


def job_id_of(entry: Entry) -> str | None:
    """The entry's job id, or None when it has no valid one (then nobody can be answered)."""
    raw = entry.fields.get(b"id")
    try:
        job_id = raw.decode() if isinstance(raw, bytes) else None
    except UnicodeDecodeError:
        return None
    return job_id if valid_job_id(job_id) else None


def reply_key_of(entry: Entry, keys: Keys) -> str | None:
    """The entry's reply key (an inbox of this namespace), or None when it has no valid one."""
    raw = entry.fields.get(b"r")
    try:
        key = raw.decode() if isinstance(raw, bytes) else None
    except UnicodeDecodeError:
        return None
    return key if keys.inbox_token(key) is not None else None


def entry_time(entry_id: str) -> float | None:
    """Unix time (Redis' clock) encoded in a stream entry id ``<ms>-<seq>``; None if it is not one."""
    ms, _, seq = entry_id.partition("-")
    return int(ms) / 1000 if ms.isdigit() and seq.isdigit() else None


def accept(entry: Entry, keys: Keys, limits: Limits, now: float, clock_offset: float = 0.0) -> Accepted | Rejected:
    """Validate one entry against the wire schema, its stream's bucket and the model's limits; its priority is
    its stream's (``entry.priority``).

    ``clock_offset``: Redis time minus this host's time (s); the entry id's timestamp minus it is when the
    request was enqueued on this host's clock, so no producer clock is ever trusted.
    """
    job_id = job_id_of(entry)
    if job_id is None:
        return Rejected(entry, None, "entry has no valid 'id' field")
    reply_key = reply_key_of(entry, keys)
    if reply_key is None:
        return Rejected(entry, None, f"entry has no valid 'r' (reply key {keys.inbox('<token>')!r}) field")

    def reject(code: str, message: str) -> Rejected:
        return Rejected(entry, Error(id=job_id, code=code, message=message), message, reply_key)

    if entry.oversize:  # cut short when read (worker/transport/bounded.py): answered, never decoded
        return reject(INVALID_REQUEST, f"entry of {entry.oversize} bytes is too large (payload too large)")
    payload = entry.fields.get(b"p")
    if payload is None:
        return reject(INVALID_REQUEST, "entry has no 'p' (payload) field")
    try:
        req = Request.decode(payload)
    except ProtocolError as exc:
        return reject(exc.code, str(exc))
    if req.id != job_id:
        return reject(INVALID_REQUEST, "payload id does not match the entry id")
    if req.reply_key != reply_key:
        return reject(INVALID_REQUEST, "payload reply_key does not match the entry's 'r' field")
    if len(req.prompt) > entry.bucket:
        return reject(PROMPT_TOO_LONG, f"prompt of {len(req.prompt)} tokens is longer than bucket {entry.bucket}")
    if len(req.prompt) + req.params.max_new_tokens > limits.max_seq_len:
        return reject(PROMPT_TOO_LONG, f"prompt + max_new_tokens exceeds max_seq_len {limits.max_seq_len}")
    if max(req.prompt) >= limits.vocab_size:
        return reject(INVALID_REQUEST, f"token id {max(req.prompt)} is outside the vocabulary ({limits.vocab_size})")
    if req.params.logit_bias and req.params.logit_bias[-1][0] >= limits.vocab_size:  # pairs sorted by id
        return reject(INVALID_REQUEST, f"logit_bias names token id {req.params.logit_bias[-1][0]}, outside the "
                                       f"vocabulary ({limits.vocab_size})")
    # a bad guide is the client's error, not the engine's: checked as the clients check it (without the
    # tokenizer), here when its verdict is known, else off the loop's thread (``unchecked``)
    verdict = req.params.guide.known_verdict() if req.params.guide is not None else ""
    if verdict:
        return reject(INVALID_REQUEST, verdict)
    stamped = entry_time(entry.entry_id)
    # the id holds whole milliseconds: the enqueue happened somewhere in that millisecond, whose middle is the
    # unbiased estimate (its start would add 0.5 ms on average to every queue time measured from it)
    enqueued = now if stamped is None else min(stamped + 0.0005 - clock_offset, now)
    deadline = None if req.timeout_ms is None else enqueued + req.timeout_ms / 1000
    # the priority is the stream's: the one place it travels (an older producer's payload 'priority' is ignored)
    gen = GenRequest(id=req.id, prompt=list(req.prompt), bucket=entry.bucket, params=req.params,
                     enqueued_at=enqueued, priority=LEVEL[entry.priority], embed=req.embed)
    return Accepted(entry, req, gen, enqueued, deadline, req.params.guide if verdict is None else None)
