"""The engine interface the worker loop drives, and the types crossing it (no Redis here).

Lifecycle: the loop calls ``add`` with requests of ONE bucket, then ``step`` repeatedly; each step
returns the completions that finished during it. The engine owns its capacity: ``room`` says how many
more requests ``add`` may take now (an engine that cannot take requests mid-batch, hf or native in
dynamic mode, says 0 until it is idle). Engines never block on I/O and never see Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchfleet.common.errors import ENGINE_ERROR
from batchfleet.common.wire.params import DEFAULT, Params


@dataclass
class GenRequest:
    """One validated request as the engine sees it: the wire's parameters as they came (common/wire/params.py:
    the sampler reads ``params``), the bucket and priority of the stream it came from."""

    id: str
    prompt: list[int]
    bucket: int
    params: Params = DEFAULT
    enqueued_at: float = 0.0  # unix time, for bookkeeping only
    priority: int = 0  # 0 = interactive, 1 = background (LEVEL of its stream, common/wire/priority.py): lower first
    embed: bool = False  # an embed request (worker/engine/embed.py): prefill only, answered with a vector


@dataclass
class Completion:
    """A finished (or failed) request. ``error`` set means the engine could not serve it (``error_code``:
    the Error reply's code, ``guide_failed`` when llguidance gave up on its guide). ``extra``: what the
    engine did for it (native: ``cached_tokens``, prompt tokens the prefix cache supplied, and
    ``preemptions``), into ``Result.extra``."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "eos" ("" when error is set)
    started_at: float  # unix time its batch started (or it joined a running batch)
    first_token_at: float  # unix time its first output token was computed
    batch_size: int  # size of the batch it first ran in
    error: str | None = None
    error_code: str = ENGINE_ERROR
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list | None = None  # one (logprob, top ids, top logprobs) per token when the request asked
    embedding: list[float] | None = None  # an embed request's vector


class Engine(Protocol):
    """What the worker loop needs from an engine."""

    def add(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests (all of one bucket) to run from the next step."""

    def step(self) -> list[Completion]:
        """Run one unit of work (a decode step, or a whole batch) and return what finished."""

    def has_work(self) -> bool:
        """Whether any added request has not been returned yet."""

    def num_active(self) -> int:
        """Requests added and not yet returned."""

    def room(self, priority: int = 0) -> int:
        """How many more requests of ``priority`` ``add`` may take now (0: wait for what runs to finish).
        An engine that preempts may give interactive work room that background work holds."""

    def failed_ids(self) -> list[str]:
        """After ``step`` raised: the ids of the requests that were in that step (each is retried alone);
        empty when the engine cannot tell (then every active request is)."""

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
