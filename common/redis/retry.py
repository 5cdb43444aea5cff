"""The one capped exponential backoff and the one definition of a transient Redis error.

Workers (their loop and startup) and clients (sync and async) retry through the same policy: a delay
that doubles from ``min_s`` up to ``max_s`` per consecutive failure, and one log line when the
resource goes away and one when it is back (never one per retry).
"""

from __future__ import annotations

import logging
import time

import redis

# What a retry can cure: a dropped connection, a restart (LOADING is a ConnectionError subclass), a Redis Cluster
# between a master's loss and its replica's promotion (CLUSTERDOWN: redis-py raises it once its own few retries
# are spent, within a second or two) or moving a slot (TRYAGAIN).
TRANSIENT: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError,
                                              redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)


def transient_reason(exc: BaseException) -> str:
    """What went wrong with a TRANSIENT error, in words: "connection refused" when the connect was refused
    (nothing listens on that port: redis-py's message says only "Error 111 connecting" or "Connect call
    failed"), else the error itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or "Error 111 " in str(seen):
            return "connection refused (is Redis listening on that host and port?)"
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {exc}"


class Backoff:
    """Tracks one resource's availability; ``failed`` returns how long to wait before the next try."""

    def __init__(self, log: logging.Logger, what: str = "redis", min_s: float = 0.1, max_s: float = 5.0) -> None:
        self.log = log
        self.what = what
        self.min_s = min_s
        self.max_s = max_s
        self.failures = 0  # consecutive failures since the last success
        self.since: float | None = None  # monotonic time the current outage began

    def failed(self, exc: BaseException) -> float:
        """Record a failure; returns the delay before the next try (min_s, 2 min_s, ... up to max_s)."""
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("%s unavailable (%s: %s); retrying with backoff up to %.0fs", self.what,
                             type(exc).__name__, str(exc)[:200], self.max_s)
        delay = min(self.max_s, self.min_s * 2 ** min(self.failures, 16))
        self.failures += 1
        return delay

    def ok(self) -> None:
        """Record a success: logs once when an outage ends and resets the delay."""
        if self.since is not None:
            self.log.warning("%s available again after %.1fs", self.what, time.monotonic() - self.since)
            self.since = None
        self.failures = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    @staticmethod
    def wait_left(deadline: float | None, want: float) -> float:
        """How long to sleep before the next try: ``want`` capped by a monotonic deadline (<= 0: give up)."""
        return want if deadline is None else min(want, deadline - time.monotonic())
