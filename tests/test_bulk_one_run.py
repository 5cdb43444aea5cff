"""One bulk run per output at a time, and a stop that always ends (issue 54): a second run on an output (a cron
job started twice) is refused with exit 1 and leaves the output alone; a run stopped by SIGTERM while no
worker answers exits within its drain bound, and a later run resumes it to the end, every line once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.gateway.cli.bulk_progress import CLOSE_S
from batchfleet.producer.bulk.lock import OutputBusy, OutputLock
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import silent_fleet, wait_until
from tests.test_bulk_runs import bulk_cli
from tests.test_bulk_trust import check_attached, prompts

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.unit
def test_the_output_lock_is_one_holder_at_a_time_and_names_it(tmp_path):
    out = tmp_path / "out.jsonl"
    (tmp_path / "link.jsonl").symlink_to(out)
    with OutputLock(str(out)):
        holder = rf"another bulk run writes .*link.jsonl now \(host .*, pid {os.getpid()}\)"
        with pytest.raises(OutputBusy, match=holder):
            OutputLock(str(tmp_path / "link.jsonl")).acquire()  # another spelling of the same output
    with OutputLock(str(tmp_path / "link.jsonl")):  # released: taken again
        pass
    assert (tmp_path / "out.jsonl.lock").exists()  # kept: a run deleting it would let two runs in


def start_bulk(src: Path, dst: Path, redis_url: str, namespace: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                             "--redis-url", redis_url, "--namespace", namespace, "--max-new-tokens", "2", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def enqueued(redis_url: str, namespace: str) -> int:
    r = redis.Redis.from_url(redis_url)
    return sum(r.xlen(Keys(namespace).stream(b, BACKGROUND)) for b in TEST_BUCKETS)


def test_two_runs_started_together_on_one_output_one_is_refused(start_worker, redis_url, namespace, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(prompts(*(f"prompt {i}" for i in range(30))))
    # no answer comes: the run that got the output holds it; a max_batch_size past the lines lets it queue them
    # all (a run queues at most max_batch_size x live workers unread, producer/bulk/queued.py)
    with silent_fleet(redis_url, namespace, max_batch_size=64):
        runs = [start_bulk(src, dst, redis_url, namespace, "--drain-timeout", "1") for _ in range(2)]
        wait_until(lambda: any(p.poll() is not None for p in runs), 60, "one run refused")
        refused = next(p for p in runs if p.poll() is not None)
        running = next(p for p in runs if p is not refused)
        _, err = refused.communicate()
        assert refused.returncode == 1, err[-2000:]
        assert f"another bulk run writes {dst} now" in err and f"pid {running.pid})" in err, err
        assert "one run per output at a time" in err
        wait_until(lambda: enqueued(redis_url, namespace) == 30, 60, "every line enqueued once")
        assert running.poll() is None
        running.send_signal(signal.SIGTERM)
        _, err = running.communicate(timeout=60)
        assert running.returncode == 143, err[-2000:]
    assert enqueued(redis_url, namespace) == 30  # the refused run submitted nothing
    start_worker(max_wait_ms=5)
    done = bulk_cli(src, dst, redis_url, namespace)
    assert done.returncode == 0, done.stderr[-2000:]
    check_attached(src, dst)  # every line once, each line valid JSON with its own answer


def test_sigterm_with_no_live_worker_exits_within_the_drain_bound_and_a_rerun_finishes(
        start_worker, redis_url, namespace, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(prompts(*(f"p{i}" for i in range(20))))
    with silent_fleet(redis_url, namespace, max_batch_size=64):  # every line queued at once (as above)
        run = start_bulk(src, dst, redis_url, namespace, "--drain-timeout", "3")
        wait_until(lambda: enqueued(redis_url, namespace) == 20, 60, "every line enqueued")
    # the "worker" went away (its heartbeat and the fleet description with it): no answer will come
    sent = time.monotonic()
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    took = time.monotonic() - sent
    assert run.returncode == 143, err[-2000:]
    assert 3 <= took < 3 + CLOSE_S, err[-2000:]  # drained for its bound, then closed (the watchdog never fired)
    assert "SIGTERM: stopping: nothing more is submitted" in err and "stopped at once" not in err, err
    assert err.strip().splitlines()[-1] == ("stopped by SIGTERM: 0 of 20 lines written, 20 unanswered (20 of them "
                                            "in flight); run the same command again to resume"), err
    start_worker(max_wait_ms=5)
    done = bulk_cli(src, dst, redis_url, namespace)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all("result" in o for o in check_attached(src, dst))


HUNG_RUN = """
import asyncio, os, signal
import batchfleet.gateway.cli.bulk_progress as shown

shown.CLOSE_S = 0.5

async def hung(stop, progress):  # a run that never ends, not even when cancelled
    os.kill(os.getpid(), signal.SIGTERM)
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

shown.run_stoppable(hung, "prompts", 10.0, drain_s=0.5)
"""


def test_a_stopped_run_that_hangs_is_ended_by_the_watchdog(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HUNG_RUN], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "stopped at once (the run did not end within 1 s)" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30
