"""KEDA's and the Kubernetes HPA's arithmetic over one external metric, in simulated time (scripts/autoscale_sim.py).

Pure: no clock, no Redis. ``Autoscaler.advance(now, metric)`` is called with the metric as it is at ``now`` and
returns the replicas the Deployment is set to. What it models, with Kubernetes' and KEDA's defaults:

- KEDA polls the scaler every ``polling_interval_s``: active when the metric is above ``activation``
  (activationThreshold). At 0 replicas an active poll sets 1 (KEDA owns 0 <-> 1, the HPA cannot leave 0); with
  ``min_replicas`` 0, replicas go back to 0 once no poll was active for ``cooldown_period_s``.
- The HPA syncs every ``hpa_sync_s`` (kube-controller-manager's 15 s) while replicas >= 1, reading the metric
  then (KEDA's metrics server asks the scaler at each HPA read). Target type AverageValue: the raw
  recommendation is ceil(metric / target), unless metric / (target x replicas) is within ``tolerance`` (10%) of 1,
  then it stays; clamped to [max(min_replicas, 1), max_replicas].
- Stabilization (behavior.*.stabilizationWindowSeconds): scale-up takes the smallest recommendation of the
  last ``up_window_s`` (default 0: the current one), scale-down the largest of the last ``down_window_s`` (300 s).
- Rate limits (the default policies, one period = one sync): up by at most max(4 pods, 100%), down by 100%.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScaledObject:
    """A ScaledObject and its HPA behavior (seconds of simulated time)."""

    polling_interval_s: float = 5.0  # deploy/k8s/keda.yaml
    cooldown_period_s: float = 300.0
    min_replicas: int = 0
    max_replicas: int = 200
    target: float = 1.0  # metric per replica (AverageValue): the metric is in worker-equivalents
    activation: float = 0.0  # active above this
    hpa_sync_s: float = 15.0
    tolerance: float = 0.1
    up_window_s: float = 0.0
    down_window_s: float = 300.0
    up_pods: int = 4
    up_percent: float = 100.0
    down_percent: float = 100.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.polling_interval_s <= 0 or self.hpa_sync_s <= 0 or self.target <= 0:
            raise ValueError("polling interval, HPA sync and target must be > 0")


@dataclass
class Autoscaler:
    """The replicas one ScaledObject sets over time (module docstring). Call ``advance`` with non-decreasing
    ``now``; polls and syncs fall due on their own grids from the first call."""

    so: ScaledObject
    replicas: int = -1  # -1: min_replicas at the first call
    last_active: float = -math.inf
    next_poll: float | None = None
    next_sync: float | None = None
    history: deque[tuple[float, int]] = field(default_factory=deque)  # (when, raw recommendation)

    def advance(self, now: float, metric: float) -> int:
        so = self.so
        if self.next_poll is None or self.next_sync is None:
            self.next_poll = self.next_sync = now
            self.replicas = so.min_replicas
        while self.next_poll <= now:  # a caller ticking slower than the grid still sees every due poll once
            self._poll(now, metric)
            self.next_poll += so.polling_interval_s
        while self.next_sync <= now:
            if self.replicas >= 1:
                self._sync(now, metric)
            self.next_sync += so.hpa_sync_s
        return self.replicas

    def _poll(self, now: float, metric: float) -> None:
        so = self.so
        if metric > so.activation:
            self.last_active = now
            if self.replicas == 0:
                self.replicas = max(so.min_replicas, 1)
                self.history.clear()
        elif so.min_replicas == 0 and self.replicas > 0 and now - self.last_active >= so.cooldown_period_s:
            self.replicas = 0
            self.history.clear()

    def recommend(self, metric: float) -> int:
        """The HPA's raw recommendation at ``self.replicas`` (>= 1) replicas, tolerance and bounds applied."""
        so, current = self.so, self.replicas
        ratio = metric / (so.target * current)
        raw = current if abs(ratio - 1.0) <= so.tolerance else math.ceil(metric / so.target - 1e-9)
        return min(max(raw, so.min_replicas, 1), so.max_replicas)

    def _sync(self, now: float, metric: float) -> None:
        so, current = self.so, self.replicas
        self.history.append((now, self.recommend(metric)))
        keep = max(so.up_window_s, so.down_window_s)
        while self.history and self.history[0][0] < now - keep:
            self.history.popleft()
        up = min(n for t, n in self.history if t >= now - so.up_window_s)
        down = max(n for t, n in self.history if t >= now - so.down_window_s)
        desired = current
        if desired < up:
            desired = up
        if desired > down:
            desired = down
        up_limit = max(current + so.up_pods, math.ceil(current * (1 + so.up_percent / 100)))
        down_limit = math.floor(current * (1 - so.down_percent / 100))
        self.replicas = min(max(desired, down_limit, max(so.min_replicas, 1)), up_limit, so.max_replicas)


def run_series(so: ScaledObject, series: list[tuple[float, float]], step_s: float = 1.0) -> list[tuple[float, int]]:
    """Replicas every ``step_s`` over a piecewise-constant metric ``series`` [(from when, value)], sorted."""
    out: list[tuple[float, int]] = []
    scaler = Autoscaler(so)
    end = series[-1][0]
    i, t = 0, series[0][0]
    while t <= end + 1e-9:
        while i + 1 < len(series) and series[i + 1][0] <= t + 1e-9:
            i += 1
        out.append((t, scaler.advance(t, series[i][1])))
        t = round(t + step_s, 9)
    return out
