"""Prometheus metrics of a real worker under load, scraped over HTTP: every metric is present with values
that match what was served; queue depth, pending and age come from Redis (fleet-wide)."""

from __future__ import annotations

import time
import urllib.request

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.metrics import queue_collector, registry_with, serve_metrics
from batchfleet.producer import Client
from batchfleet.worker.devtools import free_port
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import raw_inbox, wait_until
from tests.helpers.metrics import scrape

GAUGES = ("batchfleet_queue_depth", "batchfleet_queue_pending", "batchfleet_queue_oldest_age_seconds",
          "batchfleet_requests_running", "batchfleet_requests_waiting", "batchfleet_kv_cache_usage_ratio")
COUNTERS = ("batchfleet_prompt_tokens", "batchfleet_generation_tokens", "batchfleet_requests",
            "batchfleet_dead_letters", "batchfleet_preemptions", "batchfleet_reclaimed",
            "batchfleet_prompt_tokens_cached", "batchfleet_request_preemptions")
HISTOGRAMS = ("batchfleet_time_to_first_token_seconds", "batchfleet_e2e_request_latency_seconds",
              "batchfleet_request_queue_time_seconds", "batchfleet_batch_size", "batchfleet_decode_step_seconds")


IA = {"priority": "interactive", "class": "interactive"}  # the series of interactive work (both labels)


def one(m: dict, name: str, **labels: str) -> float:
    return m[name][tuple(sorted(labels.items()))]


def total(m: dict, name: str) -> float:
    return sum(m.get(name, {}).values())


def test_worker_metrics_under_load(start_worker, redis_url: str, namespace: str):
    port = free_port()
    w = start_worker(metrics_port=port, max_wait_ms=20)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    prompts = [[5 + i] * n for i, n in enumerate((3, 10, 20, 40, 70, 100, 150, 3, 10, 20, 40, 70))]
    with Client(redis_url, namespace) as client:
        results = client.generate_many(prompts, max_new_tokens=6)
        # one dead letter (no usable reply key) and one invalid request: error outcomes are counted too
        r.xadd(keys.stream(TEST_BUCKETS[0]), {"id": "bad-reply-key", "r": "nope", "p": b"x"})
        r.xadd(keys.stream(TEST_BUCKETS[0]), {"id": "bad-payload", "r": raw_inbox(keys), "p": b"\xc1"})
        wait_until(lambda: w.loop.ledger["dead_lettered"] == 1 and w.loop.ledger["errors"] >= 2, 30,
                   "the two bad entries answered")
        m = scrape(port)
        n = len(results)
        for name in GAUGES:
            assert name in m, name
        for name in COUNTERS:
            assert name + "_total" in m, name
        for name in HISTOGRAMS:
            assert name + "_count" in m and name + "_sum" in m and name + "_bucket" in m, name
        # the priority, and for one release the deprecated label ``class`` with its old values, on one series
        assert {(dict(k)["bucket"], dict(k)["priority"], dict(k)["class"]) for k in m["batchfleet_queue_depth"]} == {
            (str(b), p, c) for b in TEST_BUCKETS for p, c in (("interactive", "interactive"), ("background", "batch"))}
        assert total(m, "batchfleet_queue_depth") == 0 and total(m, "batchfleet_queue_pending") == 0
        assert one(m, "batchfleet_requests_running") == 0 and one(m, "batchfleet_requests_waiting") == 0
        assert 0 <= one(m, "batchfleet_kv_cache_usage_ratio") <= 1
        assert one(m, "batchfleet_requests_total", outcome="ok") == n
        assert one(m, "batchfleet_requests_total", outcome="invalid_request") == 1
        assert one(m, "batchfleet_requests_total", outcome="worker_failed") == 1
        assert one(m, "batchfleet_requests_total", outcome="cancelled") == 0
        assert one(m, "batchfleet_dead_letters_total") == 1
        assert one(m, "batchfleet_reclaimed_total") == 0
        assert one(m, "batchfleet_preemptions_total", reason="capacity") == 0
        assert one(m, "batchfleet_preemptions_total", reason="priority") == 0
        assert one(m, "batchfleet_prompt_tokens_total") == sum(x.prompt_tokens for x in results)
        assert one(m, "batchfleet_generation_tokens_total") == sum(x.completion_tokens for x in results) > 0
        for name in ("batchfleet_time_to_first_token_seconds", "batchfleet_e2e_request_latency_seconds",
                     "batchfleet_request_queue_time_seconds"):
            # every priority exported from the start; these requests are all interactive (the default)
            background = {"priority": "background", "class": "batch"}
            assert one(m, name + "_count", **IA) == n and one(m, name + "_count", **background) == 0, name
        e2e = one(m, "batchfleet_e2e_request_latency_seconds_sum", **IA)
        assert e2e == pytest.approx(sum(x.total_ms for x in results) / 1000, rel=1e-3)
        assert one(m, "batchfleet_time_to_first_token_seconds_sum", **IA) <= e2e
        # every served request entered the engine in exactly one prefill batch
        assert total(m, "batchfleet_batch_size_sum") == n
        assert total(m, "batchfleet_batch_size_count") == w.loop.ledger["batches"]
        assert {dict(k)["bucket"] for k in m["batchfleet_batch_size_count"]} <= {str(b) for b in TEST_BUCKETS}
        assert 1 <= one(m, "batchfleet_decode_step_seconds_count") and one(m, "batchfleet_decode_step_seconds_sum") > 0

        # pause the worker: new requests queue up; the gauges (read from Redis) show them
        w.loop.stopping.set()
        w.thread.join(60)
    with Client(redis_url, namespace, require_workers=False) as client:
        for i in range(5):
            client.submit([7] * 3, max_new_tokens=2, job_id=f"queued-{i}")
        time.sleep(0.3)
        m = scrape(port)
        depth = one(m, "batchfleet_queue_depth", bucket=str(TEST_BUCKETS[0]), **IA)
        assert depth == 5 and one(m, "batchfleet_queue_pending", bucket=str(TEST_BUCKETS[0]), **IA) == 0
        assert one(m, "batchfleet_queue_oldest_age_seconds", bucket=str(TEST_BUCKETS[0]), **IA) >= 0.2
        assert one(m, "batchfleet_queue_oldest_age_seconds", bucket=str(TEST_BUCKETS[1]), **IA) == 0
        # another consumer takes two: they move from depth to pending
        r.xreadgroup(keys.group, "someone", {keys.stream(TEST_BUCKETS[0]): ">"}, count=2)
        m = scrape(port)
        assert one(m, "batchfleet_queue_depth", bucket=str(TEST_BUCKETS[0]), **IA) == 3
        assert one(m, "batchfleet_queue_pending", bucket=str(TEST_BUCKETS[0]), **IA) == 2
    w.loop.observer.close()
    r.close()


