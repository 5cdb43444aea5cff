"""A fleet sharded over the masters of a real local Redis Cluster (``--shards 3``, common/keys.py): each
shard's keys on its own master, requests spread over them by backlog, and the single-tag fleet's guarantees
held across shards: answers, streaming, cancel, deadlines, both priorities, status, the gateway, KEDA's count
(a worker killed -9, a master's failover and the ACL users run sharded in tests/test_cluster.py and
tests/test_cluster_acl.py)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import Timeout
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.producer import Client
from batchfleet.producer.ops.status import snapshot
from batchfleet.worker.transport.scripts import WorkerScripts
from tests.helpers.cluster import answers_streams_and_cancels, module_cluster_url
from tests.helpers.loops import beside, wait_until

pytestmark = pytest.mark.integration
SHARDS = 3


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """This module's fleets run on a private 3-master cluster (it overrides the suite's Redis)."""
    yield from module_cluster_url()


def _layout(url: str, namespace: str):
    return ConnectionConfig(url, namespace).keys.with_shards(SHARDS)


def test_each_shard_of_a_fleet_lives_on_its_own_master(redis_url, namespace):
    keys = _layout(redis_url, namespace)
    r = sync_client(redis_url)
    try:
        nodes = {r.get_node_from_key(k.workers).name for k in keys.every_shard}
    finally:
        r.close()
    assert len(nodes) == SHARDS
    assert keys.prefix == f"{{{namespace}}}"  # shard 0 is the single-tag fleet's own tag


def test_a_sharded_fleet_answers_streams_and_cancels_over_every_shard(redis_url, namespace, start_worker):
    start_worker(max_wait_ms=10, max_batch_size=8, shards=SHARDS)
    keys = _layout(redis_url, namespace)
    r = sync_client(redis_url)
    with Client(redis_url, namespace) as client, Client(redis_url, namespace) as other:
        answers_streams_and_cancels(client, other, namespace, 24)
        assert client.reply_key.startswith(keys.of_shard(keys.home_shard(client.reply_key.rsplit(":", 1)[1])).prefix)
    batches = [f for _, f in r.xrange(keys.batches)]
    r.close()
    assert batches, "no batch record on shard 0"
    # every shard served requests: the producer spread them by backlog
    snap = snapshot(sync_client(redis_url), ConnectionConfig(redis_url, namespace).keys)
    assert snap["fleet"]["shards"] == SHARDS and all(q["length"] == 0 for q in snap["queues"])


def test_requests_spread_over_the_shards_and_status_sums_them(redis_url, namespace, start_worker):
    """With no worker live (a fleet that scales to zero), the backlog stays where producers put it: spread
    over the shards, and ``status`` sums it; a worker started later answers every shard's requests, of both
    classes, and a request whose deadline passed meanwhile with ``deadline_exceeded``."""
    keys = _layout(redis_url, namespace)
    config = {"max_wait_ms": 10, "max_batch_size": 8, "shards": SHARDS, "scale_to_zero": True}
    w = start_worker(**config)
    with Client(redis_url, namespace) as client:
        client.generate([1, 2, 3], max_new_tokens=2, timeout=60)
        w.stop()
        jobs = [client.submit([10 + i, 11], max_new_tokens=4, timeout=120) for i in range(30)]
        background = [client.submit([20 + i, 21], max_new_tokens=3, timeout=120, priority="background")
                      for i in range(6)]
        late = client.submit([7, 8], max_new_tokens=4, timeout=1.0)  # its deadline passes before any worker runs
        r = sync_client(redis_url)
        try:
            lengths = [r.xlen(k.stream(32)) for k in keys.every_shard]
            snap = snapshot(r, ConnectionConfig(redis_url, namespace).keys)
        finally:
            r.close()
        assert sum(lengths) == 31 and min(lengths) >= 8, lengths  # the 30 and the late one
        queued = {(q["bucket"], q["priority"]): q for q in snap["queues"]}
        assert queued[32, "interactive"]["length"] == queued[32, "interactive"]["depth"] == 31
        assert queued[32, "background"]["length"] == 6
        time.sleep(1.2)
        start_worker(**config)
        assert all(len(client.result(j, timeout=120).token_ids) == 4 for j in jobs)
        assert all(len(client.result(j, timeout=120).token_ids) == 3 for j in background)  # background, every shard
        with pytest.raises(Timeout, match="deadline passed before the request was scheduled"):
            client.result(late, timeout=120)


def test_the_gateway_serves_a_sharded_fleet_to_the_openai_client(redis_url, namespace, start_worker, start_gateway):
    import openai

    start_worker(max_wait_ms=10, shards=SHARDS)
    gw = start_gateway()
    api = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = api.models.list().data[0].id
    outs = [api.completions.create(model=model, prompt=f"hello {i}", max_tokens=5, temperature=0) for i in range(6)]
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 5 for o in outs)
    chunks = list(api.completions.create(model=model, prompt="hello 0", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == outs[0].choices[0].text


def test_kedas_triggers_over_every_shard_count_every_unanswered_request(redis_url, namespace, start_worker,
                                                                      tmp_path):
    """deploy/k8s rendered for a 3-shard cluster fleet (scripts/k8s_redis.py, BATCHFLEET_SHARDS 3): KEDA's
    arithmetic over the demand the gateway exports (every shard's streams, producer/ops/demand.py), with 8
    requests a worker, asks for >= 2 workers for 17 requests, counts each unanswered one (and, for a moment, answered
    ones whose entries are still being acked on another shard than their inbox's: one batch at most), 0 when
    all are answered."""
    import shutil

    from scripts.k8s_redis import write
    from tests.helpers.deploy import K8S, render
    from tests.helpers.keda import for_fleet
    from tests.test_keda_signal import assert_backlog_counted

    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("secret.env"))
    config = k8s / "config.yaml"
    config.write_text(config.read_text().replace('BATCHFLEET_SHARDS: "1"', f'BATCHFLEET_SHARDS: "{SHARDS}"'))
    write(redis_url, k8s)
    (shipped,) = [d for d in render(k8s) if d["kind"] == "ScaledObject"]
    so = for_fleet(shipped)
    so["spec"]["advanced"]["scalingModifiers"]["target"] = "8"
    start_worker(max_batch_size=4, max_running=4, shards=SHARDS)
    r = sync_client(redis_url)
    try:
        assert_backlog_counted(redis_url, namespace, r, so, 17, 200, settling=4)
    finally:
        r.close()


def test_an_entry_a_waiter_reads_after_the_loop_stopped_waiting_is_taken_or_released(redis_url, namespace):
    """The loop waits 50 ms and gives up; the shards' waiters stay blocked (2 s). An entry arriving then is read
    by its shard's waiter anyway: the loop's next read takes it; one not taken within LATE_S is released by the
    lease keeper's ``alive`` (no longer offered, pending with a lapsed lease) and comes back through reclaim."""
    from batchfleet.worker.transport.shard_waiters import LATE_S
    from batchfleet.worker.transport.sharded import ShardedConsumer

    keys = _layout(redis_url, namespace)
    t = ShardedConsumer(ConnectionConfig(redis_url, namespace), keys, (32,), f"w-{namespace}", 60, claim_idle_ms=1000)
    r = sync_client(redis_url)
    try:
        t.setup()
        for late in (False, True):
            assert t.read(4, 50) == []  # the waiters are still blocked on their shards after this
            stream = keys.of_shard(2).stream(32)
            entry_id = r.xadd(stream, {"id": f"j{late}", "r": "x", "p": "y"}).decode()
            wait_until(lambda: t.waiters.held(), 5, "the shard's waiter reading the entry")
            if not late:
                assert [(e.entry_id, e.shard) for e in t.read(4, None)] == [(entry_id, 2)]
                continue
            time.sleep(LATE_S)
            t.presence.alive()
            assert t.read(4, None) == [] and r.xpending(stream, keys.group)["pending"] == 2
            assert [(e.entry_id, e.shard) for e in t.pending.reclaim(1000, 10)] == [(entry_id, 2)]
    finally:
        t.close()
        r.close()


def test_new_tenants_on_every_shard_are_heard_at_once(redis_url, namespace, start_worker, monkeypatch):
    """The tenant bell of each shard wakes the worker's waiter on it (worker/transport/shard_waiters.py): with the
    periodic look at the tenants' sets switched off, new tenants' requests, spread over the shards, are answered."""
    from batchfleet.worker.transport import consumer

    monkeypatch.setattr(consumer, "TENANTS_CHECK_S", 3600.0)
    start_worker(max_wait_ms=5, shards=SHARDS)
    with Client(redis_url, namespace) as client:
        assert client.generate([1, 10, 11], max_new_tokens=2, timeout=60).completion_tokens == 2
        for i in range(6):
            client._async.tenant = f"new{i}"  # the client's own parameter is the edge's; the core takes it here
            assert client.generate([1, 12 + i, 13], max_new_tokens=2, timeout=30).completion_tokens == 2
    r = sync_client(redis_url)
    try:
        keys = _layout(redis_url, namespace)
        heard = {t for k in keys.every_shard for t in r.smembers(k.queued_tenants)}
        assert heard == {f"new{i}".encode() for i in range(6)}
    finally:
        r.close()


def test_an_idle_tenant_is_retired_on_every_shard_it_queued_on_and_answered_again(redis_url, namespace,
                                                                                   start_worker, caplog):
    """A tenant's backlog spread over the shards (no worker live) is answered, then the tenant, idle, is retired on
    each shard by the sharded worker's sweeps (worker/transport/tenant_gc.py): its streams there go, the shards'
    queued-tenants sets forget it; its next request is answered."""
    keys = _layout(redis_url, namespace)
    config = {"max_wait_ms": 10, "max_batch_size": 8, "shards": SHARDS, "scale_to_zero": True, "tenant_idle_s": 0.5}
    w = start_worker(**config)
    r = sync_client(redis_url)
    with Client(redis_url, namespace, tenant="brief") as client:
        client.generate([1, 2, 3], max_new_tokens=2, timeout=60)
        w.stop()
        jobs = [client.submit([10 + i, 11], max_new_tokens=2, timeout=120) for i in range(24)]
        on = [k for k in keys.every_shard if r.sismember(k.queued_tenants, "brief")]
        assert len(on) >= 2, "the backlog spread over several shards"
        start_worker(**config)
        assert all(len(client.result(j, timeout=120).token_ids) == 2 for j in jobs)
        wait_until(lambda: not any(r.sismember(k.queued_tenants, "brief") for k in keys.every_shard), 30,
                   "the idle tenant's retirement on every shard")
        streams = [k.stream(b, p, "brief") for k in keys.every_shard for b in (32, 64, 128, 256)
                   for p in ("interactive", "background")]
        assert not any(r.exists(s) for s in streams)
        assert len(client.generate([4, 5, 6], max_new_tokens=2, timeout=60).token_ids) == 2
    r.close()
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]


def test_no_request_is_lost_while_tenants_are_retired_under_a_sharded_worker(redis_url, namespace, start_worker,
                                                                            caplog):
    """tests/test_tenant_retirement.py's race on a sharded fleet: the waiters' blocking reads meet the retired
    streams (UNBLOCKED, NOGROUP) on their own threads, and a tenant retired and queued again between two of the
    loop's looks must still be read (its stream made again by a plain add, without the group)."""
    keys = _layout(redis_url, namespace)
    start_worker(max_wait_ms=10, max_batch_size=8, shards=SHARDS, scale_to_zero=True, tenant_idle_s=0.05)
    r = sync_client(redis_url)
    retire = WorkerScripts(r).retire_tenant
    tenants = [f"race{i}" for i in range(4)]
    retired = [0]

    def retirer(stop: threading.Event) -> None:
        while not stop.is_set():
            for k in keys.every_shard:
                for t in tenants:
                    streams = [k.stream(b, p, t) for p in PRIORITIES for b in (32, 64, 128, 256)]
                    retired[0] += int(retire(keys=[k.queued_tenants, k.idle_tenants, *streams], args=[t, 0])) == 3
            time.sleep(0.001)

    def sender(tenant: str, seed: int, out: list) -> None:
        rng = random.Random(seed)
        with Client(redis_url, namespace, tenant=tenant) as c:
            for i in range(10):
                time.sleep(rng.choice((0.0, 0.01, 0.05, 0.3)))
                out.append(len(c.generate([10 + i, 11 + seed], max_new_tokens=2, timeout=120).token_ids))

    try:
        results = beside(retirer, tenants, sender)
    finally:
        r.close()
    assert all(results[t] == [2] * 10 for t in tenants), results
    assert retired[0] >= len(tenants)
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]


