"""The autoscaling signal against a live fleet: KEDA's own arithmetic (tests/helpers/keda.py) over the shipped
ScaledObject (deploy/k8s/keda.yaml as kustomize renders it: its prometheus triggers' queries, its scalingModifiers
formula, target and activation) on the fleet's demand as the gateway exports it (gateway/demand_metrics.py).

The demand adds up every request stream and the lines bulk runs and batch jobs have not sent yet (issue 56):
320 interactive requests over several buckets on one worker ask for >= 5 workers, a 20,000-line bulk for the
operator's cap (config.yaml BACKGROUND_MAX_WORKERS), 0 when idle; both through a real Prometheus scraping a real
gateway (skipped, saying why, without the ``prometheus`` binary). The worker is stopped (SIGSTOP) while KEDA
reads: the demand is what is queued, whoever runs it. Where a test samples faster than any scrape interval
(every 100 ms, to check that no request is lost or counted twice as workers answer), the queries are evaluated on
the gateway collector's exposition text with prometheus_client's parser instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.gateway.demand_metrics import DemandCollector
from batchfleet.gateway.metrics import serve_gateway_metrics
from batchfleet.producer import Client
from batchfleet.producer.ops.demand import Demand, read_demand
from batchfleet.worker.devtools import spawn_worker
from tests.conftest import TEST_BUCKETS
from tests.helpers.deploy import configmap_env, of_kind
from tests.helpers.keda import Query, desired_replicas, for_fleet, scrape_labels, scraped
from tests.helpers.loops import wait_until
from tests.helpers.prometheus import BINARY, prometheus

CAPACITY = int(configmap_env()["BATCHFLEET_MAX_RUNNING"])  # the shipped target per worker
CAP = int(of_kind("ConfigMap")["batchfleet-scaling"]["data"]["BACKGROUND_MAX_WORKERS"])
UTILIZATION = float(of_kind("ConfigMap")["batchfleet-scaling"]["data"]["INTERACTIVE_UTILIZATION"])
SO = for_fleet(of_kind("ScaledObject")["batchfleet-worker"])
needs_prometheus = pytest.mark.skipif(BINARY is None, reason="no prometheus binary (Debian: apt install prometheus)")
WORKER_ARGS = ["--buckets", ",".join(map(str, TEST_BUCKETS)), "--max-seq-len", "512", "--dtype", "float32",
               "--engine", "hf", "--mode", "dynamic", "--max-running", "64", "--threads", "1", "--scale-to-zero"]


def scrape(collector: DemandCollector) -> Query:
    """The queries answered on one scrape of ``collector`` (what the gateway's /metrics shows now)."""
    registry = CollectorRegistry()
    registry.register(collector)
    return scraped(generate_latest(registry).decode(), scrape_labels(SO))


def unanswered(r: redis.Redis, inbox: str, jobs: list[str]) -> int:
    """Jobs of the client reading ``inbox`` whose answer is not stored yet."""
    return len(jobs) - sum(r.exists(*[Keys.done(j, inbox) for j in jobs[i:i + 500]]) for i in range(0, len(jobs), 500))


def sample_until_answered(r: redis.Redis, inbox: str, collector: DemandCollector, jobs: list[str], so: dict = SO,
                          timeout_s: float = 300) -> list:
    """Samples every 100 ms until every job is answered (a loaded host: the worker may share this process)."""
    samples, end = [], time.monotonic() + timeout_s
    while not samples or samples[-1][2]:
        assert time.monotonic() < end, f"{samples[-1][2]} of {len(jobs)} requests still unanswered"
        samples.append(sample(r, inbox, collector, jobs, so))
        time.sleep(0.1)
    return samples


def sample(r: redis.Redis, inbox: str, collector: DemandCollector, jobs: list[str],
           so: dict = SO) -> tuple[int, float, int, int]:
    """(unanswered before, the triggers' metrics summed, unanswered after, desired replicas). Answers only ever
    accumulate, so the true count at the moment of reading lies between the two unanswered counts."""
    before = unanswered(r, inbox, jobs)
    reading = desired_replicas(scrape(collector), so)
    return before, sum(reading.metrics.values()), unanswered(r, inbox, jobs), reading.desired


def paused_worker(redis_url: str, namespace: str, log: str):
    """One worker (--max-running 64, scale-to-zero), started then stopped (SIGSTOP): what is submitted stays
    queued while KEDA reads."""
    w = spawn_worker(redis_url, namespace, WORKER_ARGS, log_path=log)
    w.proc.send_signal(signal.SIGSTOP)
    return w


def served_gateway(start_gateway) -> int:
    """A gateway of the test's fleet with its metrics port (what the ServiceMonitor scrapes); returns the port."""
    gw = start_gateway(batch_runner=False)
    return serve_gateway_metrics(gw.app.state.metrics, 0).port


def settle(query: Query, ok: Callable[[int], bool], what: str, timeout_s: float = 60) -> int:
    """KEDA's ask once Prometheus has scraped what is queued now (its scrape interval is 1 s)."""
    got: list[int] = []

    def check() -> bool:
        try:
            got.append(desired_replicas(query, SO).desired)
        except LookupError:  # not scraped yet
            return False
        return ok(got[-1])
    wait_until(check, timeout_s, f"{what} (asks so far: {got[-5:]})", every_s=0.5)
    return got[-1]


@needs_prometheus
def test_320_interactive_requests_over_several_streams_ask_for_5_workers(redis_url, namespace, start_gateway,
                                                                        tmp_path):
    w = paused_worker(redis_url, namespace, str(tmp_path / "w.log"))
    try:
        port = served_gateway(start_gateway)
        with prometheus(tmp_path, [port], scrape_labels(SO)) as query:
            assert settle(query, lambda d: d == 0, "0 when idle") == 0
            with Client(redis_url, namespace) as client:
                # mixed lengths over the buckets of 32, 64, 128 and 256 tokens: 80 requests each
                lengths = [(20, 50, 100, 200)[i % 4] + i % 7 for i in range(320)]
                for i, n in enumerate(lengths):
                    client.submit([10 + (i + j) % 50 for j in range(n)], max_new_tokens=4)
            r = redis.Redis.from_url(redis_url)
            streams = [s for s, _, _ in Keys(namespace).streams(TEST_BUCKETS)]
            filled = [r.xlen(s) for s in streams if r.xlen(s)]
            # the fullest stream alone (KEDA's per-trigger max before) is worth 2 workers
            assert len(filled) >= 3 and -(-max(filled) // CAPACITY) < 5, filled
            desired = settle(query, lambda d: d >= 5, ">= 5 workers for 320 requests")
    finally:
        w.kill()
    assert desired == Demand(320, 0, 0).workers(CAPACITY, CAP, UTILIZATION)  # keda.yaml's formula, headroom too


@needs_prometheus
def test_a_20000_line_bulk_on_one_worker_asks_for_the_background_cap(redis_url, namespace, start_gateway, tmp_path):
    w = paused_worker(redis_url, namespace, str(tmp_path / "w.log"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"line {i}: tell me about queues"}) + "\n" for i in range(20_000)))
    cmd = [sys.executable, "-m", "batchfleet.common.cli", "bulk", "--redis-url", redis_url, "--namespace", namespace,
           str(prompts), "-o", str(tmp_path / "out.jsonl"), "--max-new-tokens", "8"]
    bulk = None
    try:
        port = served_gateway(start_gateway)
        with prometheus(tmp_path, [port], scrape_labels(SO)) as query:
            assert settle(query, lambda d: d == 0, "0 when idle") == 0
            bulk = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
            desired = settle(query, lambda d: d >= CAP, f">= {CAP} workers for a 20,000-line bulk", timeout_s=120)
            assert bulk.poll() is None, "the bulk ended early"
        demand = read_demand(redis.Redis.from_url(redis_url), Keys(namespace))
    finally:
        if bulk is not None:
            bulk.send_signal(signal.SIGINT)
            bulk.wait(60)
        w.kill()
    # the window (256 lines) is in the streams; the rest is counted as unsent: uncapped it asks for ~313
    assert demand.background <= 256 and demand.unsent >= 19_000, demand
    assert demand.workers(CAPACITY) > CAP and demand.workers(CAPACITY, CAP) == CAP
    assert desired == CAP  # capped as configured


