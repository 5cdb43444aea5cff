"""Commands on the consumer group's pending entries list (PEL): reclaiming what dead workers left,
renewing and releasing leases, pruning dead consumer names. ``PendingList`` is a part of StreamConsumer
(worker/consumer.py), which owns the connection and delegates to it; the policy lives in worker/reclaim.py.
"""

from __future__ import annotations

import logging

import redis

from batchfleet.common.keys import Keys
from batchfleet.worker.transport import Entry

log = logging.getLogger("batchfleet.worker.consumer")


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def autoclaim_reply(resp: list) -> tuple[str, list, int]:
    """(next cursor, [(id, fields)], number deleted) from an XAUTOCLAIM reply (Redis >= 7 has 3 parts)."""
    return resp[0], resp[1] or [], len(resp[2]) if len(resp) > 2 and resp[2] else 0


class PendingList:
    """XAUTOCLAIM / XPENDING / XCLAIM / XINFO for one worker (consumer ``name``) over its bucket streams."""

    def __init__(self, r: redis.Redis, keys: Keys, name: str, buckets: tuple[int, ...]) -> None:
        self.r = r
        self.keys = keys
        self.name = name
        self.buckets = buckets
        self._cursors: dict[int, str] = {}  # XAUTOCLAIM cursor per bucket, kept while a budget cuts a scan

    def reset(self) -> None:
        """Forget the reclaim cursors (the streams were re-created: old positions mean nothing)."""
        self._cursors.clear()

    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """Take over entries pending longer than ``min_idle_ms`` (their consumer died), at most ``budget``.

        XAUTOCLAIM is followed until its cursor returns to 0-0; when the budget cuts a scan short the
        cursor is kept, so the next call resumes there. Entries deleted while pending are dropped from
        the PEL by Redis itself (reported in the third reply element; we only count them).
        """
        out: list[Entry] = []
        for b in self.buckets:
            stream = self.keys.stream(b)
            cursor = self._cursors.pop(b, "0-0")
            while len(out) < budget:
                nxt, claimed, deleted = autoclaim_reply(self.r.xautoclaim(
                    stream, self.keys.group, self.name, min_idle_ms, start_id=cursor, count=budget - len(out)))
                if any(fields is None for _, fields in claimed):  # Redis 6.2 reports deleted ones as nil
                    deleted += self._ack_deleted(stream, {as_str(eid) for eid, f in claimed if f is not None})
                if deleted:
                    log.info("%d pending entries of %s were deleted before they could be reclaimed", deleted, stream)
                out += [Entry(b, as_str(eid), fields) for eid, fields in claimed if fields is not None]
                cursor = as_str(nxt)
                if cursor == "0-0":
                    break
            if cursor != "0-0":
                self._cursors[b] = cursor
        return self._with_delivery_counts(out)

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
            pipe.xpending_range(self.keys.stream(e.bucket), self.keys.group, e.entry_id, e.entry_id, 1)
        counts = []
        for rows in pipe.execute():
            counts.append(int(rows[0]["times_delivered"]) if rows else 1)
        return [Entry(e.bucket, e.entry_id, e.fields, n) for e, n in zip(entries, counts)]

    def release(self, entries: list[Entry], idle_ms: int) -> None:
        """Leave entries pending but make them look ``idle_ms`` idle, so the next reclaim (any worker's)
        redelivers them at once. JUSTID: the delivery count is not raised by this claim."""
        self._claim(entries, min_idle_ms=0, idle=idle_ms)

    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        """Lease renewal: reset the idle time of entries this worker still holds (no delivery count change).
        ``min_idle_ms`` > 0 keeps us from taking back an entry another worker has just reclaimed."""
        self._claim(entries, min_idle_ms=min_idle_ms, idle=None)

    def _claim(self, entries: list[Entry], min_idle_ms: int, idle: int | None) -> None:
        by_bucket: dict[int, list[str]] = {}
        for e in entries:
            by_bucket.setdefault(e.bucket, []).append(e.entry_id)
        if not by_bucket:
            return
        pipe = self.r.pipeline(transaction=False)
        for b, ids in by_bucket.items():
            pipe.xclaim(self.keys.stream(b), self.keys.group, self.name, min_idle_ms, ids, idle=idle, justid=True)
        pipe.execute()

    def prune_consumers(self, min_idle_ms: int) -> int:
        """Remove group consumers (dead workers' names) that hold nothing and were silent for min_idle_ms,
        so the group's consumer list does not grow with every restart. Returns how many were removed."""
        removed = 0
        for b in self.buckets:
            stream = self.keys.stream(b)
            for c in self.r.xinfo_consumers(stream, self.keys.group):
                name = as_str(c["name"])
                if name != self.name and c["pending"] == 0 and c["idle"] >= min_idle_ms:
                    self.r.xgroup_delconsumer(stream, self.keys.group, name)
                    removed += 1
        return removed
