"""The autoscaling simulation (scripts/autoscale_sim.py): KEDA's and the HPA's arithmetic over a synthetic metric
series (exact replicas), the day trace and its oracle, and one tiny run of the whole script over real Redis and
real simulated workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.benchlib.daytrace import DayShape, make_trace, oracle_schedule
from scripts.benchlib.keda import Autoscaler, ScaledObject, run_series
from scripts.benchlib.shipped import shipped
from tests.helpers.deploy import of_kind

ROOT = Path(__file__).resolve().parents[1]
SO = ScaledObject(polling_interval_s=5, cooldown_period_s=300, max_replicas=10)
# metric (worker-equivalents) from each time on: idle, 6, a burst of 20, down to 3, idle again
SERIES = [(0, 0.0), (10, 6.0), (60, 20.0), (100, 3.0), (500, 0.0), (900, 0.0)]


@pytest.mark.unit
def test_keda_wakes_from_zero_at_the_first_active_poll_then_the_hpa_scales_up_by_its_policy() -> None:
    replicas = dict(run_series(SO, SERIES, 5))
    assert [replicas[t] for t in (0, 5, 10)] == [0, 0, 1]  # activation: KEDA sets 1 at the poll that sees work
    assert replicas[15] == 5  # HPA wants 6; one period adds at most max(4 pods, 100%)
    assert replicas[30] == 6
    assert replicas[60] == 10  # wants 20: capped by max_replicas


@pytest.mark.unit
def test_hpa_scale_down_waits_out_the_stabilization_window() -> None:
    replicas = dict(run_series(SO, SERIES, 5))
    # the last recommendation of 10 was at the t=90 sync: kept until it leaves the 300 s window
    assert [replicas[t] for t in (105, 390)] == [10, 10]
    assert replicas[405] == 3


@pytest.mark.unit
def test_keda_scales_to_zero_after_cooldown_since_the_last_active_poll() -> None:
    replicas = dict(run_series(SO, SERIES, 5))
    assert replicas[790] == 3  # the HPA alone never goes below 1, and 3 is still in its window
    assert replicas[795] == 0  # last active poll at 495, cooldown 300
    assert replicas[900] == 0


@pytest.mark.unit
def test_hpa_tolerance_keeps_replicas_within_ten_percent() -> None:
    scaler = Autoscaler(ScaledObject(min_replicas=5, max_replicas=50, down_window_s=0))
    assert scaler.advance(0, 5.0) == 5
    assert scaler.advance(15, 5.4) == 5  # ratio 1.08: within tolerance
    assert scaler.advance(30, 4.6) == 5  # 0.92
    assert scaler.advance(45, 5.6) == 6  # 1.12: ceil(5.6)
    assert scaler.advance(60, 0.0) == 5  # min_replicas holds; never 0 with min_replicas > 0


@pytest.mark.unit
def test_simulation_defaults_are_the_scaled_object_the_manifests_ship() -> None:
    so = of_kind("ScaledObject")["batchfleet-worker"]["spec"]  # as kustomize renders it
    ships = shipped()
    assert so["advanced"]["scalingModifiers"]["formula"].startswith(f"interactive / {ships.interactive_utilization:g} ")
    assert (ships.polling_interval_s, ships.cooldown_period_s) == (so["pollingInterval"], so["cooldownPeriod"])
    down = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"]
    assert ships.down_window_s == down


@pytest.mark.unit
def test_scaled_object_refuses_impossible_bounds() -> None:
    with pytest.raises(ValueError):
        ScaledObject(min_replicas=5, max_replicas=2)


@pytest.mark.unit
def test_day_trace_has_its_bulk_job_at_night_and_the_oracle_covers_every_request() -> None:
    shape = DayShape(hours=24, peak_rps=0.5, night_rps=0.05, bulk_lines=300, bulk_at_h=1.0, seed=3)
    trace = make_trace(shape)
    assert trace.bulk_at_s == 3600
    assert trace.arrivals == sorted(trace.arrivals)
    day = [t for t in trace.arrivals if 12 * 3600 <= t < 16 * 3600]
    night = [t for t in trace.arrivals if 2 * 3600 <= t < 6 * 3600]
    assert len(day) > 3 * len(night)
    plan = oracle_schedule(trace, service_s=100, bulk_service_s=400, max_running=4, interval_s=60,
                           start_delay_s=30, background_cap=20)
    busy = [sum(1 for a in trace.arrivals if a <= t < a + 100) for t in range(0, 24 * 3600, 60)]
    # at each instant the oracle holds enough interactive slots for everything arrived and still running
    for i, need in enumerate(busy):
        assert plan.interactive[i] * 4 >= need
    assert plan.bulk_done_s > trace.bulk_at_s
    assert plan.worker_seconds > 0


def test_autoscale_sim_tiny_run_answers_every_request_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "autoscale_sim.py"), "--hours", "0.3", "--speed", "100",
         "--peak-rps", "0.08", "--night-rps", "0.02", "--bulk-lines", "40", "--bulk-at-h", "0.05", "--bulk-tokens", "6",
         "--background-cap", "4", "--max-replicas", "8", "--hosts", "2", "--kill-every-h", "0.15",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("keda", "oracle"):
        run = result["runs"][name]
        # a host was SIGKILLed mid-batch: its workers' entries were reclaimed, every request answered once
        assert run["host_kills"] >= 1
        assert run["interactive"]["sent"] == run["interactive"]["answered"] > 0
        assert run["interactive"]["lost"] == 0
        assert (run["bulk"]["answered"], run["bulk"]["duplicates"], run["bulk"]["failed"]) == (40, 0, 0)
        assert run["worker_seconds"] > 0 and f"| {name} |" in proc.stdout
