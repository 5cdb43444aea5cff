"""The dispatcher: what happens between the request table and the engine, for the loop (worker/loop.py).

Admission (which held requests enter the engine, and when), one engine step and its completions,
engine failures (who is retried alone, who runs again as usual, who is released or given up),
cancellation of running requests, and streamed deltas. It owns no request state: held requests are the
request table's (worker/requests/table.py), capacity is the engine's (``Engine.room``), counts are the
ledger's; replies and dead letters leave through the outbox (worker/requests/outbox.py).

Invariants: a request that must run alone starts only on an idle engine and nothing joins it; a failed
step costs at most the requests that were in it (each retried alone), its bystanders run again as usual.
"""

from __future__ import annotations

import logging
import time

from batchfleet.common.config import WorkerConfig
from batchfleet.common.errors import CANCELLED
from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.common.wire.priority import INTERACTIVE, LEVEL, PRIORITIES
from batchfleet.worker.batching.window import Window
from batchfleet.worker.engine.base import Completion, Engine
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.metrics import LoopStats
from batchfleet.worker.requests.outbox import Outbox
from batchfleet.worker.requests.replies import completion_reply, error_reply
from batchfleet.worker.requests.streaming import StreamPublisher
from batchfleet.worker.requests.table import RequestTable, Stage
from batchfleet.worker.requests.validate import Accepted
from batchfleet.worker.transport.base import Cancel, Transport

log = logging.getLogger("batchfleet.worker.loop")


