"""``batchfleet status``: the table, ``--json`` and ``--watch`` against two real workers, a gone worker and a
queue that is waiting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.producer.ops.status import snapshot
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import wait_until


def run_status(redis_url: str, namespace: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_NAMESPACE": namespace}
    return subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "status", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_status_table_and_json(start_worker, redis_url: str, namespace: str):
    a, b = start_worker(name="worker-a", max_wait_ms=10), start_worker(name="worker-b", max_wait_ms=10)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        results = client.generate_many([[5] * 3, [6] * 40, [7] * 3, [8] * 100] * 3, max_new_tokens=4)
    def counted() -> bool:  # a heartbeat each: the statuses include the answered requests
        return sum(w["completed"] for w in snapshot(r, keys)["workers"]) == len(results)

    wait_until(counted, 30, "the workers' statuses to count every answer")
    r.zadd(keys.workers, {"worker-old": int(r.time()[0]) * 1000 - 120_000})  # last seen 2 minutes ago
    r.xadd(keys.dead, {"reason": "test"})
    a.loop.stopping.set()
    b.loop.stopping.set()
    a.thread.join(60)
    b.thread.join(60)
    with Client(redis_url, namespace, require_workers=False) as client:
        client.submit([9] * 3, max_new_tokens=2)
    time.sleep(0.2)

    proc = run_status(redis_url, namespace, "--json")
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["fleet"]["buckets"] == list(TEST_BUCKETS) and snap["dead_letters"] == 1
    q = {x["bucket"]: x for x in snap["queues"] if x["priority"] == "interactive"}
    priorities = {(x["bucket"], x["priority"], x["class"]) for x in snap["queues"]}  # "class": deprecated key
    assert priorities == {(b, p, c) for b in TEST_BUCKETS for p, c in (("interactive", "interactive"),
                                                                          ("background", "batch"))}
    assert q[TEST_BUCKETS[0]]["depth"] == 1 and q[TEST_BUCKETS[0]]["pending"] == 0
    assert q[TEST_BUCKETS[0]]["oldest_age_s"] > 0 and q[TEST_BUCKETS[1]]["depth"] == 0
    w = {x["name"]: x for x in snap["workers"]}
    assert set(w) == {"worker-a", "worker-b", "worker-old"}
    assert w["worker-a"]["alive"] and w["worker-b"]["alive"] and not w["worker-old"]["alive"]
    assert w["worker-old"]["seen_s"] >= 119
    assert w["worker-a"]["completed"] + w["worker-b"]["completed"] == len(results)
    assert sum(sum(x["last_batch_sizes"]) for x in (w["worker-a"], w["worker-b"])) == len(results)
    assert w["worker-a"]["engine"] == "hf" and w["worker-a"]["running"] == 0
    assert any(x["tokens_per_s"] > 0 for x in (w["worker-a"], w["worker-b"]))

    proc = run_status(redis_url, namespace)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"buckets {list(TEST_BUCKETS)}" in out and "dead letters: 1" in out
    lines = out.splitlines()
    assert any(line.split()[:4] == [str(TEST_BUCKETS[0]), "interactive", "1", "0"] for line in lines), out
    assert any(line.startswith("worker-a") and " alive " in line and "hf/dynamic" in line for line in lines), out
    assert any(line.startswith("worker-old") and "gone (2." in line for line in lines), out
    r.close()


def test_status_watch_until_interrupted(redis_url: str, namespace: str):
    env = {**os.environ, "BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_NAMESPACE": namespace}
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "status", "--json", "--watch", "0.1"],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        snaps = [json.loads(proc.stdout.readline()) for _ in range(3)]  # refreshes
        assert all(s["fleet"] is None and s["workers"] == [] for s in snaps)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    proc = run_status(redis_url, namespace)
    assert proc.returncode == 0 and "no fleet published" in proc.stdout


@pytest.mark.unit
def test_running_over_max_running_says_it_is_the_background_reserve():
    """Interactive work fills --max-running while background work keeps its reserve decoding: 'running' above
    the limit is explained, not shown bare (issue 32)."""
    from batchfleet.producer.ops.status import _worker_row, render

    beat = {"name": "w1", "alive": True, "seen_s": 0.5, "engine": "native", "mode": "continuous", "active": 70,
            "waiting": 3, "engine_running_limit": 64, "engine_background_reserve": 6}
    row = _worker_row(beat)
    assert (row["running"], row["running_limit"], row["background_reserve"]) == (70, 64, 6)
    assert row["batch_reserve"] == 6  # the key's deprecated name, kept one release
    older = {k: v for k, v in beat.items() if k != "engine_background_reserve"} | {"engine_batch_reserve": 5}
    assert _worker_row(older)["background_reserve"] == 5  # an older worker's heartbeat still read
    snap = {"namespace": "bf", "fleet": None, "queues": [], "workers": [row], "dead_letters": 0}
    (line,) = [x for x in render(snap).splitlines() if x.startswith("w1")]
    assert "70 (max-running 64 + background reserve 6)" in line, line
    row = _worker_row({**beat, "active": 64})
    (line,) = [x for x in render({**snap, "workers": [row]}).splitlines() if x.startswith("w1")]
    assert " 64 " in line and "reserve" not in line, line
