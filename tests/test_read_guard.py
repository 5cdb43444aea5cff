"""The reply guard and the recovery after it (worker/transport/reply_guard.py, worker/transport/delivered.py,
worker/transport/bounded.py),
on the machine's Redis 7 and the bundled 6.2: a read is plain XREADGROUPs whose replies are capped while they
are parsed; one that passes the cap (a huge field, millions of small fields, many medium entries) is cut off
with its connection, and what it delivered is recovered inside Redis: every entry once, too-large ones cut
down, none the worker already holds; the worker's memory stays bounded and the client works on."""

from __future__ import annotations

import threading
import tracemalloc
import uuid

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.worker.devtools import delete_namespace
from batchfleet.worker.transport import bounded
from batchfleet.worker.transport.consumer import StreamConsumer

HUGE = 48 << 20  # one field far past the guard's limit (below a recovery's 64 MiB scan budget)
MANY = 300_000  # empty fields: ~19 MB at the guard's 64 bytes an element, a few MB on the wire
HOLD_MB = 16  # what one read may allocate (tracemalloc peak), against 64 MB+ without the guard


@pytest.fixture(params=[3, 2], ids=["resp3", "resp2"])
def consumers(request, any_redis_url):
    """(make consumer, keys, raw client) on both protocols (redis-py here speaks RESP3 unless told 2)."""
    ns = f"rg-{uuid.uuid4().hex[:6]}"
    conn = ConnectionConfig(redis_url=f"{any_redis_url}?protocol={request.param}", namespace=ns)

    def make(name: str, buckets=(32, 64)) -> StreamConsumer:
        c = StreamConsumer(conn, buckets, name, 60)
        c.setup()
        return c

    raw = redis.Redis.from_url(any_redis_url)
    yield make, Keys(ns), raw
    delete_namespace(any_redis_url, ns)


def _fields(job: str, size: int = 10) -> dict:
    return {"id": job, "r": "bf:inbox:" + "x" * 22, "p": b"\x00" * size}


def _huge(job: str) -> dict:
    return {"id": job, "r": "bf:inbox:" + "x" * 22, "p": b"\x00" * HUGE}


def _many(job: str) -> dict:
    return {"id": job, "r": "bf:inbox:" + "x" * 22, **{f"f{i}": b"" for i in range(MANY)}}


def _read_all(c: StreamConsumer, count=10) -> list:
    out, got = [], c.read(count=count, block_ms=None)
    while got:
        out += got
        got = c.read(count=count, block_ms=None)
    return out


def _peak_mb(call):
    tracemalloc.start()
    try:
        out = call()
        return out, tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_one_huge_field_trips_the_guard_and_comes_back_cut_down(consumers):
    make, keys, r = consumers
    c = make("a")
    r.xadd(keys.stream(32), _fields("small1"))
    r.xadd(keys.stream(32), _huge("huge"))
    r.xadd(keys.stream(32), _fields("small2", 1000))
    got, peak = _peak_mb(lambda: _read_all(c))
    assert [e.fields[b"id"] for e in got] == [b"small1", b"huge", b"small2"]
    huge = got[1]
    assert huge.oversize > HUGE and len(huge.fields[b"p"]) == bounded.KEEP_BYTES and huge.deliveries == 1
    assert got[0].oversize == 0 and got[2].oversize == 0 and len(got[2].fields[b"p"]) == 1000
    assert peak < HOLD_MB, f"one read allocated {peak:.0f} MB"
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 3  # all stay pending until answered


def test_an_entry_of_many_small_fields_trips_the_guard_too(consumers):
    make, keys, r = consumers
    c = make("a")
    r.xadd(keys.stream(64), _many("many"))
    r.xadd(keys.stream(64), _fields("after"))
    got, peak = _peak_mb(lambda: _read_all(c))
    assert [e.fields[b"id"] for e in got] == [b"many", b"after"]
    assert got[0].oversize > 0 and len(got[0].fields) == bounded.KEEP_FIELDS // 2 and got[1].oversize == 0
    assert peak < HOLD_MB, f"one read allocated {peak:.0f} MB"


def test_medium_entries_past_the_budget_come_back_whole_a_budget_at_a_time(consumers):
    make, keys, r = consumers
    c = make("a")
    for i in range(12):
        r.xadd(keys.stream(32), _fields(f"m{i}", 900_000))  # under the entry limit: whole
    r.xadd(keys.stream(64), _fields("other"))
    calls = []
    got = c.read(count=16, block_ms=None)
    while got:
        calls.append(got)
        got = c.read(count=16, block_ms=None)
    assert [e.fields[b"id"] for call in calls for e in call] == [f"m{i}".encode() for i in range(12)] + [b"other"]
    assert all(e.oversize == 0 and len(e.fields[b"p"]) in (10, 900_000) for call in calls for e in call)
    for call in calls:  # what one call holds: the recovery's budget plus the entry that crosses it
        assert sum(len(e.fields[b"p"]) for e in call) <= bounded.READ_BUDGET_BYTES + bounded.MAX_ENTRY_BYTES
    assert len(calls) == 3


