"""Reliability guarantees with an in-process worker on the shared test Redis: poison isolation and
dead-lettering, deadlines, backpressure, bounded keys, re-creating lost groups. (Kill, restart, fuzz and
ACL tests live in test_worker_kill.py, test_redis_restart.py, test_fuzz_intake.py and test_acl*.py.)"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis

from batchfleet.common.errors import WORKER_FAILED, JobFailed, QueueFull, Timeout
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.producer import Client
from tests.conftest import worker_config
from tests.helpers.loops import (
    POISON_TOKEN,
    TEST_INBOX,
    LoopThread,
    PoisonEngine,
    dead_letters,
    request_fields,
    wait_until,
)


def _native_works() -> bool:
    try:
        from batchfleet.worker.engine.native.engine import NativeEngine  # noqa: F401
    except Exception:
        return False
    return True


ENGINES = ["hf"] + (["native"] if _native_works() else [])


@pytest.fixture
def loops(redis_url, namespace, tiny_model_dir, cache_dir):
    started: list[LoopThread] = []

    def start(wrap=None, **kw) -> LoopThread:
        t = LoopThread(worker_config(redis_url, namespace, tiny_model_dir, **kw), wrap)
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


@pytest.mark.parametrize("engine", ENGINES)
def test_poison_request_dead_lettered_batchmates_answered(loops, redis_url, namespace, engine):
    # a fixed window, so the five submitted one after another surely run as one batch
    t = loops(wrap=PoisonEngine, engine=engine, max_wait_ms=300, window="fixed", max_batch_size=8,
              claim_idle_ms=1000, max_deliveries=2)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    with Client(redis_url, namespace) as client:
        good = [client.submit([11 + i, 12, 13], max_new_tokens=3) for i in range(4)]
        poison = client.submit([11, POISON_TOKEN, 13], max_new_tokens=3)
        t0 = time.monotonic()
        results = [client.result(j, timeout=30) for j in good]
        with pytest.raises(JobFailed) as failed:
            client.result(poison, timeout=30)
        elapsed = time.monotonic() - t0
    assert failed.value.code == WORKER_FAILED
    assert [res.completion_tokens for res in results] == [3] * 4
    # they really were batchmates: one batch record holds all five
    records = [f for _, f in r.xrange(keys.batches)]
    assert any(set(good + [poison]) <= set(f[b"ids"].decode().split(",")) for f in records)
    dead = [d for d in dead_letters(r, keys) if d[b"id"] == poison.encode()]
    assert len(dead) == 1 and int(dead[0][b"deliveries"]) == 2
    answer = keys.done(poison, client.reply_key)
    assert not r.exists(answer) or r.ttl(answer) > 0  # answered once (first writer wins)
    assert t.loop.ledger["released"] == 1 and t.thread.is_alive()
    assert sum(r.xlen(keys.stream(b)) for b in (32, 64, 128, 256)) == 0
    print(f"\npoison ({engine}): dead-lettered after 2 deliveries in {elapsed:.2f}s")


def test_deadline_exceeded_answered_without_computing(loops, redis_url, namespace):
    loops(max_wait_ms=1500, window="fixed", max_batch_size=8)  # the job waits its batch past its deadline
    r = redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        client.generate([20, 21], max_new_tokens=1)  # warm
        job = client.submit([20, 21, 22], max_new_tokens=4, timeout=0.2)
        with pytest.raises(Timeout, match="deadline passed"):
            client.result(job, timeout=10)  # the worker's answer, not our own timeout
        with pytest.raises(Timeout):
            client.generate([20, 21, 22], max_new_tokens=4, timeout=0.3)
    ids = b",".join(f[b"ids"] for _, f in r.xrange(Keys(namespace).batches))
    assert job.encode() not in ids


def _publish_fleet(redis_url: str, keys: Keys, tiny_model_dir: Path, max_queue_len: int) -> None:
    info = FleetInfo(model="tiny", tokenizer_json=(tiny_model_dir / "tokenizer.json").read_text(),
                     buckets=(32, 64), max_seq_len=128, max_batch_size=4, vocab_size=320, eos_token_ids=(2,),
                     max_queue_len=max_queue_len)
    redis.Redis.from_url(redis_url).set(keys.fleet, info.encode())


def test_queue_full_raises_at_once_and_enqueues_nothing(redis_url, namespace, tiny_model_dir):
    keys = Keys(namespace)
    _publish_fleet(redis_url, keys, tiny_model_dir, max_queue_len=3)
    r = redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace, require_workers=False) as client:
        for _ in range(3):
            client.submit([5, 6], max_new_tokens=2)
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            client.submit([5, 6], max_new_tokens=2)
        assert time.monotonic() - t0 < 0.5
        assert client.submit([5] * 40, max_new_tokens=2)  # another bucket has its own limit
        with pytest.raises(QueueFull):
            client.generate_many([[5, 6]], max_new_tokens=2)
    assert r.xlen(keys.stream(32)) == 3 and r.xlen(keys.stream(64)) == 1


def test_no_key_grows_without_bound(loops, redis_url, namespace, monkeypatch):
    from batchfleet.worker.transport import settle

    monkeypatch.setattr(settle, "DEAD_LETTER_MAXLEN", 20)
    loops(max_wait_ms=5, reply_ttl_s=30)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    pipe = r.pipeline(transaction=False)
    for i in range(60):
        pipe.xadd(keys.stream(32), {"junk": str(i)})  # no id: dead-lettered
    pipe.execute()
    with Client(redis_url, namespace) as client:
        jobs = [client.submit([30, 31], max_new_tokens=2) for _ in range(3)]
        wait_until(lambda: all(r.exists(keys.done(j, client.reply_key)) for j in jobs), 30, "replies")
        assert 0 < r.ttl(client.reply_key) <= 30
        for j in jobs:
            assert 0 < r.ttl(keys.done(j, client.reply_key)) <= 30
            client.result(j, timeout=10)
        wait_until(lambda: r.xlen(keys.stream(32)) == 0, 30, "junk consumed")
    assert r.xlen(keys.dead) == 20  # capped
    assert sum(r.xlen(keys.stream(b)) for b in (32, 64, 128, 256)) == 0  # acked entries are deleted
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 0
    assert r.ttl(keys.worker(next(iter(r.scan_iter(match=keys.worker("*")))).decode().split(":")[-1])) > 0


def test_groups_and_fleet_recreated_when_redis_comes_back_empty(loops, redis_url, namespace):
    from batchfleet.worker.devtools import delete_namespace

    loops(max_wait_ms=5)
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        client.generate([40, 41], max_new_tokens=2)
        delete_namespace(redis_url, keys.namespace)  # what a restart without persistence looks like to us
        wait_until(lambda: r.exists(keys.fleet), 15, "fleet re-published")
        res = client.generate([40, 41], max_new_tokens=2, timeout=30)
    assert res.completion_tokens == 2


def test_internal_error_on_one_entry_costs_that_entry_only(loops, redis_url, namespace, monkeypatch):
    from batchfleet.worker.requests import intake

    real_accept = intake.accept

    def flaky_accept(entry, *a, **kw):
        if entry.fields.get(b"id", b"").startswith(b"boom"):
            raise RuntimeError("simulated bug")
        return real_accept(entry, *a, **kw)

    monkeypatch.setattr(intake, "accept", flaky_accept)
    t = loops(max_wait_ms=20)
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    boom = f"boom{uuid.uuid4().hex[:6]}"
    with Client(redis_url, namespace, inbox=TEST_INBOX) as client:
        r.xadd(keys.stream(32), request_fields(keys, boom, [3, 4]))
        with pytest.raises(JobFailed) as failed:
            client.result(boom, timeout=10)
        assert failed.value.code == WORKER_FAILED
        assert client.generate([3, 4], max_new_tokens=2).completion_tokens == 2
    assert t.loop.ledger["internal_errors"] == 1 and t.thread.is_alive()


def test_reclaim_follows_cursor_within_budget_and_drops_deleted(any_redis_url):
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.worker.transport.consumer import StreamConsumer

    ns = f"rc-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    conn = ConnectionConfig(redis_url=any_redis_url, namespace=ns)
    dead = StreamConsumer(conn, (32,), "dead", 60)
    live = StreamConsumer(conn, (32,), "live", 60)
    dead.setup()
    r = redis.Redis.from_url(any_redis_url)
    ids = [r.xadd(keys.stream(32), request_fields(keys, f"j{i}", [1, 2])) for i in range(25)]
    assert len(dead.read(count=100, block_ms=None)) == 25
    r.xdel(keys.stream(32), ids[3], ids[17])  # deleted while pending
    time.sleep(1.1)  # idle past 1 s: the rest of the test has a second before the claimed ones are idle again
    got = [live.pending.reclaim(min_idle_ms=1000, budget=10) for _ in range(3)]
    assert [len(g) for g in got] == [10, 10, 3]
    claimed = [e.entry_id for g in got for e in g]
    assert len(set(claimed)) == 23 and all(e.deliveries == 2 for g in got for e in g)
    assert r.xpending(keys.stream(32), keys.group)["pending"] == 23  # the deleted ones left the PEL
    assert live.pending.reclaim(min_idle_ms=1000, budget=10) == []  # just claimed: not idle
    live.pending.release(got[0][:1], idle_ms=5000)  # released: reclaimable at once, count unchanged until then
    again = live.pending.reclaim(min_idle_ms=1000, budget=10)
    assert [(e.entry_id, e.deliveries) for e in again] == [(got[0][0].entry_id, 3)]
    from batchfleet.worker.devtools import delete_namespace

    delete_namespace(any_redis_url, keys.namespace)


def test_dead_consumer_names_are_pruned_and_a_clean_stop_removes_its_own(redis_url, namespace):
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.worker.transport.consumer import StreamConsumer

    keys = Keys(namespace)
    conn = ConnectionConfig(redis_url=redis_url, namespace=namespace)
    ghost, holder, live = (StreamConsumer(conn, (32,), name, 60) for name in ("ghost", "holder", "live"))
    live.setup()
    r = redis.Redis.from_url(redis_url)
    read = {}
    for c in (ghost, holder):
        r.xadd(keys.stream(32), request_fields(keys, f"j-{c.name}", [1, 2]))
        (read[c.name],) = c.read(count=1, block_ms=None)
    ghost.settler.ack(read["ghost"])  # the ghost answered its entry, then died: nothing pending on its name
    time.sleep(0.05)
    assert live.pending.prune_consumers(min_idle_ms=20) == 1  # ghost: nothing pending; holder keeps its entry
    names = {c["name"] for c in r.xinfo_consumers(keys.stream(32), keys.group)}
    assert names == {b"holder"}
    live.read(count=1, block_ms=None)
    live.close()  # nothing pending on it: its name goes too
    assert {c["name"] for c in r.xinfo_consumers(keys.stream(32), keys.group)} == {b"holder"}


def test_lease_keeper_renews_held_entries_until_the_loop_stalls():
    from batchfleet.worker.transport.base import Entry
    from batchfleet.worker.transport.reclaim import LeaseKeeper

    class FakeConsumer:  # plays the two parts the keeper uses (transport.pending, transport.presence)
        def __init__(self) -> None:
            self.renewed: list[list[str]] = []
            self.pending = self.presence = self

        def refresh(self, entries, min_idle_ms: int) -> None:
            self.renewed.append([e.entry_id for e in entries])

        def alive(self) -> None:
            pass

    consumer = FakeConsumer()
    progress = [time.monotonic() + 3600]  # the loop makes progress (however slowly this host runs the test)
    keeper = LeaseKeeper(consumer, claim_idle_ms=100, held=lambda: (Entry(32, "1-0", {}),),
                         progress=lambda: progress[0], stall_timeout_s=0.2)
    keeper.start()
    try:
        wait_until(lambda: len(consumer.renewed) >= 3, 5, "renewals")
        assert consumer.renewed[0] == ["1-0"] and not keeper.stalled
        progress[0] = time.monotonic() - 10  # the loop is wedged: stop renewing so other workers take over
        wait_until(lambda: keeper.stalled, 5, "stall detected")
        count = len(consumer.renewed)
        time.sleep(0.15)
        assert len(consumer.renewed) == count
        progress[0] = time.monotonic() + 60
        wait_until(lambda: len(consumer.renewed) > count, 5, "renewals resumed")
    finally:
        keeper.stop()
