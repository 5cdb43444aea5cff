"""How many of a run's jobs wait unread in the fleet's background streams, kept to what the fleet starts soon.

Why: every bulk run and batch job (producer/bulk/runner.py, both formats) shares the background class, and a
stream is read first in, first out. A run that keeps its whole window (256 lines) queued put a 256-line block
ahead of the run beside it, and each waited for the other's block: answers came in bursts with 14-15 s gaps
(issue 58). A run that keeps at most ``limit`` of its jobs unread (``max_batch_size`` x live workers: what
the fleet reads next) has its jobs interleave in the stream with the other runs', so every run gets answers
all the time, in proportion to the runs sharing the class. What a run has not yet sent stays in its input
(the run's registry report and the batch's request counts still say how much is left).

How a run tells its jobs read without a call per job, two ways, per stream:

- by time: a job's stream entry id is stamped by the clock of the stream's Redis (``TIME``), so every job placed
  before a ``TIME`` answered ``T`` has an id at or below ``T``; once the consumer group's ``last-delivered-id``
  (``XINFO GROUPS``) is past ``T``, a worker has read it;
- by count: the unread entries of a stream are its newest ones, ``U`` of them (the group's ``lag``, else the
  stream's length less the group's pending entries: a worker deletes what it acks), so at most the run's newest
  ``U`` jobs there are unread. This one sees a stream read to its end, which the first cannot until an entry
  stamped after ``T`` is read.

A poll is one ``TIME``, one ``XINFO GROUPS`` and one ``XLEN`` per stream the run has unread jobs in, at most
every MIN_POLL_S and only while the run is at its limit; both ways err on the side of unread (fewer jobs
queued, never more). A job whose line was settled (answered, failed, expired) counts no longer, read or not. A
user that may not ``XINFO GROUPS`` (an ACL from before this rule, docs/SECURITY.md) turns the limit off, with a
warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis

from batchfleet.common.redis.clients import same_node
from batchfleet.producer.aclient import AsyncClient

log = logging.getLogger(__name__)

MIN_POLL_S = 0.1  # a run at its limit asks Redis at most this often
POLL_S = 0.25  # and waits at most this long for one of its answers before it asks again
LIVE_REFRESH_S = 5.0  # how often the live-worker count (part of the limit) is read again


def _ms(entry_id: Any) -> int:
    """The milliseconds part of a stream entry id ("1700000000000-3")."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-")[0] or 0)


class Queued:
    """A run's jobs placed in a background stream and not yet read by a worker (``unread``), and the wait
    while they fill the run's share (``full``)."""

    def __init__(self, client: AsyncClient, on: bool = True) -> None:
        self.client, self.on = client, on
        # stream -> job id -> the TIME bound (ms) of its entry id, None until a poll sets it; insertion order is
        # placement order, so bounds do not decrease along a stream's dict
        self.streams: dict[str, dict[str, int | None]] = {}
        self.stream_of: dict[str, str] = {}
        self.polled = -float("inf")
        self.live, self.live_at = 1, -float("inf")

    @property
    def unread(self) -> int:
        return len(self.stream_of)

    def placed(self, job_id: str, stream: str) -> None:
        """A job was added to ``stream`` (``AsyncClient.submit``'s ``placed``)."""
        if self.on:
            self.streams.setdefault(stream, {})[job_id] = None
            self.stream_of[job_id] = stream

    def settled(self, job_ids: Iterable[str]) -> None:
        """The line of these jobs is written (or given up): whether read or not, they count no longer."""
        for jid in job_ids:
            stream = self.stream_of.pop(jid, None)
            if stream is not None:
                self.streams[stream].pop(jid, None)

    async def limit(self) -> int:
        """What the fleet reads next: ``max_batch_size`` per live worker (at least one worker's: a fleet at
        zero still gets a batch to wake it)."""
        if time.monotonic() - self.live_at > LIVE_REFRESH_S:
            self.live_at = time.monotonic()
            try:
                self.live = await self.client.live_workers()
            except Exception as exc:  # noqa: BLE001 - keep the last count; the submits meet a real outage
                log.debug("live workers not read: %r", exc)
        try:
            fleet = await self.client.fleet()
        except Exception as exc:  # noqa: BLE001 - no limit: the next submit meets the outage (or NoWorkers)
            log.debug("fleet not read: %r", exc)
            return self.unread + 1
        assert fleet.info is not None
        return fleet.info.max_batch_size * max(1, self.live)

    async def full(self) -> bool:
        """Whether the run has its share unread now (asks Redis at most every MIN_POLL_S, only when it may
        be full); False when off."""
        if not self.on or not self.unread or self.unread < await self.limit():
            return False
        if time.monotonic() - self.polled >= MIN_POLL_S and not await self.poll():
            return False  # Redis did not answer: the next submit meets the outage (and stops the run), not a wait
        return self.on and self.unread >= await self.limit()

    async def poll(self) -> bool:
        """Drop the jobs a worker has read (by time and by count, module docstring); False: a stream could not
        be polled."""
        self.polled = time.monotonic()
        answered = True
        r, group = self.client.r, self.client.keys.group
        for stream, jobs in list(self.streams.items()):
            if not jobs:
                del self.streams[stream]
                continue
            fresh = [j for j, bound in jobs.items() if bound is None]  # placed before this poll's TIME
            try:
                (sec, usec), rows, length = await asyncio.gather(
                    r.execute_command("TIME", **same_node(r, stream)), self._groups(stream), r.xlen(stream))
            except redis.exceptions.NoPermissionError as exc:
                log.warning("background share off: this Redis user may not XINFO GROUPS %s (%s); runs beside this "
                            "one may wait for its queued lines (docs/SECURITY.md)", stream, exc)
                self.on = False
                self.streams.clear()
                self.stream_of.clear()
                return True
            except (redis.RedisError, OSError) as exc:
                log.debug("background share: %s not polled: %r", stream, exc)
                answered = False
                continue
            now_ms = int(sec) * 1000 + int(usec) // 1000
            for jid in fresh:
                if jid in jobs:
                    jobs[jid] = now_ms
            row = next((g for g in rows if g.get("name") in (group, group.encode())), None) or {}
            delivered_ms = _ms(row.get("last-delivered-id", "0-0"))
            lag = row.get("lag")
            newest = int(lag) if lag is not None else max(0, int(length) - int(row.get("pending") or 0))
            for jid, bound in list(jobs.items()):
                # in placement order: once one may be unread, every later one may be too
                if len(jobs) <= newest and (bound is None or bound >= delivered_ms):
                    break
                del jobs[jid]
                self.stream_of.pop(jid, None)
        return answered

    async def _groups(self, stream: str) -> list[dict]:
        try:
            return await self.client.r.xinfo_groups(stream)
        except redis.exceptions.NoPermissionError:
            raise
        except redis.ResponseError:  # no such stream yet: nothing of it was read
            return []
