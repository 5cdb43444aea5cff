"""Tenants on one fleet with a real worker (tiny model, native engine, continuous mode): a tenant's requests are
read past another tenant's deep backlog, a full queue refuses the tenant that fills it, and what each tenant
used is counted (Redis usage hashes, the worker's Prometheus counters)."""

from __future__ import annotations

import json
import time

import pytest
import redis

from batchfleet.common.errors import QueueFull
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import queue_stats
from batchfleet.producer import Client
from batchfleet.producer.ops.demand import request_streams
from batchfleet.worker.devtools import free_port
from tests.helpers.loops import wait_until

NATIVE = dict(engine="native", mode="continuous", max_running=4, max_batch_size=4, max_wait_ms=5)


def as_tenant(client: Client, tenant: str) -> Client:
    client._async.tenant = tenant  # the client's own parameter is the edge's (issue 57); the core takes it here
    return client


def answered(r: redis.Redis, keys: Keys, client: Client, jobs: list[str]) -> int:
    return sum(1 for j in jobs if r.exists(keys.done(j, client.reply_key)))


def test_a_tenants_request_is_answered_while_another_has_a_deep_backlog(start_worker, redis_url, namespace):
    w = start_worker(**NATIVE, metrics_port=free_port(), metrics_host="127.0.0.1")
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    r.hset(keys.tenants, "a", json.dumps({"weight": 1}))
    with as_tenant(Client(redis_url, namespace), "a") as a, as_tenant(Client(redis_url, namespace), "b") as b:
        flood = [a.submit([10 + i % 50, 11, 12], max_new_tokens=16) for i in range(300)]
        wait_until(lambda: answered(r, keys, a, flood) >= 4, 60, "the first of a's answers")
        for i in range(3):  # b's requests, one after another: each read past a's backlog
            assert b.generate([20 + i, 21, 22], max_new_tokens=4, timeout=120).completion_tokens == 4
        left = len(flood) - answered(r, keys, a, flood)
        assert left > 150, f"b's requests waited behind a's backlog ({left} of a's left)"
        assert r.xlen(keys.stream(32, tenant="a")) > 0 and r.sismember(keys.queued_tenants, "b")
        results = [a.result(j, timeout=300) for j in flood]
    assert all(x.completion_tokens == 16 for x in results)
    # usage: every answer counted once, per tenant, in the total and today's hash
    day = time.strftime("%Y-%m-%d", time.gmtime())
    for key in (keys.usage(), keys.usage(day)):
        usage = {k.decode(): int(v) for k, v in r.hgetall(key).items()}
        assert usage["a|requests"] == 300 and usage["a|generated_tokens"] == 300 * 16
        assert usage["b|requests"] == 3 and usage["b|generated_tokens"] == 12 and usage["b|prompt_tokens"] == 9
    assert r.ttl(keys.usage(day)) > 86_400
    counters = {}
    for fam in w.loop.observer.registry.collect():
        for s in fam.samples:
            if s.name.startswith("batchfleet_tenant_") and s.name.endswith("_total"):
                counters[s.name, s.labels["tenant"]] = s.value
    assert counters["batchfleet_tenant_requests_total", "a"] == 300  # configured: its own label
    assert counters["batchfleet_tenant_generated_tokens_total", "other"] == 12  # b is not configured
    assert counters["batchfleet_tenant_requests_total", "default"] == 0


def test_a_full_queue_refuses_the_tenant_that_fills_it(start_worker, redis_url, namespace):
    start_worker(**NATIVE, max_queue_len=20)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    with as_tenant(Client(redis_url, namespace), "a") as a, as_tenant(Client(redis_url, namespace), "b") as b:
        accepted, refused = [], 0
        for i in range(200):
            try:
                accepted.append(a.submit([10 + i % 50, 11, 12], max_new_tokens=32))
            except QueueFull as exc:
                assert "tenant a" in str(exc)
                refused += 1
        assert refused > 0, "a never filled its queue"
        ours = [b.submit([30 + i, 31], max_new_tokens=2) for i in range(10)]  # none refused while a's is full
        assert r.xlen(keys.stream(32, tenant="a")) >= 15  # a's queue still (nearly) full when b's were taken
        # demand (what KEDA scales on) and the queue gauges count every tenant's streams
        assert {keys.stream(32, tenant="a"), keys.stream(32, tenant="b")} <= {s for s, _ in request_streams(r, keys)}
        assert sum(q.length for q in queue_stats(r, keys, (32,))) >= r.xlen(keys.stream(32, tenant="a"))
        assert all(b.result(j, timeout=120).completion_tokens == 2 for j in ours)
        assert all(a.result(j, timeout=300).completion_tokens == 32 for j in accepted)
    usage = {k.decode(): int(v) for k, v in r.hgetall(keys.usage()).items()}
    assert usage["a|requests"] == len(accepted) and usage["b|requests"] == 10


@pytest.mark.unit
@pytest.mark.parametrize("tenant", ["", "acme"])
def test_every_request_stream_is_enumerated_with_its_tenants(tenant):
    keys = Keys("ns")
    streams = [s for s, _, _ in keys.streams((32, 64), [tenant])]
    assert keys.stream(64, "background", tenant) in streams and keys.stream(32) in streams
    assert len(streams) == 4 * (2 if tenant else 1)
