"""The autoscaling signal against a live fleet: KEDA's own arithmetic (tests/helpers/keda.py) over the shipped
ScaledObject (deploy/k8s/keda.yaml as kustomize renders it), re-aimed at the test's namespace and buckets.

The shipped triggers read each stream's length, and an entry leaves its stream only when its reply is written,
so the signal counts every request not yet answered: undelivered, read ahead by a worker, waiting in its
batcher or engine, or running. Cases (issue 29): a 10,000-prompt bulk on one worker asks for >= 2 workers; an
interactive backlog worth two workers asks for >= 2; the count is 0 only when nothing is queued, held or
running; a worker killed while holding read-ahead entries neither loses nor double-counts them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.devtools import spawn_worker
from tests.conftest import TEST_BUCKETS
from tests.helpers.deploy import configmap_env, of_kind
from tests.helpers.keda import desired_replicas, for_fleet
from tests.helpers.loops import wait_until

CAPACITY = int(configmap_env()["BATCHFLEET_MAX_RUNNING"])  # the shipped streamLength target per worker


def scaled_object(namespace: str) -> dict:
    return for_fleet(of_kind("ScaledObject")["batchfleet-worker"], Keys(namespace), TEST_BUCKETS)


def unanswered(r: redis.Redis, inbox: str, jobs: list[str]) -> int:
    """Jobs of the client reading ``inbox`` whose answer is not stored yet."""
    return len(jobs) - sum(r.exists(*[Keys.done(j, inbox) for j in jobs[i:i + 500]]) for i in range(0, len(jobs), 500))


def sample_until_answered(r: redis.Redis, inbox: str, so: dict, jobs: list[str], timeout_s: float = 180) -> list:
    """Samples every 50 ms until every job is answered."""
    samples, end = [], time.monotonic() + timeout_s
    while not samples or samples[-1][2]:
        assert time.monotonic() < end, f"{samples[-1][2]} of {len(jobs)} requests still unanswered"
        samples.append(sample(r, inbox, so, jobs))
        time.sleep(0.05)
    return samples


def sample(r: redis.Redis, inbox: str, so: dict, jobs: list[str]) -> tuple[int, int, int, int]:
    """(unanswered before, the metric summed over the triggers, unanswered after, desired replicas). Answers
    only ever accumulate, so the true count at the moment of reading lies between the two unanswered counts."""
    before = unanswered(r, inbox, jobs)
    desired, readings = desired_replicas(r, so)
    return before, sum(t.metric for t in readings), unanswered(r, inbox, jobs), desired


def test_a_bulk_of_10000_prompts_on_one_worker_asks_for_more_workers(start_worker, redis_url, namespace, tmp_path):
    # a worker slower than the bulk refills its window (small batches of longer answers), so the window stays
    # full on a loaded host too: what is tested is the signal, not which process the host starves
    start_worker(max_batch_size=4)
    r, keys, so = redis.Redis.from_url(redis_url), Keys(namespace), scaled_object(namespace)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"line {i}: tell me about queues"}) + "\n" for i in range(10_000)))
    cmd = [sys.executable, "-m", "batchfleet.common.cli", "bulk", "--redis-url", redis_url, "--namespace", namespace,
           str(prompts), "-o", str(tmp_path / "out.jsonl"), "--max-new-tokens", "32"]
    bulk = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        streams = [s for s, _, _ in keys.streams(TEST_BUCKETS)]
        wait_until(lambda: sum(r.xlen(s) for s in streams) >= 200, 120, "the bulk's window in the streams")
        desired = []
        for _ in range(20):
            desired.append(desired_replicas(r, so)[0])
            time.sleep(0.1)
        assert bulk.poll() is None, "the bulk ended early"
    finally:
        bulk.send_signal(signal.SIGINT)
        bulk.wait(60)
    # the group's lag (the old signal) stayed under its target: the window is read ahead as it comes
    assert min(desired) >= 2, desired


def test_an_interactive_backlog_worth_two_workers_and_zero_only_when_all_is_answered(start_worker, redis_url,
                                                                                      namespace):
    start_worker(max_batch_size=8)
    r = redis.Redis.from_url(redis_url)
    # settling: a batch's entries are acked a round trip after its answers are stored (worker/transport/settle.py)
    assert_backlog_counted(redis_url, namespace, r, Keys(namespace), scaled_object(namespace), 2 * CAPACITY + 1, 24,
                           settling=8)


def assert_backlog_counted(redis_url: str, namespace: str, r, keys: Keys, so: dict, n: int, new_tokens: int,
                           settling: int = 0) -> None:
    """``n`` requests at once, worth two workers of ``so``'s target: KEDA asks >= 2 at first; every sample counts
    each unanswered request exactly once, and asks >= 1 while any is; 0 once all are answered. ``settling``: how
    many answered requests a sample may still count (a worker acks a batch's entries just after storing their
    answers, a sharded fleet also after writing them on another shard: up to one batch of replies at a time)."""
    with Client(redis_url, namespace) as client:
        jobs = [client.submit([10 + i % 50, 11, 12], max_new_tokens=new_tokens) for i in range(n)]
        first = sample(r, client.reply_key, so, jobs)
        samples = [first, *sample_until_answered(r, client.reply_key, so, jobs)]
        results = [client.result(j, timeout=120) for j in jobs]
    assert first[3] >= 2, first
    for before, metric, after, desired in samples:
        assert after <= metric <= before + settling, (before, metric, after)  # none lost, none counted twice
        if after:
            assert desired >= 1  # something was still queued, held or running
    assert desired_replicas(r, so)[0] == 0
    assert [res.id for res in results] == jobs


def test_a_worker_killed_holding_read_ahead_is_neither_lost_nor_double_counted(start_worker, redis_url, namespace,
                                                                              tmp_path):
    args = ["--buckets", ",".join(map(str, TEST_BUCKETS)), "--max-seq-len", "512", "--dtype", "float32",
            "--engine", "hf", "--mode", "dynamic", "--max-batch-size", "64", "--max-wait-ms", "10000",
            "--window", "fixed", "--threads", "1"]
    w = spawn_worker(redis_url, namespace, args, log_path=str(tmp_path / "w.log"))
    r, keys, so = redis.Redis.from_url(redis_url), Keys(namespace), scaled_object(namespace)
    stream = keys.stream(TEST_BUCKETS[0])
    try:
        with Client(redis_url, namespace) as client:
            jobs = [client.submit([20 + i, 21, 22], max_new_tokens=16) for i in range(24)]
            # w reads them all and holds them, none running: its fixed window waits 10 s for a batch of 64
            wait_until(lambda: r.xpending(stream, keys.group)["pending"] == len(jobs), 60, "w holding every entry")
            w.kill()
            held = unanswered(r, client.reply_key, jobs)
            before, metric, after, desired = sample(r, client.reply_key, so, jobs)
            assert metric == held == before == after and desired >= 1  # nothing answers while no worker runs
            start_worker(claim_idle_ms=1000, max_batch_size=8)
            samples = sample_until_answered(r, client.reply_key, so, jobs)
            results = [client.result(j, timeout=120) for j in jobs]
    finally:
        w.kill()
    for before, metric, after, _ in samples:  # + one batch (8): answered entries count until their acks, a round
        assert after <= metric <= before + 8 and before <= len(jobs)  # trip later (worker/transport/settle.py)
    assert desired_replicas(r, so)[0] == 0
    assert [res.id for res in results] == jobs
