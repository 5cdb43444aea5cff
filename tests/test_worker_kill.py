"""Subprocess workers (worker/devtools.py spawn_worker): kill -9 mid-batch under load, and graceful SIGTERM.

Each request must get exactly one answer: the reply list holds one item (consumed by the client, so
LLEN is 0 afterwards), the done marker exists, and re-runs after the crash are visible in the batch
records but never produce a second reply.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.devtools import WorkerProcess, spawn_worker
from tests.helpers.loops import wait_until

BUCKETS = "32,64"
ARGS = ["--buckets", BUCKETS, "--max-seq-len", "256", "--dtype", "float32", "--max-batch-size", "8",
        "--max-wait-ms", "50", "--claim-idle-ms", "1000", "--max-deliveries", "3",
        "--threads", "1"]  # two workers on a 2-core machine: one core each, no OpenMP oversubscription


def _spawn_many(redis_url: str, namespace: str, n: int, tmp_path, extra: list[str]) -> list[WorkerProcess]:
    out: list[WorkerProcess | BaseException] = [None] * n  # type: ignore[list-item]

    def one(i: int) -> None:
        try:
            out[i] = spawn_worker(redis_url, namespace, [*ARGS, *extra], name=f"w{i}-{namespace}",
                                  log_path=str(tmp_path / f"w{i}.log"))
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in out if isinstance(o, BaseException)]
    if errors:
        for o in out:
            if isinstance(o, WorkerProcess):
                o.kill()
        raise errors[0]
    return out  # type: ignore[return-value]


def _pending_of(r: redis.Redis, keys: Keys, consumer: str) -> list[bytes]:
    ids = []
    for b in map(int, BUCKETS.split(",")):
        for row in r.xpending_range(keys.stream(b), keys.group, "-", "+", 1000, consumername=consumer):
            fields = r.xrange(keys.stream(b), row["message_id"], row["message_id"])
            if fields:
                ids.append(fields[0][1][b"id"])
    return ids


def test_kill9_one_of_two_workers_mid_batch_every_request_answered_once(redis_url, namespace, tmp_path):
    a, b = _spawn_many(redis_url, namespace, 2, tmp_path, [])
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    n = 64
    try:
        with Client(redis_url, namespace) as client, ThreadPoolExecutor(16) as pool:
            jobs = [client.submit([10 + i % 50, 11, 12, 13], max_new_tokens=48) for i in range(n)]
            futures = [pool.submit(client.result, j, 90) for j in jobs]
            # kill a as soon as it has a batch running (its batch record is written when the batch starts)
            wait_until(lambda: any(f[b"worker"] == a.name.encode() for _, f in r.xrange(keys.batches)), 60,
                       "a batch on worker a")
            a.kill()
            t_kill = time.monotonic()
            orphans = _pending_of(r, keys, a.name)
            orphans = [j for j in orphans if not r.exists(keys.done(j.decode(), client.reply_key))]
            assert orphans, "the kill should have left unanswered entries behind"
            recovery = wait_until(lambda: all(r.exists(keys.done(j.decode(), client.reply_key)) for j in orphans), 60,
                                  "orphans answered")
            results = [f.result() for f in futures]
            total = time.monotonic() - t_kill
    finally:
        a.kill()
        b.stop()
    assert [res.id for res in results] == jobs and all(res.completion_tokens >= 1 for res in results)
    assert r.xlen(client.reply_key) == 0  # each reply was read once and deleted; no second one was written
    assert all(r.exists(keys.done(j, client.reply_key)) for j in jobs)
    assert sum(r.xlen(keys.stream(int(x))) for x in BUCKETS.split(",")) == 0
    runs: dict[str, int] = {}
    for _, f in r.xrange(keys.batches):
        for j in f[b"ids"].decode().split(","):
            runs[j] = runs.get(j, 0) + 1
    assert set(runs) == set(jobs)
    print(f"\nkill -9: {len(orphans)} orphaned requests answered {recovery:.2f}s after the kill "
          f"(claim_idle_ms=1000); all {n} answered {total:.2f}s after; re-run {sum(v > 1 for v in runs.values())}")


def test_sigterm_finishes_running_batch_hands_back_rest_exits_0(redis_url, namespace, tmp_path):
    (w,) = _spawn_many(redis_url, namespace, 1, tmp_path, ["--max-batch-size", "4"])
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    try:
        with Client(redis_url, namespace) as client:
            jobs = [client.submit([20 + i, 21, 22], max_new_tokens=64) for i in range(12)]
            wait_until(lambda: r.xlen(keys.batches) > 0, 30, "first batch")
            t0 = time.monotonic()
            w.proc.terminate()
            rc = w.proc.wait(30)
            exit_s = time.monotonic() - t0
    finally:
        w.kill()
    assert rc == 0
    answered = {j for j in jobs if r.exists(keys.done(j, client.reply_key))}
    first = r.xrange(keys.batches)[0][1][b"ids"].decode().split(",")
    assert set(first) <= answered  # the running batch finished
    stream = keys.stream(32)
    left = {f[b"id"].decode() for _, f in r.xrange(stream)}
    assert left | answered == set(jobs) and not left & answered  # the rest is back in the stream
    assert r.xpending(stream, keys.group)["pending"] == 0  # nothing stuck on the stopped worker
    print(f"\nSIGTERM: exit 0 after {exit_s:.2f}s; {len(answered)} answered, {len(left)} handed back")
    assert exit_s < 15
