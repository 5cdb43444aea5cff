"""The intake half of the worker loop: reading, reclaiming, validating, rejecting, expiring, giving up.

A mixin of WorkerLoop (worker/loop.py), split out to keep each file one idea. It uses the loop's state:
``cfg``, ``consumer``, ``limits``, ``batcher``, ``waiting``, ``solo``/``solo_ids``, ``active``,
``counters``, ``stopping``, ``_held`` and the loop's ``_send`` / ``_publish_held``.
Every entry read ends as: queued to run, answered with an error, or dead-lettered; never dropped.
"""

from __future__ import annotations

import logging
import time

import redis

from batchfleet.common.errors import DEADLINE_EXCEEDED, WORKER_FAILED
from batchfleet.common.protocol import Error
from batchfleet.worker.consumer import Entry, Reply
from batchfleet.worker.intake import Accepted, Rejected, accept, job_id_of
from batchfleet.worker.reclaim import SOLO_FROM_DELIVERY, reclaim_period_s, split_exhausted

log = logging.getLogger("batchfleet.worker.loop")

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
PRUNE_PERIOD_S = 60.0
PRUNE_IDLE_MS = 3_600_000  # a consumer name silent for an hour with nothing pending is a dead worker's


class IntakeMixin:
    """Turns stream entries into queued requests (or their answers)."""

    # ---- intake ----------------------------------------------------------------------------------
    def _room(self) -> int:
        """Hold at most two batches locally: leave the rest to peers."""
        return 2 * self.cfg.batching.max_batch_size - len(self.waiting) - len(self.solo)

    def _read(self, now: float) -> None:
        if self.stopping.is_set():
            return
        room = self._room()
        busy = self.engine.has_work() or bool(self.solo)
        if room <= 0:
            deadline = self.batcher.next_deadline()
            if not busy and deadline is not None and deadline > now:
                time.sleep(min(deadline - now, 0.5))
            return
        if busy:
            block_ms: int | None = None
        else:
            deadline = self.batcher.next_deadline()
            if deadline is None and self.batcher.static and len(self.batcher):
                deadline = now + 0.05  # poll the flush counter while a partial static batch waits
            block_ms = self.consumer.max_block_ms if deadline is None else int((deadline - now) * 1000) + 1
            block_ms = min(block_ms, int(reclaim_period_s(self.cfg.claim_idle_ms) * 1000) + 1)
            if block_ms <= 0:
                return
        # COUNT applies per stream: split the room so all buckets together stay within it
        per_stream = max(1, -(-room // len(self.cfg.batching.buckets)))
        for entry in self.consumer.read(count=per_stream, block_ms=block_ms):
            self._take(entry, solo=False)
        self._publish_held()

    def _reclaim(self, now: float) -> None:
        """Take over entries whose worker went silent for claim_idle_ms (see worker/reclaim.py)."""
        if self.stopping.is_set() or now < self._next_reclaim:
            return
        self._next_reclaim = now + reclaim_period_s(self.cfg.claim_idle_ms)
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_PERIOD_S
            self.consumer.prune_consumers(PRUNE_IDLE_MS)
        room = min(self._room(), self.cfg.reclaim_budget)
        if room <= 0:
            return
        # entry ids are unique per stream only: two buckets often share "<ms>-0"
        held = {(e.bucket, e.entry_id) for e in self._held}
        entries = [e for e in self.consumer.reclaim(self.cfg.claim_idle_ms, room) or []
                   if (e.bucket, e.entry_id) not in held]
        if not entries:
            return
        self.counters["reclaimed"] += len(entries)
        log.info("reclaimed %d entries left pending by a silent worker", len(entries))
        keep, spent = split_exhausted(entries, self.cfg.max_deliveries)
        for e in spent:
            self._give_up(e, f"delivered {e.deliveries} times (max_deliveries {self.cfg.max_deliveries}): "
                             "its workers died or it failed every time")
        answered = self.consumer.answered([job_id_of(e) or "-" for e in keep]) or [False] * len(keep)
        for e, done in zip(keep, answered):
            if done:
                self.consumer.ack(e)  # answered already (a duplicate enqueue): nothing to run
            else:
                self._take(e, solo=e.deliveries >= SOLO_FROM_DELIVERY)
        self._publish_held()

    def _take(self, entry: Entry, solo: bool) -> None:
        """Validate one entry and queue it; any failure here costs this entry only."""
        try:
            outcome = accept(entry, self.consumer.keys, self.limits, time.time())
            if isinstance(outcome, Rejected):
                self._reject(outcome)
                return
            job = outcome.gen.id
            if job in self.waiting or job in self.active or job in self.solo_ids:
                self.consumer.ack(entry)  # same job enqueued twice: the copy we hold answers for both
            elif solo:
                self.solo.append(outcome)
                self.solo_ids.add(job)
            else:
                self.waiting[job] = outcome
                self.batcher.add(outcome, entry.bucket, outcome.enqueued_at)
        except REDIS_DOWN:
            raise  # the entry stays pending; it is read again after the outage (reclaim)
        except Exception as exc:
            self.counters["internal_errors"] += 1
            log.exception("internal error on entry %s; dead-lettering it", entry.entry_id)
            self._give_up(entry, f"internal error while validating: {exc!r}"[:500])

    def _reject(self, rej: Rejected) -> None:
        if rej.error is None:  # no usable id: nobody to answer
            self._give_up(rej.entry, rej.reason)
            return
        self.counters["errors"] += 1
        self._send([Reply(rej.error.id, rej.error.encode(), rej.entry.bucket, rej.entry.entry_id)])

    def _give_up(self, entry: Entry, reason: str) -> None:
        """Dead-letter an entry for good, answering ``worker_failed`` when it names a job."""
        job_id = job_id_of(entry)
        reply = None
        if job_id is not None:
            reply = Reply(job_id, Error(job_id, WORKER_FAILED, reason).encode(), entry.bucket, entry.entry_id)
        log.warning("giving up on entry %s (job %s): %s", entry.entry_id, job_id, reason)
        self.counters["dead_lettered"] += 1
        self.counters["errors"] += 1
        self.consumer.give_up(entry, reason, reply)

    def _expire(self, now: float) -> None:
        def expired(acc: Accepted) -> bool:
            return acc.request.deadline is not None and acc.request.deadline <= now

        gone = self.batcher.expire(expired)
        for acc in [a for a in self.solo if expired(a)]:
            self.solo.remove(acc)
            self.solo_ids.discard(acc.gen.id)
            gone.append(acc)
        if gone:
            replies = []
            for acc in gone:
                self.waiting.pop(acc.gen.id, None)
                err = Error(acc.gen.id, DEADLINE_EXCEEDED, "deadline passed before the request was scheduled")
                replies.append(Reply(acc.gen.id, err.encode(), acc.entry.bucket, acc.entry.entry_id))
            self.counters["errors"] += len(replies)
            self._send(replies)
