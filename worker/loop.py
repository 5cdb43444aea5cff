"""The worker loop: the only place that wires stream consumer, batcher and engine together.

One tick: read new entries (blocking only while the engine is idle, and never past the next batch
deadline), validate them, expire dead ones, admit a batch (or joins, in continuous mode), run one
engine step, write its replies. Replies are written before entries are acked (one script per reply).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis

from common.config import WorkerConfig
from common.errors import DEADLINE_EXCEEDED, ENGINE_ERROR
from common.protocol import Error, Result
from worker.batcher import Batcher
from worker.consumer import Reply, StreamConsumer
from worker.engine.base import Completion, Engine
from worker.intake import Accepted, Limits, Rejected, accept

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
BACKOFF_MAX_S = 5.0


class WorkerLoop:
    """Drives one engine from the bucket streams until stopped."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, consumer: StreamConsumer, limits: Limits) -> None:
        self.cfg = cfg
        self.engine = engine
        self.consumer = consumer
        self.limits = limits
        b = cfg.batching
        self.batcher: Batcher[Accepted] = Batcher(b.buckets, b.max_batch_size, b.max_wait_ms)
        self.continuous = cfg.engine.mode == "continuous" and engine.accepts_joins
        self.waiting: dict[str, Accepted] = {}  # read, validated, not yet in the engine
        self.active: dict[str, Accepted] = {}  # in the engine
        self.solo: deque[Accepted] = deque()  # batchmates of a failed batch, retried one at a time
        self.solo_ids: set[str] = set()
        self.bucket: int | None = None  # bucket of the batch in the engine
        self.stopping = threading.Event()
        self.counters = {"batches": 0, "completed": 0, "errors": 0, "dead_lettered": 0, "batched_requests": 0}
        self._last_heartbeat = 0.0
        self._backoff = 0.0
        self._flush_seen = consumer.flush_counter() if self.batcher.static else 0
        self._flush_checked = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stopping`` is set, then finish the running batch and hand back the rest."""
        while not self.stopping.is_set() or self.engine.has_work():
            try:
                self.tick()
                self._backoff = 0.0
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._backoff = min(BACKOFF_MAX_S, max(0.1, self._backoff * 2))
                log.warning("redis unavailable (%s); retrying in %.1fs", exc.__class__.__name__, self._backoff)
                self.stopping.wait(self._backoff)
        self._hand_back()

    def tick(self) -> None:
        now = time.time()
        self._read(now)
        now = time.time()
        self._expire(now)
        self._admit(now)
        if self.engine.has_work():
            self._step()
        self._heartbeat()

    # ---- intake ----------------------------------------------------------------------------------
    def _read(self, now: float) -> None:
        if self.stopping.is_set():
            return
        mbs = self.cfg.batching.max_batch_size
        room = 2 * mbs - len(self.waiting)  # hold at most two batches locally: leave the rest to peers
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
            if block_ms <= 0:
                return
        entries = self.consumer.read(count=room, block_ms=block_ms)
        now = time.time()
        for entry in entries:
            outcome = accept(entry, self.consumer.keys, self.limits, now)
            if isinstance(outcome, Rejected):
                self._reject(outcome)
            elif outcome.gen.id in self.waiting or outcome.gen.id in self.active:
                # same job delivered twice (re-added after a crash): the first copy answers for both
                self.consumer.ack(entry)
            else:
                self.waiting[outcome.gen.id] = outcome
                self.batcher.add(outcome, entry.bucket, outcome.enqueued_at)

    def _reject(self, rej: Rejected) -> None:
        self.counters["errors"] += 1
        if rej.error is None:
            log.warning("dead-lettering entry %s: %s", rej.entry.entry_id, rej.reason)
            self.counters["dead_lettered"] += 1
            self.consumer.dead_letter(rej.entry, rej.reason)
        else:
            self.consumer.write_replies([Reply(rej.error.id, rej.error.encode(), rej.entry.bucket, rej.entry.entry_id)])

    def _expire(self, now: float) -> None:
        def expired(acc: Accepted) -> bool:
            return acc.request.deadline is not None and acc.request.deadline <= now

        gone = self.batcher.expire(expired)
        if gone:
            replies = []
            for acc in gone:
                self.waiting.pop(acc.gen.id, None)
                err = Error(acc.gen.id, DEADLINE_EXCEEDED, "deadline passed before the request was scheduled")
                replies.append(Reply(acc.gen.id, err.encode(), acc.entry.bucket, acc.entry.entry_id))
            self.counters["errors"] += len(replies)
            self.consumer.write_replies(replies)

    # ---- scheduling ------------------------------------------------------------------------------
    def _check_flush(self, now: float) -> None:
        """Static batching waits for full batches; a bumped flush counter closes partial ones."""
        if now - self._flush_checked < 0.05:
            return
        self._flush_checked = now
        counter = self.consumer.flush_counter()
        if counter != self._flush_seen:
            self._flush_seen = counter
            self.batcher.flush()

    def _admit(self, now: float) -> None:
        if not self.engine.has_work():
            if self.batcher.static and len(self.batcher):
                self._check_flush(now)
            if self.solo:
                self._start([self.solo.popleft()], kind="solo")
                return
            popped = self.batcher.pop_batch(now)
            if popped is not None:
                self.bucket = popped[0]
                self._start(popped[1], kind="batch")
        elif self.continuous and self.bucket is not None and not self.solo:
            if self.batcher.other_bucket_ready(self.bucket, now):
                return  # let the running batch drain so the older bucket gets its turn
            room = self.cfg.batching.max_batch_size - self.engine.num_active()
            if room > 0 and self.batcher.pending(self.bucket):
                self._start(self.batcher.take(self.bucket, room), kind="join")

    def _start(self, items: list[Accepted], kind: str) -> None:
        for acc in items:
            self.waiting.pop(acc.gen.id, None)
            self.active[acc.gen.id] = acc
        self.engine.add([acc.gen for acc in items])
        if kind != "join":
            self.counters["batches"] += 1
        self.counters["batched_requests"] += len(items)
        self.consumer.log_batch({
            "worker": self.consumer.name, "kind": kind, "bucket": items[0].entry.bucket,
            "size": self.engine.num_active(), "ids": [acc.gen.id for acc in items], "at": f"{time.time():.6f}",
        })

    def _step(self) -> None:
        try:
            completions = self.engine.step()
        except Exception as exc:  # an engine fault must cost at most the request that caused it
            self._engine_failed(exc)
            return
        self._answer(completions)

    def _engine_failed(self, exc: Exception) -> None:
        failed = list(self.active.values())
        self.active.clear()
        self.engine.reset()
        log.error("engine step failed with %d active request(s): %r", len(failed), exc)
        replies = []
        for acc in failed:
            if len(failed) > 1 and acc.gen.id not in self.solo_ids:
                self.solo_ids.add(acc.gen.id)
                self.solo.append(acc)  # retried alone: its batchmates must not pay for a poison request
            else:
                self.solo_ids.discard(acc.gen.id)
                err = Error(acc.gen.id, ENGINE_ERROR, f"engine failed on this request: {exc!r}"[:500])
                replies.append(Reply(acc.gen.id, err.encode(), acc.entry.bucket, acc.entry.entry_id))
        self.counters["errors"] += len(replies)
        self.consumer.write_replies(replies)

    def _answer(self, completions: list[Completion]) -> None:
        if not completions:
            return
        now = time.time()
        replies = []
        for c in completions:
            acc = self.active.pop(c.id)
            self.solo_ids.discard(c.id)
            if c.error is not None:
                payload = Error(c.id, ENGINE_ERROR, c.error).encode()
                self.counters["errors"] += 1
            else:
                t0 = acc.enqueued_at
                payload = Result(
                    id=c.id, token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason,
                    prompt_tokens=len(acc.gen.prompt), completion_tokens=len(c.token_ids),
                    queue_ms=(c.started_at - t0) * 1000, ttft_ms=(c.first_token_at - t0) * 1000,
                    total_ms=(now - t0) * 1000, worker=self.consumer.name, batch_size=c.batch_size,
                    extra={"bucket": acc.entry.bucket},
                ).encode()
                self.counters["completed"] += 1
            replies.append(Reply(c.id, payload, acc.entry.bucket, acc.entry.entry_id))
        self.consumer.write_replies(replies)

    # ---- housekeeping ----------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        now = time.time()
        if now - self._last_heartbeat < HEARTBEAT_S:
            return
        self._last_heartbeat = now
        self.consumer.heartbeat(self.status())

    def status(self) -> dict:
        return {
            "name": self.consumer.name, "engine": self.cfg.engine.engine, "mode": self.cfg.engine.mode,
            "buckets": list(self.cfg.batching.buckets), "waiting": len(self.waiting),
            "active": len(self.active), "at": time.time(), **self.counters,
            **{f"engine_{k}": v for k, v in self.engine.stats().items()},
        }

    def _hand_back(self) -> None:
        """On shutdown, return read-but-unstarted entries to their streams for other workers."""
        entries = [acc.entry for acc in self.waiting.values()] + [acc.entry for acc in self.solo]
        self.waiting.clear()
        self.solo.clear()
        if entries:
            log.info("handing back %d queued entries", len(entries))
            self.consumer.hand_back(entries)
