"""The reply guard itself (worker/transport/reply_guard.py) on every kind of client the worker makes (plain over RESP2
and
RESP3, Redis Cluster, Sentinel): a reply past its limit raises ``ReplyTooLarge`` (no ConnectionError, no
ResponseError) before its body is read, the connection is dropped and the client works on; and the
bookkeeping that keeps a recovery from handing an entry over twice (worker/transport/delivered.py), pure."""

from __future__ import annotations

import subprocess
import tracemalloc
import uuid
from pathlib import Path

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.redis.clients import sync_client
from batchfleet.worker.devtools import PrivateRedis, free_port
from batchfleet.worker.transport.base import Entry
from batchfleet.worker.transport.consumer import StreamConsumer, connect
from batchfleet.worker.transport.delivered import Delivered
from batchfleet.worker.transport.reply_guard import ReplyTooLarge, guard, one_budget
from tests.helpers.acl import redis7_binary
from tests.helpers.cluster import PrivateCluster
from tests.helpers.loops import wait_until

LIMIT = 1 << 20


def _trips_and_recovers(r, raw: redis.Redis, key: str) -> None:
    """``r`` (guarded at LIMIT) refuses a big value, a list of many tiny items and a pipeline past one budget,
    and works on after each."""
    raw.set(f"{key}:big", b"x" * (32 << 20))
    raw.rpush(f"{key}:list", *range(100_000))  # ~0.6 MB on the wire, 6.4 MB at 64 bytes an element
    raw.set(f"{key}:small", b"y" * 1000)
    tracemalloc.start()
    with pytest.raises(ReplyTooLarge):
        r.get(f"{key}:big")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 << 20  # the 32 MB body was never read
    assert r.get(f"{key}:small") == b"y" * 1000
    with pytest.raises(ReplyTooLarge):
        r.lrange(f"{key}:list", 0, -1)
    assert r.lrange(f"{key}:list", 0, 9) == [str(i).encode() for i in range(10)]
    with one_budget(2500):  # each reply fits, the three together do not
        pipe = r.pipeline(transaction=False)
        for _ in range(3):
            pipe.get(f"{key}:small")
        with pytest.raises(ReplyTooLarge):
            pipe.execute()
    assert r.ping() and r.get(f"{key}:small") == b"y" * 1000
    raw.delete(f"{key}:big", f"{key}:list", f"{key}:small")


def test_the_exception_is_no_error_redis_py_would_retry_or_keep():
    assert issubclass(ReplyTooLarge, redis.RedisError)
    assert not issubclass(ReplyTooLarge, (redis.ConnectionError, redis.TimeoutError, redis.ResponseError))


@pytest.mark.parametrize("protocol", ["", "?protocol=2", "?protocol=3"])
def test_a_plain_client_on_either_protocol(redis_url, protocol):
    r = sync_client(redis_url + protocol, wrap_connection=guard(LIMIT))
    _trips_and_recovers(r, redis.Redis.from_url(redis_url), f"rg-{uuid.uuid4().hex[:6]}")
    conn = r.connection_pool.get_connection()
    try:  # the parser HELLO (or a fallback) switched to is guarded too
        assert type(conn._parser).__name__ == ("GuardedRESP2Parser" if protocol == "?protocol=2" else
                                               "GuardedRESP3Parser")
    finally:
        r.connection_pool.release(conn)


def test_the_workers_client_is_guarded(redis_url):
    r = connect(ConnectionConfig(redis_url=redis_url))
    conn = r.connection_pool.get_connection()
    try:
        assert type(conn).__name__ == "GuardedConnection" and type(conn._parser).__name__.startswith("Guarded")
    finally:
        r.connection_pool.release(conn)


