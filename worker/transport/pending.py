"""Commands on the consumer group's pending entries list (PEL): reclaiming what dead workers left,
renewing and releasing leases, pruning dead consumer names. ``PendingList`` is the stream consumer's ``pending``
part (worker/transport/consumer.py owns the connection; callers reach it as ``transport.pending``); the policy
lives in worker/transport/reclaim.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import redis

from batchfleet.common.keys import TENANT_STREAM_SUFFIX, Keys
from batchfleet.worker.transport.base import Entry, Leases
from batchfleet.worker.transport.bounded import BoundedReader, as_str, autoclaim_args, entry_of
from batchfleet.worker.transport.reclaim import scan_period_s
from batchfleet.worker.transport.refused import refused
from batchfleet.worker.transport.scripts import WorkerScripts

log = logging.getLogger("batchfleet.worker.transport.consumer")


class PendingList(Leases):
    """XAUTOCLAIM / XPENDING / XCLAIM / XINFO for one worker (consumer ``name``) over its bucket streams."""

    def __init__(self, r: redis.Redis, scripts: WorkerScripts, keys: Keys, name: str,
                 buckets: tuple[int, ...], reader: BoundedReader) -> None:
        """``reader``: the consumer's, told of every entry reclaimed (never recovered as unseen)."""
        self.r = r
        self.reader = reader
        self.keys = keys
        self.name = name
        self._cursors: dict[str, str] = {}  # XAUTOCLAIM cursor per stream, kept while a budget cuts a scan
        self._autoclaim = scripts.autoclaim
        self._released: object = None  # the release counter at the last scan (a sentinel: scan first)
        self._next_scan = 0.0  # time.monotonic() of the next full scan without a release

    @property
    def streams(self) -> list[tuple[str, int, str]]:
        """(stream, bucket, priority) of every request stream the reader reads (every tenant's), interactive first."""
        return self.reader.streams

    def reset(self) -> None:
        """Forget the reclaim cursors (the streams were re-created: old positions mean nothing)."""
        self._cursors.clear()
        self._released, self._next_scan = None, 0.0

    @refused
    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """Take over entries pending longer than ``min_idle_ms`` (their consumer died), at most ``budget``.

        XAUTOCLAIM is followed until its cursor returns to 0-0; when the budget cuts a scan short the
        cursor is kept, so the next call resumes there. Entries deleted while pending are dropped from
        the PEL by Redis itself (reported in the third reply element; we only count them).

        The scan itself (1 + streams commands) runs only when a peer released entries (the release
        counter moved), a cut scan is to be resumed, or ``scan_period_s`` passed; otherwise a call is
        one GET, so an idle worker can look every second for released entries. What it takes is noted by the
        reader (``BoundedReader.held``).
        """
        if budget <= 0:
            return []
        released = self.r.get(self.keys.released)
        now = time.monotonic()
        if not self._cursors and released == self._released and now < self._next_scan:
            return []
        self._released, self._next_scan = released, now + scan_period_s(min_idle_ms)
        # one script call over every stream (1 + streams commands), through the bounded reads: too-large
        # entries come back cut short (worker/transport/bounded.py)
        streams = self.streams
        keys = [stream for stream, _, _ in streams]
        per_stream = self._autoclaim(keys=keys, args=[*autoclaim_args(self.keys.group, self.name, min_idle_ms, budget),
                                                      *(self._cursors.get(k, "0-0") for k in keys)])
        out: list[Entry] = []
        for (stream, b, priority), (nxt, claimed, deleted) in zip(streams, per_stream):
            tenant = self.reader.where[stream][2]
            claimed = [(as_str(raw[0]), entry_of(b, priority, raw, tenant)) for raw in claimed]
            if any(e is None for _, e in claimed):  # Redis 6.2 reports deleted ones as nil
                deleted += self._ack_deleted(stream, {eid for eid, e in claimed if e is not None})
            if deleted:
                log.info("%d pending entries of %s were deleted before they could be reclaimed", deleted, stream)
            out += [e for _, e in claimed if e is not None]
            cursor = as_str(nxt)
            if cursor == "0-0":
                self._cursors.pop(stream, None)
            else:
                self._cursors[stream] = cursor
        return self.reader.held(self._with_delivery_counts(out))

    def _ack_deleted(self, stream: str, alive: set[str]) -> int:
        """Redis 6.2 keeps deleted entries in the PEL (7.0 drops them): ack ours that no longer exist."""
        gone = [row["message_id"] for row in self.r.xpending_range(stream, self.keys.group, "-", "+", 1000,
                                                                    consumername=self.name)
                if as_str(row["message_id"]) not in alive and not self.r.xrange(stream, row["message_id"],
                                                                            row["message_id"])]
        if gone:
            self.r.xack(stream, self.keys.group, *gone)
        return len(gone)

    def _with_delivery_counts(self, entries: list[Entry]) -> list[Entry]:
        if not entries:
            return []
        pipe = self.r.pipeline(transaction=False)
        for e in entries:
            pipe.xpending_range(self.keys.stream(*e.stream_of), self.keys.group, e.entry_id, e.entry_id, 1)
        counts = []
        for rows in pipe.execute():
            counts.append(int(rows[0]["times_delivered"]) if rows else 1)
        return [dataclasses.replace(e, deliveries=n) for e, n in zip(entries, counts)]

    @refused
    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        """Leave entries pending but make them look ``idle_ms`` idle, so the next reclaim (any worker's)
        redelivers them at once. JUSTID: the delivery count is not raised by this claim. With
        ``count_delivery=False`` it is set one lower (RETRYCOUNT), so the reclaim that takes the entry
        brings it back to what it is now: a release to balance load is not a failed delivery. Bumps the
        release counter, so peers with room scan the pending lists at their next look."""
        pipe = self.r.pipeline(transaction=False)
        if count_delivery:
            self._queue_claims(pipe, entries, min_idle_ms=0, idle=idle_ms)
        else:
            for e in entries:
                pipe.xclaim(self.keys.stream(*e.stream_of), self.keys.group, self.name, 0, [e.entry_id],
                            idle=idle_ms, retrycount=max(0, e.deliveries - 1), justid=True)
        if entries:
            pipe.execute_command("INCR", self.keys.released)  # redis-py's incr() sends INCRBY
            pipe.execute()

    @refused
    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        """Lease renewal: reset the idle time of entries this worker still holds (no delivery count change).
        ``min_idle_ms`` > 0 keeps us from taking back an entry another worker has just reclaimed."""
        self._claim(entries, min_idle_ms=min_idle_ms, idle=None)

    def _claim(self, entries: list[Entry], min_idle_ms: int, idle: int | None) -> None:
        if not entries:
            return
        pipe = self.r.pipeline(transaction=False)
        self._queue_claims(pipe, entries, min_idle_ms, idle)
        pipe.execute()

    def _queue_claims(self, pipe, entries: list[Entry], min_idle_ms: int, idle: int | None) -> None:
        """XCLAIM JUSTID of ``entries``, one command per stream, queued on ``pipe``."""
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(self.keys.stream(*e.stream_of), []).append(e.entry_id)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, self.keys.group, self.name, min_idle_ms, ids, idle=idle, justid=True)

    @refused
    def prune_consumers(self, min_idle_ms: int) -> int:
        """Remove group consumers (dead workers' names) that hold nothing and were silent for min_idle_ms,
        so the group's consumer list does not grow with every restart. Returns how many were removed. On the tenant
        bell (every worker reads it) a silent name goes with what it holds: a ring pending there is a wake-up nobody
        reclaims (a worker that died before acking it), so it would keep the name for ever."""
        removed = 0
        bell = self.keys.tenant_bell
        for stream in [*(s for s, _, _ in self.streams), bell]:
            try:
                consumers = self.r.xinfo_consumers(stream, self.keys.group)
            except redis.ResponseError as exc:  # a retired tenant's stream, or one made again without the group yet
                if (TENANT_STREAM_SUFFIX in stream or stream == bell) and (
                        "no such key" in str(exc).lower() or "NOGROUP" in str(exc)):
                    continue  # (worker/transport/tenant_gc.py): no consumer name to forget there
                raise
            for c in consumers:
                name = as_str(c["name"])
                if name == self.name and stream == bell and c["pending"]:
                    self._drop_lost_rings(int(c["pending"]))
                if name != self.name and (c["pending"] == 0 or stream == bell) and c["idle"] >= min_idle_ms:
                    self.r.xgroup_delconsumer(stream, self.keys.group, name)
                    removed += 1
        return removed

    def _drop_lost_rings(self, n: int) -> None:
        """Ack and delete the rings pending on us: a read acks its rings at once (worker/transport/bounded.py), so
        these are a failed or cut-off read's, which nothing else would ack (trimming the bell keeps their PEL
        entries). One that a read on another thread is about to ack is only acked first: its ``rang`` stands."""
        rows = self.r.xpending_range(self.keys.tenant_bell, self.keys.group, "-", "+", min(n, 1000),
                                     consumername=self.name)
        ids = [row["message_id"] for row in rows]
        if ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.keys.tenant_bell, self.keys.group, *ids)
            pipe.xdel(self.keys.tenant_bell, *ids)
            pipe.execute()
