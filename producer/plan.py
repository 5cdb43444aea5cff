"""Sans-IO retry and wait decisions shared by Client and AsyncClient.

The clients make the Redis calls and sleep (blocking or awaited); the objects here decide how long to
sleep, when to give up and what a popped reply means. Nothing here does I/O, so the sync and async
clients cannot drift apart on retry semantics.
"""

from __future__ import annotations

import logging
import time

from batchfleet.common.errors import Timeout
from batchfleet.common.protocol import Result
from batchfleet.common.retry import Backoff
from batchfleet.producer.core import parse_reply

log = logging.getLogger("producer")


def client_backoff() -> Backoff:
    """The backoff of one client (shared by all its calls and threads): an outage is logged once per
    client, and delays grow 0.05 s, 0.1 s, ... up to 2 s while it lasts."""
    return Backoff(log, "redis", min_s=0.05, max_s=2.0)


def retry_deadline(retry_s: float, timeout: float | None = None) -> float:
    """Monotonic time until which a call retries connection errors: ``retry_s``, bounded by ``timeout``."""
    return time.monotonic() + (retry_s if timeout is None else min(retry_s, timeout))


def time_left(start: float, timeout: float | None) -> float | None:
    """What is left of ``timeout`` seconds counted from monotonic ``start`` (never negative; None: no limit)."""
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


class RetryPlan:
    """One call retried through connection errors until a monotonic deadline.

    The caller runs its call; on a transient error it asks ``failed(exc)`` how long to sleep (which
    re-raises ``exc`` once the deadline leaves no time), on success it reports ``succeeded()``.
    """

    def __init__(self, backoff: Backoff, deadline: float | None) -> None:
        self.backoff = backoff
        self.deadline = deadline

    def failed(self, exc: BaseException) -> float:
        """Seconds to sleep before the next try; re-raises ``exc`` when the deadline has no room left."""
        wait = Backoff.wait_left(self.deadline, self.backoff.failed(exc))
        if wait <= 0:
            raise exc
        return wait

    def succeeded(self) -> None:
        self.backoff.ok()


class ResultWait:
    """Waiting for one job's reply.

    Each BLPOP blocks at most ``pop_s`` (kept below the socket timeout) and never past the caller's
    timeout; connection errors are retried until that timeout (a Redis restart while waiting is
    survived); a popped reply becomes a Result, or raises JobFailed / Timeout.
    """

    def __init__(self, job_id: str, timeout: float | None, pop_s: float, backoff: Backoff) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.pop_s = pop_s
        self.backoff = backoff

    def next_pop_s(self) -> float:
        """Timeout (s) of the next BLPOP; raises Timeout once the caller's timeout has passed."""
        wait = self.pop_s if self.deadline is None else min(self.pop_s, self.deadline - time.monotonic())
        if wait <= 0:
            raise Timeout(f"no result for job {self.job_id} within {self.timeout} s")
        return max(wait, 0.01)

    def failed(self, exc: BaseException) -> float:
        """Seconds to sleep after a connection error: the backoff delay, cut at the deadline (the next
        ``next_pop_s`` then raises Timeout)."""
        return max(0.0, Backoff.wait_left(self.deadline, self.backoff.failed(exc)))

    def popped(self, got: tuple[bytes, bytes] | list[bytes] | None) -> Result | None:
        """Record a completed BLPOP: the Result when it returned the reply, None to pop again."""
        self.backoff.ok()
        return None if got is None else parse_reply(self.job_id, got[1])
