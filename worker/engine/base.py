"""The engine interface the worker loop drives, and the types crossing it (no Redis here).

Lifecycle: the loop calls ``add`` with requests of ONE bucket, then ``step`` repeatedly; each step
returns the completions that finished during it. ``add`` may be called again between steps: an engine
that cannot take requests mid-batch (hf) reports ``accepts_joins = False`` and the loop waits until it
is idle. Engines never block on I/O and never see Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchfleet.common.guided import Guide


@dataclass
class GenRequest:
    """One validated request as the engine sees it."""

    id: str
    prompt: list[int]
    bucket: int
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    enqueued_at: float = 0.0  # unix time, for bookkeeping only
    guide: Guide | None = None  # structured output: each step samples only tokens the grammar allows
    logprobs: int | None = None  # None = off; k: record each token's logprob and its k best alternatives


@dataclass
class Completion:
    """A finished (or failed) request. ``error`` set means the engine could not serve it."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "eos" ("" when error is set)
    started_at: float  # unix time its batch started (or it joined a running batch)
    first_token_at: float  # unix time its first output token was computed
    batch_size: int  # size of the batch it first ran in
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list | None = None  # one (logprob, top ids, top logprobs) per token when the request asked


class Engine(Protocol):
    """What the worker loop needs from an engine."""

    accepts_joins: bool  # True: add() may be called while a batch runs (continuous batching)

    def add(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests (all of one bucket) to run from the next step."""

    def step(self) -> list[Completion]:
        """Run one unit of work (a decode step, or a whole batch) and return what finished."""

    def has_work(self) -> bool:
        """Whether any added request has not been returned yet."""

    def num_active(self) -> int:
        """Requests added and not yet returned."""

    def stats(self) -> dict[str, Any]:
        """Counters for status and benchmarks (e.g. KV blocks total/used/waste); msgpack-encodable values."""

    def reset(self) -> None:
        """Drop every active request and free what it holds (called after step() raised)."""

    def abort(self, ids: Sequence[str]) -> list[str]:
        """Drop these requests (cancelled) and free what they hold at once; returns the ids found."""

    def progress(self, ids: Sequence[str]) -> dict[str, list[int]]:
        """Tokens generated so far by each of these running requests (streaming); engines that finish a
        request within one step may return nothing. A request that asked for logprobs gets a
        ``sampling.Generated`` list, whose ``logprobs`` holds one entry per token."""
