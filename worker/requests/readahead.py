"""Read-ahead bound: a worker does not hoard entries an idle peer could serve.

Two rules:

- **Read no more than it can start soon** (``cap``). An engine that runs each batch to completion
  (dynamic and static modes): two batches' worth (``2 x max_batch_size``) while idle, one while a batch
  runs, so the next batch is formed while this one runs. An engine that admits at every step (continuous
  mode): only its room now (``Engine.room``, at most ``2 x max_batch_size``): the loop reads before it
  admits in every tick, so a slot that frees is filled from Redis one tick later whoever's entry it is,
  and a full worker holds nothing a peer with room could start (holding a batch ahead there cost a third
  of the fleet's throughput at 8+ workers: docs/BENCHMARKS_HISTORY.md section 11).
- **Release what waits too long** (``ReadAhead``): a request queued here for longer than
  ``max(2 x max_wait_ms, RELEASE_FLOOR_MS)`` while the engine has no room for it is released (its lease
  given up, ``transport.pending.release`` without counting a delivery), so the next reclaim of any worker, an
  idle peer's first, takes it at once. The check runs on its own thread because the case that matters
  is a long engine step (an hf batch runs to completion in one ``step``): the loop thread is inside the
  engine then, so the queued requests cannot change under the thread. The thread never touches the
  loop's state: it posts what it released, and the loop drains that at the top of its next tick
  (``settle``: the request table drops them), before it admits anything. Only when another live worker
  exists (``transport.presence.live_peers``): alone, releasing would only churn.

Locking: ``lock`` serializes the release decision with the loop's step boundaries (``stepping`` /
``stepped``), with ``settle``, and with the lease keeper's renewals, which skip released entries
(``unreleased``), so a release is never undone by a renewal and a released request is never started here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

from batchfleet.worker.requests.table import RequestTable
from batchfleet.worker.requests.validate import Accepted
from batchfleet.worker.transport.base import Entry, Transport

log = logging.getLogger("batchfleet.worker.loop")

RELEASE_FLOOR_MS = 1000.0  # never release a request held for less than this
CHECK_S = 0.1  # how often the release thread looks
PEERS_CHECK_S = 1.0  # how often it asks Redis whether a live peer exists


def cap(max_batch_size: int, engine_full: bool, joins: bool = False, room: int = 0) -> int:
    """How many requests of a priority a worker may hold waiting to start. ``joins``: the engine admits at
    every step, and ``room`` is how many it could take now; otherwise one batch ahead while the engine is
    full, two while it is idle."""
    if joins:
        return min(max(0, room), 2 * max_batch_size)
    return max_batch_size if engine_full else 2 * max_batch_size


def release_after_s(max_wait_ms: float) -> float:
    """How long a request may wait here while the engine has no room (inf for static batching)."""
    return max(2 * max_wait_ms, RELEASE_FLOOR_MS) / 1000 if math.isfinite(max_wait_ms) else math.inf


class ReadAhead:
    """Releases queued requests the engine cannot start soon, from its own thread, during engine steps."""

    def __init__(self, transport: Transport, max_wait_ms: float, claim_idle_ms: int) -> None:
        self.transport = transport
        self.after_s = release_after_s(max_wait_ms)
        self.claim_idle_ms = claim_idle_ms
        self.lock = threading.Lock()
        self.released_total = 0
        self._since: dict[str, float] = {}  # job id -> monotonic time first seen queued (loop thread only)
        self._queued: tuple[tuple[Accepted, float], ...] = ()  # what waits during the current step
        self._stepping = False
        self._released: dict[tuple[int, str, str, int, str], Accepted] = {}  # released, not yet dropped by the loop
        self._peers = (0, -math.inf)  # (live peers, monotonic time asked)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)

    def start(self) -> None:
        if math.isfinite(self.after_s):
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    # ---- loop thread -----------------------------------------------------------------------------
    def stepping(self, queued: Iterable[Accepted], engine_full: bool) -> None:
        """Called right before an engine step with the requests queued (not started) and whether the
        engine has room for more: they may be released while the step runs."""
        now = time.monotonic()
        queued = list(queued)
        self._since = {acc.gen.id: self._since.get(acc.gen.id, now) for acc in queued}
        with self.lock:
            self._queued = tuple((acc, self._since[acc.gen.id]) for acc in queued) if engine_full else ()
            self._stepping = True

    def stepped(self) -> None:
        """Called when the step returned: nothing more is released until the next ``stepping``."""
        with self.lock:
            self._stepping = False
            self._queued = ()

    def settle(self, drop: Callable[[str], object]) -> int:
        """Loop thread, top of a tick and before hand-back: ``drop`` (the request table's) each request
        released since the last call (they were never started here); returns how many."""
        with self.lock:  # dropped and unmarked together: the lease keeper sees them in neither
            gone = list(self._released.values())
            for acc in gone:
                drop(acc.gen.id)
                self._since.pop(acc.gen.id, None)
            self._released.clear()
        return len(gone)

    # ---- any thread ------------------------------------------------------------------------------
    def unreleased(self, requests: RequestTable) -> list[Entry]:
        """The entries of ``requests``' lease snapshot minus those released (the lease keeper renews these;
        it calls under ``lock``)."""
        if not self._released:
            return list(requests.snapshot)
        return [e for e in requests.snapshot if e.where not in self._released]

    # ---- release thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                self.check()
            except Exception as exc:  # an outage: nothing released, the loop logs it; try again later
                log.debug("read-ahead release failed: %r", exc)

    def check(self) -> int:
        """Release what waited too long during the current step; returns how many."""
        now = time.monotonic()
        with self.lock:
            if not self._stepping:
                return 0
            stale = [acc for acc, t in self._queued if now - t > self.after_s
                     and acc.entry.where not in self._released]
            if not stale or not self._peer_alive(now):
                return 0
            for acc in stale:
                self._released[acc.entry.where] = acc
            # under the lock: the lease keeper must not renew them between our decision and the release
            self.transport.pending.release([acc.entry for acc in stale], idle_ms=self.claim_idle_ms,
                                           count_delivery=False)
        self.released_total += len(stale)
        log.info("released %d queued requests the engine cannot start soon (waited > %.1fs) to idle peers",
                 len(stale), self.after_s)
        return len(stale)

    def _peer_alive(self, now: float) -> bool:
        peers, asked = self._peers
        if now - asked > PEERS_CHECK_S:
            peers = self.transport.presence.live_peers()
            self._peers = (peers, now)
        return peers > 0
