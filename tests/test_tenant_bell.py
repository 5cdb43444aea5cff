"""A tenant new to the fleet is heard at once (the tenant bell, ``Keys.tenant_bell``), with a real worker and real
Redis: the worker's periodic look at the tenants' set is switched off (``TENANTS_CHECK_S``), so each request
below is answered only because its enqueue rang and the worker's read (blocking while idle, not blocking while
the engine runs) took the ring. Before the bell a new tenant's first request waited for that look (0.8 s on
average, up to 3 s on an idle worker), and the first read naming the tenant's other streams, not made yet, failed
as if Redis had lost its data (every group re-created, a warning logged)."""

from __future__ import annotations

import logging

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.transport import consumer
from batchfleet.worker.transport.consumer import StreamConsumer
from tests.conftest import TEST_BUCKETS
from tests.helpers.loops import wait_until

NATIVE = dict(engine="native", mode="continuous", max_wait_ms=5)


@pytest.fixture
def no_periodic_look(monkeypatch):
    monkeypatch.setattr(consumer, "TENANTS_CHECK_S", 3600.0)


def as_tenant(client: Client, tenant: str) -> Client:
    client._async.tenant = tenant  # the client's own parameter is the edge's (issue 57); the core takes it here
    return client


def test_an_idle_worker_answers_a_new_tenant_without_looking_at_the_set(no_periodic_look, start_worker, redis_url,
                                                                        namespace, caplog):
    start_worker(**NATIVE)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        assert client.generate([1, 10, 11], max_new_tokens=2, timeout=60).completion_tokens == 2  # the worker idles
        for tenant in ("first", "second"):
            with caplog.at_level(logging.WARNING):
                got = as_tenant(client, tenant).generate([1, 12, 13], max_new_tokens=2, timeout=30)
            assert got.completion_tokens == 2
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert r.xlen(keys.tenant_bell) == 0  # each ring deleted once heard
    assert r.smembers(keys.queued_tenants) == {b"first", b"second"}


def test_a_busy_worker_answers_a_new_tenant_while_its_engine_runs(no_periodic_look, start_worker, redis_url,
                                                                  namespace):
    start_worker(**NATIVE)
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as old, as_tenant(Client(redis_url, namespace), "newcomer") as new:
        long = old.submit([1, 10, 11], max_new_tokens=500, ignore_eos=True)
        wait_until(lambda: r.xpending(keys.stream(32), keys.group)["pending"] == 1, 60, "the long request read")
        assert new.generate([1, 12, 13], max_new_tokens=2, timeout=60).completion_tokens == 2
        assert not r.exists(keys.done(long, old.reply_key))  # heard while the engine still ran the long one
        old.cancel(long)


def test_a_tenant_the_set_lost_rings_again(no_periodic_look, start_worker, redis_url, namespace):
    """The set lost the tenant (Redis restarted without it, or an operator removed it): the next enqueue, plain add
    or function, adds it again and rings; a worker that started after the loss hears it."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    first = start_worker(**NATIVE)
    with as_tenant(Client(redis_url, namespace), "returning") as client:
        assert client.generate([1, 12, 13], max_new_tokens=2, timeout=60).completion_tokens == 2
        first.stop()
        r.srem(keys.queued_tenants, "returning")
        start_worker(**NATIVE)  # its start reads the set: no "returning" there
        assert client.generate([1, 14, 15], max_new_tokens=2, timeout=60).completion_tokens == 2
    assert r.sismember(keys.queued_tenants, "returning")


def test_a_deleted_bell_is_made_again_without_taking_it_for_lost_data(no_periodic_look, start_worker, redis_url,
                                                                      namespace, caplog):
    """An operator deletes the bell under an idle worker's blocking read: the worker makes it again (no 'Redis lost
    its data' warning, no re-join) and hears the next new tenant's ring."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    w = start_worker(**NATIVE)
    with Client(redis_url, namespace) as client, caplog.at_level(logging.INFO):
        assert client.generate([1, 10, 11], max_new_tokens=2, timeout=60).completion_tokens == 2  # the worker idles
        r.delete(keys.tenant_bell)
        wait_until(lambda: r.exists(keys.tenant_bell), 10, "the bell made again")
        got = as_tenant(client, "after-delete").generate([1, 12, 13], max_new_tokens=2, timeout=30)
    assert got.completion_tokens == 2
    assert not [rec for rec in caplog.records if "consumer groups are gone" in rec.getMessage()]
    assert w.loop.ledger.get("internal_errors", 0) == 0


