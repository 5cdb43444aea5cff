"""The worker's reads are bounded in memory whatever size entries have (worker/bounded.py), on the
machine's Redis 7 and the bundled 6.2: too-large entries come back cut short with their real size, whole
ones stay whole, one call stops at its byte budget, reclaim is bounded the same way. Transport only (no
model); the end-to-end RSS test with a worker process is in test_worker_memory_bound.py."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.worker import bounded
from batchfleet.worker.consumer import StreamConsumer
from batchfleet.worker.devtools import delete_namespace

BIG = 3 << 20  # > MAX_ENTRY_BYTES (1 MiB + 64 KiB)


@pytest.fixture
def consumers(any_redis_url):
    ns = f"br-{uuid.uuid4().hex[:6]}"
    conn = ConnectionConfig(redis_url=any_redis_url, namespace=ns)

    def make(name: str, buckets=(32, 64)) -> StreamConsumer:
        c = StreamConsumer(conn, buckets, name, 60)
        c.setup()
        return c

    yield make, Keys(ns), redis.Redis.from_url(any_redis_url)
    delete_namespace(any_redis_url, ns)


def _fields(job: str, size: int = 10, extra: int = 0) -> dict:
    out = {"id": job, "r": "bf:inbox:" + "x" * 22, "p": b"\x00" * size}
    out.update({f"f{i}": "v" for i in range(extra)})
    return out


def test_too_large_entries_come_back_cut_short_whole_ones_whole(consumers):
    make, keys, r = consumers
    c = make("a")
    r.xadd(keys.stream(32), _fields("small1"))
    r.xadd(keys.stream(32), _fields("big1", BIG))
    r.xadd(keys.stream(32), _fields("many", extra=40))  # 43 field pairs: too many
    r.xadd(keys.stream(64), _fields("small2", 1000))
    got = {e.fields[b"id"]: e for e in c.read(count=10, block_ms=None)}
    assert set(got) == {b"small1", b"big1", b"many", b"small2"}
    assert got[b"small1"].oversize == 0 and got[b"small1"].fields[b"p"] == b"\x00" * 10
    assert got[b"small2"].oversize == 0 and len(got[b"small2"].fields[b"p"]) == 1000
    big = got[b"big1"]
    assert big.oversize > BIG and len(big.fields[b"p"]) == bounded.KEEP_BYTES and big.fields[b"r"].startswith(b"bf:")
    assert got[b"many"].oversize > 0 and len(got[b"many"].fields) == bounded.KEEP_FIELDS // 2
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 3  # all read stay pending until answered


def test_one_read_stops_at_its_byte_budget(consumers, monkeypatch):
    make, keys, r = consumers
    c = make("a")
    for i in range(8):
        r.xadd(keys.stream(32), _fields(f"j{i}", 900_000))  # under the entry limit: returned whole
    first = c.read(count=8, block_ms=None)
    assert len(first) == 5  # 4 MiB budget: the 5th entry crosses it, the rest wait for the next call
    assert len(c.read(count=8, block_ms=None)) == 3


def test_blocking_read_takes_one_entry_and_cuts_it_down(consumers):
    make, keys, r = consumers
    c = make("a")
    adder = threading.Timer(0.2, lambda: r.xadd(keys.stream(32), _fields("big", BIG)))
    adder.start()  # arrives while the read blocks: the one entry read whole (then cut down at once)
    got = c.read(count=4, block_ms=900)
    adder.join()
    assert [e.fields[b"id"] for e in got] == [b"big"]
    assert got[0].oversize > BIG and len(got[0].fields[b"p"]) == bounded.KEEP_BYTES
    r.xadd(keys.stream(32), _fields("big2", BIG))
    r.xadd(keys.stream(32), _fields("next"))
    got = c.read(count=4, block_ms=900)  # entries already there: the script, no blocking read
    assert [(e.fields[b"id"], e.oversize > 0) for e in got] == [(b"big2", True), (b"next", False)]


def test_reclaim_is_bounded_too_and_keeps_delivery_counts(consumers):
    make, keys, r = consumers
    dead, live = make("dead"), make("live")
    for i in range(3):
        r.xadd(keys.stream(32), _fields(f"big{i}", BIG))
    gone = r.xadd(keys.stream(32), _fields("deleted"))
    r.xadd(keys.stream(32), _fields("small"))
    assert len(dead.read(count=10, block_ms=None)) == 5
    r.xdel(keys.stream(32), gone)  # deleted while pending (Redis 6.2 reports it as nil)
    got = live.reclaim(min_idle_ms=0, budget=10)
    by_id = {e.fields[b"id"]: e for e in got}
    assert set(by_id) == {b"big0", b"big1", b"big2", b"small"}
    assert all(by_id[f"big{i}".encode()].oversize > BIG for i in range(3)) and by_id[b"small"].oversize == 0
    assert all(len(v) <= bounded.KEEP_BYTES for e in got for v in e.fields.values())
    assert all(e.deliveries == 2 for e in got)
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 4


def test_a_lost_group_still_raises_nogroup(consumers):
    make, keys, r = consumers
    c = make("a")
    r.delete(keys.stream(32), keys.stream(64))
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        c.read(count=4, block_ms=None)


def _xreadgroups(r: redis.Redis) -> int:
    """XREADGROUP calls so far, those scripts make inside Redis included (INFO commandstats)."""
    return r.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)


def test_a_small_stream_is_read_at_once_a_long_one_an_entry_at_a_time(monkeypatch):
    from batchfleet.worker.devtools import PrivateRedis, free_port

    server = PrivateRedis(port=free_port()).start()  # its own command counts
    try:
        conn = ConnectionConfig(redis_url=server.url, namespace="br")
        c = StreamConsumer(conn, (32, 64), "a", 60)
        c.setup()
        keys, r = Keys("br"), redis.Redis.from_url(server.url)
        for i in range(20):
            r.xadd(keys.stream(32), _fields(f"j{i}", 300))
        before = _xreadgroups(r)
        got = c.read(count=20, block_ms=None)
        assert [e.fields[b"id"] for e in got] == [f"j{i}".encode() for i in range(20)]
        assert all(e.oversize == 0 and len(e.fields[b"p"]) == 300 for e in got)
        assert _xreadgroups(r) - before == 2  # the probe over both streams, then the other 19 at once

        monkeypatch.setattr(bounded, "MEASURED_ENTRIES", 30)  # a stream longer than this is not measured
        for i in range(40):
            r.xadd(keys.stream(32), _fields(f"k{i}", 300))
        before = _xreadgroups(r)
        got = c.read(count=20, block_ms=None)
        assert [e.fields[b"id"] for e in got] == [f"k{i}".encode() for i in range(20)]
        assert _xreadgroups(r) - before == 20  # the probe, then one entry at a time
        assert r.xpending(keys.stream(32), keys.group)["pending"] == 40  # read stays pending until answered
        c.close()
    finally:
        server.stop()
