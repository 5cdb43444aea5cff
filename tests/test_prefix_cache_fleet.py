"""The prefix cache seen from outside a real native worker: Prometheus counters (tokens, like vLLM's
prefix_cache_queries / prefix_cache_hits), the heartbeat status, the hit-rate column of ``batchfleet
status``, and ``--no-prefix-cache`` (flag and environment variable)."""

from __future__ import annotations

import json
import urllib.request

import click
import redis
from prometheus_client.parser import text_string_to_metric_families

from batchfleet.common.cli import main
from batchfleet.common.keys import Keys
from batchfleet.common.options import build_worker_config
from batchfleet.producer import Client
from batchfleet.producer.ops.status import render, snapshot
from batchfleet.worker.devtools import free_port
from tests.helpers.loops import wait_until
from tests.helpers.native import prompt

SHARED = prompt(11, 48)  # three whole blocks of 16


def scrape(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def status(redis_url: str, namespace: str) -> tuple[dict, str]:
    """What ``batchfleet status --json`` prints, and its table."""
    snap = snapshot(redis.Redis.from_url(redis_url), Keys(namespace))
    return json.loads(json.dumps(snap)), render(snap)


def worker_params(*args: str) -> dict:
    return main.get_command(click.Context(main), "worker").make_context("worker", list(args)).params


def test_counters_in_metrics_status_and_table(start_worker, redis_url: str, namespace: str):
    port = free_port()
    w = start_worker(engine="native", mode="continuous", metrics_port=port, max_wait_ms=20, kv_cache_gb=0.02)
    prompts = [SHARED + prompt(30 + i, 2 + i)[1:] for i in range(6)]  # 49..54 tokens, one bucket
    with Client(redis_url, namespace) as client:
        results = client.generate_many(prompts, max_new_tokens=4)
    assert all(len(r.token_ids) == 4 for r in results)
    def m(name: str) -> float:
        return scrape(port, name)

    queries, hits = m("batchfleet_prefix_cache_queries_total"), m("batchfleet_prefix_cache_hits_total")
    # every prompt is looked up; all but the first admitted take the three shared blocks from the cache
    assert queries == sum(len(p) for p in prompts) and hits == 48 * (len(prompts) - 1)
    stats = w.loop.engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queries, hits)

    # a heartbeat: the status carries the counters
    wait_until(lambda: [w["prefix_hit_rate"] for w in status(redis_url, namespace)[0]["workers"]] == [
        round(hits / queries, 4)], 30, "the status to carry the prefix counters")
    snap, table = status(redis_url, namespace)
    (row,) = snap["workers"]
    assert row["prefix_hit_rate"] == round(hits / queries, 4)
    header = next(line for line in table.splitlines() if line.startswith("worker"))
    assert "prefix hit" in header
    assert f"{hits / queries * 100:.0f}%" in next(line for line in table.splitlines() if line.startswith(row["name"]))


def test_no_prefix_cache_turns_it_off(start_worker, redis_url: str, namespace: str, monkeypatch):
    monkeypatch.delenv("BATCHFLEET_PREFIX_CACHE", raising=False)
    assert build_worker_config(**worker_params()).engine.prefix_cache is True  # on by default
    assert build_worker_config(**worker_params("--no-prefix-cache")).engine.prefix_cache is False
    monkeypatch.setenv("BATCHFLEET_PREFIX_CACHE", "0")
    assert build_worker_config(**worker_params()).engine.prefix_cache is False

    w = start_worker(engine="native", mode="continuous", prefix_cache=False, max_wait_ms=20, kv_cache_gb=0.02)
    with Client(redis_url, namespace) as client:
        client.generate_many([SHARED + [7], SHARED + [8]], max_new_tokens=2)
    stats = w.loop.engine.stats()
    assert stats["prefix_cache"] is False and (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (0, 0)
    wait_until(lambda: [w["kv_usage"] is not None for w in status(redis_url, namespace)[0]["workers"]] == [True],
               30, "a heartbeat")
    (row,) = status(redis_url, namespace)[0]["workers"]
    assert row["prefix_hit_rate"] is None and row["kv_usage"] is not None
