"""Priority: what a producer may ask for and how the spellings of the ecosystem map to one.

Two priorities, most urgent first: ``interactive`` (a person waits for each answer: the default of
``Client``, ``AsyncClient`` and the gateway) and ``background`` (thousands wait, nobody waits on any one:
the default of ``batchfleet bulk``, the RQ bulk job and OpenAI batch jobs). Each has its own stream per bucket
(common/keys.py) and queue limit; workers read, batch and admit interactive work first, and in continuous
mode an interactive arrival preempts running background sequences (docs/OPERATIONS.md, "Priority").

Accepted spellings (``priority_of``): the priority names; OpenAI's ``service_tier`` (``flex`` -> background,
``auto`` / ``default`` -> interactive); vLLM's integer ``priority`` (lower is more urgent, default 0:
``<= 0`` -> interactive, ``> 0`` -> background); ``batch``, the deprecated name of ``background`` (accepted
on input for one release, never written). Clients normalise once (``priority_of``) and pick the stream with
it; the stream is the only place the priority travels (a worker takes it from the stream an entry came from).
Pure: no Redis.
"""

from __future__ import annotations

import math

# the priority constants' one home (common/keys.py names streams with them)
INTERACTIVE, BACKGROUND = "interactive", "background"
PRIORITIES = (INTERACTIVE, BACKGROUND)  # most urgent first
SERVICE_TIERS = {"auto": INTERACTIVE, "default": INTERACTIVE, "flex": BACKGROUND}
# older names still accepted on input (docs/CONFIGURATION.md, "Deprecated names"): drop after one release
DEPRECATED = {"batch": BACKGROUND}
LEVEL = {priority: i for i, priority in enumerate(PRIORITIES)}  # 0 = most urgent: vLLM's int priority

__all__ = ["BACKGROUND", "DEPRECATED", "INTERACTIVE", "LEVEL", "PRIORITIES", "SERVICE_TIERS", "background_reserve",
           "old_name", "priority_of"]


def priority_of(asked: object) -> str:
    """The priority for a priority name, a ``service_tier`` or vLLM's integer priority; ValueError otherwise."""
    if isinstance(asked, bool):  # True is an int: refuse it rather than guess
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)} or an integer, got {asked!r}")
    if isinstance(asked, int):
        return INTERACTIVE if asked <= 0 else BACKGROUND
    if isinstance(asked, str):
        if asked in PRIORITIES:
            return asked
        if asked in SERVICE_TIERS:
            return SERVICE_TIERS[asked]
        if asked in DEPRECATED:
            return DEPRECATED[asked]
    raise ValueError(f"priority must be one of {', '.join(PRIORITIES)} (or service_tier auto, default, flex, or "
                     f"an integer), got {asked!r}"[:300])


def background_reserve(max_running: int, share: float) -> int:
    """Decode slots background work keeps while interactive work runs: ``share`` of ``max_running``, at least
    one when ``share`` > 0."""
    return 0 if share <= 0 else max(1, math.ceil(share * max_running))


def old_name(priority: str) -> str:
    """The name a priority had before (``background``: ``batch``), for the outputs that still carry it for one
    release (the metrics' ``class`` label, ``batchfleet status --json``'s ``class`` key)."""
    return next((old for old, new in DEPRECATED.items() if new == priority), priority)