def test_every_delivered_entry_is_recovered_once_at_every_priority(consumers):
    make, keys, r = consumers
    c = make("a")
    kinds = {}
    for priority in ("interactive", "background"):
        for b in (32, 64):
            stream = keys.stream(b, priority)
            for kind, fields in (("s", _fields), ("h", _huge), ("m", _many), ("t", _fields)):
                job = f"{kind}-{b}-{priority}"
                kinds[job] = kind
                r.xadd(stream, fields(job))
    got = _read_all(c, count={"interactive": 10, "background": 10})
    ids = [e.fields[b"id"].decode() for e in got]
    assert sorted(ids) == sorted(kinds)  # each exactly once
    assert all((e.oversize > 0) == (kinds[e.fields[b"id"].decode()] in "hm") for e in got)
    assert all(len(v) <= bounded.KEEP_BYTES for e in got for v in e.fields.values())
    assert all(e.deliveries == 1 for e in got)  # the recovery is no second delivery
    assert sum(r.xpending(keys.stream(b, priority), keys.group)["pending"]
               for b in (32, 64) for priority in ("interactive", "background")) == 16


def test_entries_already_held_are_not_returned_again(consumers):
    make, keys, r = consumers
    c, dead = make("a"), make("dead")
    stream = keys.stream(32)
    r.xadd(stream, _fields("mine"))
    assert [e.fields[b"id"] for e in c.read(count=10, block_ms=None)] == [b"mine"]  # held by the worker
    r.xadd(stream, _fields("r1"))
    r.xadd(stream, _fields("r2"))
    assert len(dead.read(count=10, block_ms=None)) == 2  # delivered to a worker that then dies
    # reclaimed (with our own "mine": min_idle_ms=0): pending on us now, r1 and r2 with ids above everything a
    # read of ours handed over
    assert sorted(e.fields[b"id"] for e in c.pending.reclaim(min_idle_ms=0, budget=10)) == [b"mine", b"r1", b"r2"]
    r.xadd(stream, _huge("huge"))
    r.xadd(stream, _fields("new"))
    got = c.read(count=10, block_ms=None)  # trips: the recovery looks at our pending entries
    assert [(e.fields[b"id"], e.oversize > 0) for e in got] == [(b"huge", True), (b"new", False)]
    assert c.read(count=10, block_ms=None) == []
    assert r.xpending(stream, keys.group)["consumers"] == [{"name": b"a", "pending": 5}]


def test_the_blocking_read_is_guarded_and_recovered(consumers):
    make, keys, r = consumers
    c = make("a")
    adder = threading.Timer(0.2, lambda: r.xadd(keys.stream(32), _huge("huge")))
    adder.start()  # arrives while the read blocks
    got = c.read(count=4, block_ms=1500)
    adder.join()
    assert [(e.fields[b"id"], e.oversize > HUGE) for e in got] == [(b"huge", True)]
    r.xadd(keys.stream(32), _fields("next"))
    assert [e.fields[b"id"] for e in c.read(count=4, block_ms=900)] == [b"next"]


def test_the_client_works_on_after_a_trip(consumers):
    make, keys, r = consumers
    c = make("a")
    r.xadd(keys.stream(32), _huge("huge"))
    assert [e.oversize > 0 for e in c.read(count=4, block_ms=None)] == [True]
    assert c.r.ping() and c.read(count=4, block_ms=None) == []
    c.presence.heartbeat({"ok": 1})  # a script on the same client
    r.xadd(keys.stream(32), _fields("after"))
    assert [e.fields[b"id"] for e in c.read(count=4, block_ms=None)] == [b"after"]
    assert not c.reader.delivered.owes()


def test_a_lost_group_forgets_what_was_owed(consumers):
    make, keys, r = consumers
    c = make("a")
    c.reader.delivered.owe({keys.stream(32): "0-0"})
    r.delete(keys.stream(32), keys.stream(64))
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        c.read(count=4, block_ms=None)
    assert not c.reader.delivered.owes()
    c.recover()  # what the loop does on NOGROUP
    r.xadd(keys.stream(32), _fields("again"))
    assert [e.fields[b"id"] for e in c.read(count=4, block_ms=None)] == [b"again"]