def test_no_consumer_name_stays_on_the_bell_after_a_worker_stops_or_dies(no_periodic_look, start_worker, redis_url,
                                                                        namespace):
    """A stopped worker drops its name from the bell's group, and a dead one's name goes with the next prune even
    with a ring pending on it (nothing reclaims a ring): the group does not grow with every restart."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    r.xgroup_create(keys.tenant_bell, keys.group, id="0", mkstream=True)
    r.xadd(keys.tenant_bell, {"t": "rung-before"})
    r.xreadgroup(keys.group, "dead-worker", {keys.tenant_bell: ">"}, count=1)  # died before acking it
    first = start_worker(**NATIVE)
    with as_tenant(Client(redis_url, namespace), "rings") as client:
        assert client.generate([1, 12, 13], max_new_tokens=2, timeout=60).completion_tokens == 2
    first.stop()
    names = {c["name"].decode() for c in r.xinfo_consumers(keys.tenant_bell, keys.group)}
    assert names == {"dead-worker"}, names
    second = start_worker(**NATIVE)
    wait_until(lambda: r.xinfo_consumers(keys.tenant_bell, keys.group), 30, "the second worker reading the bell")
    assert second.loop.transport.pending.prune_consumers(0) >= 1  # type: ignore[attr-defined]
    names = {c["name"].decode() for c in r.xinfo_consumers(keys.tenant_bell, keys.group)}
    assert names <= {second.loop.transport.name}, names  # type: ignore[attr-defined]
    assert r.xpending(keys.tenant_bell, keys.group)["pending"] == 0


def test_a_ring_a_failed_read_left_pending_on_a_live_worker_is_acked_at_its_prune(redis_url, namespace):
    """A read that failed or was cut off after the bell's part delivered (a several-command read, the reply guard)
    leaves the ring pending on the live worker, never acked: its next prune acks and deletes it, so the bell's
    pending list does not grow (trimming the bell keeps PEL entries)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    worker = StreamConsumer(ConnectionConfig(redis_url=redis_url, namespace=namespace), TEST_BUCKETS, "w1", 60)
    try:
        worker.setup()
        r.xadd(keys.tenant_bell, {"t": "lost"})
        assert r.xreadgroup(keys.group, "w1", {keys.tenant_bell: ">"}, count=1)  # delivered, the read then failed
        assert r.xpending(keys.tenant_bell, keys.group)["pending"] == 1
        worker.pending.prune_consumers(3_600_000)
        assert r.xpending(keys.tenant_bell, keys.group)["pending"] == 0
        assert r.xlen(keys.tenant_bell) == 0
    finally:
        worker.close()


def test_a_read_whose_ring_cannot_be_acked_still_hands_over_its_entries():
    """The read took a request and a ring, then deleting the ring failed (here an ACL without ``XDEL`` on the bell,
    as a lost connection would): the request is handed over all the same, not left pending unseen until a reclaim."""
    from tests.helpers.acl import start_redis7

    server = start_redis7()
    try:
        admin = redis.Redis(port=server.port)
        admin.execute_command("ACL", "SETUSER", "w", "on", ">pw", "~*", "+@all", "-xdel", "(~ns:stream:* +xdel)")
        keys = Keys("ns")
        worker = StreamConsumer(ConnectionConfig(redis_url=f"redis://w:pw@127.0.0.1:{server.port}/0", namespace="ns"),
                                TEST_BUCKETS, "w1", 60)
        worker.setup()
        admin.xadd(keys.stream(32), {"id": "job1", "r": "inbox", "p": "x"})
        admin.xadd(keys.tenant_bell, {"t": "new"})
        got = worker.read(4, None)
        assert [e.fields[b"id"] for e in got] == [b"job1"]
        worker.close()
    finally:
        server.stop()


