"""The blocking side of a sharded worker's reads (worker/transport/sharded.py): one waiter thread per shard.

A blocking command holds its thread and each shard lives on its own master, so while the loop waits for work
(``wait``) every shard's waiter blocks on that shard's streams (``BoundedReader.wait``: ``COUNT 1`` per
stream, cut down at once) and hands what it reads over; the loop's wait ends at its own deadline, to the
millisecond. A waiter still blocked when the loop stops waiting may read an entry later: it is kept for the
loop's next read (``take``), and ``age`` (the lease keeper's thread, every few seconds) says which are kept
(to renew) and which waited ``LATE_S`` (to release: any worker's next reclaim takes them). The entries read
and not yet taken are guarded by one condition; everything else here is set by the loop's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.worker.transport.base import Entry
from batchfleet.worker.transport.consumer import StreamConsumer, connect
from batchfleet.worker.transport.tenant_gc import bell_gone, gone

log = logging.getLogger(__name__)

RETRY_S = 0.5  # a waiter's pause after a failed blocking read (the loop's sweep reports the outage)
LATE_S = 0.5  # an entry a waiter read that the loop has not taken this long goes back to its stream


class Waiters:
    """The waiter threads of every shard and the entries they read (module docstring)."""

    def __init__(self, parts: list[StreamConsumer]) -> None:
        self._cond = threading.Condition()
        self._got: list[tuple[Entry, float]] = []  # (entry, time.monotonic() it came)
        # while the loop waits (``_armed``) the waiters block on their shards; ``_arms`` counts the waits, so a
        # waiter busy elsewhere (a retry pause) when a short wait began and ended still reads once for it
        self._armed = False
        self._arms = 0
        self._rang = False  # a waiter read a ring of its shard's tenant bell (the loop's wait ends early)
        self.stopped = threading.Event()
        self.failing = False  # a waiter's last read failed: the loop sweeps on every read until one works
        self.counts: dict[str, int] = dict.fromkeys(PRIORITIES, 1)
        self.block_ms = parts[0].max_block_ms
        self._parts = parts
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the threads (once), each with a connection of its own: a blocking read holds its connection."""
        if self._threads or self.stopped.is_set():
            return
        self._threads = [threading.Thread(target=self._run, args=(p, s, connect(p.conn)), name=f"shard-waiter-{s}",
                                          daemon=True) for s, p in enumerate(self._parts)]
        for t in self._threads:
            t.start()

    def wait(self, counts: dict[str, int], timeout_s: float) -> list[Entry]:
        """Block the waiters on their shards (priorities with room in ``counts``) until one reads something or
        ``timeout_s`` passes; what they read (loop's thread)."""
        self.counts = counts
        with self._cond:
            self._armed, self._arms, self._rang = True, self._arms + 1, False
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: self._got or self._rang, timeout_s)
            finally:
                self._armed = False
            return self._take_locked()

    def held(self) -> int:
        """How many entries the waiters read that the loop has not taken."""
        with self._cond:
            return len(self._got)

    def take(self) -> list[Entry]:
        """What the waiters read since the last take."""
        with self._cond:
            return self._take_locked()

    def _take_locked(self) -> list[Entry]:
        out, self._got = [e for e, _ in self._got], []
        return out

    def age(self) -> tuple[list[Entry], list[Entry]]:
        """(late, kept): entries not taken for ``LATE_S`` (no longer offered to the loop: the caller releases
        them) and the others (the caller renews their leases)."""
        now = time.monotonic()
        with self._cond:
            late = [e for e, at in self._got if now - at >= LATE_S]
            self._got = [(e, at) for e, at in self._got if now - at < LATE_S]
            return late, [e for e, _ in self._got]

    def drop(self, wheres: set[tuple]) -> None:
        """Forget entries the loop got another way (a reclaim): taken twice, one copy would be acked."""
        with self._cond:
            self._got = [(e, at) for e, at in self._got if e.where not in wheres]

    def stop(self) -> bool:
        """Stop the threads (each within one blocking read); whether they all stopped."""
        with self._cond:
            self.stopped.set()
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=self.block_ms / 1000 + 1)
        return not any(t.is_alive() for t in self._threads)

    def _run(self, part: StreamConsumer, shard: int, r) -> None:
        seen = 0  # the last wait this waiter read for
        while True:
            with self._cond:
                self._cond.wait_for(lambda seen=seen: self._armed or self._arms != seen or self.stopped.is_set())
                seen = self._arms
            if self.stopped.is_set():
                break
            try:
                got = part.reader.wait(self.counts, self.block_ms, r=r)
            except Exception as exc:  # noqa: BLE001 - a waiter outlives any error; the loop's sweeps report it
                # a retired tenant's stream: the loop's next read looks at the tenants again; the bell without its
                # group: the loop's next sweep (``failing``) makes it again
                if gone(exc) or bell_gone(exc, part.keys.tenant_bell):
                    part.tenants_gone()
                    log.debug("shard %d: a tenant's stream went away under a blocking read: %s", shard, exc)
                elif not self.failing:
                    log.warning("shard %d: blocking read failed (the loop sweeps until it works): %r", shard, exc)
                self.failing = True
                self.stopped.wait(RETRY_S)
                continue
            self.failing = False
            if got or part.reader.rang.is_set():  # a ring: the loop's wait ends, its sweep reads the new tenant's
                with self._cond:
                    self._got += [(dataclasses.replace(e, shard=shard), time.monotonic()) for e in got]
                    self._rang = True
                    self._cond.notify()
        r.close()
