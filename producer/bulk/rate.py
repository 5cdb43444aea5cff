"""A run's pace, once it can be told: lines answered per second over the last WINDOW_S, measured from the first
answer on, and no figure at all (None) until MIN_ANSWERS more lines were answered over at least MIN_WINDOW_S.

Why: the time before a run's first answer is start-up (a queue ahead of it, a worker warming up, the first
prefill), not its pace. A rate taken from the run's start, or from one answer, gave the first progress line of
an 8-minute run an ETA of 8 hours. ``batchfleet bulk``'s progress (gateway/cli/bulk_progress.py) and the
bulk-run registry (producer/bulk/registry.py, so the dashboard and ``batchfleet status``) both use it. Pure:
the caller passes the clock.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 60.0  # the rate is over the answers of this last window (a recent rate, smoothed over a minute)
MIN_ANSWERS = 10  # lines answered after the first answer before a rate is told
MIN_WINDOW_S = 5.0  # seconds after the first answer before a rate is told
SAMPLE_S = 1.0  # samples kept at most one per this many seconds (a run may answer thousands per second)


class RecentRate:
    """Feed it ``add(now, answered)`` (a monotonic clock, the lines this run answered so far); ``rate()`` and
    ``eta(left)`` are None until the rate is measured."""

    def __init__(self, window_s: float = WINDOW_S, min_answers: int = MIN_ANSWERS,
                 min_window_s: float = MIN_WINDOW_S) -> None:
        self.window_s, self.min_answers, self.min_window_s = window_s, min_answers, min_window_s
        self.first: tuple[float, int] | None = None  # (when, answered) at the first answer seen
        self.samples: deque[tuple[float, int]] = deque()  # (when, answered), the oldest at least window_s old

    def add(self, now: float, answered: int) -> None:
        if self.first is None:
            if answered <= 0:  # still starting up: that time is not the run's pace
                return
            self.first = (now, answered)
        if len(self.samples) >= 2 and now - self.samples[-2][0] < SAMPLE_S:
            self.samples[-1] = (now, answered)  # thinned: the newest sample moves forward
        else:
            self.samples.append((now, answered))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self) -> float | None:
        """Lines per second over the last window_s (the time since the first answer while shorter), or None
        until min_answers lines were answered over at least min_window_s after the first answer."""
        if self.first is None or not self.samples:
            return None
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        if n1 - self.first[1] < self.min_answers or t1 - self.first[0] < self.min_window_s or t1 <= t0:
            return None
        return (n1 - n0) / (t1 - t0)

    def eta(self, left: int) -> float | None:
        """Seconds until ``left`` more lines are answered at ``rate()`` (None while it is not measured, or 0)."""
        rate = self.rate()
        return left / rate if rate else None