def test_queue_collector_serves_alone_and_survives_redis_down(redis_url: str, namespace: str):
    """The gateway's one-liner: queue gauges from any process; buckets from the published fleet when not
    given; a scrape still answers when Redis is unreachable."""
    from batchfleet.common.config import ConnectionConfig

    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    r.xgroup_create(keys.stream(64), keys.group, id="0", mkstream=True)
    r.xadd(keys.stream(64), {"id": "a"})
    server = serve_metrics(registry_with(queue_collector(ConnectionConfig(redis_url, namespace), [64])), 0,
                           addr="127.0.0.1")
    try:
        assert one(scrape(server.port), "batchfleet_queue_depth", bucket="64", **IA) == 1
    finally:
        server.close()
    down = serve_metrics(registry_with(queue_collector(ConnectionConfig(f"redis://127.0.0.1:{free_port()}/0",
                                                                        namespace))), 0, addr="127.0.0.1")
    try:
        t0 = time.monotonic()
        assert "batchfleet_queue_depth" not in scrape(down.port)
        assert time.monotonic() - t0 < 5
    finally:
        down.close()
    r.close()


def test_gateway_serves_the_fleet_queue_gauges(start_worker, redis_url, namespace):
    import socket
    import subprocess
    import sys

    start_worker(max_wait_ms=5)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "serve", "--port", str(ports[0]),
                             "--metrics-port", str(ports[1]), "--redis-url", redis_url, "--namespace", namespace],
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=2).read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "gateway metrics did not come up"
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)
    assert 'batchfleet_queue_depth{bucket="32",class="interactive",priority="interactive"}' in body
    assert "batchfleet_gateway_requests_in_progress 0.0" in body  # and its own HTTP metrics, on the same port
