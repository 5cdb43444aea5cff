"""``batchfleet bulk``'s progress tells a rate and an ETA only once the run's pace is measured (issue 58, item 4):
the first line of an 8-minute run said ``ETA 8h34m`` (the start-up time before the first answer, counted as the
run's pace). The pace (producer/bulk/rate.py) and the lines (gateway/cli/bulk_progress.py) on given clocks,
with exact expectations."""

from __future__ import annotations

import io

import pytest

from batchfleet.gateway.cli.bulk_progress import Progress, progress_line
from batchfleet.producer.bulk.rate import MIN_ANSWERS, MIN_WINDOW_S, RecentRate
from batchfleet.producer.bulk.work import Summary

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_no_rate_before_the_first_answer_then_enough_answers_over_enough_time():
    pace = RecentRate()
    pace.add(0.0, 0)
    pace.add(25.0, 0)  # 25 s of start-up: a queue ahead, a worker warming up
    assert pace.rate() is None and pace.eta(100) is None
    pace.add(25.0, 1)  # the first answer: the measure starts here, not at 0
    assert pace.rate() is None
    pace.add(25.5, 1 + MIN_ANSWERS)  # enough answers, too short a time
    assert pace.rate() is None
    pace.add(25.0 + MIN_WINDOW_S, 3)  # enough time, too few answers
    assert pace.rate() is None
    pace.add(25.0 + MIN_WINDOW_S, 101)  # 100 answers in the 5 s after the first: 20/s, the start-up left out
    assert pace.rate() == 20.0 and pace.eta(1000) == 50.0


def test_the_rate_is_the_last_minutes_so_it_follows_a_change_of_pace():
    pace = RecentRate()
    for t in range(0, 121):  # 20 lines/s for two minutes, then 5 lines/s
        pace.add(float(t), 1 + 20 * t)
    assert pace.rate() == 20.0
    for t in range(121, 241):
        pace.add(float(t), 1 + 20 * 120 + 5 * (t - 120))
    assert pace.rate() == 5.0  # the minute before is all at the new pace
    pace.add(270.0, 1 + 20 * 120 + 5 * 120)  # nothing answered for 30 s: the rate falls, no ETA at a rate of 0
    assert pace.rate() == pytest.approx(5 * 30 / 60) and pace.eta(0) == 0.0
    stalled = RecentRate()
    stalled.add(0.0, 1)
    stalled.add(10.0, 20)
    stalled.add(80.0, 20)
    assert stalled.rate() == 0.0 and stalled.eta(5) is None


def test_samples_stay_few_however_many_answers():
    pace = RecentRate()
    for i in range(100_000):  # 1000 answers a second for 100 s: at most two samples a second are kept
        pace.add(i / 1000, i + 1)
    assert len(pace.samples) <= 2 * 61 and pace.rate() == pytest.approx(1000.0, rel=0.01)


def test_the_first_progress_lines_of_an_8_minute_run_show_no_hours_long_eta():
    """9600 prompts: the first answer after 30 s, then 20 a second (8 minutes). Lines every 10 s."""
    clock, out = Clock(), io.StringIO()
    progress = Progress("prompts", 10.0, out, clock)
    s = Summary(total=9600)
    for t in range(30, 511):  # the run calls progress once per answer; here once a second with 20 more
        clock.now = float(t)
        s.written = min(9600, 1 + 20 * (t - 30))
        progress(s)
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["prompts: 1/9600 (0%), measuring the rate",  # before: "0.0/s, ETA 79h59m"
                         "prompts: 201/9600 (2%), 20.0/s, ETA 7m49s",
                         "prompts: 401/9600 (4%), 20.0/s, ETA 7m39s"]
    assert lines[-1] == "prompts: 9600/9600 (100%) in 8m30s, 18.8/s"  # the whole run's mean, start-up included
    assert len(lines) == 49  # at 30, 40, ..., 510 s


def test_a_short_run_says_no_eta_at_all():
    """3 prompts in 11 s: never enough answers to measure a pace (the old line said ETA 12m14s)."""
    clock, out = Clock(), io.StringIO()
    progress = Progress("prompts", 10.0, out, clock)
    s = Summary(total=3)
    for t, written in ((9.0, 1), (10.0, 2), (11.0, 3)):
        clock.now, s.written = t, written
        progress(s)
    assert out.getvalue().splitlines() == ["prompts: 1/3 (33%), measuring the rate",
                                           "prompts: 3/3 (100%) in 11s, 0.3/s"]


def test_progress_line_exact_forms():
    assert progress_line("lines", Summary(total=10, written=4), 3.0, None) == "lines: 4/10 (40%), measuring the rate"
    assert progress_line("lines", Summary(total=10, written=4), 3.0, 0.0) == "lines: 4/10 (40%), 0.0/s, ETA -"
    assert progress_line("lines", Summary(total=7200, written=3600), 9.0, 1.0) == \
        "lines: 3600/7200 (50%), 1.0/s, ETA 1h00m"
    assert progress_line("lines", Summary(total=0), 0.0, None) == "lines: 0/0 (100%) in 0s, 0.0/s"
