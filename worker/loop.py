"""The worker loop: the only place that wires transport, intake, batcher, request table and engine together.

One tick, top to bottom: write replies still in the outbox; take over entries dead workers left pending;
read new entries (blocking only while nothing can run, and never past the next batch deadline) and
validate them; answer requests whose deadline passed; admit a batch (a request that must run alone, the
next closed batch, or joins to the running batch in continuous mode); run one engine step; write its
replies; publish a heartbeat.

Invariants: an entry is settled only by the write that stores its reply (or dead-letters it), so whatever
dies, it stays pending until answered; every request held is in exactly one stage of the request table
(worker/requests.py), whose snapshot the lease keeper renews; replies that could not be written wait in
the outbox and are retried after an outage; one entry's failure (bad input, a bug, an engine fault) costs
only that entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from batchfleet.common.config import WorkerConfig
from batchfleet.common.errors import CANCELLED, ENGINE_ERROR
from batchfleet.common.protocol import Error
from batchfleet.common.retry import TRANSIENT, Backoff
from batchfleet.worker.batcher import Batcher
from batchfleet.worker.engine.base import Completion, Engine
from batchfleet.worker.intake import Intake
from batchfleet.worker.metrics import LoopStats
from batchfleet.worker.readahead import ReadAhead
from batchfleet.worker.reclaim import LeaseKeeper
from batchfleet.worker.replies import completion_payload, error_reply
from batchfleet.worker.requests import RequestTable, Stage
from batchfleet.worker.streaming import StreamPublisher
from batchfleet.worker.transport import Reply, Transport
from batchfleet.worker.validate import Accepted, Limits

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
SHUTDOWN_OUTAGE_GRACE_S = 10.0  # on shutdown, how long to keep retrying replies Redis will not take


class WorkerLoop:
    """Drives one engine from the transport's bucket streams until stopped."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, transport: Transport, limits: Limits,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        """``decode``: token ids -> text as the engine's final text decodes them; None: no streamed deltas
        (streamed requests then get their whole text with the final reply)."""
        self.cfg = cfg
        self.engine = engine
        self.transport = transport
        b = cfg.batching
        self.batcher: Batcher[Accepted] = Batcher(b.buckets, b.max_batch_size, b.max_wait_ms)
        self.continuous = cfg.engine.mode == "continuous" and engine.accepts_joins
        # continuous mode: sequences of every bucket decode together, up to max_running of them
        self.max_running = cfg.engine.max_running if self.continuous else b.max_batch_size
        self.requests = RequestTable()
        self.alone = False  # a request that must run alone is in the engine: nothing may join it
        self.stopping = threading.Event()
        self.counters = {"batches": 0, "completed": 0, "errors": 0, "dead_lettered": 0, "batched_requests": 0,
                         "reclaimed": 0, "released": 0, "internal_errors": 0, "cancelled": 0, "deltas": 0,
                         "duplicates": 0}
        self.streams = StreamPublisher(decode, cfg.stream_interval_ms / 1000) if decode else None
        self.intake = Intake(cfg, transport, limits, self.batcher, self.requests, self.counters, self._send)
        self.outage = Backoff(log, "redis")
        self.faults = Backoff(log, "worker loop (after an internal error)")
        self._progress = time.monotonic()  # last time a tick completed or an engine step returned
        # read-ahead bound: hold one batch ahead while the engine is full, release what waits too long
        self.readahead = ReadAhead(transport, b.max_wait_ms, cfg.claim_idle_ms)
        self.intake.engine_full = self._engine_full
        self.counters["handed_to_peers"] = 0
        self.lease = LeaseKeeper(transport, cfg.claim_idle_ms, lambda: self.readahead.unreleased(self.requests),
                                 lambda: self._progress, cfg.stall_timeout_s, lock=self.readahead.lock)
        self._stop_at: float | None = None
        self._last_heartbeat = 0.0
        self.observer = LoopStats()  # WorkerMetrics with --metrics-port (worker/compose.py)

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stopping`` is set, then finish the running batch and hand back the rest.

        Never raises for Redis outages or one bad entry: it backs off (capped, one log line per state
        change) and resumes by itself; NOGROUP (Redis came back empty) re-creates groups and fleet info.
        """
        self.lease.start()
        self.readahead.start()
        try:
            while self._keep_running():
                self._guarded(self.tick)
        finally:
            self.readahead.stop()
            self.lease.stop()
            self._guarded(self._hand_back)

    def tick(self) -> None:
        """One round: outbox, reclaim, read, cancels, expire, admit, step, deltas, outbox, heartbeat."""
        self._flush_outbox()
        if not self.stopping.is_set():  # shutting down: take nothing new, finish what runs
            self.intake.reclaim(time.time())
            self.intake.read(time.time(), engine_busy=self.engine.has_work())
        self._cancel()
        now = time.time()
        self.intake.expire(now)
        if not self.stopping.is_set():
            self._admit(now)
        if self.engine.has_work():
            self.readahead.stepping(self.requests.of(Stage.QUEUED), self._engine_full())
            try:
                self._step()
            finally:  # what the read-ahead thread released to peers meanwhile leaves the batcher and table
                self.counters["handed_to_peers"] += self.readahead.stepped(self.batcher, self.requests)
            self._stream()
        self._flush_outbox()
        self._heartbeat()

    def status(self) -> dict:
        """What the heartbeat publishes: identity, request counts, counters and engine stats."""
        return {
            "name": self.transport.name, "engine": self.cfg.engine.engine, "mode": self.cfg.engine.mode,
            "buckets": list(self.cfg.batching.buckets), "waiting": self.requests.count(Stage.QUEUED),
            "active": self.requests.count(Stage.RUNNING), "outbox": self.requests.count(Stage.OUTBOX),
            "at": time.time(), **self.counters, **{f"engine_{k}": v for k, v in self.engine.stats().items()},
            **self.observer.status(),
        }

    def _keep_running(self) -> bool:
        if not self.stopping.is_set():
            return True
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        outbox = self.requests.count(Stage.OUTBOX)
        if not (self.engine.has_work() or outbox):
            return False
        if self.outage.down and time.monotonic() - self._stop_at > SHUTDOWN_OUTAGE_GRACE_S:
            log.warning("stopping during an outage: %d unanswered entries stay pending for other workers",
                        outbox + self.engine.num_active())
            return False
        return True

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            if self.outage.down:  # a tick may not reach Redis (shutdown): "available again" needs a round trip
                self.transport.ping()
            fn()
            self._progress = time.monotonic()
            self.outage.ok()
            self.faults.ok()
        except TRANSIENT as exc:
            self._sleep(self.outage.failed(exc))
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                log.warning("consumer groups are gone (Redis lost its data?): re-creating them and the fleet info")
                try:
                    self.transport.recover()
                except redis.RedisError as again:
                    self._sleep(self.outage.failed(again))
            else:  # NOPERM, OOM, READONLY, ...: an operator must act; keep retrying slowly
                self._sleep(self.outage.failed(exc))
        except Exception:  # a bug must not kill the worker: log it, back off, keep serving
            self.counters["internal_errors"] += 1
            log.exception("worker loop tick failed")
            self._sleep(self.faults.failed(RuntimeError("tick failed")))

    def _sleep(self, seconds: float) -> None:
        if self.stopping.is_set():
            time.sleep(seconds)
        else:
            self.stopping.wait(seconds)

    def _hand_back(self) -> None:
        """On shutdown, return read-but-unstarted entries to their streams for other workers."""
        entries = self.requests.unstarted()
        if entries:
            log.info("handing back %d queued entries", len(entries))
            self.transport.hand_back(entries)
        self.requests.forget_unstarted()

    # ---- scheduling ------------------------------------------------------------------------------
    def _engine_full(self) -> bool:
        """Whether the engine can start nothing more now (dynamic: a batch runs; continuous: max_running
        sequences, or a request runs or waits to run alone)."""
        return self.engine.has_work() and (not self.continuous or self.alone or self.requests.count(Stage.SOLO) > 0
                                           or self.engine.num_active() >= self.max_running)

    def _admit(self, now: float) -> None:
        """dynamic: when the engine is idle, start the next closed batch (it runs to completion).
        continuous: start every closed batch, of any bucket, while the engine has room (max_running);
        the engine prefills each batch on its own and decodes all buckets together. Either way a request
        that must run alone starts only on an idle engine, and nothing joins it."""
        if self.engine.has_work():
            if not self.continuous or self.alone or self.requests.count(Stage.SOLO):
                return  # dynamic: the batch runs to completion; solo requests wait for an idle engine
        else:
            self.alone = False
            # static batching waits for full batches; a bumped flush counter closes partial ones
            if self.batcher.static and len(self.batcher) and self.transport.flush_requested():
                self.batcher.flush()
            alone = self.requests.first_alone()
            if alone is not None:
                self.alone = True
                self._start([alone], kind="solo")
                return
        room = self.max_running - self.engine.num_active()
        while room > 0 and (popped := self.batcher.pop_batch(now, limit=room)) is not None:
            if not self._start(popped[1], kind="batch"):
                return  # the engine was reset: its requests must run alone first
            room = self.max_running - self.engine.num_active() if self.continuous else 0

    def _start(self, items: list[Accepted], kind: str) -> bool:
        """Hand ``items`` to the engine; False when it refused them (handled as a failed step)."""
        self.requests.start(items)
        try:
            self.engine.add([acc.gen for acc in items])
        except Exception as exc:  # refused at admission: same isolation as a failed step
            self._engine_failed(exc, suspects=[acc.gen.id for acc in items])
            return False
        self.counters["batches"] += 1
        self.counters["batched_requests"] += len(items)
        self.observer.started(items[0].entry.bucket, len(items))
        if self.streams is not None:
            for acc in items:
                if acc.request.stream:
                    self.streams.track(acc.gen.id, acc.reply_key, acc.gen.stop, time.time())
        try:
            self.transport.log_batch({
                "worker": self.transport.name, "kind": kind, "bucket": items[0].entry.bucket,
                "size": self.engine.num_active(), "ids": [acc.gen.id for acc in items],
                "at": f"{time.time():.6f}",
            })
        except redis.RedisError as exc:  # the audit record is best effort; the batch runs regardless
            log.debug("batch record not written: %r", exc)
        return True

    def _step(self) -> None:
        began = time.monotonic()
        try:
            completions = self.engine.step()
        except Exception as exc:  # an engine fault must cost at most the request that caused it
            # the requests of the step that raised (engines that say so); else every running one
            self._engine_failed(exc, suspects=getattr(self.engine, "last_step_ids", None))
            return
        self._progress = time.monotonic()
        self.observer.stepped(self._progress - began)
        self._answer(completions)

    def _engine_failed(self, exc: Exception, suspects: list[str] | None = None) -> None:
        """The engine is reset. Requests of the failed step (``suspects``; None or empty: all) are
        retried one at a time; the others (continuous mode: other buckets' sequences that were not in
        that step) go back to the batcher and run again as usual. A request failing alone is released
        for redelivery (another worker, or this one, retries it) until max_deliveries, then given up."""
        held = self.requests.of(Stage.RUNNING)
        self.alone = False
        if self.streams is not None:  # a re-run streams again; clients skip text they already have (offset)
            for acc in held:
                self.streams.forget(acc.gen.id)
        try:
            self.engine.reset()
        except Exception:
            log.exception("engine reset failed")
        log.error("engine step failed with %d active request(s): %r", len(held), exc)
        wanted = set(suspects or ()) or {acc.gen.id for acc in held}
        failed = [acc for acc in held if acc.gen.id in wanted]
        bystanders = [acc for acc in held if acc.gen.id not in wanted]
        if bystanders:
            self.requests.requeue(bystanders)
            for acc in bystanders:
                self.batcher.add(acc, acc.entry.bucket, acc.enqueued_at)
        if len(held) > 1:  # retried alone: batchmates must not pay for a poison request
            self.requests.run_alone(failed)
            return
        for acc in failed:
            self.requests.drop(acc.gen.id)  # stops renewing its lease before it is released
            if acc.entry.deliveries >= self.cfg.max_deliveries:
                self.intake.give_up(acc.entry, f"engine failed on this request on each of {acc.entry.deliveries} "
                                               f"deliveries; last error: {exc!r}"[:500])
            else:
                self.counters["released"] += 1
                self.transport.release([acc.entry], idle_ms=self.cfg.claim_idle_ms)

    # ---- cancellation and streaming ---------------------------------------------------------------
    def _cancel(self) -> None:
        """Honour new cancel requests for jobs held here (only from the client that submitted them: the
        reply key must match): a running job leaves the engine now, freeing its KV blocks; its batchmates
        are not touched. Answered once, with ``cancelled``."""
        for c in self.transport.cancels():
            acc = self.requests.get(c.job_id)
            if acc is None or acc.reply_key != c.reply_key:
                continue  # not here (another worker's, or answered already), or not the submitter's
            if self.requests.stage(c.job_id) is not Stage.RUNNING:
                self.intake.cancel_unstarted(acc)
                continue
            self.engine.abort([c.job_id])
            self.requests.finish(c.job_id)
            if self.streams is not None:
                self.streams.forget(c.job_id)
            self.counters["cancelled"] += 1
            self._send([error_reply(acc, CANCELLED, "cancelled while running")])

    def _stream(self) -> None:
        """Write the text deltas that are due for streamed requests still running (best effort)."""
        if self.streams is None:
            return
        deltas = self.streams.due_deltas(time.time(), lambda j: self.requests.stage(j) is Stage.RUNNING,
                                         lambda ids: self.engine.progress(ids))
        if not deltas:
            return
        try:
            self.transport.write_deltas(deltas)
            self.counters["deltas"] += len(deltas)
        except TRANSIENT as exc:  # the final reply carries the whole text; a lost delta costs nothing
            log.debug("deltas not written: %r", exc)

    # ---- replies ---------------------------------------------------------------------------------
    def _answer(self, completions: list[Completion]) -> None:
        if not completions:
            return
        now = time.time()
        replies = []
        for c in completions:
            if self.requests.stage(c.id) is not Stage.RUNNING:  # defensive: the engine returned a stranger
                log.error("engine returned %s, which is not running here: ignored", c.id)
                self.counters["internal_errors"] += 1
                continue
            acc = self.requests.finish(c.id)
            if self.streams is not None:
                self.streams.forget(c.id)
            try:
                payload = completion_payload(c, acc, now, self.transport.name)
                self.counters["errors" if c.error is not None else "completed"] += 1
            except Exception as exc:  # e.g. unencodable text: answer this one with an error, keep going
                log.exception("could not encode the result of %s", c.id,
                              extra={"job": c.id, "bucket": acc.entry.bucket})
                payload = Error(c.id, ENGINE_ERROR, f"result could not be encoded: {exc!r}"[:500]).encode()
                self.counters["errors"] += 1
            replies.append(Reply(c.id, payload, acc.entry.bucket, acc.entry.entry_id, acc.reply_key))
        self._send(replies)

    def _send(self, replies: list[Reply]) -> None:
        """Queue replies and try to write them now; on an outage they wait in the outbox (still leased)."""
        self.observer.replied(replies)
        self.requests.answer(replies)
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        batch = self.requests.outbox
        if not batch:
            return
        self.transport.write_replies(list(batch))  # idempotent: first writer wins, settling repeatable
        self.requests.written(len(batch))

    def _heartbeat(self) -> None:
        now = time.time()
        if now - self._last_heartbeat < HEARTBEAT_S:
            return
        self._last_heartbeat = now
        self.transport.heartbeat(self.status())
