"""Idle tenants are retired (worker/transport/tenant_gc.py) with a real worker on real Redis: the queued-tenants set
forgets them and their streams go, a later request of theirs is answered, and no request enqueued while tenants
are retired under it is lost. The idle time is made short through the worker's ``tenant_idle_s``."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.producer import Client
from batchfleet.worker.transport.scripts import WorkerScripts
from batchfleet.worker.transport.tenant_gc import RETIRED, gone
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import beside, wait_until

NATIVE = dict(engine="native", mode="continuous", max_running=8, max_batch_size=8, max_wait_ms=5)
# scale_to_zero: a client then skips the live-worker check, so after its first add to a stream (through the enqueue
# function) it adds with plain XADD + SADD (producer/redis_calls.py): after a retirement that makes the stream again
# without the workers' group, the harder case for a worker (the function makes it with the group)


def tenant_streams(keys: Keys, tenant: str) -> list[str]:
    return [keys.stream(b, priority, tenant) for priority in PRIORITIES for b in TEST_BUCKETS]


def queued(r: redis.Redis, keys: Keys) -> set[str]:
    return {m.decode() for m in r.smembers(keys.queued_tenants)}


def test_an_idle_tenant_is_retired_and_its_next_request_answered(start_worker, redis_url, namespace, caplog):
    caplog.set_level(logging.INFO)
    w = start_worker(**NATIVE, tenant_idle_s=0.5, scale_to_zero=True)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    with Client(redis_url, namespace, tenant="shortlived") as c:
        assert c.generate([10, 11, 12], max_new_tokens=4, timeout=120).completion_tokens == 4
        # the worker made the tenant's other streams when it first read it: every one exists while it is queued
        wait_until(lambda: all(r.exists(s) for s in tenant_streams(keys, "shortlived")), 10, "the tenant's streams")
        assert "shortlived" in queued(r, keys)
        wait_until(lambda: "shortlived" not in queued(r, keys), 20, "the idle tenant's retirement")
        assert not any(r.exists(s) for s in tenant_streams(keys, "shortlived")), "its streams were deleted"
        assert not r.hexists(keys.idle_tenants, "shortlived")
        assert w.loop.transport.tenant_streams.retired >= 1  # type: ignore[attr-defined]
        wait_until(lambda: "shortlived" not in w.loop.transport.reader.tenants, 5,  # type: ignore[attr-defined]
                   "the worker dropping the retired tenant from its reads")
        # back: its next (plain) add makes its stream again, the worker its group and other streams, and reads it
        assert c.generate([20, 21, 22], max_new_tokens=4, timeout=60).completion_tokens == 4
        assert "shortlived" in queued(r, keys)
    lost = [rec.getMessage() for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert not lost, f"a retired tenant read as Redis losing its data: {lost}"
    assert w.loop.ledger.get("internal_errors", 0) == 0


def test_no_request_is_lost_while_tenants_are_retired_under_it(start_worker, redis_url, namespace, caplog):
    """Enqueues of a handful of tenants race retirement: the worker's own sweep (idle time 50 ms) and a second
    retirer calling the script in a loop with no idle time, which retires a tenant whenever two of its calls in a
    row find its streams empty with nothing added between (as a second worker's sweep could, at any moment). Every
    request is answered, the worker never takes a retired stream for lost data, and tenants were retired meanwhile
    (many times)."""
    caplog.set_level(logging.INFO)
    w = start_worker(**NATIVE, tenant_idle_s=0.05, scale_to_zero=True)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    tenants = [f"race{i}" for i in range(6)]
    retire = WorkerScripts(r).retire_tenant
    retired = [0]

    def retirer(stop: threading.Event) -> None:
        while not stop.is_set():
            for t in tenants:
                code = retire(keys=[keys.queued_tenants, keys.idle_tenants, *tenant_streams(keys, t)], args=[t, 0])
                retired[0] += int(code) == RETIRED
            time.sleep(0.001)

    def sender(tenant: str, seed: int, out: list) -> None:
        rng = random.Random(seed)
        with Client(redis_url, namespace, tenant=tenant) as c:
            for i in range(12):
                time.sleep(rng.choice((0.0, 0.0, 0.01, 0.05, 0.2)))  # bursts and pauses: retired in the pauses
                out.append(c.generate([10 + i, 11 + seed, 12], max_new_tokens=2, timeout=120).completion_tokens)

    results = beside(retirer, tenants, sender)
    assert all(len(results[t]) == 12 and all(n == 2 for n in results[t]) for t in tenants), results
    assert retired[0] + w.loop.transport.tenant_streams.retired >= len(tenants), "tenants were retired meanwhile"  # type: ignore[attr-defined]
    lost = [rec.getMessage() for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert not lost, f"a retired tenant read as Redis losing its data: {lost}"
    # nothing queued is left behind, and once idle every tenant goes (the worker's own sweep)
    wait_until(lambda: not queued(r, keys) & set(tenants), 20, "every idle tenant's retirement")
    assert not any(r.exists(s) for t in tenants for s in tenant_streams(keys, t))
    assert w.loop.ledger.get("internal_errors", 0) == 0


def test_two_workers_answer_each_request_once_while_tenants_are_retired_under_them(start_worker, redis_url, namespace,
                                                                                  caplog):
    """The race above on a fleet of two workers (each sweeping, one retiring while the other reads) with bursts of
    submits in both classes: every request is answered once (the workers completed exactly as many, no duplicate)."""
    caplog.set_level(logging.INFO)
    config = dict(NATIVE, tenant_idle_s=0.05, scale_to_zero=True)
    workers = [start_worker(**config), start_worker(**config)]
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    tenants = [f"pair{i}" for i in range(4)]
    retire = WorkerScripts(r).retire_tenant

    def retirer(stop: threading.Event) -> None:
        while not stop.is_set():
            for t in tenants:
                retire(keys=[keys.queued_tenants, keys.idle_tenants, *tenant_streams(keys, t)], args=[t, 0])
            time.sleep(0.001)

    def sender(tenant: str, seed: int, out: list) -> None:
        rng = random.Random(seed)
        with Client(redis_url, namespace, tenant=tenant) as c:
            for burst in range(5):
                time.sleep(rng.choice((0.0, 0.01, 0.05, 0.2)))
                jobs = [c.submit([10 + burst, 11 + seed, 12 + k], max_new_tokens=2,
                                 priority=rng.choice(PRIORITIES)) for k in range(rng.randint(1, 4))]
                out += [c.result(j, timeout=120).completion_tokens for j in jobs]

    results = beside(retirer, tenants, sender)
    answered = [n for t in tenants for n in results[t]]
    assert answered and all(n == 2 for n in answered), results
    assert sum(w.loop.ledger["completed"] for w in workers) == len(answered)
    assert sum(w.loop.ledger["duplicates"] for w in workers) == 0
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert all(w.loop.ledger.get("internal_errors", 0) == 0 for w in workers)


def test_the_retire_script_keeps_a_tenant_with_work_or_new_entries_and_retires_it_after_the_idle_time(
        redis_url, namespace):
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    scripts = WorkerScripts(r)
    streams = tenant_streams(keys, "t")
    r.sadd(keys.queued_tenants, "t")
    for s in streams:
        r.xgroup_create(s, keys.group, id="0", mkstream=True)

    def look(idle_ms: int) -> int:
        time.sleep(0.002)  # the clock is Redis' in ms: an entry of the same ms as a look counts as added after it
        return int(scripts.retire_tenant(keys=[keys.queued_tenants, keys.idle_tenants, *streams], args=["t", idle_ms]))

    entry = r.xadd(streams[0], {"id": "j"})
    assert look(0) == 1 and not r.hexists(keys.idle_tenants, "t")  # queued work: kept
    r.xdel(streams[0], entry)  # answered (the worker's XACK + XDEL)
    assert look(0) == 2 and r.hexists(keys.idle_tenants, "t")  # empty: its clock starts
    r.xdel(streams[1], r.xadd(streams[1], {"id": "k"}))  # queued and answered between two looks
    assert look(0) == 2, "an entry added since the clock started restarts it"
    assert look(60_000) == 2, "not idle long enough"
    assert look(0) == 3
    assert not r.sismember(keys.queued_tenants, "t") and not any(r.exists(s) for s in streams)
    assert not r.hexists(keys.idle_tenants, "t")
    assert look(0) == 0  # not queued any more: nothing to do
    # the ensure script makes a queued tenant's streams (with the group), never a retired one's
    ensure = scripts.ensure_tenant
    assert int(ensure(keys=[keys.queued_tenants, *streams], args=["t", keys.group])) == 0
    assert not any(r.exists(s) for s in streams)
    r.sadd(keys.queued_tenants, "t")
    r.xadd(streams[2], {"id": "l"})  # a producer's plain add made this one again, without the group
    assert int(ensure(keys=[keys.queued_tenants, *streams], args=["t", keys.group])) == 1
    assert all(r.xinfo_groups(s)[0]["name"] == keys.group.encode() for s in streams)
    assert r.xreadgroup(keys.group, "c", {streams[2]: ">"})[0][1][0][1] == {b"id": b"l"}  # read from its start


@pytest.mark.unit
def test_a_retired_tenants_stream_is_gone_and_a_default_streams_is_lost_data():
    keys = Keys("ns")
    nogroup = "NOGROUP No such key '{}' or consumer group 'workers' in XREADGROUP with GROUP option"
    assert gone(redis.ResponseError(nogroup.format(keys.stream(32, tenant="acme"))))
    assert gone(redis.ResponseError("UNBLOCKED the stream key no longer exists"))
    assert not gone(redis.ResponseError(nogroup.format(keys.stream(32))))
    assert not gone(redis.ResponseError("NOPERM this user has no permissions"))
    assert not gone(redis.ConnectionError("reset"))
