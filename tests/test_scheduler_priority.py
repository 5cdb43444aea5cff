"""Scheduler priorities, exactly (pure Python): interactive sequences are admitted first, preempt batch
sequences beyond the background reserve when the engine is full (slots or KV blocks), pause the rest of the batch
class without recomputing it, and never starve it."""

from __future__ import annotations

import pytest

from batchfleet.common.wire.priority import background_reserve
from batchfleet.worker.engine.native.block_manager import BlockManager
from batchfleet.worker.engine.native.scheduler import Scheduler
from batchfleet.worker.engine.native.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess

INTERACTIVE, BACKGROUND = 0, 1


def seq(name: str, n: int = 4, max_new: int = 50, priority: int = BACKGROUND, bucket: int = 16) -> Sequence:
    return Sequence(id=name, token_ids=list(range(n)), max_new_tokens=max_new, priority=priority, bucket=bucket)


def sched(max_running: int = 4, reserve: int = 1, blocks: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=blocks, block_size=4), max_batch_size=8, max_prefill_tokens=64,
                     max_running=max_running, chunked=True, background_reserve=reserve)


def run(s: Scheduler, steps: int = 1) -> list[tuple[bool, list[str]]]:
    out = []
    for _ in range(steps):
        batch = s.schedule()
        assert batch is not None
        s.postprocess(batch, [7] * len(batch.sampled))
        out.append((batch.is_prefill, [q.id for q in batch.seqs]))
    return out


def test_queue_is_ordered_by_class_then_arrival():
    s = sched()
    for q in (seq("b1"), seq("i1", priority=INTERACTIVE), seq("b2"), seq("i2", priority=INTERACTIVE)):
        s.add(q)
    assert [q.id for q in s.waiting] == ["i1", "i2", "b1", "b2"]


def test_interactive_arrival_preempts_batch_beyond_the_reserve_and_pauses_the_rest():
    s = sched(max_running=4, reserve=1)
    for i in range(4):
        s.add(seq(f"b{i}"))
    assert run(s, 2) == [(True, ["b0", "b1", "b2", "b3"]), (False, ["b0", "b1", "b2", "b3"])]
    assert s.room(INTERACTIVE) == 3 and s.room(BACKGROUND) == 0
    s.add(seq("i0", priority=INTERACTIVE))
    # no slot: the latest background sequence is preempted (back to the front of background work)
    assert run(s, 1) == [(True, ["i0"])]
    assert s.num_priority_preemptions == 1 and [q.id for q in s.waiting] == ["b3"]
    assert s.waiting[0].status is SeqStatus.WAITING and s.waiting[0].num_cached == 0
    # while i0 runs, background work decodes with its reserve (b0); b1, b2 keep their KV, paused
    kv = {q.id: list(q.block_table) for q in s.running}
    assert run(s, 2) == [(False, ["b0", "i0"]), (False, ["b0", "i0"])]
    assert [q.id for q in s.running] == ["b0", "b1", "b2", "i0"]
    assert {q: kv[q] for q in ("b1", "b2")} == {q.id: q.block_table for q in s.running if q.id in ("b1", "b2")}
    # i0 finishes: everything resumes, b3 is recomputed once a slot is free
    s.abort(["i0"])
    assert run(s, 2) == [(True, ["b3"]), (False, ["b0", "b1", "b2", "b3"])]
    assert s.num_priority_preemptions == 1


def test_batch_class_keeps_its_reserve_under_an_interactive_flood():
    s = sched(max_running=4, reserve=1)
    s.add(seq("b0"))
    s.add(seq("b1"))
    for i in range(6):
        s.add(seq(f"i{i}", priority=INTERACTIVE))
    assert s.room(BACKGROUND) == 0 and s.room(INTERACTIVE) == 0
    history = run(s, 12)
    decodes = [ids for prefill, ids in history if not prefill]
    # interactive sequences fill every slot but one; b0 (admitted as the reserve) decodes in every step
    assert decodes and all("b0" in ids for ids in decodes)
    assert all(sum(x.startswith("i") for x in ids) <= 3 for ids in decodes)
    assert "b1" not in {x for _, ids in history for x in ids}  # beyond the reserve: waits, not starved below it


def test_interactive_preempts_batch_for_kv_blocks_too():
    s = sched(max_running=8, reserve=1, blocks=6)  # 6 blocks of 4 tokens
    s.add(seq("b0", n=8, max_new=4))
    s.add(seq("b1", n=8, max_new=4))
    run(s, 1)  # b0, b1 hold 2 blocks each; 2 free
    s.add(seq("i0", n=8, max_new=4, priority=INTERACTIVE))
    # the decode step after a prefill runs first (b0 alone: b1 is paused; b0 takes a third block), then i0
    # needs 2 blocks + a spare per holder with 1 free: b1 is preempted for it
    assert run(s, 2) == [(False, ["b0"]), (True, ["i0"])]
    assert [q.id for q in s.waiting] == ["b1"] and s.num_priority_preemptions == 1


def test_batch_never_preempts_and_reserve_zero_means_no_share():
    s = sched(max_running=2, reserve=0)
    s.add(seq("i0", priority=INTERACTIVE))
    s.add(seq("i1", priority=INTERACTIVE))
    run(s, 1)
    s.add(seq("b0"))
    assert s.room(BACKGROUND) == 0 and run(s, 2) == [(False, ["i0", "i1"]), (False, ["i0", "i1"])]
    assert s.num_priority_preemptions == 0 and [q.id for q in s.waiting] == ["b0"]


def test_background_reserve_is_a_share_of_max_running_at_least_one():
    cases = [(64, 0.1), (4, 0.1), (64, 0.0), (10, 1.0)]
    assert [background_reserve(n, share) for n, share in cases] == [7, 1, 0, 10]
