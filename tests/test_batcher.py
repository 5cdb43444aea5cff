"""Batch forming rules, exactly, on a fake clock (no Redis, no torch)."""

from __future__ import annotations

import pytest

from batchfleet.common.wire.priority import INTERACTIVE
from batchfleet.worker.batching.batcher import Batcher
from batchfleet.worker.transport.fair_share import FairShare

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess


def make(max_batch_size=3, max_wait_ms=100.0, buckets=(128, 256)):
    return Batcher(buckets, max_batch_size, max_wait_ms)


def test_batch_closes_when_full():
    b = make()
    for i in range(3):
        b.add(f"r{i}", 128, enqueued_at=10.0 + i * 0.001)
    assert b.pop_batch(now=10.003) == (128, ["r0", "r1", "r2"])
    assert b.pop_batch(now=10.003) is None


def test_batch_closes_by_age_of_oldest_entry():
    b = make()
    b.add("old", 128, enqueued_at=10.0)
    b.add("new", 128, enqueued_at=10.09)
    assert b.next_deadline() == 10.1
    assert b.pop_batch(now=10.0999) is None
    # the deadline counts from the OLDEST entry, not from when anyone started waiting
    assert b.pop_batch(now=10.1) == (128, ["old", "new"])


def test_entry_already_old_when_read_closes_at_once():
    b = make()
    b.add("stale", 256, enqueued_at=5.0)
    assert b.pop_batch(now=9.0) == (256, ["stale"])


def test_buckets_never_share_and_oldest_bucket_first():
    b = make(max_batch_size=2)
    b.add("a256", 256, enqueued_at=1.0)
    b.add("a128", 128, enqueued_at=2.0)
    b.add("b128", 128, enqueued_at=2.1)
    b.add("b256", 256, enqueued_at=2.2)
    # both buckets are full; 256's oldest entry waited longer
    assert b.pop_batch(now=2.3) == (256, ["a256", "b256"])
    assert b.pop_batch(now=2.3) == (128, ["a128", "b128"])


def test_overflow_stays_for_next_batch_in_order():
    b = make(max_batch_size=2)
    for i in range(5):
        b.add(i, 128, enqueued_at=float(i))
    assert b.pop_batch(now=4.0) == (128, [0, 1])
    assert b.pop_batch(now=4.0) == (128, [2, 3])
    assert b.pop_batch(now=4.0) is None  # 4 arrived at t=4.0, waits until 4.1
    assert b.pop_batch(now=4.1) == (128, [4])


def test_out_of_order_arrival_sorted_by_enqueue_time():
    b = make()
    b.add("late", 128, enqueued_at=3.0)
    b.add("early", 128, enqueued_at=1.0)
    assert b.next_deadline() == 1.1
    assert b.pop_batch(now=1.1) == (128, ["early", "late"])


def test_static_mode_waits_for_full_batch_until_flush():
    b = make(max_wait_ms=None)
    b.add("x", 128, enqueued_at=0.0)
    assert b.next_deadline() is None
    assert b.pop_batch(now=1e9) is None
    b.flush()
    assert b.pop_batch(now=0.0) == (128, ["x"])


def test_zero_wait_runs_immediately_and_batch_size_one():
    b = make(max_batch_size=1, max_wait_ms=0.0)
    b.add("x", 128, enqueued_at=1.0)
    b.add("y", 128, enqueued_at=1.0)
    assert b.pop_batch(now=1.0) == (128, ["x"])
    assert b.pop_batch(now=1.0) == (128, ["y"])


def test_pop_batch_limit_takes_what_the_engine_has_room_for():
    b = make()
    for i, t in enumerate((1.0, 1.01)):
        b.add(f"r{i}", 128, enqueued_at=t)
    b.add("c", 256, enqueued_at=1.03)
    assert b.pop_batch(now=1.05, limit=1) is None  # not closed yet: a limit does not close a batch
    assert b.pop_batch(now=1.1, limit=1) == (128, ["r0"])
    assert b.pop_batch(now=1.1, limit=5) is None  # r1 is now the oldest: its own deadline counts
    assert b.pop_batch(now=1.12, limit=5) == (128, ["r1"])
    assert b.take(256, 1) == ["c"] and len(b) == 0


def test_expire_removes_matching_items():
    b = make()
    b.add(1, 128, 1.0)
    b.add(2, 128, 1.1)
    b.add(3, 256, 1.2)
    assert b.expire(lambda item: item % 2 == 1) == [1, 3]
    assert len(b) == 1 and b.pop_batch(now=100.0) == (128, [2])


def test_with_an_order_the_tenant_furthest_behind_its_share_starts_first():
    share = FairShare()
    share.got("a", 10, full=True)  # a far ahead of its share, b behind
    share.got("b", 2, full=False)
    fair = Batcher((128, 256), 4, 0.0, order=lambda priority, waiting, n: share.order(waiting, n))
    plain = Batcher((128, 256), 4, 0.0)
    for b in (fair, plain):
        for i in range(3):
            b.add(f"a{i}", 128, enqueued_at=float(i), tenant="a")
        b.add("a-due", 128, enqueued_at=3.0, deadline=50.0, tenant="a")  # a's earliest deadline: first of a's
        b.add("b0", 256, enqueued_at=5.0, tenant="b")
        b.add("b1", 128, enqueued_at=6.0, tenant="b")
    rooms = {INTERACTIVE: 2}
    assert plain.pop_batch(now=10.0, rooms=rooms) == (128, ["a-due", "a0"])  # deadline, then arrival
    assert fair.pop_batch(now=10.0, rooms=rooms) == (256, ["b0"])  # the queue holding b's first entry
    assert fair.pop_batch(now=10.0, rooms=rooms) == (128, ["b1", "a-due"])
    assert fair.pop_batch(now=10.0, rooms=rooms) == (128, ["a0", "a1"])
    assert fair.pop_batch(now=10.0, rooms=rooms) == (128, ["a2"])
    assert len(fair) == 0
