"""Scheduler: admission, decode growth, preemption and abort with exact block ids (pure Python)."""

import pytest

from batchfleet.worker.engine.native.block_manager import BlockManager
from batchfleet.worker.engine.native.scheduler import Scheduler
from batchfleet.worker.engine.native.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess


def plain(num_blocks: int) -> BlockManager:
    """A pool without prefix caching: these tests pin the plain allocator's block ids (the cache's own
    behaviour is tested in test_prefix_cache.py)."""
    return BlockManager(num_blocks=num_blocks, block_size=4, enable_caching=False)


def seq(name: str, n: int, max_new: int = 8) -> Sequence:
    return Sequence(id=name, token_ids=list(range(n)), max_new_tokens=max_new)


def step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    assert batch is not None
    return batch, s.postprocess(batch, [token] * len(batch))


def test_prefill_then_decode_and_block_growth():
    s = Scheduler(plain(10), max_batch_size=4)
    a, b = seq("a", 4), seq("b", 6)
    s.add(a)
    s.add(b)
    batch, done = step(s)
    assert batch.is_prefill and [x.id for x in batch.seqs] == ["a", "b"]
    assert a.block_table == [0] and b.block_table == [1, 2]
    assert (a.num_cached, len(a)) == (4, 5) and done == []
    batch, _ = step(s)  # decode: a writes slot 4 -> needs block 3; b writes slot 6, fits block 2
    assert not batch.is_prefill
    assert a.block_table == [0, 3] and b.block_table == [1, 2]
    assert (a.num_cached, b.num_cached) == (5, 7)
    assert s.wasted_slots() == (8 - 5) + (8 - 7)


def test_finished_sequences_free_blocks_immediately():
    s = Scheduler(plain(10), max_batch_size=4)
    short, long = seq("s", 3, max_new=2), seq("l", 3, max_new=5)
    s.add(long)
    s.add(short)
    step(s)
    _, done = step(s)
    assert [x.id for x in done] == ["s"] and short.status is SeqStatus.FINISHED
    assert short.block_table == [] and s.blocks.num_used == 1 and [x.id for x in s.running] == ["l"]
    s.add(seq("n", 5))  # joins while l runs, reuses the freed block after the untouched ones
    batch, _ = step(s)
    assert batch.is_prefill and batch.seqs[0].block_table == [2, 3]


def test_max_batch_size_keeps_extra_waiting():
    s = Scheduler(plain(20), max_batch_size=2)
    for i in range(3):
        s.add(seq(f"r{i}", 2, max_new=3))
    batch, _ = step(s)
    assert [x.id for x in batch.seqs] == ["r0", "r1"] and [x.id for x in s.waiting] == ["r2"]
    for _ in range(2):
        step(s)
    batch, _ = step(s)  # r0, r1 finished: r2 is admitted
    assert batch.is_prefill and [x.id for x in batch.seqs] == ["r2"]


def test_watermark_keeps_a_block_per_running_sequence():
    s = Scheduler(plain(4), max_batch_size=4)
    s.add(seq("a", 4))
    step(s)  # a holds block 0; 3 free
    s.add(seq("b", 12, max_new=1))  # needs 3 blocks; with 1 reserved for a only 2 are usable
    batch, _ = step(s)
    assert not batch.is_prefill and [x.id for x in s.waiting] == ["b"]


def test_preemption_recomputes_newest_first():
    s = Scheduler(plain(4), max_batch_size=4)
    a, b = seq("a", 4, max_new=12), seq("b", 3, max_new=12)
    s.add(a)
    s.add(b)
    step(s)  # a: [0], b: [1]; 2 free
    assert (a.block_table, b.block_table) == ([0], [1])
    step(s)  # a needs a block (slot 4) -> [0, 2]; b writes slot 3
    assert (a.block_table, b.block_table) == ([0, 2], [1])
    for _ in range(3):
        step(s)  # a fills slots 5..7; b needs block 3 at slot 4
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])
    batch, _ = step(s)  # a needs a 3rd block, none free: b (newest) is preempted
    assert [x.id for x in batch.preempted] == ["b"] and b.block_table == [] and b.num_cached == 0
    assert a.block_table == [0, 2, 1] and [x.id for x in s.waiting] == ["b"]
    assert b.status is SeqStatus.WAITING and b.num_preemptions == 1 and len(b) == 3 + 5
    assert s.num_preemptions == 1


def test_lone_sequence_that_cannot_grow_is_preempted_not_crashed():
    s = Scheduler(plain(2), max_batch_size=2)
    with pytest.raises(ValueError):
        s.add(seq("big", 6, max_new=4))  # KV for 9 tokens > 8 slots: rejected up front
    s.add(seq("ok", 5, max_new=3))
    for _ in range(3):
        step(s)
    assert not s.has_work() and s.blocks.num_used == 0


def test_abort_frees_running_and_waiting():
    s = Scheduler(plain(8), max_batch_size=1)
    s.add(seq("a", 5))
    s.add(seq("b", 5))
    step(s)
    assert s.blocks.num_used == 2
    found = s.abort(["a", "b", "zzz"])
    assert sorted(x.id for x in found) == ["a", "b"]
    assert s.blocks.num_used == 0 and not s.has_work() and s.schedule() is None


def test_requeue_puts_sequence_back_in_front():
    s = Scheduler(plain(8), max_batch_size=4)
    s.add(seq("a", 5))
    s.add(seq("b", 2))
    batch = s.schedule()
    s.add(seq("c", 2))
    for x in reversed(batch.seqs):
        s.requeue(x)
    assert [x.id for x in s.waiting] == ["a", "b", "c"] and s.blocks.num_used == 0 and not s.running
    batch = s.schedule()
    assert [x.id for x in batch.seqs] == ["a", "b", "c"]
    assert [x.block_table for x in batch.seqs] == [[3, 4], [5], [6]]  # 0..2 freed to the back
