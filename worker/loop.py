"""The worker loop: the only place that wires transport, intake, request table, dispatcher and engine.

One tick, top to bottom, as a list: forget what the read-ahead thread released; act on the guide checks
that finished (worker/requests/guidecheck.py: new guides are judged off this thread); write replies still in
the outbox; take over entries dead workers left pending; read new entries (blocking only while nothing
can run, and never past the next batch deadline) and validate them; honour cancels; answer requests
whose deadline passed; admit; run one engine step and write its deltas; write replies; heartbeat.

Invariants: an entry is settled only by the write that stores its reply (or dead-letters it), so whatever
dies, it stays pending until answered; every request held is in exactly one stage of the request table
(worker/requests/table.py), the one owner of held requests, whose snapshot the lease keeper renews; other
threads (read-ahead, lease keeper, guide check) never change the loop's state: they post to it
(``ReadAhead.settle``, ``GuideChecks.done``); replies that could not be written wait in the outbox and are
retried after an outage; one entry's failure (bad input, a bug, an engine fault) costs only that entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from batchfleet.common.config import WorkerConfig
from batchfleet.common.redis.retry import TRANSIENT, Backoff
from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.batching.window import Window
from batchfleet.worker.dispatch import Dispatcher
from batchfleet.worker.engine.base import Engine
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.metrics import LoopStats
from batchfleet.worker.requests.guidecheck import Compiler, GuideChecks
from batchfleet.worker.requests.intake import Intake
from batchfleet.worker.requests.outbox import Outbox
from batchfleet.worker.requests.readahead import ReadAhead
from batchfleet.worker.requests.streaming import StreamPublisher
from batchfleet.worker.requests.table import RequestTable, Stage
from batchfleet.worker.requests.validate import Limits
from batchfleet.worker.transport.base import StreamsLost, Transport, TransportError
from batchfleet.worker.transport.reclaim import LeaseKeeper

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # while anything changed (requests answered or held): statuses stay fresh
IDLE_HEARTBEAT_S = 5.0  # nothing changed: live window 30 s (common/redis/functions.py LIVE_WORKER_MS), status TTL 15 s
SHUTDOWN_OUTAGE_GRACE_S = 10.0  # on shutdown, how long to keep retrying replies Redis will not take


def _loop_stats(loop: WorkerLoop) -> LoopStats:
    return LoopStats(loop.ledger)


class WorkerLoop:
    """Drives one engine from the transport's bucket streams until stopped."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, transport: Transport, limits: Limits,
                 decode: Callable[[list[int]], str] | None = None,
                 observe: Callable[[WorkerLoop], LoopStats] | None = None,
                 guides: Compiler | None = None) -> None:
        """``decode``: token ids -> text as the engine's final text decodes them; None: no streamed deltas
        (streamed requests then get their whole text with the final reply). ``observe``: makes the loop's
        observer from the loop (its ledger, engine, request table are set by then); default ``LoopStats``,
        ``WorkerMetrics`` with --metrics-port (worker/compose.py). ``guides``: the engine's guide compiler,
        run on the guide-check thread for each new guide that passes (None: the engine compiles at
        admission)."""
        self.cfg = cfg
        self.engine = engine
        self.transport = transport
        b = cfg.batching
        joins = cfg.engine.mode == "continuous"
        # when partly filled batches close (worker/batching/window.py): the dispatcher tells it what steps and runs cost
        self.window = Window(b.max_wait_ms, adaptive=b.window == "adaptive", joins=joins, ttft_slo_ms=b.ttft_slo_ms)
        # between tenants, the fair share picks whose held entry starts next (worker/transport/fair_share.py)
        self.requests = RequestTable(Batcher(b.buckets, b.max_batch_size, b.max_wait_ms, window=self.window,
                                             order=transport.admission_order))
        self.ledger = Ledger()
        self.observer = (observe or _loop_stats)(self)
        self.stopping = threading.Event()
        streams = StreamPublisher(decode, cfg.stream_interval_ms / 1000) if decode else None
        # every answer, the intake's and the dispatcher's, leaves through the outbox (worker/requests/outbox.py)
        self.outbox = Outbox(transport, self.requests, self.ledger, self.observer)
        self.dispatch = Dispatcher(cfg, engine, transport, self.requests, self.outbox, self.ledger, streams,
                                   self.observer, self.window)
        # the intake asks the dispatcher whether the engine is full and how much it could start now
        self.intake = Intake(cfg, transport, limits, self.requests, self.ledger, self.outbox, self.dispatch,
                             GuideChecks(guides))
        self.outage = Backoff(log, "redis")
        self.faults = Backoff(log, "worker loop (after an internal error)")
        self._progress = time.monotonic()  # last time a tick completed or an engine step returned
        # read-ahead bound (worker/requests/readahead.py): hold only what can start soon, release what waits too long
        self.readahead = ReadAhead(transport, b.max_wait_ms, cfg.claim_idle_ms)
        self.lease = LeaseKeeper(transport, cfg.claim_idle_ms, lambda: self.readahead.unreleased(self.requests),
                                 lambda: max(self._progress, self.dispatch.progress), cfg.stall_timeout_s,
                                 lock=self.readahead.lock)
        self._stop_at: float | None = None
        self._last_heartbeat = 0.0
        self._last_marks: tuple = ()  # what the last heartbeat saw change (ledger, requests held)

    # ---- lifecycle -------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until ``stopping`` is set, then finish the running batch and hand back the rest.

        Never raises for Redis outages or one bad entry: it backs off (capped, one log line per state
        change) and resumes by itself; lost streams (Redis came back empty) re-create groups and fleet info.
        """
        self.lease.start()
        self.readahead.start()
        # a status at once: the first tick's read of an idle worker blocks up to MAX_BLOCK_MS
        # (worker/transport/consumer.py)
        # before the tick's own heartbeat, and status, the dashboard and those waiting for a worker read this key
        self._guarded(self._heartbeat)
        try:
            while self._keep_running():
                self._guarded(self.tick)
        finally:
            self.readahead.stop()
            self.intake.guides.stop()  # what is still VALIDATING is handed back below
            self.lease.stop()
            self._guarded(self._hand_back)

    def tick(self) -> None:
        """One round: settle, verdicts, outbox, reclaim, read, cancels, expire, admit, step, deltas, outbox,
        heartbeat."""
        self._settle_released()
        self.intake.verdicts()
        self.outbox.flush()
        taking = not self.stopping.is_set()  # shutting down: take nothing new, finish what runs
        # requests read from now on had their cancel markers checked by the read itself (Intake._take_all)
        unstarted = (Stage.VALIDATING, Stage.QUEUED, Stage.SOLO)
        held, waited = bool(self.requests.snapshot), any(self.requests.count(s) for s in unstarted)
        if taking:
            self.intake.reclaim(time.time())
            self.intake.read(time.time(), engine_busy=self.engine.has_work())
        # the cancels stream matters only for requests held since an earlier tick (holding nothing before this
        # read, nothing runs and every request was just checked): a lone request starts without that round trip
        if held and self.requests.snapshot:
            waiting = waited and any(self.requests.count(s) for s in unstarted)
            self.dispatch.cancel(self.transport.cancel_watch.cancels(waiting=waiting))
        self.intake.expire(time.time())
        if taking:
            self.dispatch.admit(time.time())
        if self.engine.has_work():
            # what the engine has no room for may be released to idle peers while the step runs
            stuck = [acc for acc in self.requests.of(Stage.QUEUED) if self.dispatch.engine_full(acc.entry.priority)]
            self.readahead.stepping(stuck, engine_full=bool(stuck))
            try:
                self.dispatch.step()
            finally:  # the read-ahead thread releases nothing more; what it released is settled next tick
                self.readahead.stepped()
            self.dispatch.stream()
        self.outbox.flush()
        self._heartbeat()

    def status(self) -> dict:
        """What the heartbeat publishes: identity, request counts, counters and engine stats."""
        return {
            "name": self.transport.name, "engine": self.cfg.engine.engine, "mode": self.cfg.engine.mode,
            "buckets": list(self.cfg.batching.buckets), "waiting": self.requests.count(Stage.QUEUED),
            "active": self.requests.count(Stage.RUNNING), "outbox": self.requests.count(Stage.OUTBOX),
            "at": time.time(), **self.ledger, **{f"engine_{k}": v for k, v in self.engine.stats().items()},
            **self.observer.status(), **self.window.describe(),
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
        except StreamsLost:
            log.warning("consumer groups are gone (Redis lost its data?): re-creating them and the fleet info")
            try:
                self.transport.recover()
            except (TransportError, *TRANSIENT) as again:
                self._sleep(self.outage.failed(again))
        except TransportError as exc:  # NOPERM, OOM, READONLY, ...: an operator must act; keep retrying slowly
            self._sleep(self.outage.failed(exc))
        except Exception:  # a bug must not kill the worker: log it, back off, keep serving
            self.ledger.note("internal_errors")
            log.exception("worker loop tick failed")
            self._sleep(self.faults.failed(RuntimeError("tick failed")))

    def _sleep(self, seconds: float) -> None:
        if self.stopping.is_set():
            time.sleep(seconds)
        else:
            self.stopping.wait(seconds)

    def _settle_released(self) -> None:
        """Forget the requests the read-ahead thread released to peers (never started here)."""
        self.ledger.note("handed_to_peers", self.readahead.settle(self.requests.drop))

    def _hand_back(self) -> None:
        """On shutdown, return read-but-unstarted entries to their streams for other workers."""
        self._settle_released()  # released ones are a peer's now: never hand them back twice
        entries = self.requests.unstarted()
        if entries:
            log.info("handing back %d queued entries", len(entries))
            self.transport.settler.hand_back(entries)
        self.requests.forget_unstarted()

    def _heartbeat(self) -> None:
        now = time.time()
        since = now - self._last_heartbeat
        if since < HEARTBEAT_S:
            return
        marks = (dict(self.ledger), len(self.requests.snapshot))
        if since < IDLE_HEARTBEAT_S and marks == self._last_marks:
            return  # an idle worker beats less often: its status says nothing new
        self._last_heartbeat, self._last_marks = now, marks
        self.transport.presence.heartbeat(self.status())
