"""The request table: the one owner of every request a worker holds (pure: no Redis, no torch).

A request read and validated is held in exactly one stage until it is answered:

    VALIDATING (its guide is being checked off the loop's thread) ──► QUEUED or SOLO, or answered
    QUEUED  (waiting for its batch) ──► RUNNING (in the engine) ──► answered
    SOLO    (waiting to run alone)  ──► RUNNING
    RUNNING ──► SOLO   (its batch failed: each request is retried alone)
    RUNNING ──► QUEUED (a bystander of a failed step: it runs again as usual)

QUEUED requests also sit in the table's own ``Batcher`` (per-bucket order and batch deadlines); every
operation here (queue, drop, requeue, expire, take a batch) changes both at once, so nothing outside can
let them disagree. Answers wait in the outbox (stage OUTBOX) until the transport takes them; rejections
and expiries enter the outbox directly.

A job is named by its inbox and its job id together (docs/PROTOCOL.md: a job id names one job per inbox), so
two inboxes may hold one job id at once: at most one request per (reply key, job id) is held (a duplicate
entry is acked instead), and each held request has a **run id** (``Accepted.gen.id``), unique in this worker,
that the engine, the batcher and every stage here know it by: its job id, or ``<job id>~<n>`` while another
inbox's request of that job id is held (``~`` is no job id character, so a run id never names another job).
The outbox may hold several replies for one job (the first write wins).

``snapshot`` is what the lease keeper renews: the entries of every held request and every reply not yet
written. It is an immutable tuple replaced after each change, so the lease keeper's thread reads it
without a lock and never sees the table's own containers. Only the loop's thread calls anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import Enum

from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.requests.validate import Accepted
from batchfleet.worker.transport.base import Entry, Reply


class Stage(Enum):
    VALIDATING = "validating"  # its new guide is being checked (worker/requests/guidecheck.py); not in the batcher
    QUEUED = "queued"  # waiting for its batch (in the batcher)
    SOLO = "solo"  # waiting to run alone: batchmates of a failed batch, redeliveries
    RUNNING = "running"  # in the engine
    OUTBOX = "outbox"  # answered, reply not written yet


_HELD = (Stage.VALIDATING, Stage.QUEUED, Stage.SOLO, Stage.RUNNING)
_UNSTARTED = (Stage.QUEUED, Stage.SOLO, Stage.VALIDATING)  # read, never started: what shutdown hands back


class RequestTable:
    """Stages of held requests (each in arrival order within its stage), their batches, the outbox and the
    lease snapshot."""

    def __init__(self, batcher: Batcher[Accepted]) -> None:
        self._batcher = batcher  # holds exactly the QUEUED requests
        self._held: dict[Stage, dict[str, Accepted]] = {stage: {} for stage in _HELD}
        self._outbox: list[Reply] = []
        self._alone: set[str] = set()  # VALIDATING requests that go to SOLO once their guide passes
        self._runs: dict[tuple[str, str], str] = {}  # (reply key, job id) -> run id, for every held request
        self.snapshot: tuple[Entry, ...] = ()  # replaced, never mutated: read from the lease keeper's thread

    # ---- questions -------------------------------------------------------------------------------
    def holds(self, run_id: str) -> bool:
        """Whether the request of this run id is validating, queued, waiting to run alone or running."""
        return any(run_id in held for held in self._held.values())

    def run_of(self, reply_key: str, job_id: str) -> str | None:
        """The run id of the held request of job ``job_id`` of inbox ``reply_key``, else None."""
        return self._runs.get((reply_key, job_id))

    def free_run_id(self, job_id: str) -> str:
        """A run id for a new request of ``job_id``: the job id itself unless a held request (another inbox's
        job of that id) has it, else the first free ``<job id>~<n>``."""
        run_id, n = job_id, 0
        while self.holds(run_id):
            n += 1
            run_id = f"{job_id}~{n}"
        return run_id

    def stage(self, run_id: str) -> Stage | None:
        """The request's stage: where it is held, else OUTBOX while a reply to a job of that id waits, else None."""
        for stage, held in self._held.items():
            if run_id in held:
                return stage
        return Stage.OUTBOX if any(rep.job_id == run_id for rep in self._outbox) else None

    def get(self, run_id: str) -> Accepted | None:
        """The held request of this run id (any stage but OUTBOX), else None."""
        for held in self._held.values():
            if run_id in held:
                return held[run_id]
        return None

    def of(self, stage: Stage) -> list[Accepted]:
        """Requests held in ``stage`` (any but OUTBOX), in the order they entered it."""
        return list(self._held[stage].values())

    def count(self, stage: Stage) -> int:
        """How many requests are in ``stage`` (for OUTBOX: replies not written yet)."""
        return len(self._outbox) if stage is Stage.OUTBOX else len(self._held[stage])

    def waiting(self, priority: str) -> int:
        """How many requests of ``priority`` are held but not started (VALIDATING, QUEUED or SOLO)."""
        return sum(acc.entry.priority == priority for stage in _UNSTARTED for acc in self._held[stage].values())

    def unstarted(self) -> list[Entry]:
        """Entries of requests read but not started (QUEUED, then SOLO, then VALIDATING): what shutdown hands
        back."""
        return [acc.entry for stage in _UNSTARTED for acc in self._held[stage].values()]

    @property
    def outbox(self) -> tuple[Reply, ...]:
        """Replies not written yet, oldest first."""
        return tuple(self._outbox)

    # ---- batches ---------------------------------------------------------------------------------
    @property
    def static(self) -> bool:
        """Static batching: a batch closes only when full or flushed."""
        return self._batcher.static

    def next_deadline(self) -> float | None:
        """When the next not-yet-full batch closes by age (None: nothing waits on a timer)."""
        return self._batcher.next_deadline()

    def flush(self) -> None:
        """Close every partial batch now (static batching: a load generator asked)."""
        self._batcher.flush()

    def take_batch(self, now: float, rooms: Mapping[str, int]) -> list[Accepted] | None:
        """QUEUED -> RUNNING for the next closed batch (interactive first; at most ``rooms[priority]``
        requests; the caller hands them to the engine), or None when no batch with room is closed."""
        popped = self._batcher.pop_batch(now, rooms=rooms)
        if popped is None:
            return None
        self._run(popped[1])
        return popped[1]

    def take_alone(self) -> Accepted | None:
        """SOLO -> RUNNING for the request that has waited longest to run alone, if any."""
        acc = next(iter(self._held[Stage.SOLO].values()), None)
        if acc is not None:
            self._run([acc])
        return acc

    # ---- transitions -----------------------------------------------------------------------------
    def queue(self, acc: Accepted, alone: bool = False) -> None:
        """Hold a new request: QUEUED in its bucket's batch or, ``alone``, SOLO."""
        assert not self.holds(acc.gen.id), "duplicates are acked, never held twice"
        self._runs[_job(acc)] = acc.gen.id
        if alone:
            self._held[Stage.SOLO][acc.gen.id] = acc
        else:
            self._held[Stage.QUEUED][acc.gen.id] = acc
            self._add(acc)
        self._publish()

    def validate(self, acc: Accepted, alone: bool = False) -> None:
        """Hold a new request whose guide is being checked: VALIDATING until ``validated`` (or dropped)."""
        assert not self.holds(acc.gen.id), "duplicates are acked, never held twice"
        self._runs[_job(acc)] = acc.gen.id
        self._held[Stage.VALIDATING][acc.gen.id] = acc
        if alone:
            self._alone.add(acc.gen.id)
        self._publish()

    def validated(self, acc: Accepted) -> bool:
        """VALIDATING -> QUEUED (or SOLO, when it came to run alone): its guide passed. False, and nothing
        changes, when this very request is no longer VALIDATING (cancelled, expired, handed back)."""
        if self._held[Stage.VALIDATING].get(acc.gen.id) is not acc:
            return False
        del self._held[Stage.VALIDATING][acc.gen.id]
        alone = acc.gen.id in self._alone
        self._alone.discard(acc.gen.id)
        self.queue(acc, alone=alone)
        return True

    def finish(self, run_id: str) -> Accepted:
        """RUNNING -> answered (the caller puts its reply in the outbox). KeyError when not running."""
        acc = self._held[Stage.RUNNING].pop(run_id)
        self._runs.pop(_job(acc), None)
        self._publish()
        return acc

    def run_alone(self, accs: Iterable[Accepted]) -> None:
        """RUNNING -> SOLO, in the given order (batchmates of a failed batch are retried one at a time)."""
        for acc in accs:
            self._held[Stage.RUNNING].pop(acc.gen.id, None)
            self._held[Stage.SOLO][acc.gen.id] = acc
        self._publish()

    def requeue(self, accs: Iterable[Accepted]) -> None:
        """RUNNING -> QUEUED (bystanders of a failed step: the engine dropped them, they run again)."""
        for acc in accs:
            self._held[Stage.RUNNING].pop(acc.gen.id, None)
            self._held[Stage.QUEUED][acc.gen.id] = acc
            self._add(acc, arrival=False)
        self._publish()

    def drop(self, run_id: str) -> Accepted | None:
        """Stop holding a request in any stage (expired, cancelled, released, given up); None when not held."""
        for stage, held in self._held.items():
            if run_id in held:
                acc = held.pop(run_id)
                self._runs.pop(_job(acc), None)
                self._alone.discard(run_id)
                if stage is Stage.QUEUED:
                    self._batcher.expire(lambda a: a.gen.id == run_id)
                self._publish()
                return acc
        return None

    def expire(self, expired: Callable[[Accepted], bool]) -> list[Accepted]:
        """Stop holding every unstarted (QUEUED, SOLO or VALIDATING) request for which ``expired`` is true;
        returns them."""
        gone = self._batcher.expire(expired) + [acc for stage in (Stage.SOLO, Stage.VALIDATING)
                                                for acc in self._held[stage].values() if expired(acc)]
        for acc in gone:
            for stage in _UNSTARTED:
                self._held[stage].pop(acc.gen.id, None)
            self._runs.pop(_job(acc), None)
            self._alone.discard(acc.gen.id)
        if gone:
            self._publish()
        return gone

    def forget_unstarted(self) -> None:
        """Drop every unstarted request (handed back on shutdown)."""
        self._batcher.expire(lambda a: True)
        for stage in _UNSTARTED:
            for acc in self._held[stage].values():
                self._runs.pop(_job(acc), None)
            self._held[stage].clear()
        self._alone.clear()
        self._publish()

    def answer(self, replies: Iterable[Reply]) -> None:
        """Put replies in the outbox (their entries stay leased until written)."""
        self._outbox.extend(replies)
        self._publish()

    def written(self, n: int) -> None:
        """The oldest ``n`` outbox replies were written: forget them."""
        del self._outbox[:n]
        self._publish()

    def _add(self, acc: Accepted, arrival: bool = True) -> None:
        self._batcher.add(acc, acc.entry.bucket, acc.enqueued_at, acc.entry.priority, acc.deadline, arrival,
                          acc.entry.tenant)

    def _run(self, accs: Iterable[Accepted]) -> None:
        """QUEUED or SOLO -> RUNNING (already out of the batcher)."""
        for acc in accs:
            self._held[Stage.QUEUED].pop(acc.gen.id, None)
            self._held[Stage.SOLO].pop(acc.gen.id, None)
            self._held[Stage.RUNNING][acc.gen.id] = acc
        self._publish()

    def _publish(self) -> None:
        """Replace the lease snapshot (one attribute store: atomic for the reading thread)."""
        held = tuple(acc.entry for stage in _HELD for acc in self._held[stage].values())
        self.snapshot = held + tuple(rep.settles for rep in self._outbox)


def _job(acc: Accepted) -> tuple[str, str]:
    """What names a request's job: its inbox and its job id."""
    return acc.reply_key, acc.request.id
