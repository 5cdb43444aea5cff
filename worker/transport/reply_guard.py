"""A cap on every reply the worker's Redis client reads, checked while the reply is parsed (worker/transport/bounded.py
says why a worker needs one: a raw ``XADD`` may put entries of any size in a stream it reads).

redis-py's pure-Python parsers (RESP2 and RESP3) take a reply element by element from a ``SocketBuffer``: one
header line per element (``*<n>``, ``$<len>``, ``:<int>``, ...), then a bulk string's body. The buffer here
charges each header line at least ``ELEMENT_BYTES`` (what a parsed element costs the worker: a Python object
and its list slot, so a reply of millions of empty fields counts too) and a bulk body its length *before*
reading it, and raises ``ReplyTooLarge`` as soon as one reply (or all the replies read inside one
``one_budget``: a pipeline's, held at once) passes its limit. The parser then drops the connection: the rest
of the reply is never read and nothing of it stays buffered (Redis frees it with the connection).

``guarded_connection(base, limit)`` is a subclass of a redis-py connection class whose parser is always a
guarded one: the one it starts with (never hiredis, which reads whole replies in C), the RESP3 one ``HELLO``
switches to, the RESP2 one a server without ``HELLO`` falls back to. common/redis/clients.py puts it in every
pool of a client (plain, Sentinel, each cluster node's).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import redis
from redis._parsers import _RESP2Parser, _RESP3Parser
from redis._parsers.socket import SocketBuffer
from redis.utils import SENTINEL

ELEMENT_BYTES = 64  # the least one element is charged: a small bytes object plus its slot in a list


class ReplyTooLarge(redis.RedisError):
    """A reply passed its limit; its connection was dropped unread. Neither a ConnectionError (redis-py's
    retry would send the command again: a second ``XREADGROUP >`` delivering more entries nobody sees) nor a
    ResponseError (a pipeline would keep it as one command's answer and read on)."""


class _Left:
    """Bytes a reply (or a scope's replies) may still take."""

    __slots__ = ("limit", "left")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit


_SCOPE: ContextVar[_Left | None] = ContextVar("batchfleet_reply_budget", default=None)


@contextmanager
def one_budget(limit: int) -> Iterator[None]:
    """Every reply this thread reads inside shares one ``limit`` (a pipeline's replies are all held at once;
    each thread has its own context, so a waiter thread's read never counts against the loop's)."""
    token = _SCOPE.set(_Left(limit))
    try:
        yield
    finally:
        _SCOPE.reset(token)


class _GuardedBuffer(SocketBuffer):
    """A ``SocketBuffer`` that charges what the parser takes from it against ``self.budget``."""

    def __init__(self, sock: Any, socket_read_size: int, socket_timeout: Any) -> None:
        super().__init__(sock, socket_read_size, socket_timeout)
        self.budget = _Left(0)

    def _charge(self, n: int) -> None:
        self.budget.left -= n
        if self.budget.left < 0:
            raise ReplyTooLarge(f"a Redis reply passed {self.budget.limit} bytes: connection dropped, rest unread")

    def readline(self, timeout: Any = SENTINEL) -> bytes:
        line = super().readline(timeout=timeout)
        self._charge(max(ELEMENT_BYTES, len(line)))
        return line

    def read(self, length: int, timeout: Any = SENTINEL) -> bytes:
        self._charge(length)  # before the body is read: a 512 MB field costs its header line only
        return super().read(length, timeout=timeout)


def _arm(parser: Any, connection: Any) -> None:
    """Swap the buffer ``on_connect`` just made (still empty) for a guarded one on the same socket."""
    parser._buffer.close()
    parser._buffer = _GuardedBuffer(parser._sock, parser.socket_read_size, connection.socket_timeout)
    parser._connection = weakref.ref(connection)


def _read_guarded(parser: Any, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    buffer = parser._buffer
    if isinstance(buffer, _GuardedBuffer):
        buffer.budget = _SCOPE.get() or _Left(parser.limit)
    try:
        return read(*args, **kwargs)
    except ReplyTooLarge:
        # redis-py disconnects on any error too, except on reads made with disconnect_on_error=False
        connection = parser._connection() if parser._connection is not None else None
        if connection is not None:
            connection.disconnect()
        raise


def _guarded_class(base: type) -> type:
    """``base`` (a redis-py parser class) whose buffer is guarded from connect and whose reads are charged."""
    def on_connect(self: Any, connection: Any) -> None:
        base.on_connect(self, connection)
        _arm(self, connection)

    def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _read_guarded(self, functools.partial(base.read_response, self), *args, **kwargs)

    # limit: set by the connection (``guarded_connection``)
    return type(f"Guarded{base.__name__.lstrip('_')}", (base,), {
        "limit": 0, "_connection": None, "on_connect": on_connect, "read_response": read_response,
        "__module__": __name__})


GuardedRESP2Parser = _guarded_class(_RESP2Parser)
GuardedRESP3Parser = _guarded_class(_RESP3Parser)


def _guarded_parser(connection: Any, parser_class: type) -> type:
    """The guarded parser for the protocol ``parser_class`` parses (hiredis: the connection's protocol)."""
    if issubclass(parser_class, _RESP3Parser):
        return GuardedRESP3Parser
    if issubclass(parser_class, _RESP2Parser):
        return GuardedRESP2Parser
    return GuardedRESP3Parser if str(getattr(connection, "protocol", 2)) == "3" else GuardedRESP2Parser


@functools.cache
def guarded_connection(base: type, limit: int) -> type:
    """``base`` (a redis-py connection class) whose every parser is guarded, each reply at most ``limit``."""
    def set_parser(self: Any, parser_class: type) -> None:
        base.set_parser(self, _guarded_parser(self, parser_class))
        self._parser.limit = limit

    return type(f"Guarded{base.__name__}", (base,), {"set_parser": set_parser, "__module__": __name__})


def guard(limit: int) -> Callable[[type], type]:
    """What common/redis/clients.py ``sync_client(wrap_connection=...)`` takes: ``guarded_connection(base, limit)``."""
    return functools.partial(guarded_connection, limit=limit)