def test_an_interactive_backlog_worth_two_workers_and_zero_only_when_all_is_answered(start_worker, redis_url,
                                                                                      namespace):
    start_worker(max_batch_size=8)
    r = redis.Redis.from_url(redis_url)
    # settling: a batch's entries are acked a round trip after its answers are stored (worker/transport/settle.py)
    assert_backlog_counted(redis_url, namespace, r, SO, 2 * CAPACITY + 1, 24, settling=8)


def assert_backlog_counted(redis_url: str, namespace: str, r, so: dict, n: int, new_tokens: int,
                           settling: int = 0) -> None:
    """``n`` requests at once, worth two workers of ``so``'s target: KEDA asks >= 2 at first; every sample (the
    gateway's demand gauge, scraped every 100 ms) counts each unanswered request exactly once, and asks >= 1 while
    any is; 0 once all are answered. ``settling``: how many answered requests a sample may still count (a worker
    acks a batch's entries just after storing their answers, a sharded fleet also after writing them on another
    shard: up to one batch of replies at a time). ``r``: a client of the fleet's Redis (a cluster's too)."""
    collector = DemandCollector(ConnectionConfig(redis_url, namespace))
    try:
        with Client(redis_url, namespace) as client:
            jobs = [client.submit([10 + i % 50, 11, 12], max_new_tokens=new_tokens) for i in range(n)]
            first = sample(r, client.reply_key, collector, jobs, so)
            samples = [first, *sample_until_answered(r, client.reply_key, collector, jobs, so)]
            results = [client.result(j, timeout=120) for j in jobs]
        idle = desired_replicas(scrape(collector), so).desired
    finally:
        collector.close()
    assert first[3] >= 2, first
    for before, metric, after, desired in samples:
        assert after <= metric <= before + settling, (before, metric, after)  # none lost, none counted twice
        if after:
            assert desired >= 1  # something was still queued, held or running
    assert idle == 0
    assert [res.id for res in results] == jobs


