"""Per-bucket, per-priority queues and batch deadlines. Pure Python: no Redis, no torch; time is passed in.

Rule (exact): a queue (one bucket of one priority) closes its batch when it holds
``max_batch_size`` entries, or when ``max_wait_ms`` has passed since its OLDEST entry was enqueued,
whichever is first. Buckets never share a batch, nor do priorities. Priorities are served in order
(``PRIORITIES``: interactive, then background): a background batch is taken only when no interactive one is
closed (or interactive work has no room). Within a priority the next batch is the queue whose head
has the earliest deadline, then the earliest arrival; within a queue, entries are taken in the same
order (earliest deadline first, then arrival). With an ``order`` (the fair share between tenants,
worker/transport/fair_share.py) and several tenants waiting in a priority, the tenants come first: each
entry taken is the next of the tenant ``order`` names (the one furthest behind its share), deadline then
arrival still ordering each tenant's own entries, and the next batch is the queue holding the first one.
``max_wait_ms=None`` (or infinity) means "static": a
batch closes only when full (or on ``flush``). When a partly filled batch closes by time is the window's
decision (worker/batching/window.py): fixed (``max_wait_ms`` after the oldest entry, the default here) or adaptive.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from batchfleet.common.wire.priority import INTERACTIVE, PRIORITIES
from batchfleet.worker.batching.window import Window

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Pending(Generic[T]):
    deadline: float  # inf when the request has none: earliest deadline first
    enqueued_at: float  # seconds, same clock as `now`: then arrival order
    item: T = field(compare=False)
    bucket: int = field(compare=False)
    tenant: str = field(default="", compare=False)


# (priority, tenant -> entries waiting, n) -> the tenants of the next n entries taken, or None (no tenant order)
Order = Callable[[str, Mapping[str, int], int], "list[str] | None"]


class Batcher(Generic[T]):
    """Holds requests per (priority, bucket) and decides which batch runs next."""

    def __init__(self, buckets: Iterable[int], max_batch_size: int, max_wait_ms: float | None,
                 priorities: tuple[str, ...] = PRIORITIES, window: Window | None = None,
                 order: Order | None = None) -> None:
        self.max_batch_size = max_batch_size
        self.order = order  # between tenants (module docstring); None: deadline, then arrival
        static = max_wait_ms is None or math.isinf(max_wait_ms)
        self.max_wait_s = None if static else max_wait_ms / 1000.0
        self.window = window if window is not None else Window(math.inf if static else max_wait_ms)
        self.priorities = priorities
        # each queue sorted by (deadline, enqueued_at): Redis delivery order is near-sorted, so the
        # insertion point is almost always the end
        self._queues: dict[tuple[str, int], list[Pending[T]]] = {(p, b): [] for p in priorities for b in buckets}
        self._flush = False

    def add(self, item: T, bucket: int, enqueued_at: float, priority: str = INTERACTIVE,
            deadline: float | None = None, arrival: bool = True, tenant: str = "") -> None:
        """Queue ``item``; ``arrival=False`` for one queued again (it ran, and a failed step dropped it): not
        an arrival, so the window's arrival rate does not count it twice."""
        entry = Pending(math.inf if deadline is None else deadline, enqueued_at, item, bucket, tenant)
        q = self._queues[(priority, bucket)]
        q.insert(bisect.bisect(q, entry), entry)
        if arrival:
            self.window.arrived((priority, bucket), enqueued_at)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending(self, bucket: int, priority: str = INTERACTIVE) -> int:
        return len(self._queues[(priority, bucket)])

    @property
    def static(self) -> bool:
        return self.max_wait_s is None

    def flush(self) -> None:
        """Close every non-empty batch now (end of load, shutdown)."""
        self._flush = True

    def _closes_at(self, key: tuple[str, int], q: list[Pending[T]]) -> float:
        times = [p.enqueued_at for p in q]
        return self.window.closes_at(key, min(times), len(q), max(times))

    def _ready(self, key: tuple[str, int], q: list[Pending[T]], now: float) -> bool:
        if not q:
            return False
        if self._flush or len(q) >= self.max_batch_size:
            return True
        # same expression as next_deadline(), so "now == deadline" is ready despite float rounding
        return self.max_wait_s is not None and now >= self._closes_at(key, q)

    def next_deadline(self) -> float | None:
        """Earliest time a not-yet-full batch closes by time; None if nothing waits on a timer."""
        if self.max_wait_s is None:
            return None
        closing = [self._closes_at(key, q) for key, q in self._queues.items() if q]
        return min(closing) if closing else None

    def pop_batch(self, now: float, limit: int | None = None,
                  rooms: Mapping[str, int] | None = None) -> tuple[int, list[T]] | None:
        """Remove and return the next closed batch (bucket, items in order), or None.

        ``limit`` caps the items taken (the engine's room); ``rooms`` gives it per priority instead (a priority
        with no room is skipped). What is not taken stays queued, its batch still closed."""
        for priority in self.priorities:
            room = limit if rooms is None else rooms.get(priority, 0)
            if room is not None and room <= 0:
                continue
            ready = [(q[0], key[1]) for key, q in self._queues.items()
                     if key[0] == priority and self._ready(key, q, now)]
            if ready:
                _, bucket = min(ready)
                first = self._tenants(priority, [self._queues[(priority, b)] for _, b in ready], 1)
                if first:  # the queue holding the first entry of the tenant furthest behind its share
                    heads = [(next(p for p in self._queues[(priority, b)] if p.tenant == first[0]), b)
                             for _, b in ready if any(p.tenant == first[0] for p in self._queues[(priority, b)])]
                    _, bucket = min(heads)
                n = self.max_batch_size if room is None else min(room, self.max_batch_size)
                return bucket, self.take(bucket, n, priority)
        if self._flush and not len(self):
            self._flush = False
        return None

    def take(self, bucket: int, n: int, priority: str = INTERACTIVE) -> list[T]:
        """Remove up to n items of a queue, in its order."""
        q = self._queues[(priority, bucket)]
        tenants = self._tenants(priority, [q], n)
        if not tenants:
            taken, q[:] = q[:n], q[n:]
            return [p.item for p in taken]
        own: dict[str, list[Pending[T]]] = {}
        for p in q:
            own.setdefault(p.tenant, []).append(p)
        taken = [own[t].pop(0) for t in tenants]
        ids = {id(p) for p in taken}
        q[:] = [p for p in q if id(p) not in ids]
        return [p.item for p in taken]

    def _tenants(self, priority: str, queues: list[list[Pending[T]]], n: int) -> list[str] | None:
        """The tenants of the next ``n`` entries taken from ``queues`` (``order``), or None when there is no
        order to keep (no ``order``, or one tenant alone)."""
        waiting: dict[str, int] = {}
        for q in queues:
            for p in q:
                waiting[p.tenant] = waiting.get(p.tenant, 0) + 1
        if self.order is None or len(waiting) < 2:
            return None
        return self.order(priority, waiting, n)

    def expire(self, is_expired: Callable[[T], bool]) -> list[T]:
        """Remove and return every queued item for which ``is_expired(item)`` is true."""
        gone: list[T] = []
        for key, q in self._queues.items():
            keep: list[Pending[T]] = []
            for p in q:
                if is_expired(p.item):
                    gone.append(p.item)
                else:
                    keep.append(p)
            self._queues[key] = keep
        return gone
