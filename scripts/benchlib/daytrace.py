"""A day-shaped trace and the oracle that knows it in advance (scripts/autoscale_sim.py). Pure: no clock, no Redis.

The trace, in simulated seconds from midnight: interactive requests arrive as a Poisson process whose rate
follows a diurnal curve (lowest at 04:00, highest at 16:00) with bursts on top (a multiple of the curve for some
minutes), and one bulk job of ``bulk_lines`` lines arrives at once at ``bulk_at_h`` (at night). A shorter run
(``hours`` < 24) squeezes the same curve and bursts into its hours.

The oracle: per interval, the fewest workers that run every interactive request from the moment it arrives
(the peak of requests in service within the interval, over ``max_running`` slots a worker), started one start
delay ahead; the bulk job on ``background_cap`` workers from its arrival, every slot busy (its work packed in
whole waves, which is the fewest worker-seconds it can cost). Its worker-seconds count every start's delay.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

DAY_S = 24 * 3600


@dataclass(frozen=True)
class DayShape:
    hours: float = 24.0
    peak_rps: float = 1.0  # interactive requests per simulated second at the day's peak
    night_rps: float = 0.1  # at 04:00
    bursts: tuple[tuple[float, float, float], ...] = ((10.5, 10.0, 4.0), (19.0, 15.0, 3.0))  # (at h, minutes, x)
    bulk_lines: int = 10_000
    bulk_at_h: float = 1.0
    seed: int = 1

    def rate(self, t: float) -> float:
        """Interactive arrivals per second at ``t`` (simulated seconds since the run began)."""
        h = t / (self.hours * 3600) * 24  # the day's hour this instant stands for
        base = self.night_rps + (self.peak_rps - self.night_rps) * (1 - math.cos(2 * math.pi * (h - 4) / 24)) / 2
        for at_h, minutes, x in self.bursts:
            if at_h <= h < at_h + minutes / 60 * 24 / self.hours:
                base *= x
        return base


@dataclass(frozen=True)
class Trace:
    shape: DayShape
    arrivals: list[float]  # interactive requests' arrival times, sorted
    bulk_at_s: float

    @property
    def end_s(self) -> float:
        return self.shape.hours * 3600


def make_trace(shape: DayShape) -> Trace:
    """Poisson arrivals at ``shape.rate`` (thinning against the highest rate), reproducible from ``shape.seed``."""
    rng = random.Random(shape.seed)
    end = shape.hours * 3600
    top = max(shape.peak_rps * max((x for _, _, x in shape.bursts), default=1.0), shape.peak_rps, 1e-9)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= end:
            break
        if rng.random() < shape.rate(t) / top:
            arrivals.append(round(t, 3))
    return Trace(shape, arrivals, shape.bulk_at_h * 3600)


@dataclass
class Plan:
    """The oracle's workers per interval: ``interactive[i]`` + ``bulk[i]`` during [i x interval, (i+1) x interval)."""

    interval_s: float
    start_delay_s: float
    interactive: list[int] = field(default_factory=list)
    bulk: list[int] = field(default_factory=list)
    bulk_done_s: float = 0.0
    worker_seconds: float = 0.0
    bulk_at_s: float | None = None
    background_cap: int = 0

    def workers(self, i: int) -> int:
        return self.interactive[i] + self.bulk[i] if 0 <= i < len(self.interactive) else 0

    def replicas_at(self, t: float, bulk_left: bool) -> int:
        """What the oracle runs at ``t``: the workers needed one start delay later are already starting. The
        bulk job keeps its ``background_cap`` workers from one start delay before it arrives while it has lines
        left (``bulk_left``: the oracle knows when its last line is answered, which the planned waves only
        estimate)."""
        i0 = int(t // self.interval_s)
        i1 = int((t + self.start_delay_s) // self.interval_s)
        interactive = max(self.interactive[i] if 0 <= i < len(self.interactive) else 0 for i in range(i0, i1 + 1))
        arrived = self.bulk_at_s is not None and t + self.start_delay_s >= self.bulk_at_s
        return interactive + (self.background_cap if arrived and bulk_left else 0)


def oracle_schedule(trace: Trace, service_s: float, bulk_service_s: float, max_running: int, interval_s: float,
                    start_delay_s: float, background_cap: int) -> Plan:
    bulk_done = 0.0
    if trace.shape.bulk_lines:
        waves = math.ceil(trace.shape.bulk_lines / (background_cap * max_running))
        bulk_done = trace.bulk_at_s + waves * bulk_service_s
    # past the trace's end: the last requests still run
    n = math.ceil(max(trace.end_s + service_s, bulk_done) / interval_s)
    plan = Plan(interval_s, start_delay_s, [0] * n, [0] * n, bulk_done,
                bulk_at_s=trace.bulk_at_s if trace.shape.bulk_lines else None, background_cap=background_cap)
    # the peak of requests in service within each interval: a sweep over +1 (arrival) and -1 (finish) events
    events = sorted([(a, 1) for a in trace.arrivals] + [(a + service_s, -1) for a in trace.arrivals],
                    key=lambda e: (e[0], e[1]))
    busy, j = 0, 0
    for i in range(n):
        lo, hi = i * interval_s, (i + 1) * interval_s
        while j < len(events) and events[j][0] <= lo:  # finishes at lo free their slot before lo
            busy += events[j][1]
            j += 1
        peak = busy
        while j < len(events) and events[j][0] < hi:
            busy += events[j][1]
            peak = max(peak, busy)
            j += 1
        plan.interactive[i] = math.ceil(peak / max_running)
    if bulk_done:
        for i in range(int(trace.bulk_at_s // interval_s), min(n, math.ceil(bulk_done / interval_s))):
            plan.bulk[i] = background_cap
    starts = sum(max(0, plan.workers(i) - plan.workers(i - 1)) for i in range(n))
    plan.worker_seconds = sum(plan.workers(i) for i in range(n)) * interval_s + starts * start_delay_s
    return plan
