"""One request's token state as the scheduler and block manager see it (pure Python, no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens of one request plus where their KV lives.

    Invariants: while RUNNING between steps, ``num_cached == len(token_ids) - 1`` (the newest sampled
    token has no KV yet) once its prefill is complete, ``num_cached < len(token_ids)`` while a chunked
    prefill is under way; ``len(block_table) * block_size >= num_cached``. While WAITING,
    ``num_cached == 0`` and ``block_table == []`` (a preempted sequence is recomputed, except the blocks
    the prefix cache still holds). ``block_hashes[i]`` is the prefix-cache key of tokens
    ``[i * block_size, (i + 1) * block_size)`` chained over every earlier block: a pure function of
    ``token_ids``, which only grow, so it is computed once per full block.
    """

    id: str
    token_ids: list[int]
    max_new_tokens: int
    stopper: Callable[[int], bool] | None = None  # token -> finished? (default: length only)
    payload: Any = None  # the engine's per-request data (request, RNG, stop checker, timings)
    bucket: int = 0  # prompt-length bucket: one prefill step never mixes buckets
    num_prompt: int = 0
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    priority: int = 0  # 0 = interactive, 1 = background (common/wire/priority.py LEVEL): lower is more urgent
    arrival: int = 0  # the scheduler's admission counter: order within a priority, kept across preemptions
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block of token_ids (as needed)
    num_committed: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cache_hit: int = 0  # prompt tokens the prefix cache supplied at the last admission
    # of the prompt's tokens, those the prefix cache supplied at the first admission (OpenAI's
    # cached_tokens: a preempted sequence's re-admission finds its own blocks, which it computed itself)
    num_prompt_cache_hit: int | None = None

    def __post_init__(self) -> None:
        self.num_prompt = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def append(self, token: int) -> bool:
        """Add one sampled token; return True when the sequence is finished."""
        self.token_ids.append(token)
        if self.stopper is not None and self.stopper(token):
            return True
        return self.num_generated >= self.max_new_tokens
