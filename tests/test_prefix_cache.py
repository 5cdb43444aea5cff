"""Prefix cache of the block manager and how the scheduler uses it: exact block ids, reference counts,
LRU eviction, hit/query counters, same-step sharing, chunked prefill, preemption, rollback (pure Python)."""

import pytest

from batchfleet.worker.engine.native.block_manager import BlockManager, block_key
from batchfleet.worker.engine.native.scheduler import Scheduler
from batchfleet.worker.engine.native.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit

P = list(range(100, 108))  # an 8-token shared prefix: two full blocks of 4


def seq(name: str, tokens: list[int], max_new: int = 8) -> Sequence:
    return Sequence(id=name, token_ids=list(tokens), max_new_tokens=max_new)


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """Allocate ``s`` with its cache hits and register what a full prefill computes; returns the hits."""
    hits = bm.match(s)
    bm.allocate(s, len(s), hits)
    bm.commit(s, len(s))
    return hits


def step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    assert batch is not None
    return batch, s.postprocess(batch, [token] * len(batch.sampled))


def test_keys_chain_over_the_parent():
    a, b = block_key(b"", [1, 2]), block_key(b"", [1, 2])
    assert a == b and len(a) == 16
    assert block_key(a, [3, 4]) != block_key(b"", [3, 4])  # same tokens, other prefix: other key
    assert block_key(b"", [1, 2]) != block_key(b"", [2, 1])


def test_reuse_full_blocks_and_count_queries_and_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", P + [1, 2])
    assert admit(bm, a) == [] and a.block_table == [0, 1, 2] and a.num_cached == 0
    b = seq("b", P + [3])  # shares both full blocks; its third block is its own
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3] and b.num_cached == 8 and b.num_cache_hit == 8
    assert (bm.queries, bm.hits) == (10 + 9, 8)
    assert bm.num_used == 4  # blocks 0, 1 are held twice, counted once


def test_partial_block_is_never_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", P + [1, 2, 3]))  # 11 tokens: blocks 0, 1 full, block 2 partial
    b = seq("b", P + [1, 2, 9, 9, 9])  # agrees on 10 tokens, but only whole blocks are shared
    assert admit(bm, b) == [0, 1] and b.num_cached == 8


def test_last_token_is_computed_even_when_every_block_is_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", P + [1]))
    same = seq("same", P)  # its whole prompt is cached: the last block is computed again for logits
    assert admit(bm, same) == [0]
    assert same.num_cached == 4 and same.block_table == [0, 3]


def test_prompt_that_is_a_prefix_of_another():
    bm = BlockManager(num_blocks=8, block_size=4)
    short = seq("short", P[:5])
    admit(bm, short)  # registers block 0
    long = seq("long", P + [1, 2])
    assert admit(bm, long) == [0] and long.block_table == [0, 2, 3]
    again = seq("again", P[:5])
    assert admit(bm, again) == [0]  # and the short one hits the long one's first block


def test_free_keeps_content_until_evicted_least_recently_used_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", P + [1])
    admit(bm, a)  # [0, 1, 2]; 0 and 1 cached
    bm.free(a)
    assert (bm.num_free, bm.num_evictable, bm.num_used) == (4, 2, 0)
    x = seq("x", [9] * 8)  # 2 blocks: block 3 (plain free list first: 2 went to its back), then 2
    bm.allocate(x, 8)
    assert x.block_table == [3, 2] and bm.num_evictable == 2
    y = seq("y", [8] * 4)
    bm.allocate(y, 4)  # nothing plain left: evicts the least recently used cached block, a's tail
    assert y.block_table == [1] and bm.evictions == 1
    b = seq("b", P + [5])
    assert bm.match(b) == [0]  # the head survived
    bm.free(y)
    bm.allocate(seq("z", [7] * 8), 8)  # evicts block 0 now (y's block 1 was never registered)
    assert bm.match(b) == [] and bm.evictions == 2


def test_shared_block_stays_held_until_its_last_holder_frees_it():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq("a", P + [1]), seq("b", P + [2])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert bm.num_evictable == 0 and bm.num_used == 3  # 0, 1 still held by b, and b's block 3
    bm.free(b)
    assert bm.num_evictable == 2 and bm.num_used == 0


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq("a", P + [1])
    admit(bm, a)
    bm.free(a)  # all 3 free, 2 of them cached
    b = seq("b", P + [1, 2, 3, 4, 5])  # 13 tokens: 4 blocks, 2 of them hits
    hits = bm.match(b)
    assert hits == [0, 1] and not bm.can_allocate(len(b), hits=hits)  # needs 2 fresh, only 1 left
    c = seq("c", P + [1, 2])
    hits = bm.match(c)
    assert bm.can_allocate(len(c), hits=hits) and not bm.can_allocate(len(c), reserve=1, hits=hits)


def test_uncache_and_reset_forget_content():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", P + [1])
    bm.allocate(a, len(a))
    assert bm.commit(a, len(a)) == [0, 1] and bm.commit(a, len(a)) == []  # once
    bm.uncache([1])
    assert bm.match(seq("b", P + [1])) == [0]
    bm.free(a)
    bm.reset_cache()
    assert bm.match(seq("b", P + [1])) == [] and bm.num_evictable == 0 and bm.num_free == 4


