"""Every Redis call of one client, bounded: within the call's deadline (or ``retry_s`` without one),
connection errors retried with capped backoff, Redis' own refusals raised as the fleet's types (RedisFull,
RedisRefused: common/redis/refusals.py), a Redis function called by FCALL where Redis has it and by
EVALSHA of the same body where it has not (6.2). The ``AsyncClient`` makes every call through one of these.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import RedisUnavailable, Timeout
from batchfleet.common.redis.clients import WAIT_TIMEOUT_MS, require_replicas, same_node, write_acked
from batchfleet.common.redis.functions import BELL_MAXLEN, LIVE_WORKER_MS, Functions
from batchfleet.common.redis.refusals import refused
from batchfleet.common.redis.retry import TRANSIENT, Backoff, transient_reason
from batchfleet.common.redis.url import redact_url
from batchfleet.common.wire.protocol import MAX_PAYLOAD_BYTES
from batchfleet.producer.core import Deadline
from batchfleet.producer.outgoing import ADDED_PAST_LIMIT, Outgoing

log = logging.getLogger("producer")
T = TypeVar("T")
NEAR_LIMIT = 0.5  # a stream seen at this share of its queue limit or more is enqueued to through the function
LENGTH_TRUST_S = 1.0  # how long a stream length this client saw stands for the stream's


class RedisCalls:
    """The bounded calls of one client over its pool ``r`` (see the module doc)."""

    def __init__(self, r: redis.asyncio.Redis, conn: ConnectionConfig, retry_s: float) -> None:
        self.r, self.conn, self.retry_s = r, conn, retry_s
        self.backoff = Backoff(log, "redis", min_s=0.05, max_s=2.0)  # shared with the inbox reader
        self.functions = Functions(r)
        self._made: set[str] = set()  # named tenants' streams this client added to through the function
        self._lengths: dict[str, tuple[int, float]] = {}  # stream -> (its length after our last add, when)
        self._probing: set[str] = set()  # streams seen near their limit with a plain add (a probe) on its way

    async def io(self, call: Callable[[], Awaitable[T]], deadline: Deadline, what: str) -> T:
        """``call()`` within the deadline, retrying connection errors with backoff (see the module doc)."""
        give_up = None if deadline.timeout is not None else time.monotonic() + self.retry_s
        fresh = True  # a pooled connection Redis closed (a restart) fails once: retried at once, not an outage
        tried, failed = False, None  # what the message says when the deadline passes: why, not just "late"
        while True:
            left = deadline.left()
            if left == 0:
                raise self._late(what, deadline, tried, failed)
            if give_up is not None:  # no timeout: a frozen Redis must not hold one try past retry_s
                left = max(0.05, give_up - time.monotonic())
            try:
                tried = True
                async with asyncio.timeout(left):  # not wait_for: it can swallow a cancellation (stream.py)
                    out = await call()
            except TimeoutError:
                if give_up is None:
                    raise self._late(what, deadline, tried, failed) from None
                raise RedisUnavailable(f"{what}: Redis at {self.conn.redis_url.split('@')[-1]} did not answer "
                                       f"for {self.retry_s:g} s") from None
            except TRANSIENT as exc:
                failed = exc
                if fresh:
                    fresh = False
                    continue
                delay = self.backoff.failed(exc)
                if give_up is not None:
                    if time.monotonic() >= give_up:
                        raise RedisUnavailable(f"{what}: Redis at {self.conn.redis_url.split('@')[-1]} unreachable "
                                               f"for {self.retry_s:g} s ({transient_reason(exc)})") from None
                    delay = min(delay, give_up - time.monotonic())
                await asyncio.sleep(deadline.sooner(max(0.0, delay)))
                continue
            except redis.RedisError as exc:  # Redis' own refusal (full, read-only, no permission): the fleet's type,
                raise refused(exc, what) from None  # its text without the command (an inbox token is a secret)
            self.backoff.ok()
            return out

    def _late(self, what: str, deadline: Deadline, tried: bool, failed: BaseException | None) -> Timeout:
        """The Timeout of a call whose deadline passed, saying why: Redis refused or dropped the connection
        until then; the deadline passed before the call was sent (a timeout shorter than the client's own
        work); or Redis was asked and did not answer in time."""
        t = deadline.timeout
        if failed is not None:
            return Timeout(f"{what}: cannot reach Redis at {redact_url(self.conn.redis_url)}: "
                           f"{transient_reason(failed)}; retried until the {t:g} s timeout passed")
        if not tried:
            return Timeout(f"{what}: the request's deadline passed (timeout {t:g} s) before it was sent to Redis")
        return Timeout(f"{what}: the request's deadline passed (timeout {t:g} s) before Redis answered")

    async def function(self, name: str, keys: list[str], args: list) -> Any:
        """FCALL of a library function; EVALSHA of the same body where Redis has no functions (6.2) or the
        library is not loaded yet."""
        n = self.conn.wait_replicas  # > 0: the write counts once n replicas have it (WAIT, same connection)
        # keys[0]: every library function has keys; a cluster sends the WAIT to the master of their slot
        return await self.functions.call(name, keys, args, send=lambda cmd: write_acked(self.r, n, cmd, keys[0]))

    async def append(self, stream: str, fields: dict[str, Any], queued: str = "", tenant: str = "",
                     bell: str = "") -> tuple[Any, int]:
        """``XADD`` then ``XLEN`` of ``stream`` in one round trip (then WAIT, as ``function``): the new entry's id and
        the stream's length with it. Plain commands, as the enqueue function's own: through the function Redis
        spends ~4x the XADD's time on the entry (issue 29)."""
        n = self.conn.wait_replicas
        async with self.r.pipeline(transaction=False) as pipe:  # gives its connection back however it ends
            pipe.xadd(stream, fields)
            pipe.xlen(stream)
            if tenant:  # a named tenant's: workers read it even if Redis lost the set since its first add
                pipe.sadd(queued, tenant)
            if n > 0:
                pipe.execute_command("WAIT", n, WAIT_TIMEOUT_MS, **same_node(self.r, stream))
            out = await pipe.execute()
        if n > 0:
            require_replicas(out[-1], n, f"enqueue to {stream}")
        if tenant and bell and out[2] == 1:  # new to the set again (Redis lost it, or it was retired): ring, as the
            # function does. The add stands whatever becomes of the ring: one lost with its connection must not
            # have the caller send the add again (a second copy of the request); the workers' next look at the set
            # finds the tenant within a second
            try:
                await self.r.xadd(bell, {"t": tenant}, maxlen=BELL_MAXLEN, approximate=True)
            except TRANSIENT as exc:
                log.debug("ring of tenant %s not sent: %r", tenant, exc)
        return out[0], int(out[1])

    async def enqueue(self, job: Outgoing, workers: str, check: bool, deadline: Deadline, queued: str = "",
                      group: str = "workers", bell: str = "") -> int:
        """The enqueue function's answer for ``job`` (``Outgoing.accepted``). Through the function (the checks
        and the add in one step) where the live-worker check is due or this client saw the stream at or past
        half its limit within LENGTH_TRUST_S; else a plain ``XADD`` + ``XLEN``, which checks the limit only
        after the add (``Outgoing.appended``): a queue at its limit refuses the function's way, so a refusal
        costs Redis no entry, save one plain add per stream and LENGTH_TRUST_S that finds it full (one at a time:
        while it is on its way, the other enqueues to that stream go through the function; a refusal by the
        function renews the length seen). That add is
        withdrawn with ``XDEL``: gone unread, it is never answered, and a retry under the same job id is a job
        like any other (a cancel would answer the id ``cancelled``, the retry with it). A worker that read it
        first runs it: the answer of a retry under that id (the client keeps it as unclaimed).

        A named tenant's first add to a stream goes through the function (``queued``: the shard's
        ``Keys.queued_tenants``; ``group``: the workers'; ``bell``: ``Keys.tenant_bell``), which makes the stream with
        the workers' group and tells the workers of the tenant; plain adds may follow."""
        what = f"enqueue of job {job.id}"
        if job.tenant and (check or job.stream not in self._made):
            args = job.args(check, LIVE_WORKER_MS, group)
            keys = [job.stream, workers, queued, bell] if bell else [job.stream, workers, queued]
            code = await self.io(lambda: self.function("enqueue", keys, args), deadline, what)
            if code == 1:
                self._made.add(job.stream)
            elif code == 0:
                self._lengths[job.stream] = (job.max_queue_len, time.monotonic())
            return code
        seen_len, seen_at = self._lengths.get(job.stream, (0, -math.inf))
        near = job.max_queue_len and seen_len >= job.max_queue_len * NEAR_LIMIT
        # near the limit, one plain add at a time probes a length no longer trusted: a burst of submits (all
        # deciding before the first add answers) through the function otherwise, never a burst of plain adds
        if check or (near and (time.monotonic() - seen_at < LENGTH_TRUST_S or job.stream in self._probing)):
            args = job.args(check, LIVE_WORKER_MS)
            code = await self.io(lambda: self.function("enqueue", [job.stream, workers], args), deadline, what)
            if code == 0:  # the function found the queue full: that length stands for LENGTH_TRUST_S again
                self._lengths[job.stream] = (job.max_queue_len, time.monotonic())
            return code
        fields = job.fields()
        if len(fields["p"]) > MAX_PAYLOAD_BYTES:
            return -2
        if near:
            self._probing.add(job.stream)
        try:
            entry_id, length = await self.io(lambda: self.append(job.stream, fields, queued, job.tenant, bell),
                                              deadline, what)
        finally:
            if near:
                self._probing.discard(job.stream)
        self._lengths[job.stream] = (length, time.monotonic())
        code = job.appended(length)
        if code == ADDED_PAST_LIMIT:
            await self.io(lambda: self.r.xdel(job.stream, entry_id), deadline, f"withdrawal of job {job.id}")
        return code
