"""Intake: turns transport entries into held requests or their answers (reading, reclaiming, validating,
rejecting, expiring, giving up).

Every entry read ends as: held in the request table (queued to run), answered with an error (through the
outbox, worker/requests/outbox.py, which writes it at once or keeps it until the transport takes it), acked as
a duplicate, or dead-lettered (the outbox's ``give_up``); never dropped. Validation itself is pure and lives in
worker/requests/validate.py; a guide not seen before is checked off the loop's thread
(worker/requests/guidecheck.py), its request held VALIDATING meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from batchfleet.common.config import WorkerConfig
from batchfleet.common.errors import CANCELLED, DEADLINE_EXCEEDED, INVALID_REQUEST
from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.common.wire.protocol import Error
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.requests.guidecheck import GuideChecks
from batchfleet.worker.requests.outbox import Outbox
from batchfleet.worker.requests.readahead import cap as readahead_cap
from batchfleet.worker.requests.replies import error_reply
from batchfleet.worker.requests.table import RequestTable, Stage
from batchfleet.worker.requests.validate import Accepted, Limits, Rejected, accept, job_id_of, reply_key_of
from batchfleet.worker.transport.base import Entry, Reply, Transport
from batchfleet.worker.transport.reclaim import SOLO_FROM_DELIVERY, reclaim_period_s, split_exhausted

log = logging.getLogger("batchfleet.worker.loop")

PRUNE_PERIOD_S = 600.0  # a pass is one XINFO CONSUMERS per stream; names are pruned after an hour anyway
PRUNE_IDLE_MS = 3_600_000  # a consumer name silent for an hour with nothing pending is a dead worker's
FULL_SLEEP_MAX_S = 0.5  # with no room to read and nothing running, sleep at most this long per tick
VERDICT_POLL_S = 0.02  # while guides are being checked, an idle loop looks for their verdicts this often


class EngineRoom(Protocol):
    """What the intake asks of the engine's admission (the dispatcher, worker/dispatch.py) to bound its reads."""

    def engine_full(self, priority: str) -> bool:
        """Whether the engine can start nothing more of ``priority`` now."""
        ...

    def room_now(self, priority: str) -> int:
        """How many requests of ``priority`` the engine could start at its next admission."""
        ...


