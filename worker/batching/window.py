"""The batching window: when a queue's partly filled batch closes (pure Python: no Redis, no torch; time
is passed in). The Batcher (worker/batching/batcher.py) asks it for each queue's closing time; a full batch closes
whatever the window says.

fixed: a batch closes ``max_wait_ms`` after its oldest entry was enqueued (the reference rule).

adaptive (the default): ``max_wait_ms`` stays the upper bound (and ``ttft_slo_ms`` minus one expected
step, when given); within it a batch closes as soon as waiting longer no longer pays:

- waiting pays while more requests are expected to arrive during one *missed turn* than are waiting
  now: ``waiting < rate x miss``. ``rate`` is the queue's arrivals over the last second; ``miss`` is how
  long a request that just misses this batch waits for the next one (continuous mode: one engine step,
  it joins at the next; dynamic mode: the whole run of this batch). Each extra second of waiting costs
  ``waiting`` request-seconds of TTFT and saves ``rate x miss``: hold only while the saving is larger.
- continuous mode starts at once, idle or busy: a request that misses this batch joins at the next step,
  so a burst's first entry may start alone and the rest join one step later (a busy engine's reads are a
  step apart anyway);
- dynamic mode: starts once arrivals pause (no entry enqueued for ``QUIET_S``): a lone request waits about
  a millisecond, a burst read in pieces still lands in one batch, a backlog read late starts at once.

With no measurements yet (``miss`` 0) the adaptive window starts everything at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

QUIET_S = 0.001  # dynamic mode: wait this long after the last arrival, so a burst read in pieces stays one batch
RATE_HORIZON_S = 1.0  # the arrival rate is measured over this much of the queue's recent history
EWMA_WEIGHT = 0.2  # weight of the newest step or run time in its moving average


class Window:
    """Closing times of partly filled batches, per queue (a hashable key per priority and bucket)."""

    def __init__(self, max_wait_ms: float, adaptive: bool = False, joins: bool = True,
                 ttft_slo_ms: float | None = None) -> None:
        self.max_wait_s = max_wait_ms / 1000.0  # may be inf: then only the adaptive rules close batches
        self.adaptive = adaptive
        self.joins = joins  # continuous mode: a request that misses a batch joins at the next step
        self.slo_s = None if ttft_slo_ms is None else ttft_slo_ms / 1000.0
        self.step_s = 0.0  # moving average of one engine step
        self.run_s = 0.0  # moving average of one batch's run on an otherwise idle engine (dynamic mode)
        self._arrivals: dict[Hashable, deque[float]] = {}  # enqueue times within RATE_HORIZON_S of the newest

    # ---- what the worker measures ----------------------------------------------------------------
    def arrived(self, key: Hashable, enqueued_at: float) -> None:
        """A request was queued in ``key`` (enqueue time on the same clock as every other time here)."""
        times = self._arrivals.setdefault(key, deque())
        times.append(enqueued_at)
        while times and times[0] < enqueued_at - RATE_HORIZON_S:
            times.popleft()

    def step_took(self, seconds: float) -> None:
        """An engine step took ``seconds``."""
        self.step_s = _ewma(self.step_s, seconds)

    def run_took(self, seconds: float) -> None:
        """A batch started on an idle engine ran ``seconds`` until the engine was idle again."""
        self.run_s = _ewma(self.run_s, seconds)

    # ---- decisions -------------------------------------------------------------------------------
    def rate(self, key: Hashable) -> float:
        """Arrivals per second to ``key`` over the last RATE_HORIZON_S of its history."""
        return len(self._arrivals.get(key, ())) / RATE_HORIZON_S

    def miss_s(self) -> float:
        """How long a request that misses the batch closing now waits for its own start."""
        return self.step_s if self.joins else self.run_s

    def holds(self, key: Hashable, waiting: int) -> bool:
        """Whether waiting for more arrivals pays for a queue with ``waiting`` requests (adaptive rule)."""
        return waiting < self.rate(key) * self.miss_s()

    def closes_at(self, key: Hashable, oldest: float, waiting: int, newest: float) -> float:
        """When the queue ``key`` closes its batch: ``oldest`` and ``newest`` are its entries' first and last
        enqueue times, ``waiting`` its size. May be inf (static batching)."""
        bound = oldest + self.max_wait_s
        if self.slo_s is not None:  # leave one step for the prefill itself
            bound = min(bound, oldest + max(0.0, self.slo_s - self.step_s))
        if not self.adaptive or self.holds(key, waiting):
            return bound
        if self.joins:
            return min(bound, oldest)  # latecomers join at the next step
        return min(bound, newest + QUIET_S)  # a dynamic batch runs to its end without latecomers

    def describe(self) -> dict[str, float | str]:
        """What the window has measured (worker status)."""
        return {"window": "adaptive" if self.adaptive else "fixed", "window_step_ms": round(self.step_s * 1000, 3),
                "window_run_ms": round(self.run_s * 1000, 3)}


def _ewma(current: float, sample: float) -> float:
    if not math.isfinite(sample) or sample < 0:
        return current
    return sample if current == 0.0 else (1 - EWMA_WEIGHT) * current + EWMA_WEIGHT * sample
