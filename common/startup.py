"""A starting worker's phases, timed: where its seconds before serving go.

Each slow step of a start (imports, the model load, the kernel choice, joining the fleet, ...) runs inside
``PHASES.phase(name, message)``: the message goes out at once on the ``batchfleet.startup`` logger (what
`batchfleet demo` relays while it waits), and the phase's own seconds are kept, those of phases inside it
excluded, so that the phases add up. ``PHASES.report`` logs one line per phase and the total since the process
started (the interpreter's start included: ``process_started``), once the worker serves.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfleet.common.logs import STARTUP_LOGGER, startup_phase

_IMPORTED = time.time()


def process_started() -> float:
    """Unix time this process started (Linux: /proc/self/stat); elsewhere, when this module was imported."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot (fields 1-2 are pid and name)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


@dataclass(eq=False)  # identity: list.remove finds this very phase
class _Open:
    """A phase under way: its start (clock) and the seconds of the phases that ran inside it so far."""

    name: str
    start: float
    inner: float = 0.0


class Phases:
    """Seconds per named phase (a name run twice adds up), each phase's own: nested phases are subtracted."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._open: list[_Open] = []  # innermost last

    @contextmanager
    def phase(self, name: str, message: str = "", *args: Any) -> Iterator[None]:
        if message:
            startup_phase(message, *args)
        self.seconds.setdefault(name, 0.0)  # reported in the order the phases began
        entry = _Open(name, self.clock())
        self._open.append(entry)
        try:
            yield
        finally:
            self._open.remove(entry)
            took = self.clock() - entry.start
            self.seconds[name] += took - entry.inner
            if self._open:
                self._open[-1].inner += took

    def report(self, started: float | None = None, note: str = "") -> dict[str, float]:
        """Log one line per phase, "other" (the time in none of them, the interpreter's start included) and the
        total since ``started`` (default: the process start); returns them (seconds) and starts over."""
        total = time.time() - (process_started() if started is None else started)
        out = {name: round(s, 3) for name, s in self.seconds.items()}
        out["other"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        out["total"] = round(total, 3)
        log = logging.getLogger(STARTUP_LOGGER)
        for name, s in out.items():
            if name != "total":
                log.info("start phase %-8s %6.2f s", name, s)
        log.info("start total %.2f s from process start to serving%s", total, f" ({note})" if note else "")
        self.seconds = {}
        return out


PHASES = Phases()  # one start per process (a process runs one worker)
