"""Commands Redis refused, as the transport's own errors (worker/transport/base.py): the loop matches no Redis
error strings. NOGROUP (Redis restarted empty) becomes ``StreamsLost``; any other refusal (NOPERM, OOM,
READONLY, ...) a ``TransportError``. Both stay ``redis.ResponseError`` too, for callers of the consumer
outside the loop. Connection-level outages pass unchanged (``common.retry.TRANSIENT``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, ParamSpec, TypeVar

import redis

from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.worker.transport.base import StreamsLost, TransportError

P = ParamSpec("P")
R = TypeVar("R")


class _StreamsLost(StreamsLost, redis.ResponseError):
    """NOGROUP: also a ResponseError, for callers that predate the transport's own types."""


class _Refused(TransportError, redis.ResponseError):
    """NOPERM, OOM, READONLY, ...: an operator must act."""


class Refusals:
    """Translates a refusal raised inside a ``with`` block; stateless, so one shared instance (``REFUSALS``)
    serves every thread. The hot path (``Settler.write_replies``) uses it inline: no wrapper call per reply."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> Literal[False]:
        # CLUSTERDOWN and TRYAGAIN are ResponseErrors, and transient: they pass unchanged
        if not isinstance(exc, redis.ResponseError) or isinstance(exc, (TransportError, *TRANSIENT)):
            return False
        raise (_StreamsLost if "NOGROUP" in str(exc) else _Refused)(str(exc)) from exc


REFUSALS = Refusals()


def refused(method: Callable[P, R]) -> Callable[P, R]:
    """Raise the transport's error types for a command Redis refused (transient errors pass unchanged)."""
    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with REFUSALS:
            return method(*args, **kwargs)
    return wrapper
