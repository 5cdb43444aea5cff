"""Settling entries: every write that ends an entry's stay in its stream (a reply, a dead letter, an ack, a
hand-back) and the streamed deltas written beside replies. ``Settler`` is a part of the stream consumer
(worker/consumer.py), which owns the connection and delegates to it.

Invariant: an entry is acked only by the same server-side step that stores its answer (the reply
script) or its dead-letter copy (one transaction), so a crash can never ack an unanswered entry; and
the first reply to a job wins (its ``done`` marker), so a rewrite is harmless.
"""

from __future__ import annotations

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis_conn import WAIT_TIMEOUT_MS, require_replicas, same_node
from batchfleet.worker.scripts import REPLIES_PER_CALL, WorkerScripts
from batchfleet.worker.transport import Entry, Reply

DEAD_LETTER_MAXLEN = 10_000
_DEAD_FIELDS = {b"reason", b"bucket", b"worker", b"entry_id", b"deliveries"}


class Settler:
    """The reply, dead-letter, ack and hand-back writes of one worker (``name``)."""

    def __init__(self, r: redis.Redis, scripts: WorkerScripts, keys: Keys, wait_replicas: int, name: str,
                 reply_ttl_s: int) -> None:
        self.r = r
        self.scripts = scripts
        self.keys = keys  # one shard's: every key a call touches is on it (worker/sharded.py splits the rest)
        self.wait_replicas = wait_replicas
        self.name = name
        self.reply_ttl_s = reply_ttl_s

    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Write replies and ack their entries in one round trip (one script call per REPLIES_PER_CALL
        replies); returns which were first writes."""
        if not replies:
            return []
        wanted = self.wait_replicas
        if not wanted and len(replies) <= REPLIES_PER_CALL:  # one EVALSHA (a pipeline adds a SCRIPT EXISTS)
            return [bool(x) for x in self.scripts.replies(**self._replies_call(replies))]
        pipe = self.r.pipeline(transaction=False)
        for i in range(0, len(replies), REPLIES_PER_CALL):
            self.scripts.queue(pipe, self.scripts.replies, **self._replies_call(replies[i:i + REPLIES_PER_CALL]))
        if wanted:  # WAIT on the same connection: every reply above is on `wanted` replicas, else retried
            pipe.execute_command("WAIT", wanted, WAIT_TIMEOUT_MS, **same_node(self.r, self.keys.workers))
        out = self.scripts.run_pipeline(pipe, self.scripts.replies)
        if wanted:  # too few: NotReplicated (transient) keeps the replies in the outbox; rewrites are idempotent
            require_replicas(out.pop(), wanted, f"{len(replies)} replies")
        return [bool(x) for chunk in out for x in chunk]

    def _replies_call(self, replies: list[Reply]) -> dict:
        """The REPLIES script's keys and args for ``replies`` (worker/scripts.py: per reply, first writer
        wins; then one XACK + XDEL per stream)."""
        streams: dict[str, int] = {}
        keys: list[str] = []
        args: list = [self.keys.group, self.reply_ttl_s, len(replies)]
        for rep in replies:
            keys += [self.keys.done(rep.job_id), rep.reply_key]
            # no entry id: a reply whose entry is settled elsewhere (on another shard, worker/sharded.py)
            where = streams.setdefault(self.keys.stream(rep.bucket, rep.lane), len(streams) + 1) if rep.entry_id else 0
            args += [rep.entry_id, rep.encode(), rep.job_id, where]
        return {"keys": keys + list(streams), "args": args}

    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        """XADD each streamed delta to its inbox, then one EXPIRE per inbox, in one round trip."""
        if not deltas:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id, reply_key, payload in deltas:
            pipe.xadd(reply_key, {b"id": job_id.encode(), b"p": payload})
        for reply_key in dict.fromkeys(key for _, key, _ in deltas):
            pipe.expire(reply_key, self.reply_ttl_s)
        pipe.execute()

    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        """Dead-letter an entry and, when its job id is known, answer it, in one transaction (then ack)."""
        # bounded copy: at most 16 fields of 4 KiB each, so the capped stream stays small in bytes too
        fields = {k[:64]: v[:4096] for k, v in list(entry.fields.items())[:16] if k not in _DEAD_FIELDS}
        fields.update({b"reason": reason[:500].encode(), b"bucket": str(entry.bucket).encode(),
                       b"worker": self.name.encode(), b"entry_id": entry.entry_id.encode(),
                       b"deliveries": str(entry.deliveries).encode()})
        stream = self.keys.stream(entry.bucket, entry.lane)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=False)  # rare: exact cap
        if reply is not None:
            self.scripts.queue(pipe, self.scripts.replies, **self._replies_call([reply]))  # the entry's bucket, id
        else:
            pipe.xack(stream, self.keys.group, entry.entry_id)
            pipe.xdel(stream, entry.entry_id)
        self.scripts.run_pipeline(pipe, self.scripts.replies)

    def ack(self, entry: Entry) -> None:
        """Acknowledge and delete an entry that needs no reply of its own (a duplicate delivery)."""
        stream = self.keys.stream(entry.bucket, entry.lane)
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(stream, self.keys.group, entry.entry_id)
        pipe.xdel(stream, entry.entry_id)
        pipe.execute()

    def ack_all(self, entries: list[Entry]) -> None:
        """Acknowledge and delete entries whose replies were written on another shard (worker/sharded.py):
        one XACK + XDEL per stream."""
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(self.keys.stream(e.bucket, e.lane), []).append(e.entry_id)
        pipe = self.r.pipeline(transaction=True)
        for stream, ids in by_stream.items():
            pipe.xack(stream, self.keys.group, *ids)
            pipe.xdel(stream, *ids)
        pipe.execute()

    def hand_back(self, entries: list[Entry]) -> None:
        """Return entries this worker read but will not run (shutdown): re-add, then ack + delete."""
        if not entries:
            return
        pipe = self.r.pipeline(transaction=True)
        for e in entries:
            stream = self.keys.stream(e.bucket, e.lane)
            pipe.xadd(stream, e.fields)
            pipe.xack(stream, self.keys.group, e.entry_id)
            pipe.xdel(stream, e.entry_id)
        pipe.execute()