def test_a_cluster_client_and_a_cluster_workers_read():
    cluster = PrivateCluster(masters=3).start()
    try:
        r = sync_client(cluster.url, wrap_connection=guard(LIMIT))
        _trips_and_recovers(r, sync_client(cluster.url), "{rg}")  # one hash tag: the pipeline on one node
        ns = f"rgc-{uuid.uuid4().hex[:6]}"
        c = StreamConsumer(ConnectionConfig(redis_url=cluster.url, namespace=ns), (32, 64), "a", 60)
        c.setup()
        stream = c.keys.stream(32)
        c.r.xadd(stream, {"id": "huge", "p": b"\x00" * (16 << 20)})
        c.r.xadd(stream, {"id": "small", "p": b"x"})
        c.r.xadd(c.keys.stream(64, "background"), {"id": "batch", "p": b"x"})
        got = c.read(count={"interactive": 4, "background": 2}, block_ms=None)  # two counts: one command each
        assert [(e.fields[b"id"], e.oversize > 0) for e in got] == [(b"huge", True), (b"small", False)]
        assert [e.fields[b"id"] for e in c.read(count={"interactive": 4, "background": 2}, block_ms=None)] == [b"batch"]
    finally:
        cluster.stop()


def test_a_sentinel_client(tmp_path: Path):
    primary = PrivateRedis(port=free_port(), binary=redis7_binary()).start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {tmp_path}\n"
                    f"sentinel monitor m 127.0.0.1 {primary.port} 1\n")
    sentinel = subprocess.Popen([redis7_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        probe = redis.Redis(port=port)
        wait_until(lambda: _answers(probe), 10, "the sentinel answers", every_s=0.1)
        r = sync_client(f"redis+sentinel://127.0.0.1:{port}/m/0", wrap_connection=guard(LIMIT))
        _trips_and_recovers(r, redis.Redis(port=primary.port), "rg")
        assert type(r.connection_pool.get_connection()).__name__ == "GuardedSentinelManagedConnection"
    finally:
        sentinel.kill()
        sentinel.wait(5)
        primary.stop()


def _answers(r: redis.Redis) -> bool:
    try:
        return bool(r.sentinel_get_master_addr_by_name("m"))
    except redis.RedisError:
        return False


# --- the bookkeeping (pure) -----------------------------------------------------------------------------

def _e(entry_id: str) -> tuple[str, Entry]:
    return "s", Entry(32, entry_id, {})


def _ids(entries: list[Entry]) -> list[str]:
    return [e.entry_id for e in entries]


@pytest.mark.unit
def test_a_recovery_starts_above_everything_handed_over_reclaims_included():
    d = Delivered()
    t, since = d.begin(["s"])
    assert since == {"s": "0-0"} and _ids(d.end(t, [_e("1-0"), _e("2-0")])) == ["1-0", "2-0"]
    d.held([_e("9-0")])  # a reclaim of an entry delivered to a dead worker: above our reads' ids
    t, since = d.begin(["s"])
    assert since == {"s": "9-0"}
    d.owe(since)
    d.end(t, [])  # tripped
    assert d.owes() and d.take_owed()[1] == {"s": "9-0"}


@pytest.mark.unit
@pytest.mark.parametrize("waiter_first", [True, False])
def test_two_threads_never_hand_an_entry_over_twice(waiter_first):
    """A sharded worker's waiter thread and loop read one shard at once: the loop's read trips and its recovery
    (from its floor) also finds the entry the waiter's read delivered, whichever of the two ends first."""
    d = Delivered()
    waiter, _ = d.begin(["s"])  # blocks
    loop, since = d.begin(["s"])
    d.owe(since)
    d.end(loop, [])  # tripped: recover above 0-0
    if waiter_first:
        assert _ids(d.end(waiter, [_e("5-0")])) == ["5-0"]
        token, owed = d.take_owed()
        assert _ids(d.end(token, [_e("3-0"), _e("5-0")])) == ["3-0"]
    else:
        token, owed = d.take_owed()
        assert _ids(d.end(token, [_e("3-0"), _e("5-0")])) == ["3-0", "5-0"]
        assert _ids(d.end(waiter, [_e("5-0")])) == []
    assert not d.owes() and not d._given  # nothing left to remember


@pytest.mark.unit
def test_a_lower_owed_cursor_wins_and_a_reset_forgets():
    d = Delivered()
    d.owe({"s": "7-0"})
    d.owe({"s": "4-0", "t": "1-0"})
    d.owe({"s": "6-0"})
    assert d.take_owed()[1] == {"s": "4-0", "t": "1-0"}
    d.owe({"s": "4-0"})
    d.reset()
    assert not d.owes() and d.begin(["s"])[1] == {"s": "0-0"}
