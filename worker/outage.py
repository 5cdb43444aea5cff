"""Capped exponential backoff with one log line per outage state change (down, then up again)."""

from __future__ import annotations

import logging
import time

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0


class Outage:
    """Tracks whether Redis is reachable; ``failed`` returns how long to wait before the next try."""

    def __init__(self, log: logging.Logger, what: str = "redis") -> None:
        self.log = log
        self.what = what
        self.delay = 0.0
        self.since: float | None = None  # monotonic time the current outage began

    def failed(self, exc: BaseException) -> float:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s unavailable (%s: %s); retrying with backoff up to %.0fs", self.what,
                             type(exc).__name__, str(exc)[:200], BACKOFF_MAX_S)
        self.delay = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self.delay * 2))
        return self.delay

    def ok(self) -> None:
        if self.since is not None:
            self.log.warning("%s available again after %.1fs", self.what, time.monotonic() - self.since)
            self.since = None
        self.delay = 0.0

    @property
    def down(self) -> bool:
        return self.since is not None
