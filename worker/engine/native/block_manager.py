"""Fixed pool of KV blocks and per-sequence block tables (pure Python, no torch).

Blocks are handed out lowest-id-first from a FIFO free list: a fresh manager gives 0, 1, 2, ...;
freed blocks go to the back of the list, so ids are deterministic and easy to assert in tests.
"""

from __future__ import annotations

from collections import deque

from batchfleet.worker.engine.native.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the free list of ``num_blocks`` blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``num_tokens`` fit in free blocks while leaving ``reserve`` blocks free."""
        return blocks_for(num_tokens, self.block_size) + reserve <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give an empty sequence blocks for its first ``num_tokens`` tokens."""
        assert not seq.block_table, f"{seq.id} already holds blocks"
        n = blocks_for(num_tokens, self.block_size)
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        seq.block_table = [self._free.popleft() for _ in range(n)]
        self._note_peak()

    def needs_block(self, seq: Sequence) -> bool:
        """Whether writing the next token (at slot ``num_cached``) needs a new block."""
        return seq.num_cached >= len(seq.block_table) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_block(seq) or len(self._free) > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for one more token in ``seq`` (adds a block only on a block boundary)."""
        if self.needs_block(seq):
            if not self._free:
                raise RuntimeError("out of KV blocks")
            seq.block_table.append(self._free.popleft())
            self._note_peak()

    def free(self, seq: Sequence) -> None:
        """Return all blocks of ``seq`` to the pool (at once, in table order)."""
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat pool slot of token ``position`` of ``seq``."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used)
