"""The adaptive batching window, exactly, on a fake clock (no Redis, no torch): worker/batching/window.py through the
Batcher that asks it."""

from __future__ import annotations

import math

import pytest

from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.batching.window import QUIET_S, RATE_HORIZON_S, Window

pytestmark = pytest.mark.unit

KEY = ("interactive", 128)


def adaptive(max_wait_ms=50.0, joins=True, slo=None) -> tuple[Window, Batcher]:
    w = Window(max_wait_ms, adaptive=True, joins=joins, ttft_slo_ms=slo)
    return w, Batcher((128, 256), 32, max_wait_ms, window=w)


def test_fixed_window_closes_at_max_wait_whatever_was_measured():
    for joins in (True, False):
        w = Window(50.0, joins=joins)
        w.step_took(0.02)
        w.run_took(0.5)
        assert w.closes_at(KEY, oldest=10.0, waiting=1, newest=10.0) == pytest.approx(10.05)


def test_continuous_mode_starts_a_lone_request_at_once():
    w, b = adaptive()
    w.step_took(0.03)
    b.add("lone", 128, enqueued_at=10.0)
    assert b.next_deadline() == 10.0
    assert b.pop_batch(now=10.0005) == (128, ["lone"])


def test_dynamic_mode_starts_a_lone_request_once_arrivals_pause():
    w, b = adaptive(joins=False)
    b.add("lone", 128, enqueued_at=10.0)
    assert b.next_deadline() == pytest.approx(10.0 + QUIET_S)
    assert b.pop_batch(now=10.0005) is None  # a burst's next entry may still be on its way
    assert b.pop_batch(now=10.0 + QUIET_S) == (128, ["lone"])


def test_dynamic_mode_starts_a_backlog_read_late_at_once():
    w, b = adaptive(max_wait_ms=500.0, joins=False)
    for i in range(3):
        b.add(f"r{i}", 128, enqueued_at=10.0 + i * 0.01)
    assert b.pop_batch(now=10.3) == (128, ["r0", "r1", "r2"])  # enqueued long before: nothing is arriving


def test_dynamic_mode_gathers_a_burst_read_in_pieces_into_one_batch():
    w, b = adaptive(joins=False)
    for i in range(20):  # each arrives within QUIET_S of the one before: the batch stays open
        t = 10.0 + i * 0.0004
        b.add(f"r{i}", 128, enqueued_at=t)
        assert b.pop_batch(now=t) is None
    assert b.pop_batch(now=10.0076 + QUIET_S) == (128, [f"r{i}" for i in range(20)])


def test_continuous_mode_holds_while_expected_arrivals_outnumber_the_waiting():
    w, b = adaptive(max_wait_ms=200.0)
    w.step_took(0.1)
    for i in range(50):  # 50 arrivals within a second: 50/s x 0.1 s = 5 expected per missed step
        w.arrived(("background", 256), 9.0 + i * 0.02)
    for i in range(4):
        b.add(f"r{i}", 256, enqueued_at=10.0, priority="background")
    # 4 queued arrivals join the window's history: rate 54/s (inside the horizon), 5.4 > 4 waiting: hold
    assert w.holds(("background", 256), 4)
    assert b.pop_batch(now=10.01) is None
    assert b.next_deadline() == pytest.approx(10.2)  # bounded by max_wait_ms
    b.add("r4", 256, enqueued_at=10.01, priority="background")
    b.add("r5", 256, enqueued_at=10.01, priority="background")
    assert not w.holds(("background", 256), 6)
    assert b.pop_batch(now=10.01) == (256, [f"r{i}" for i in range(6)])


def test_dynamic_mode_weighs_a_whole_run_not_a_step():
    w = Window(200.0, adaptive=True, joins=False)
    w.step_took(0.01)
    w.run_took(0.5)
    for i in range(10):
        w.arrived(KEY, 10.0 + i * 0.05)  # 10/s x 0.5 s run = 5 expected arrivals while a missed one waits
    assert w.miss_s() == 0.5
    assert w.holds(KEY, 4) and not w.holds(KEY, 5)
    assert w.closes_at(KEY, oldest=10.45, waiting=4, newest=10.45) == pytest.approx(10.65)


def test_max_wait_bounds_the_adaptive_window():
    w, b = adaptive(max_wait_ms=20.0)
    w.step_took(1.0)
    for i in range(100):
        w.arrived(KEY, 9.5 + i * 0.005)  # 100/s x 1 s step: holds for ever but for the bound
    b.add("r", 128, enqueued_at=10.0)
    assert b.next_deadline() == pytest.approx(10.02)
    assert b.pop_batch(now=10.0199) is None
    assert b.pop_batch(now=10.02) == (128, ["r"])


def test_ttft_target_leaves_one_step_for_the_prefill():
    w = Window(500.0, adaptive=True, ttft_slo_ms=100.0)
    w.step_took(0.03)
    for i in range(100):
        w.arrived(KEY, 9.5 + i * 0.005)
    assert w.closes_at(KEY, oldest=10.0, waiting=1, newest=10.0) == pytest.approx(10.07)


def test_rate_counts_the_last_horizon_of_arrivals():
    w = Window(50.0, adaptive=True)
    for t in (0.0, 0.5, 1.2, 1.3):
        w.arrived(KEY, t)
    assert w.rate(KEY) == 3 / RATE_HORIZON_S  # 0.0 fell out when 1.2 arrived
    assert w.rate(("background", 128)) == 0.0


def test_a_request_queued_again_is_not_counted_as_an_arrival():
    w, b = adaptive()
    b.add("a", 128, 1.0)
    b.add("b", 128, 1.1, arrival=False)  # a bystander of a failed step, back in the queue
    assert w.rate(KEY) == 1 / RATE_HORIZON_S and len(b) == 2


def test_no_measurement_yet_starts_at_once_and_bad_samples_are_ignored():
    w = Window(50.0, adaptive=True)
    assert w.miss_s() == 0.0 and not w.holds(KEY, 1)
    w.step_took(0.02)
    w.step_took(math.nan)
    w.step_took(-1.0)
    assert w.step_s == 0.02
    w.step_took(0.04)
    assert w.step_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.04)


def test_static_batching_ignores_the_adaptive_window():
    w = Window(math.inf, adaptive=True)
    b = Batcher((128,), 4, None, window=w)
    b.add("r", 128, enqueued_at=10.0)
    assert b.next_deadline() is None
    assert b.pop_batch(now=99.0) is None