def test_a_bell_deleted_on_every_shard_is_made_again_without_taking_it_for_lost_data(redis_url, namespace,
                                                                                      start_worker, caplog,
                                                                                      monkeypatch):
    """An operator deletes every shard's tenant bell under the waiters' blocking reads: each shard's bell is made
    again (no 'Redis lost its data' recovery), and new tenants over the shards are heard at once again."""
    from batchfleet.worker.transport import consumer

    keys = _layout(redis_url, namespace)
    w = start_worker(max_wait_ms=5, shards=SHARDS)
    r = sync_client(redis_url)
    try:
        with Client(redis_url, namespace) as client:
            assert client.generate([1, 10, 11], max_new_tokens=2, timeout=60).completion_tokens == 2
            for k in keys.every_shard:
                r.delete(k.tenant_bell)
            wait_until(lambda: all(r.exists(k.tenant_bell) for k in keys.every_shard), 10, "every bell made again")
            monkeypatch.setattr(consumer, "TENANTS_CHECK_S", 3600.0)  # heard by the bell alone from now on
            for i in range(6):
                client._async.tenant = f"rebell{i}"
                assert client.generate([1, 12 + i, 13], max_new_tokens=2, timeout=30).completion_tokens == 2
    finally:
        r.close()
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert w.loop.ledger.get("internal_errors", 0) == 0
