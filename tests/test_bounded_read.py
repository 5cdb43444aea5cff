"""The worker's reads are bounded in memory whatever size entries have (worker/transport/bounded.py), on the
machine's Redis 7 and the bundled 6.2: too-large entries come back cut short with their real size, whole
ones stay whole, one call returns at most its byte budget, reclaim is bounded the same way, and the common
read is plain XREADGROUPs. Transport only (no model); the reply guard and the recovery after it are tested in
test_read_guard.py, the end-to-end RSS test with a worker process is in test_worker_memory_bound.py."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.worker.devtools import delete_namespace
from batchfleet.worker.transport import bounded
from batchfleet.worker.transport.consumer import StreamConsumer

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


def test_one_read_stops_at_its_byte_budget(consumers):
    make, keys, r = consumers
    c = make("a")
    for i in range(8):
        r.xadd(keys.stream(32), _fields(f"j{i}", 900_000))  # under the entry limit: returned whole
    first = c.read(count=8, block_ms=None)  # 7.2 MB: past the reply guard, recovered inside Redis
    assert len(first) == 5  # 4 MiB budget: the 5th entry crosses it, the rest wait for the next call
    second = c.read(count=8, block_ms=None)
    assert [e.fields[b"id"] for e in first + second] == [f"j{i}".encode() for i in range(8)]
    assert all(e.oversize == 0 and len(e.fields[b"p"]) == 900_000 for e in first + second)
    assert c.read(count=8, block_ms=None) == []


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
    got = c.read(count=4, block_ms=900)  # entries already there: a plain read, no blocking read
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
    got = live.pending.reclaim(min_idle_ms=0, budget=10)
    by_id = {e.fields[b"id"]: e for e in got}
    assert set(by_id) == {b"big0", b"big1", b"big2", b"small"}
    assert all(by_id[f"big{i}".encode()].oversize > BIG for i in range(3)) and by_id[b"small"].oversize == 0
    assert all(len(v) <= bounded.KEEP_BYTES for e in got for v in e.fields.values())
    assert all(e.deliveries == 2 for e in got)
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 4


def test_a_reclaim_past_many_entries_deleted_while_pending_stays_under_the_reply_cap(consumers):
    """Entries deleted while pending (an operator's XTRIM of a backlog, a raw XADD MAXLEN) stay in Redis 6.2's PEL,
    and its XAUTOCLAIM reports each as nil: one reclaim returned every one of them, 40,000 nils past the reply
    guard's cap, so every reclaim tripped and the entries of dead workers behind them were never reclaimed."""
    make, keys, r = consumers
    live = make("live")
    pipe = r.pipeline(transaction=False)
    for i in range(40_000):
        pipe.xadd(keys.stream(32), {"id": f"j{i}"})
    pipe.execute()
    r.xreadgroup(keys.group, "dead", {keys.stream(32): ">"}, count=40_000)
    r.xtrim(keys.stream(32), maxlen=0, approximate=False)
    r.xadd(keys.stream(32), _fields("alive"))
    r.xreadgroup(keys.group, "dead", {keys.stream(32): ">"}, count=1)
    got = []
    for _ in range(200):
        got += live.pending.reclaim(min_idle_ms=0, budget=256)
        if got:
            break
    assert [e.fields[b"id"] for e in got] == [b"alive"]


def test_a_lost_group_still_raises_nogroup(consumers):
    make, keys, r = consumers
    c = make("a")
    r.delete(keys.stream(32), keys.stream(64))
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        c.read(count=4, block_ms=None)


def _calls(r: redis.Redis, command: str) -> int:
    """Calls of ``command`` so far, those scripts make inside Redis included (INFO commandstats)."""
    return r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_a_read_is_one_plain_xreadgroup_per_distinct_count():
    from batchfleet.worker.devtools import PrivateRedis, free_port

    server = PrivateRedis(port=free_port()).start()  # its own command counts
    try:
        conn = ConnectionConfig(redis_url=server.url, namespace="br")
        c = StreamConsumer(conn, (32, 64), "a", 60)
        c.setup()
        keys, r = Keys("br"), redis.Redis.from_url(server.url)
        for i in range(20):
            r.xadd(keys.stream(32), _fields(f"j{i}", 300))
            r.xadd(keys.stream(64, "background"), _fields(f"b{i}", 300))
        before = {cmd: _calls(r, cmd) for cmd in ("xreadgroup", "evalsha")}
        got = c.read(count=20, block_ms=None)  # every priority the same count: one command over the four streams
        assert [e.fields[b"id"] for e in got] == [f"j{i}".encode() for i in range(20)] + [
            f"b{i}".encode() for i in range(20)]  # interactive streams first
        assert all(e.oversize == 0 and len(e.fields[b"p"]) == 300 for e in got)
        assert _calls(r, "xreadgroup") - before["xreadgroup"] == 1
        for i in range(20, 30):
            r.xadd(keys.stream(32), _fields(f"j{i}", 300))
            r.xadd(keys.stream(64, "background"), _fields(f"b{i}", 300))
        got = c.read(count={"interactive": 3, "background": 5}, block_ms=None)  # two counts: two commands, 1 trip
        assert [e.fields[b"id"] for e in got] == [f"j{i}".encode() for i in range(20, 23)] + [
            f"b{i}".encode() for i in range(20, 25)]
        assert _calls(r, "xreadgroup") - before["xreadgroup"] == 3
        assert _calls(r, "evalsha") == before["evalsha"]  # no script on the common path
        assert r.xpending(keys.stream(32), keys.group)["pending"] == 23  # read stays pending until answered
        c.close()
    finally:
        server.stop()