def test_a_burst_of_rings_is_heard_in_a_few_reads(redis_url, namespace):
    """300 new tenants ring at once: the read that hears the first ring takes the rest with it (one look at the set
    covers them all), instead of one ring, and one look at the whole set, per read (40 s of them after 1000)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    worker = StreamConsumer(ConnectionConfig(redis_url=redis_url, namespace=namespace), TEST_BUCKETS, "w1", 60)
    try:
        worker.setup()
        pipe = r.pipeline(transaction=False)
        for i in range(300):
            pipe.xadd(keys.tenant_bell, {"t": f"burst{i}"})
        pipe.execute()
        reads = 0
        while r.xlen(keys.tenant_bell) and reads < 300:
            worker.read(4, None)
            reads += 1
        assert r.xlen(keys.tenant_bell) == 0 and reads <= 3, reads
        assert r.xpending(keys.tenant_bell, keys.group)["pending"] == 0
    finally:
        worker.close()


def test_a_fleet_whose_redis_lost_everything_hears_a_cached_tenant_again(start_worker, redis_url, namespace):
    """Redis loses every key of the fleet (a restart without persistence; here the namespace's keys deleted) while a
    tenant is queued and a client still takes its stream for made (its plain add makes the stream again without the
    group, adds the tenant and rings a bell that has no group yet): the worker re-creates its groups, the bell's
    among them (from 0: the ring is heard), and answers the tenant."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    start_worker(**NATIVE, scale_to_zero=True)  # no live-worker check: the client's next add is a plain one
    with as_tenant(Client(redis_url, namespace), "survivor") as client:
        for _ in range(2):
            assert client.generate([1, 12, 13], max_new_tokens=2, timeout=60).completion_tokens == 2
        for key in r.scan_iter(f"{namespace}:*"):
            r.delete(key)
        assert client.generate([1, 14, 15], max_new_tokens=2, timeout=60).completion_tokens == 2
    assert r.sismember(keys.queued_tenants, "survivor")
    assert [g["name"] for g in r.xinfo_groups(keys.tenant_bell)] == [keys.group.encode()]


def test_a_plain_add_whose_ring_is_cut_off_is_not_added_again(start_worker, redis_url, namespace):
    """The plain add of a tenant the set lost (its SADD answers 1) is in Redis when the connection drops as it
    rings: the ring is best effort (the workers' next look at the set finds the tenant), the add is not sent again
    (a second copy of the request)."""
    from urllib.parse import urlparse

    from tests.helpers.cutting_proxy import CuttingProxy

    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    url = urlparse(redis_url)
    proxy = CuttingProxy((url.hostname or "127.0.0.1", url.port or 6379))
    worker = start_worker(**NATIVE, scale_to_zero=True)  # no live-worker check: the second add is a plain one
    try:
        with as_tenant(Client(f"redis://127.0.0.1:{proxy.port}{url.path}", namespace), "cut") as client:
            assert client.generate([1, 12, 13], max_new_tokens=2, timeout=60).completion_tokens == 2
            worker.stop()  # what is added now stays queued
            r.srem(keys.queued_tenants, "cut")
            bell = keys.tenant_bell.encode()
            proxy.arm(b"XADD\r\n$%d\r\n%s\r\n" % (len(bell), bell))
            client.submit([1, 14, 15], max_new_tokens=2)
        assert proxy.cuts == 1
        streams = [keys.stream(b, p, "cut") for p in ("interactive", "background") for b in TEST_BUCKETS]
        assert sum(r.xlen(s) for s in streams) == 1
        assert r.sismember(keys.queued_tenants, "cut")
    finally:
        proxy.close()
