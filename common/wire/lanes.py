"""Priority classes ("lanes"): what a producer may ask for and how the spellings of the ecosystem map to one.

Two classes, most urgent first: ``interactive`` (a person waits for each answer: the default of
``Client``, ``AsyncClient`` and the gateway) and ``batch`` (thousands wait, nobody waits on any one:
the default of ``batchfleet bulk``, the RQ bulk job and batch jobs). Each has its own stream per bucket
(common/keys.py) and queue limit; workers read, batch and admit interactive work first, and in continuous
mode an interactive arrival preempts running batch sequences (docs/OPERATIONS.md, "Priority lanes").

Accepted spellings (``lane_of``): the class names; OpenAI's ``service_tier`` (``flex`` -> batch,
``auto`` / ``default`` -> interactive); vLLM's integer ``priority`` (lower is more urgent, default 0:
``<= 0`` -> interactive, ``> 0`` -> batch). Clients normalise once (``lane_of``) and pick the stream with it;
the stream is the only place the class travels (a worker takes it from the stream an entry came from).
Pure: no Redis.
"""

from __future__ import annotations

import math

# the lane constants' one home (common/keys.py names streams with them)
INTERACTIVE, BATCH = "interactive", "batch"
LANES = (INTERACTIVE, BATCH)  # most urgent first
SERVICE_TIERS = {"auto": INTERACTIVE, "default": INTERACTIVE, "flex": BATCH}
RANK = {lane: i for i, lane in enumerate(LANES)}  # 0 = most urgent: what the engine orders by

__all__ = ["BATCH", "INTERACTIVE", "LANES", "RANK", "SERVICE_TIERS", "batch_reserve", "lane_of"]


def lane_of(priority: object) -> str:
    """The class for a class name, a ``service_tier`` or vLLM's integer priority; ValueError otherwise."""
    if isinstance(priority, bool):  # True is an int: refuse it rather than guess
        raise ValueError(f"priority must be one of {', '.join(LANES)} or an integer, got {priority!r}")
    if isinstance(priority, int):
        return INTERACTIVE if priority <= 0 else BATCH
    if isinstance(priority, str):
        if priority in LANES:
            return priority
        if priority in SERVICE_TIERS:
            return SERVICE_TIERS[priority]
    raise ValueError(f"priority must be one of {', '.join(LANES)} (or service_tier auto, default, flex, or an "
                     f"integer), got {priority!r}"[:300])


def batch_reserve(max_running: int, share: float) -> int:
    """Decode slots the batch class keeps while interactive work runs: ``share`` of ``max_running``, at least
    one when ``share`` > 0."""
    return 0 if share <= 0 else max(1, math.ceil(share * max_running))