def test_duplicate_content_is_registered_once():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = seq("a", P + [1]), seq("b", P + [2])
    bm.allocate(a, len(a))
    bm.allocate(b, len(b))  # both allocated before either registered: no sharing
    assert bm.commit(a, len(a)) == [0, 1] and bm.commit(b, len(b)) == []
    bm.free(b)
    assert bm.num_evictable == 0  # b's copies were plain blocks


def test_disabled_cache_never_matches_or_counts():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=False)
    admit(bm, seq("a", P + [1]))
    b = seq("b", P + [1])
    assert admit(bm, b) == [] and b.block_table == [3, 4, 5] and (bm.queries, bm.hits) == (0, 0)


# -- the scheduler over the cache ---------------------------------------------------------------

def test_sequences_of_one_step_share_the_blocks_the_step_computes():
    s = Scheduler(BlockManager(num_blocks=20, block_size=4), max_batch_size=4, max_prefill_tokens=100,
                  chunked=True)
    a, b = seq("a", P + [1, 2]), seq("b", P + [3])
    s.add(a)
    s.add(b)
    batch, _ = step(s)
    assert batch.seqs == [a, b] and batch.num_new == [10, 1] and batch.registered == [0, 1]
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert batch.sampled == [a, b] and (a.num_cached, b.num_cached) == (10, 9)


def test_budget_counts_only_the_tokens_computed():
    s = Scheduler(BlockManager(num_blocks=40, block_size=4), max_batch_size=8, max_prefill_tokens=12)
    s.add(seq("a", P + [1, 2]))  # 10 tokens computed
    for i in range(4):
        s.add(seq(f"s{i}", P + [10 + i]))  # 1 token each once a's blocks are registered
    batch, _ = step(s)
    assert [x.id for x in batch.seqs] == ["a", "s0", "s1"] and batch.num_new == [10, 1, 1]
    batch, _ = step(s)  # dynamic mode: the two left are admitted before decode, hitting the cache
    assert batch.is_prefill and [x.id for x in batch.seqs] == ["s2", "s3"] and batch.num_new == [1, 1]


def test_chunked_prefill_registers_each_chunk_for_later_sequences():
    s = Scheduler(BlockManager(num_blocks=40, block_size=4), max_batch_size=4, max_prefill_tokens=9,
                  max_running=8, chunked=True)
    long = seq("long", list(range(200, 216)))  # 16 tokens: chunks of 9, 7
    s.add(long)
    batch, _ = step(s)
    assert batch.num_new == [9] and batch.registered == [0, 1] and not batch.sampled  # block 2 not full
    late = seq("late", list(range(200, 210)) + [1])  # 11 tokens, the first 10 are long's
    s.add(late)
    batch, _ = step(s)  # long's last chunk, then 2 of the 3 tokens late has to compute
    assert batch.seqs == [long, late] and batch.num_new == [7, 2] and batch.registered == [2, 3]
    assert late.block_table[:2] == [0, 1] and late.num_cache_hit == 8 and batch.sampled == [long]
    batch, _ = step(s)  # alternation: a decode step for long, then late's last token
    assert not batch.is_prefill
    batch, _ = step(s)
    assert batch.seqs == [late] and batch.num_new == [1] and batch.sampled == [late]


def test_preempted_sequence_resumes_from_its_cached_blocks():
    s = Scheduler(BlockManager(num_blocks=5, block_size=4), max_batch_size=4)
    a, b = seq("a", list(range(10, 14)), max_new=12), seq("b", list(range(20, 23)), max_new=12)
    s.add(a)
    s.add(b)
    for _ in range(6):
        step(s)  # a: [0, 2, 4], b: [1, 3], both of b's blocks filled by decode and registered
    batch, _ = step(s)  # b needs a third block, none is free: b is preempted, its blocks stay cached
    assert [x.id for x in batch.preempted] == ["b"] and b.status is SeqStatus.WAITING
    assert a.block_table == [0, 2, 4] and s.blocks.num_evictable == 2
    while b.status is SeqStatus.WAITING:
        step(s)  # a's fourth block evicts b's tail (3); b comes back when a finishes
    assert b.num_cache_hit == 4 and b.block_table[0] == 1  # its first block came back from the cache
    while s.has_work():
        step(s)
    assert s.blocks.num_used == 0 and s.blocks.hits >= 4


def test_rollback_unregisters_what_the_failed_step_registered():
    s = Scheduler(BlockManager(num_blocks=20, block_size=4), max_batch_size=4)
    a = seq("a", P + [1])
    s.add(a)
    batch = s.schedule()
    assert batch.registered == [0, 1]
    s.rollback(batch)  # the forward raised: nothing was written
    assert s.waiting[0] is a and a.block_table == [] and s.blocks.match(seq("b", P + [2])) == []
    batch, _ = step(s)
    assert batch.seqs == [a] and a.num_cache_hit == 0 and batch.registered == [3, 4]  # 0..2 went to the back


def test_decode_registers_a_block_once_full():
    s = Scheduler(BlockManager(num_blocks=20, block_size=4), max_batch_size=4)
    a = seq("a", [5, 6, 7], max_new=6)
    s.add(a)
    step(s)  # prefill: slots 0..2 computed, token 7 sampled
    step(s)  # decode writes slot 3: block 0 full and registered
    follow = seq("f", [5, 6, 7, 7, 1])  # the first turn's prompt + reply, then more
    assert s.blocks.match(follow) == [a.block_table[0]]
