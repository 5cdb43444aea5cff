"""Fixed pool of KV blocks, per-sequence block tables and the prefix cache (pure Python, no torch).

Blocks holding no cached content are handed out lowest-id-first from a FIFO free list: a fresh manager
gives 0, 1, 2, ...; freed blocks go to the back of the list, so ids are deterministic and easy to assert.

Prefix cache (vLLM's automatic prefix caching): once a full block's KV is computed (or is being computed
by the step just scheduled) it is registered under a key chained over (the previous block's key, the
block's tokens), so a key names the whole prefix up to the end of its block. A new sequence takes every
cached full block its tokens start with (``match`` -> ``allocate``), sharing it (reference counts), and
computes only the rest. A cached block whose last holder frees it keeps its content and key on an LRU list
("evictable", counted as free): a later ``match`` takes it back; when the plain free list is empty, a new
block is taken from the least recently used end and its key is dropped. Keys are 128-bit blake2b digests
(like vLLM's sha256 option): a collision would silently give a wrong answer, so no 64-bit hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable

from batchfleet.worker.engine.native.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """Prefix-cache key of a full block: its tokens chained onto the previous block's key (b"" first)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots: free list, reference counts, prefix cache.

    Invariants: a block is in exactly one of: the free list (ref 0, no key), the evictable list (ref 0,
    has a key), held (ref >= 1, with or without a key); ``_by_key`` and ``_key`` are inverse maps.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._ref = [0] * num_blocks
        self._key: dict[int, bytes] = {}  # block -> key of its content
        self._by_key: dict[bytes, int] = {}  # key -> block
        self.peak_used = 0
        self.queries = 0  # prompt tokens looked up in the cache at admission (vLLM: prefix_cache_queries)
        self.hits = 0  # of those, tokens whose KV came from the cache (vLLM: prefix_cache_hits)
        self.evictions = 0  # cached blocks whose content was dropped to make room

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take (evictable cached blocks included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        """Free blocks still holding cached content."""
        return len(self._evictable)

    # -- prefix cache ---------------------------------------------------------------------------
    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes`` extended to its first ``num_blocks`` full blocks (computed once each)."""
        hs, bs = seq.block_hashes, self.block_size
        assert num_blocks * bs <= len(seq.token_ids)
        while len(hs) < num_blocks:
            i = len(hs)
            hs.append(block_key(hs[-1] if hs else b"", seq.token_ids[i * bs:(i + 1) * bs]))
        return hs[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks. The last token is never covered: its
        logits are needed, so it is computed (as vLLM does) even when every block is cached."""
        if not self.enable_caching:
            return []
        out: list[int] = []
        for key in self.keys(seq, (len(seq.token_ids) - 1) // self.block_size):
            block = self._by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def commit(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (computed, or being
        computed by the step now scheduled); returns the blocks newly registered. A block whose content
        another block already holds stays unregistered (freed to the plain list later)."""
        if not self.enable_caching:
            return []
        full = min(num_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_committed:
            return []
        keys = self.keys(seq, full)
        new = []
        for i in range(seq.num_committed, full):
            block, key = seq.block_table[i], keys[i]
            if key not in self._by_key and block not in self._key:
                self._by_key[key] = block
                self._key[block] = key
                new.append(block)
        seq.num_committed = full
        return new

    def uncache(self, blocks: Iterable[int]) -> None:
        """Forget the content of ``blocks`` (a failed step never wrote it)."""
        for block in blocks:
            key = self._key.pop(block, None)
            if key is not None:
                del self._by_key[key]
            if block in self._evictable:
                del self._evictable[block]
                self._free.append(block)

    def reset_cache(self) -> None:
        """Drop every cached key (after a reset: nothing cached is trusted any more)."""
        self.uncache(list(self._key))

    # -- allocation -----------------------------------------------------------------------------
    def can_allocate(self, num_tokens: int, reserve: int = 0, hits: list[int] | tuple[int, ...] = ()) -> bool:
        """Whether ``num_tokens`` fit (the first ``len(hits)`` blocks being the cached ``hits``) while
        leaving ``reserve`` blocks free."""
        revived = sum(1 for b in hits if self._ref[b] == 0)  # taken off the evictable list
        return blocks_for(num_tokens, self.block_size) - len(hits) + reserve <= self.num_free - revived

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] | tuple[int, ...] = ()) -> None:
        """Give an empty sequence blocks for its first ``num_tokens`` tokens: the cached ``hits`` (from
        ``match``; their KV is there, so ``num_cached`` starts after them), then fresh blocks."""
        assert not seq.block_table, f"{seq.id} already holds blocks"
        if not self.can_allocate(num_tokens, hits=hits):
            need = blocks_for(num_tokens, self.block_size) - len(hits)
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for block in hits:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        fresh = [self._take() for _ in range(blocks_for(num_tokens, self.block_size) - len(hits))]
        seq.block_table = [*hits, *fresh]
        seq.num_cached = seq.num_cache_hit = len(hits) * self.block_size
        if seq.num_prompt_cache_hit is None:
            seq.num_prompt_cache_hit = min(seq.num_cache_hit, seq.num_prompt)
        seq.num_committed = len(hits)
        if self.enable_caching:
            self.queries += num_tokens
            self.hits += seq.num_cached
        self._note_peak()

    def needs_block(self, seq: Sequence) -> bool:
        """Whether writing the next token (at slot ``num_cached``) needs a new block."""
        return seq.num_cached >= len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_block(seq) or self.num_free > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for one more token in ``seq`` (adds a block only on a block boundary)."""
        if self.needs_block(seq):
            if not self.num_free:
                raise RuntimeError("out of KV blocks")
            seq.block_table.append(self._take())
            self._note_peak()

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq``: plain ones to the back of the free list in table order; cached
        ones nobody else holds to the recent end of the LRU list, tail first (a prompt's head, likelier
        shared, is evicted last)."""
        cached = []
        for block in seq.block_table:
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} freed twice"
            if self._ref[block] == 0:
                if block in self._key:
                    cached.append(block)
                else:
                    self._free.append(block)
        for block in reversed(cached):
            self._evictable[block] = None
        seq.block_table = []
        seq.num_cached = 0
        seq.num_committed = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat pool slot of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take(self) -> int:
        """A block for new content: a plain free one, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_key[self._key.pop(block)]
            self.evictions += 1
        self._ref[block] = 1
        return block

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
