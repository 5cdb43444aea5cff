"""What was cancelled: the stream consumer's ``cancel_watch`` part (worker/transport/consumer.py owns the
connection; callers reach it as ``transport.cancel_watch``).

Two ways a cancel reaches a worker (common/redis/functions.py CANCEL writes both): the cancels stream, followed
while the worker holds jobs (a running job stops within a step + CANCELS_EVERY_S), and each job's cancel
marker, read with its ``done`` marker once per read batch (a job cancelled, or answered, before this worker
read it). Both reads go through size-checking scripts (worker/transport/scripts.py): a marker or entry field longer
than MARKER_BYTES is cut, so hostile sizes never reach the worker.
"""

from __future__ import annotations

import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.worker.transport.base import Cancel, Cancelling
from batchfleet.worker.transport.refused import refused
from batchfleet.worker.transport.scripts import WorkerScripts

CANCELS_PER_TICK = 1000
CANCELS_EVERY_S = 0.05  # while only running jobs are held: a running job stops within a step + this
MARKS_PER_CALL = 1000  # jobs per MARKS call: 2 keys each, far below Lua's unpack() limit
MARKER_BYTES = 256  # longest job id or reply key a cancel entry or marker may hold (longer ones are cut)


class CancelWatch(Cancelling):
    """The cancels stream's reader (from where ``start`` found its end) and the markers check."""

    def __init__(self, r: redis.Redis, scripts: WorkerScripts, keys: Keys) -> None:
        self.r = r
        self.scripts = scripts
        self.keys = keys
        self._from = "$"  # last cancels entry seen ($: none yet; set by start)
        self._next = 0.0  # time.monotonic() of the next read of the cancels stream

    def start(self) -> None:
        """Follow cancels published from now on (first call only: a reconnect keeps its place)."""
        if self._from == "$":
            last = self.r.xrevrange(self.keys.cancels, count=1)
            self._from = last[0][0].decode() if last else "0-0"

    @refused
    def cancels(self, waiting: bool = False) -> list[Cancel]:
        """New entries of the cancels stream since the last call (the ``CANCELS`` script: at most
        CANCELS_PER_TICK entries, each field cut to MARKER_BYTES). While only running requests are held, at
        most every CANCELS_EVERY_S (a busy loop ticks far more often); while some wait to start
        (``waiting``), every call: a cancel that arrives between a request's read and its start stops it
        before it runs (the loop reads cancels just before it admits)."""
        now = time.monotonic()
        if not waiting and now < self._next:
            return []
        self._next = now + CANCELS_EVERY_S
        last, entries = self.scripts.cancels(keys=[self.keys.cancels], args=[self._from, CANCELS_PER_TICK,
                                                                              MARKER_BYTES])
        self._from = last.decode() if isinstance(last, bytes) else last
        out: list[Cancel] = []
        for _id, job_id, reply_key in entries:
            try:
                if job_id and reply_key:
                    out.append(Cancel(job_id.decode(), reply_key.decode()))
            except UnicodeDecodeError:
                continue  # malformed: nothing to cancel
        return out

    @refused
    def marks(self, job_ids: list[str], reply_keys: list[str | None]) -> list[tuple[str | None, bool]]:
        """Each job's cancel marker (the reply key of whoever cancelled it) and whether its answer is stored
        (``Keys.done`` under its reply key; None: an invalid entry, never answered by that name): one ``EXISTS``
        per MARKS_PER_CALL jobs, and only where some marker exists the ``MARKS`` script (a marker longer than
        MARKER_BYTES is no reply key)."""
        out: list[tuple[str | None, bool]] = []
        nowhere = self.keys.inbox("-")  # no valid inbox has this name, so no answer under it exists
        for i in range(0, len(job_ids), MARKS_PER_CALL):
            part = job_ids[i:i + MARKS_PER_CALL]
            n = len(part)
            keys = [self.keys.cancel(j) for j in part] + [self.keys.done(j, r or nowhere)
                                                          for j, r in zip(part, reply_keys[i:i + MARKS_PER_CALL])]
            # the usual case, no marker of any of them exists, is one plain EXISTS: no script call, whose
            # Lua overhead cost Redis more than the check itself (issue 29)
            if not self.r.exists(*keys):
                out += [(None, False)] * n
                continue
            raw = self.scripts.marks(keys=keys, args=[n, MARKER_BYTES])
            out += [(c.decode(errors="replace") if c else None, bool(d)) for c, d in zip(raw[:n], raw[n:])]
        return out