def test_a_worker_killed_holding_read_ahead_is_neither_lost_nor_double_counted(start_worker, redis_url, namespace,
                                                                              tmp_path):
    args = ["--buckets", ",".join(map(str, TEST_BUCKETS)), "--max-seq-len", "512", "--dtype", "float32",
            "--engine", "hf", "--mode", "dynamic", "--max-batch-size", "64", "--max-wait-ms", "10000",
            "--window", "fixed", "--threads", "1"]
    w = spawn_worker(redis_url, namespace, args, log_path=str(tmp_path / "w.log"))
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    collector = DemandCollector(ConnectionConfig(redis_url, namespace))
    stream = keys.stream(TEST_BUCKETS[0])
    try:
        with Client(redis_url, namespace) as client:
            jobs = [client.submit([20 + i, 21, 22], max_new_tokens=16) for i in range(24)]
            # w reads them all and holds them, none running: its fixed window waits 10 s for a batch of 64
            wait_until(lambda: r.xpending(stream, keys.group)["pending"] == len(jobs), 60, "w holding every entry")
            w.kill()
            held = unanswered(r, client.reply_key, jobs)
            before, metric, after, desired = sample(r, client.reply_key, collector, jobs)
            assert metric == held == before == after and desired >= 1  # nothing answers while no worker runs
            start_worker(claim_idle_ms=1000, max_batch_size=8)
            samples = sample_until_answered(r, client.reply_key, collector, jobs)
            results = [client.result(j, timeout=120) for j in jobs]
        idle = desired_replicas(scrape(collector), SO).desired
    finally:
        w.kill()
        collector.close()
    for before, metric, after, _ in samples:  # + one batch (8): answered entries count until their acks, a round
        assert after <= metric <= before + 8 and before <= len(jobs)  # trip later (worker/transport/settle.py)
    assert idle == 0
    assert [res.id for res in results] == jobs
