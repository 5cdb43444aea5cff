"""Issue #12 hardening, the parts that need Redis but no model: strict ids and namespaces (fullmatch),
fleet membership (fingerprint, join refusing a different live fleet, the fleet key's TTL, leave deleting
it), and releasing never-started entries to peers without counting a delivery (worker/requests/readahead.py)."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys, valid_job_id
from batchfleet.common.redis.fleetstate import live_workers
from batchfleet.common.redis.functions import LIVE_WORKER_MS
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import FleetInfo, Request
from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.requests.readahead import ReadAhead, cap, release_after_s
from batchfleet.worker.requests.table import RequestTable
from batchfleet.worker.requests.validate import Accepted, Limits, Rejected, accept, job_id_of
from batchfleet.worker.transport import fleet
from batchfleet.worker.transport.base import Entry
from batchfleet.worker.transport.consumer import StreamConsumer


# ---- point 4: fullmatch ---------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("bad", ["abc\n", "abc\r\n", "\nabc", "a b", "", "x" * 129])
def test_job_ids_with_a_newline_or_junk_are_invalid(bad):
    assert not valid_job_id(bad)
    entry = Entry(32, "1-0", {b"id": bad.encode(), b"p": b"x"})
    assert job_id_of(entry) is None
    out = accept(entry, Keys("bf"), Limits(max_seq_len=64, vocab_size=100), time.time())
    assert isinstance(out, Rejected) and out.error is None  # nobody to answer: dead-lettered, no key made


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["bf\n", "bf\r", "b f", "", "x" * 65, "bf:x"])
def test_namespaces_with_a_newline_or_junk_are_refused(bad):
    with pytest.raises(ValueError):
        Keys(bad)
    with pytest.raises(Exception):  # noqa: B017 (ConfigError or ValueError, both refuse)
        ConnectionConfig(namespace=bad)
    assert valid_job_id("abc") and Keys("bf.x-1_2").namespace == "bf.x-1_2"


# ---- point 6a/6b: fleet membership ------------------------------------------------------------------
def _info(**kw) -> FleetInfo:
    base = FleetInfo(model="tiny", tokenizer_json="{}", buckets=(32, 64), max_seq_len=256, max_batch_size=8,
                     vocab_size=320, eos_token_ids=(2,))
    return fleet.with_fingerprint(dataclasses.replace(base, **kw))


@pytest.mark.unit
def test_fingerprint_covers_model_tokenizer_buckets_not_tuning():
    a = _info()
    assert a.fingerprint and a.fingerprint == _info(max_batch_size=32, max_queue_len=5).fingerprint
    for change in ({"buckets": (32,)}, {"model": "other"}, {"tokenizer_json": "{ }"}, {"vocab_size": 321},
                   {"max_seq_len": 512}, {"eos_token_ids": (3,)}, {"chat_template": "{{x}}"}):
        assert _info(**change).fingerprint != a.fingerprint, change


@pytest.fixture
def ns_redis(redis_url, namespace):
    conn = ConnectionConfig(redis_url=redis_url, namespace=namespace)
    made: list[StreamConsumer] = []

    def consumer(name: str) -> StreamConsumer:
        c = StreamConsumer(conn, (32, 64), name, 60)
        c.setup()
        made.append(c)
        return c

    yield consumer, Keys(namespace), redis.Redis.from_url(redis_url)
    for c in made:
        c.r.close()


def test_join_refuses_a_different_live_fleet_unless_replacing(ns_redis):
    consumer, keys, r = ns_redis
    a, b, c = consumer("a"), consumer("b"), consumer("c")
    a.presence.join(_info())
    assert r.zscore(keys.workers, "a") is not None  # joined: live at once, before its first heartbeat
    ttl = r.pttl(keys.fleet)
    assert 0 < ttl <= fleet.FLEET_TTL_MS == 3 * LIVE_WORKER_MS
    with pytest.raises(fleet.FleetConflict, match=r"1 live worker.*buckets 32,64.*buckets 32,.*--replace-fleet"):
        b.presence.join(_info(buckets=(32,)))
    assert FleetInfo.decode(r.get(keys.fleet)).buckets == (32, 64) and r.zscore(keys.workers, "b") is None
    c.presence.join(_info(max_batch_size=2))  # same fingerprint: joins
    b.presence.join(_info(buckets=(32,)), replace=True)
    assert FleetInfo.decode(r.get(keys.fleet)).buckets == (32,)


def test_join_ignores_dead_workers_and_leave_deletes_the_fleet_when_none_is_live(ns_redis):
    consumer, keys, r = ns_redis
    a, b = consumer("a"), consumer("b")
    a.presence.join(_info())
    t = r.time()
    r.zadd(keys.workers, {"a": t[0] * 1000 - LIVE_WORKER_MS - 1000})  # a's heartbeat went stale: a died
    b.presence.join(_info(buckets=(32,)))  # no live worker serves the old fleet: b takes over
    assert r.zscore(keys.workers, "a") is None  # dead names pruned
    a2 = consumer("a2")
    a2.presence.join(_info(buckets=(32,)))
    assert len(live_workers(r, keys)) == 2 and a2.presence.live_peers() == 1
    a2.close()
    assert r.exists(keys.fleet)  # b is still live
    b.close()
    assert not r.exists(keys.fleet) and r.zcard(keys.workers) == 0


# ---- point 6d: releasing without counting a delivery ----------------------------------------------------
def _accepted(entry: Entry) -> Accepted:
    job_id = entry.fields[b"id"].decode()
    req = Request(id=job_id, prompt=[1, 2])
    gen = GenRequest(id=job_id, prompt=[1, 2], bucket=entry.bucket, params=Params(max_new_tokens=2))
    return Accepted(entry, req, gen, time.time(), None)


def test_release_hands_stale_queued_entries_to_a_peer_without_counting_a_delivery(ns_redis):
    consumer, keys, r = ns_redis
    busy, idle = consumer("busy"), consumer("idle")
    busy.presence.join(_info())
    ids = [f"j{i}-{uuid.uuid4().hex[:4]}" for i in range(3)]
    for j in ids:
        r.xadd(keys.stream(32), {"id": j, "p": "x"})
    held = [_accepted(e) for e in busy.read(count=10, block_ms=None)]
    table = RequestTable(Batcher((32, 64), 8, 50))
    for acc in held:
        table.queue(acc)
    ra = ReadAhead(busy, max_wait_ms=50, claim_idle_ms=1000)
    assert ra.after_s == 1.0 and release_after_s(math.inf) == math.inf and cap(8, True) == 8 and cap(8, False) == 16
    # continuous mode: only the engine's room now (never a batch ahead while full), at most two batches
    assert cap(8, True, joins=True, room=0) == 0 and cap(8, False, joins=True, room=5) == 5
    assert cap(8, False, joins=True, room=40) == 16 and cap(8, False, joins=True, room=-1) == 0
    ra.stepping(held, engine_full=True)
    assert ra.check() == 0  # not stale yet
    ra._since = {k: v - 2 for k, v in ra._since.items()}  # they have waited 2 s
    ra.stepping(held, engine_full=True)
    assert ra.check() == 0  # no live peer: releasing would only churn
    idle.presence.join(_info())
    ra._peers = (0, -math.inf)
    assert ra.check() == 3
    assert ra.unreleased(table) == []  # the lease keeper no longer renews them
    ra.stepped()
    assert ra.settle(table.drop) == 3 and table.take_batch(1e12, {"interactive": 8}) is None and table.snapshot == ()
    got = idle.pending.reclaim(min_idle_ms=1000, budget=10)
    assert sorted(e.fields[b"id"].decode() for e in got) == sorted(ids)
    assert all(e.deliveries == 1 for e in got)  # a release to balance load is not a failed delivery
