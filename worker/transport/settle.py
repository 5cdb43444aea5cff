"""Settling entries: every write that ends an entry's stay in its stream (a reply, a dead letter, an ack, a
hand-back) and the streamed deltas written beside replies. ``Settler`` is the stream consumer's ``settler`` part
(worker/transport/consumer.py owns the connection; callers reach it as ``transport.settler``). A command Redis
refuses raises the transport's own errors (worker/transport/refused.py).

Invariant: an entry is acked only after its answer is stored (``Keys.done``) and rung for in its inbox (a round
trip that answered without an error, before the acks are sent) or after its dead-letter copy (one transaction), so
neither a crash nor a refused write can ever ack an unanswered entry; and the first answer to a job wins (``SET NX``),
so a rewrite is harmless.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import WAIT_TIMEOUT_MS, require_replicas, same_node
from batchfleet.worker.transport.base import Entry, Reply, Settling
from batchfleet.worker.transport.refused import REFUSALS, refused

DEAD_LETTER_MAXLEN = 10_000
_DEAD_FIELDS = {b"reason", b"bucket", b"worker", b"entry_id", b"deliveries"}
DAY_S = 86_400
USAGE_DAYS_KEPT = 2  # a day's usage hash expires this many days after the day ends



class Settler(Settling):
    """The reply, dead-letter, ack and hand-back writes of one worker (``name``)."""

    def __init__(self, r: redis.Redis, keys: Keys, wait_replicas: int, name: str, reply_ttl_s: int,
                 served: Callable[[list[Reply]], None] | None = None) -> None:
        """``served``: told of the replies written first (the tenants' fair share takes their real cost)."""
        self.served = served
        self.r = r
        self.keys = keys  # one shard's: every key a call touches is on it (worker/transport/sharded.py splits the rest)
        self.wait_replicas = wait_replicas
        self.name = name
        self.reply_ttl_s = reply_ttl_s

    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Write replies, then settle their entries, in two round trips of plain commands; returns which were first
        writes. Per reply ``SET NX`` of its answer (the first writer wins), then the inbox entry that rings for it
        (every writer rings: a ring is idempotent for the client, and a writer that died between the two is
        covered by the next copy's ring, ``answered``), one EXPIRE per inbox; then, only once every answer and
        ring is written, one XACK + XDEL per stream. Not one pipeline: Redis refuses SET and XADD when full
        (``maxmemory``, OOM) but runs XACK and XDEL, which would settle entries whose answers were refused. A
        crash between the two leaves answered entries pending: redelivered, they ring again (``answered``).
        No Lua: a script's inner commands cost Redis ~3x the same commands sent plain (issue 29)."""
        if not replies:
            return []
        with REFUSALS:  # inline, not ``@refused``: the reply path has no wrapper hop (worker/transport/base.py)
            pipe = self.r.pipeline(transaction=False)
            for rep in replies:
                self._answer(pipe, rep)
            self._expire(pipe, [rep.reply_key for rep in replies])
            wanted = self.wait_replicas
            if wanted:  # WAIT on the same connection: every write above is on `wanted` replicas, else retried
                pipe.execute_command("WAIT", wanted, WAIT_TIMEOUT_MS, **same_node(self.r, self.keys.workers))
            out = pipe.execute(raise_on_error=False)
            for x in out[:2 * len(replies)] + (out[-1:] if wanted else []):
                if isinstance(x, Exception):
                    raise x
            if wanted:  # too few: NotReplicated (transient) keeps the replies in the outbox; rewrites are idempotent
                require_replicas(out[-1], wanted, f"{len(replies)} replies")
            first = [bool(x) for x in out[:2 * len(replies):2]]
            entries = [rep.settles for rep in replies if rep.entry_id]
            counted = [rep for rep, new in zip(replies, first) if new]
            if entries or counted:
                pipe = self.r.pipeline(transaction=False)
                self._ack(pipe, entries)
                self._count_usage(pipe, counted)
                # an ack refused (a stream or group lost with Redis' data) must not fail the replies written before
                pipe.execute(raise_on_error=False)
        if self.served is not None and counted:
            self.served(counted)
        return first

    def _count_usage(self, pipe, replies: list[Reply]) -> None:
        """HINCRBY each answered job's counts into its tenant's usage, the fleet's total and today's (UTC; on the
        fleet's shard 0). Only first writes count: a re-run's copy is not used twice. Best effort with the acks."""
        if not replies:
            return
        sums: dict[str, int] = {}
        for rep in replies:
            for what, n in rep.usage.items():
                if n:
                    field = f"{rep.tenant}|{what}"
                    sums[field] = sums.get(field, 0) + n
        now = time.time()
        day_start = int(now // DAY_S) * DAY_S
        home = self.keys.of_shard(0)
        day = home.usage(time.strftime("%Y-%m-%d", time.gmtime(now)))
        for key in (home.usage(), day):
            for field, n in sums.items():
                pipe.hincrby(key, field, n)
        pipe.expireat(day, day_start + (1 + USAGE_DAYS_KEPT) * DAY_S)

    def _answer(self, pipe, rep: Reply) -> None:
        """Store the reply as its job's answer (first writer wins), then ring for it."""
        pipe.set(self.keys.done(rep.job_id, rep.reply_key), rep.encode(), nx=True, ex=self.reply_ttl_s)
        self._ring(pipe, rep.job_id, rep.reply_key)

    @staticmethod
    def _ring(pipe, job_id: str, reply_key: str) -> None:
        """The inbox entry that tells the client its job's answer is stored (``Keys.done``)."""
        pipe.xadd(reply_key, {b"id": job_id.encode(), b"done": b"1"})

    def _expire(self, pipe, reply_keys: list[str]) -> None:
        """One EXPIRE per inbox written (its TTL runs from its last write)."""
        for reply_key in dict.fromkeys(reply_keys):
            pipe.expire(reply_key, self.reply_ttl_s)

    def _ack(self, pipe, entries: list[Entry]) -> None:
        """One XACK + XDEL per stream of ``entries``."""
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(self.keys.stream(*e.stream_of), []).append(e.entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.keys.group, *ids)
            pipe.xdel(stream, *ids)

    @refused
    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        """XADD each streamed delta to its inbox, then one EXPIRE per inbox, in one round trip."""
        if not deltas:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id, reply_key, payload in deltas:
            pipe.xadd(reply_key, {b"id": job_id.encode(), b"p": payload})
        self._expire(pipe, [key for _, key, _ in deltas])
        pipe.execute()

    @refused
    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        """Dead-letter an entry and, when its job id is known, answer it, in one transaction (then ack)."""
        # bounded copy: at most 16 fields of 4 KiB each, so the capped stream stays small in bytes too
        fields = {k[:64]: v[:4096] for k, v in list(entry.fields.items())[:16] if k not in _DEAD_FIELDS}
        fields.update({b"reason": reason[:500].encode(), b"bucket": str(entry.bucket).encode(),
                       b"worker": self.name.encode(), b"entry_id": entry.entry_id.encode(),
                       b"deliveries": str(entry.deliveries).encode()})
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=False)  # rare: exact cap
        if reply is not None:
            self._answer(pipe, reply)
            self._expire(pipe, [reply.reply_key])
        self._ack(pipe, [entry])
        pipe.execute()

    @refused
    def answered(self, entry: Entry | None, job_id: str, reply_key: str) -> None:
        """Settle a copy of a job whose answer is stored already: ring its inbox again (the writer may have died
        between storing the answer and ringing), then ack and delete the copy (None: it is on another shard)."""
        pipe = self.r.pipeline(transaction=True)
        self._ring(pipe, job_id, reply_key)
        self._expire(pipe, [reply_key])
        self._ack(pipe, [entry] if entry is not None else [])
        pipe.execute()

    def ack(self, entry: Entry) -> None:
        """Acknowledge and delete an entry that needs no reply of its own (a duplicate delivery)."""
        self.ack_all([entry])

    @refused
    def ack_all(self, entries: list[Entry]) -> None:
        """Acknowledge and delete entries that need no reply written here (duplicates; on a sharded fleet, entries
        whose replies were written on their inbox's shard, worker/transport/sharded.py): one XACK + XDEL per stream."""
        pipe = self.r.pipeline(transaction=True)
        self._ack(pipe, entries)
        pipe.execute()

    @refused
    def hand_back(self, entries: list[Entry]) -> None:
        """Return entries this worker read but will not run (shutdown): re-add, then ack + delete."""
        if not entries:
            return
        pipe = self.r.pipeline(transaction=True)
        for e in entries:
            stream = self.keys.stream(*e.stream_of)
            pipe.xadd(stream, e.fields)
            pipe.xack(stream, self.keys.group, e.entry_id)
            pipe.xdel(stream, e.entry_id)
        pipe.execute()
