"""Per-bucket queues and batch deadlines. Pure Python: no Redis, no torch; time is passed in.

Rule (exact): a bucket's batch closes when it holds ``max_batch_size`` entries, or when ``max_wait_ms``
has passed since its OLDEST entry was enqueued, whichever is first. Buckets never share a batch. Among
buckets with a closed batch, the one whose oldest entry has waited longest is served first.
``max_wait_ms=None`` (or infinity) means "static": a batch closes only when full (or on ``flush``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Pending(Generic[T]):
    item: T
    bucket: int
    enqueued_at: float  # seconds, same clock as `now`


class Batcher(Generic[T]):
    """Holds requests per bucket in arrival order and decides which batch to run next."""

    def __init__(self, buckets: Iterable[int], max_batch_size: int, max_wait_ms: float | None) -> None:
        self.max_batch_size = max_batch_size
        static = max_wait_ms is None or math.isinf(max_wait_ms)
        self.max_wait_s = None if static else max_wait_ms / 1000.0
        self._queues: dict[int, deque[Pending[T]]] = {b: deque() for b in buckets}
        self._flush = False

    def add(self, item: T, bucket: int, enqueued_at: float) -> None:
        # Entries of one bucket are served oldest-first, so keep the deque sorted by enqueue time
        # (Redis delivery order is near-sorted; inserting from the right is O(1) in the common case).
        q = self._queues[bucket]
        entry = Pending(item, bucket, enqueued_at)
        if not q or q[-1].enqueued_at <= enqueued_at:
            q.append(entry)
            return
        idx = len(q)
        while idx > 0 and q[idx - 1].enqueued_at > enqueued_at:
            idx -= 1
        q.insert(idx, entry)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending(self, bucket: int) -> int:
        return len(self._queues[bucket])

    @property
    def static(self) -> bool:
        return self.max_wait_s is None

    def flush(self) -> None:
        """Close every non-empty batch now (end of load, shutdown)."""
        self._flush = True

    def _ready(self, q: deque[Pending[T]], now: float) -> bool:
        if not q:
            return False
        if self._flush or len(q) >= self.max_batch_size:
            return True
        # same expression as next_deadline(), so "now == deadline" is ready despite float rounding
        return self.max_wait_s is not None and now >= q[0].enqueued_at + self.max_wait_s

    def next_deadline(self) -> float | None:
        """Earliest time a not-yet-full batch closes by age; None if nothing waits on a timer."""
        if self.max_wait_s is None:
            return None
        oldest = [q[0].enqueued_at for q in self._queues.values() if q]
        return min(oldest) + self.max_wait_s if oldest else None

    def pop_batch(self, now: float, limit: int | None = None) -> tuple[int, list[T]] | None:
        """Remove and return the next closed batch (bucket, items oldest first), or None.

        ``limit`` caps the items taken (the engine's room); the rest stays queued, its batch still closed."""
        ready = [(q[0].enqueued_at, b) for b, q in self._queues.items() if self._ready(q, now)]
        if not ready:
            if self._flush and not len(self):
                self._flush = False
            return None
        _, bucket = min(ready)
        return bucket, self.take(bucket, self.max_batch_size if limit is None else min(limit, self.max_batch_size))

    def take(self, bucket: int, n: int) -> list[T]:
        """Remove up to n oldest items of a bucket."""
        q = self._queues[bucket]
        return [q.popleft().item for _ in range(min(n, len(q)))]

    def expire(self, is_expired) -> list[T]:
        """Remove and return every queued item for which ``is_expired(item)`` is true."""
        gone: list[T] = []
        for b, q in self._queues.items():
            keep: deque[Pending[T]] = deque()
            for p in q:
                if is_expired(p.item):
                    gone.append(p.item)
                else:
                    keep.append(p)
            self._queues[b] = keep
        return gone
