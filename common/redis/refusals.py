"""Redis' own error answers (not connection failures, common/redis/retry.py) as the fleet's error types, with
no secret in their text.

redis-py puts a command's arguments in the text of an error raised inside a pipeline ("Command # 1 (XADD
bf:stream:32 * id j r bf:inbox:<token> p ...) of pipeline caused error: OOM ..."), and with short job ids the
cut-off still shows the client's whole inbox token, which docs/SECURITY.md says must never be logged. So
only Redis' reason is kept, and any inbox name left in it is redacted.
"""

from __future__ import annotations

import re

import redis

from batchfleet.common.errors import BatchfleetError, RedisFull, RedisRefused, RedisUnavailable

_PIPELINE = re.compile(r"^Command # \d+ \(.*\) of pipeline caused error: ", re.S)
_INBOX = re.compile(r"inbox:[A-Za-z0-9_-]+")
REASON_CHARS = 300


def reason(exc: redis.RedisError) -> str:
    """Redis' reason for refusing a command: its error text without the command, inbox tokens redacted."""
    text = _PIPELINE.sub("", str(exc))
    return " ".join(_INBOX.sub("inbox:<token>", text).split())[:REASON_CHARS]


def refused(exc: redis.RedisError, what: str) -> RedisRefused:
    """The fleet's error for Redis' refusal of ``what`` (a call's name: no key, no argument)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return RedisFull(f"{what}: Redis is full (maxmemory reached, noeviction) and refused it; nothing was "
                         f"written: retry later ({reason(exc)})")
    return RedisRefused(f"{what}: Redis refused it ({type(exc).__name__}: {reason(exc)})")


def as_fleet_error(exc: BaseException) -> BaseException:
    """A raw Redis error (one that did not go through a client's call: the gateway's own stores) as the
    fleet's error type, without its command; any other exception as it is."""
    if isinstance(exc, BatchfleetError) or not isinstance(exc, redis.RedisError):
        return exc
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return RedisUnavailable("Redis is unreachable; retry later")
    return refused(exc, "a gateway store's call")
