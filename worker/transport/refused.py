"""Commands Redis refused, as the transport's own errors (worker/transport/base.py): the loop matches no Redis
error strings. NOGROUP (Redis restarted empty) becomes ``StreamsLost``; any other refusal (NOPERM, OOM,
READONLY, ...) a ``TransportError``. Both stay ``redis.ResponseError`` too, for callers of the consumer
outside the loop. Connection-level outages pass unchanged (``common.retry.TRANSIENT``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import redis

from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.worker.transport.base import StreamsLost, TransportError

P = ParamSpec("P")
R = TypeVar("R")


class _StreamsLost(StreamsLost, redis.ResponseError):
    """NOGROUP: also a ResponseError, for callers that predate the transport's own types."""


class _Refused(TransportError, redis.ResponseError):
    """NOPERM, OOM, READONLY, ...: an operator must act."""


def refused(method: Callable[P, R]) -> Callable[P, R]:
    """Raise the transport's error types for a command Redis refused (transient errors pass unchanged)."""
    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except (TransportError, *TRANSIENT):  # CLUSTERDOWN and TRYAGAIN are ResponseErrors, and transient
            raise
        except redis.ResponseError as exc:
            kind = _StreamsLost if "NOGROUP" in str(exc) else _Refused
            raise kind(str(exc)) from exc
    return wrapper