class Intake:
    """Feeds the request table and the batcher from the transport; answers what cannot run."""

    def __init__(self, cfg: WorkerConfig, transport: Transport, limits: Limits, requests: RequestTable,
                 ledger: Ledger, outbox: Outbox, engine: EngineRoom, guides: GuideChecks | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.limits = limits
        self.requests = requests  # the one owner of held requests (worker/requests/table.py)
        self.ledger = ledger  # answers are counted by the ledger as they enter the outbox; events noted here
        self.outbox = outbox  # replies go to the outbox and are written when the transport takes them
        self.next_reclaim = 0.0  # time.time() of the next reclaim (tests set 0 to force one)
        self.next_prune = 0.0
        self.engine = engine  # the dispatcher: whether the engine is full, and its room now
        # continuous mode: the engine admits at every step, so only its room now is read ahead
        self.joins = cfg.engine.mode == "continuous"
        self.guides = guides or GuideChecks()  # checks new guides off this thread

    def room(self, priority: str) -> int:
        """Hold locally (queued or waiting to run alone) only what can start soon: leave the rest to peers
        (worker/requests/readahead.py). Per priority, so background work held here never keeps interactive work
        from being read."""
        cap = readahead_cap(self.cfg.batching.max_batch_size, self.engine.engine_full(priority), joins=self.joins,
                            room=self.engine.room_now(priority) if self.joins else 0)
        return cap - self.requests.waiting(priority)

    # ---- new entries -----------------------------------------------------------------------------
    def read(self, now: float, engine_busy: bool) -> None:
        """Read new entries. Blocks only while nothing can run (engine idle, nobody waiting to run alone),
        and never past the next batch deadline nor the next reclaim."""
        rooms = {priority: max(0, self.room(priority)) for priority in PRIORITIES}
        busy = engine_busy or self.requests.count(Stage.SOLO) > 0
        # a verdict does not wake a blocked read: wait for one at most VERDICT_POLL_S
        checking = self.requests.count(Stage.VALIDATING) > 0
        if not any(rooms.values()):
            deadline = self.requests.next_deadline()
            if checking and not busy:
                time.sleep(VERDICT_POLL_S if deadline is None else max(0.0, min(deadline - now, VERDICT_POLL_S)))
            elif not busy and deadline is not None and deadline > now:
                time.sleep(min(deadline - now, FULL_SLEEP_MAX_S))
            return
        if busy:
            block_ms: int | None = None
        else:
            deadline = self.requests.next_deadline()
            if deadline is None and self.requests.static and self.requests.count(Stage.QUEUED):
                deadline = now + 0.05  # poll the flush counter while a partial static batch waits
            block_ms = self.transport.max_block_ms if deadline is None else int((deadline - now) * 1000) + 1
            block_ms = min(block_ms, int(reclaim_period_s(self.cfg.claim_idle_ms) * 1000) + 1)
            if checking:
                block_ms = min(block_ms, int(VERDICT_POLL_S * 1000))
            if block_ms <= 0:
                return
        # COUNT applies per stream: split each priority's room so all its buckets together stay within it
        n = len(self.cfg.batching.buckets)
        per_stream = {priority: -(-room // n) for priority, room in rooms.items()}
        # no batch deadline to keep: one long blocking read, however late Redis ends it (worker/transport/consumer.py)
        exact = not busy and deadline is not None
        self._take_all(self.transport.read(count=per_stream, block_ms=block_ms, exact=exact), alone=lambda e: False)

    def reclaim(self, now: float) -> None:
        """Take over entries whose worker went silent for claim_idle_ms (policy: worker/transport/reclaim.py)."""
        if now < self.next_reclaim:
            return
        self.next_reclaim = now + reclaim_period_s(self.cfg.claim_idle_ms)
        if now >= self.next_prune:
            self.next_prune = now + PRUNE_PERIOD_S
            self.transport.pending.prune_consumers(PRUNE_IDLE_MS)
        room = min(sum(max(0, self.room(priority)) for priority in PRIORITIES), self.cfg.reclaim_budget)
        if room <= 0:
            return
        # entry ids are unique per stream only: two buckets often share "<ms>-0"
        held = {e.where for e in self.requests.snapshot}
        entries = [e for e in self.transport.pending.reclaim(self.cfg.claim_idle_ms, room) or [] if e.where not in held]
        if not entries:
            return
        self.ledger.note("reclaimed", len(entries))
        log.info("reclaimed %d entries left pending by a silent worker", len(entries))
        keep, spent = split_exhausted(entries, self.cfg.max_deliveries)
        for e in spent:
            self.outbox.give_up(e, f"delivered {e.deliveries} times (max_deliveries {self.cfg.max_deliveries}): "
                            "its workers died or it failed every time")
        self._take_all(keep, alone=lambda e: e.deliveries >= SOLO_FROM_DELIVERY)

    def _take_all(self, entries: list[Entry], alone: Callable[[Entry], bool]) -> None:
        """Take read or reclaimed entries. One round trip for all of them: jobs cancelled before any worker
        held them are answered ``cancelled``, and copies of jobs answered already (a worker died after
        replying, a resumed bulk run, a retried submit) are acked without running."""
        if not entries:
            return
        marks = self.transport.cancel_watch.marks([job_id_of(e) or "-" for e in entries],
                                                  [reply_key_of(e, self.transport.keys) for e in entries])
        for entry, (cancel_mark, done) in zip(entries, marks):
            job_id, reply_key = job_id_of(entry), reply_key_of(entry, self.transport.keys)
            if done and job_id is not None and reply_key is not None:
                self.ledger.note("duplicates")
                self.transport.settler.answered(entry, job_id, reply_key)
                continue
            self._take(entry, alone=alone(entry), cancel_mark=cancel_mark)

    def _take(self, entry: Entry, alone: bool, cancel_mark: str | None = None) -> None:
        """Validate one entry and hold it; any failure here costs this entry only."""
        try:
            offset = self.transport.presence.clock_offset()
            outcome = accept(entry, self.transport.keys, self.limits, time.time(), offset)
            if isinstance(outcome, Rejected):
                self._reject(outcome)
                return
            if cancel_mark is not None and cancel_mark == outcome.reply_key:
                self.outbox.send([error_reply(outcome, CANCELLED, "cancelled before it started")])
                return
            if self.requests.run_of(outcome.reply_key, outcome.gen.id) is not None:
                self.transport.settler.ack(entry)  # same job enqueued twice: the copy we hold answers for both
                return
            # a job is its inbox's and its id's: another inbox's job of this id held here runs beside it
            run_id = self.requests.free_run_id(outcome.gen.id)
            if run_id != outcome.gen.id:
                outcome = replace(outcome, gen=replace(outcome.gen, id=run_id))
            guide = outcome.gen.params.guide
            if outcome.unchecked is None and guide is not None and not self.guides.ready(guide):
                outcome = replace(outcome, unchecked=guide)  # known good, not compiled here: that is slow too
            if outcome.unchecked is not None:  # a guide not seen before: judged (and compiled) off this thread
                self.requests.validate(outcome, alone=alone)
                self.guides.submit(outcome)
                return
            self.requests.queue(outcome, alone=alone)
        except TRANSIENT:
            raise  # the entry stays pending; it is read again after the outage (reclaim)
        except Exception as exc:
            self.ledger.note("internal_errors")
            log.exception("internal error on entry %s; dead-lettering it", entry.entry_id,
                          extra={"job": job_id_of(entry), "bucket": entry.bucket})
            self.outbox.give_up(entry, f"internal error while validating: {exc!r}"[:500])

    def verdicts(self) -> None:
        """Act on the guide checks that finished: a request whose guide passed is queued, one whose guide
        failed is answered INVALID_REQUEST (once: a request cancelled, expired or handed back meanwhile is
        no longer VALIDATING and its verdict is ignored). Every verdict changes the table before anything
        is written, so an outage during the writes loses none (replies wait in the outbox; an entry not
        given up stays pending and is reclaimed)."""
        rejected, faults = [], []
        for v in self.guides.done():
            run, job = v.acc.gen.id, v.acc.request.id
            if self.requests.stage(run) is not Stage.VALIDATING or self.requests.get(run) is not v.acc:
                continue  # cancelled, expired or handed back meanwhile: answered (or returned) already
            if not v.error and not v.fault:
                self.requests.validated(v.acc)
                continue
            self.requests.drop(run)
            if v.fault:
                faults.append(v)
            else:
                rejected.append(Reply.to(v.acc.entry, job, Error(job, INVALID_REQUEST, v.error), v.acc.reply_key))
        if rejected:
            self.outbox.send(rejected)
        for v in faults:
            self.ledger.note("internal_errors")
            self.outbox.give_up(v.acc.entry, v.fault)

    def _reject(self, rej: Rejected) -> None:
        if rej.error is None:  # no usable id: nobody to answer
            self.outbox.give_up(rej.entry, rej.reason)
            return
        self.outbox.send([Reply.to(rej.entry, rej.error.id, rej.error, rej.reply_key)])

    # ---- expiry -----------------------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Answer ``deadline_exceeded`` to every request not started whose deadline has passed."""
        def expired(acc: Accepted) -> bool:
            return acc.deadline is not None and acc.deadline <= now

        gone = self.requests.expire(expired)
        if gone:
            self.outbox.send([error_reply(acc, DEADLINE_EXCEEDED, "deadline passed before the request was scheduled")
                   for acc in gone])