class Dispatcher:
    """Moves held requests into the engine and answers what comes out of it."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, transport: Transport, requests: RequestTable,
                 outbox: Outbox, ledger: Ledger, streams: StreamPublisher | None, observer: LoopStats,
                 window: Window) -> None:
        self.cfg = cfg
        self.engine = engine
        self.transport = transport
        self.requests = requests
        self.outbox = outbox  # replies leave here (written at once, else kept until the transport takes them)
        self.ledger = ledger
        self.streams = streams
        self.observer = observer  # the loop's observer (WorkerMetrics with --metrics-port)
        self.alone = False  # a request that must run alone is in the engine: nothing may join it
        self.progress = time.monotonic()  # last time an engine step returned
        self.window = window  # the batcher's window (worker/batching/window.py): fed step and run times
        self._run_began: float | None = None  # when the engine last started from idle
        self._logs: list[dict] = []  # batch records not written yet (written after the next step)

    # ---- admission -------------------------------------------------------------------------------
    def engine_full(self, priority: str = INTERACTIVE) -> bool:
        """Whether the engine can start nothing more of ``priority`` now (no room for it, or a request runs or
        waits to run alone)."""
        return self.engine.has_work() and (self.alone or self.requests.count(Stage.SOLO) > 0
                                           or self.engine.room(LEVEL[priority]) <= 0)

    def room_now(self, priority: str) -> int:
        """How many requests of ``priority`` the engine could start at its next admission (0 while full)."""
        return 0 if self.engine_full(priority) else max(0, self.engine.room(LEVEL[priority]))

    def rooms(self) -> dict[str, int]:
        """The engine's room per priority (interactive work may have room that background work has not)."""
        return {priority: self.engine.room(LEVEL[priority]) for priority in PRIORITIES}

    def admit(self, now: float) -> None:
        """Start what may start: on an idle engine, a request waiting to run alone first; then closed
        batches, of any bucket, while the engine has room, interactive ones first (dynamic mode: its room is
        one batch when idle, none while it runs; continuous: up to max_running sequences, decoding all
        buckets together, where an interactive batch has room that background sequences hold: the engine
        preempts them)."""
        if self.engine.has_work():
            if self.alone or self.requests.count(Stage.SOLO):
                return  # solo requests wait for an idle engine; nothing joins one running alone
        else:
            self.alone = False
            self._run_began = None
            # static batching waits for full batches; a bumped flush counter closes partial ones
            if self.requests.static and self.requests.count(Stage.QUEUED) and self.transport.flush.requested():
                self.requests.flush()
            alone = self.requests.take_alone()
            if alone is not None:
                self.alone = True
                self._start([alone], kind="solo")
                return
        while (batch := self.requests.take_batch(now, self.rooms())) is not None:
            if not self._start(batch, kind="batch"):
                return  # the engine was reset: its requests must run alone first

    def _start(self, items: list[Accepted], kind: str) -> bool:
        """Hand ``items`` (already RUNNING in the table) to the engine; False when it refused them
        (handled as a failed step)."""
        try:
            self.engine.add([acc.gen for acc in items])
        except Exception as exc:  # refused at admission: same isolation as a failed step
            self._failed(exc, suspects=[acc.gen.id for acc in items])
            return False
        if self._run_began is None:
            self._run_began = time.monotonic()
        self.ledger.note("batches")
        self.ledger.note("batched_requests", len(items))
        self.observer.started(items[0].entry.bucket, len(items))
        if self.streams is not None:
            for acc in items:
                if acc.request.stream:
                    self.streams.track(acc.gen.id, acc.request.id, acc.reply_key, acc.gen.params.stop,
                                       time.time())
        # written once the step that runs it has returned: a lone request does not wait for the round trip
        self._logs.append({
            "worker": self.transport.name, "kind": kind, "bucket": items[0].entry.bucket,
            "size": self.engine.num_active(), "ids": [acc.gen.id for acc in items], "at": f"{time.time():.6f}",
        })
        return True

    # ---- stepping --------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; its completions are answered. A raising step is handled, never re-raised."""
        began = time.monotonic()
        try:
            completions = self.engine.step()
        except Exception as exc:  # an engine fault must cost at most the requests that were in the step
            self._write_logs()
            self._failed(exc, suspects=self.engine.failed_ids())
            return
        self._write_logs()
        self.progress = time.monotonic()
        self.observer.stepped(self.progress - began)
        self.window.step_took(self.progress - began)
        if self._run_began is not None and not self.engine.has_work():
            self.window.run_took(self.progress - self._run_began)
            self._run_began = None
        self._answer(completions)

    def _write_logs(self) -> None:
        logs, self._logs = self._logs, []
        for record in logs:  # best effort (Transport.log_batch)
            self.transport.log_batch(record)

    def _failed(self, exc: Exception, suspects: list[str]) -> None:
        """The engine is reset. Requests of the failed step (``suspects``; empty: all) are retried one at a
        time; the others (continuous mode: other buckets' sequences that were not in that step) go back to
        their batches and run again as usual. A request failing alone is released for redelivery (another
        worker, or this one, retries it) until max_deliveries, then given up."""
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
        # none of the suspects held (an engine that cannot tell): every running request is one
        failed = [acc for acc in held if acc.gen.id in set(suspects)] or held
        failed_ids = {acc.gen.id for acc in failed}
        self.requests.requeue([acc for acc in held if acc.gen.id not in failed_ids])
        if len(held) > 1:  # retried alone: batchmates must not pay for a poison request
            self.requests.run_alone(failed)
            return
        for acc in failed:
            self.requests.drop(acc.gen.id)  # stops renewing its lease before it is released
            if acc.entry.deliveries >= self.cfg.max_deliveries:
                self.outbox.give_up(acc.entry, f"engine failed on this request on each of {acc.entry.deliveries} "
                                               f"deliveries; last error: {exc!r}"[:500])
            else:
                self.ledger.note("released")
                self.transport.pending.release([acc.entry], idle_ms=self.cfg.claim_idle_ms)

    def _answer(self, completions: list[Completion]) -> None:
        now = time.time()
        replies = []
        for c in completions:
            if self.requests.stage(c.id) is not Stage.RUNNING:  # defensive: the engine returned a stranger
                log.error("engine returned %s, which is not running here: ignored", c.id)
                self.ledger.note("internal_errors")
                continue
            acc = self.requests.finish(c.id)
            if self.streams is not None:
                self.streams.forget(c.id)
            replies.append(completion_reply(c, acc, now, self.transport.name))
        if replies:
            self.outbox.send(replies)

    # ---- cancellation and streaming ---------------------------------------------------------------
    def cancel(self, cancels: list[Cancel]) -> None:
        """Honour cancel requests for jobs held here (only from the client that submitted them: the reply
        key must match): a running job leaves the engine now, freeing its KV blocks; its batchmates are not
        touched. Answered once, with ``cancelled``."""
        for c in cancels:
            run = self.requests.run_of(c.reply_key, c.job_id)  # only the submitter's inbox names its job
            acc = None if run is None else self.requests.get(run)
            if run is None or acc is None:
                continue  # not here (another worker's, or answered already), or not the submitter's
            if self.requests.stage(run) is not Stage.RUNNING:
                self.requests.drop(run)
                self.outbox.send([error_reply(acc, CANCELLED, "cancelled before it started")])
                continue
            self.engine.abort([run])
            self.requests.finish(run)
            if self.streams is not None:
                self.streams.forget(run)
            self.outbox.send([error_reply(acc, CANCELLED, "cancelled while running")])

    def stream(self) -> None:
        """Write the text deltas that are due for streamed requests still running (best effort)."""
        if self.streams is None:
            return
        deltas = self.streams.due_deltas(time.time(), lambda j: self.requests.stage(j) is Stage.RUNNING,
                                         lambda ids: self.engine.progress(ids))
        if not deltas:
            return
        try:
            self.transport.settler.write_deltas(deltas)
            self.ledger.note("deltas", len(deltas))
        except TRANSIENT as exc:  # the final reply carries the whole text; a lost delta costs nothing
            log.debug("deltas not written: %r", exc)
