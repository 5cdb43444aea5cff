"""Redelivery policy: taking over what dead workers left pending, and keeping what we hold from being taken.

Invariants (the Redis commands live in worker/transport/consumer.py and worker/transport/pending.py):

- An entry stays in the group's pending list (PEL) from XREADGROUP until the reply pipeline acks it, so a
  worker that dies at any moment leaves it pending. After ``claim_idle_ms`` without a lease renewal a live
  worker XAUTOCLAIMs it (delivery count + 1) and runs it again; the ``done`` marker turns a second reply
  into a no-op, so a client never sees two answers.
- A live worker renews the lease of everything it holds (LeaseKeeper: XCLAIM JUSTID every claim_idle/4,
  from its own thread, so a long engine step does not let its entries go idle): only entries of a dead
  worker are taken over, or those of a worker whose loop made no progress for ``stall_timeout_s``
  (a wedged engine): then the keeper stops renewing.
- A delivery count above ``max_deliveries`` dead-letters the entry and answers ``worker_failed``.
- A request delivered ``SOLO_FROM_DELIVERY`` times or more runs alone: it may be what killed a worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from batchfleet.common.redis.functions import LIVE_WORKER_MS
from batchfleet.worker.transport.base import Entry, Transport

log = logging.getLogger(__name__)

SOLO_FROM_DELIVERY = 3
MIN_RECLAIM_PERIOD_S = 0.2
MAX_RECLAIM_PERIOD_S = 2.0  # entries released by a busy peer (worker/requests/readahead.py) wait at most this long


def reclaim_period_s(claim_idle_ms: int) -> float:
    """How often a worker with room looks for abandoned or released entries: twice per idle window, at
    least every 2 s (a released entry waits at most 2 s; it also bounds an idle worker's blocking read,
    so an idle worker makes about one read and one look per 2 s), never more than 5 times a second. A look
    is one GET of the release counter; the pending lists are scanned only when it moved, or every
    ``scan_period_s`` (worker/transport/pending.py)."""
    return max(MIN_RECLAIM_PERIOD_S, min(claim_idle_ms / 2000, MAX_RECLAIM_PERIOD_S))


def scan_period_s(claim_idle_ms: int) -> float:
    """How often a worker with room scans every pending list for entries of dead workers (1 + streams
    commands) when no release was signalled: twice per idle window, so recovery after a crash takes at
    most 1.5 x claim_idle_ms."""
    return max(MIN_RECLAIM_PERIOD_S, claim_idle_ms / 2000)


def split_exhausted(entries: Sequence[Entry], max_deliveries: int) -> tuple[list[Entry], list[Entry]]:
    """(entries to run again, entries delivered more than max_deliveries times)."""
    keep = [e for e in entries if e.deliveries <= max_deliveries]
    spent = [e for e in entries if e.deliveries > max_deliveries]
    return keep, spent


class LeaseKeeper:
    """Background thread renewing the idle time of every entry the loop holds.

    ``held`` returns the loop's latest snapshot (``RequestTable.snapshot``: a tuple replaced atomically);
    the thread never touches the loop's own containers.
    """

    def __init__(self, transport: Transport, claim_idle_ms: int, held: Callable[[], Sequence[Entry]],
                 progress: Callable[[], float] = time.monotonic, stall_timeout_s: float = 600.0,
                 lock: threading.Lock | None = None) -> None:
        self.transport = transport  # only ``pending.refresh`` and ``presence.alive``, from this keeper's thread
        self.progress = progress  # monotonic time the loop last made progress
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False
        self.interval_s = claim_idle_ms / 4000
        self.min_idle_ms = max(1, claim_idle_ms // 8)
        self.held = held
        # held while choosing and renewing: the read-ahead release (worker/requests/readahead.py) takes it too, so a
        # renewal never undoes a release
        self.lock = lock or threading.Lock()
        self.failures = 0  # renewals that failed (outage, missing ACL permission): visible in tests/status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        # wake often enough to keep the worker in the live-worker set (producers' NoWorkers check)
        wake_s = min(self.interval_s, LIVE_WORKER_MS / 12000)
        last_renewal = time.monotonic()
        while not self._stop.wait(wake_s):
            stalled = time.monotonic() - self.progress() > self.stall_timeout_s
            entries = list(self.held())
            if stalled != self.stalled:
                self.stalled = stalled
                if stalled:
                    log.error("worker loop made no progress for %.0fs: no longer renewing leases on %d entries; "
                              "other workers will take them over", self.stall_timeout_s, len(entries))
                else:
                    log.warning("worker loop is making progress again; renewing leases")
            if stalled:
                continue  # a wedged worker is neither live nor holding anything
            try:
                self.transport.presence.alive()
                if entries and time.monotonic() - last_renewal >= self.interval_s - wake_s / 2:
                    last_renewal = time.monotonic()
                    with self.lock:  # chosen and renewed under the read-ahead lock: never undoes a release
                        self.transport.pending.refresh(list(self.held()), self.min_idle_ms)
            except Exception as exc:  # an outage: the loop logs it; entries may be reclaimed, replies stay unique
                self.failures += 1
                log.debug("lease renewal failed: %r", exc)
