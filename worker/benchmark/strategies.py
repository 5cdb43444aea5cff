"""Named batching strategies of the reference table, as worker options.

staticN: wait until N requests are there (no timeout; the bench flushes the last partial batch).
dynamicX: close a batch at 32 entries or X ms after its oldest entry (one bucket's batch runs to completion).
fixedX: continuous mode (native joins) with a fixed X ms window. continuous: the worker's default, continuous
mode with the adaptive window (worker/batching/window.py) bounded by 50 ms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_STRATEGIES = "static1,static8,dynamic10,dynamic50,dynamic200,continuous"


@dataclass(frozen=True)
class Strategy:
    """One batching strategy: how the worker closes batches and whether running batches take joiners."""

    name: str
    max_wait_ms: float
    max_batch_size: int
    mode: str
    window: str = "fixed"

    @property
    def static(self) -> bool:
        return self.max_wait_ms == float("inf")

    def worker_values(self) -> dict[str, float | int | str]:
        """The worker config fields this strategy sets (they replace the command's own values)."""
        return {"max_wait_ms": self.max_wait_ms, "max_batch_size": self.max_batch_size, "mode": self.mode,
                "window": self.window}


def parse_strategy(name: str, max_batch_size: int = 32, continuous_wait_ms: float = 50.0) -> Strategy:
    """``staticN``, ``dynamicX`` or ``continuous``; raises ValueError for anything else."""
    if m := re.fullmatch(r"static(\d+)", name):
        return Strategy(name, float("inf"), int(m.group(1)), "dynamic")
    if m := re.fullmatch(r"dynamic(\d+(?:\.\d+)?)", name):
        return Strategy(name, float(m.group(1)), max_batch_size, "dynamic")
    if m := re.fullmatch(r"fixed(\d+(?:\.\d+)?)", name):
        return Strategy(name, float(m.group(1)), max_batch_size, "continuous")
    if name == "continuous":
        return Strategy(name, continuous_wait_ms, max_batch_size, "continuous", "adaptive")
    raise ValueError(f"unknown strategy {name!r}: use staticN, dynamicX (ms), fixedX (ms) or continuous")


def parse_strategies(text: str, max_batch_size: int = 32) -> list[Strategy]:
    """A comma-separated list of strategy names."""
    return [parse_strategy(part.strip(), max_batch_size) for part in text.split(",") if part.strip()]
