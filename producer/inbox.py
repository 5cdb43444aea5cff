"""One client's inbox: the reply stream every worker writes this client's answers to, read by one task.

Why a stream per client process and not a list per job: waiting on a list per job costs a connection per waiting
request (a blocking pop each) and consumes the reply as it is read, so a Redis crash between the read and its answer
loses the reply. Here one task XREADs the inbox (never blocking longer than the socket timeout) and hands each entry
to the job waiting for it; the entry is deleted only once the caller has taken it (deltas at once), so whatever
instant Redis dies at, the reader reads it again after the restart (appendfsync always keeps the entry). Replies
nobody waits for expire with the inbox's TTL. A final reply is stored apart and rung for (producer/answers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import redis

from batchfleet.common.errors import INVALID_REQUEST, InvalidRequest, JobFailed, RedisRefused, RedisUnavailable
from batchfleet.common.redis.clients import xread
from batchfleet.common.redis.refusals import reason, refused
from batchfleet.common.redis.retry import TRANSIENT
from batchfleet.common.wire.protocol import Delta, Result
from batchfleet.producer.answers import REUSED, Answers, job_id_of
from batchfleet.producer.core import Deadline, parse_reply
from batchfleet.producer.redis_calls import RedisCalls
from batchfleet.producer.waiters import Final, Waiter, WaitExpired

log = logging.getLogger("producer")

MAX_UNCLAIMED = 100_000  # finals with no waiter kept for a later result(job_id) (a reused inbox name)
MAX_ABANDONED = 100_000  # ids whose answer is still to be dropped; the oldest are forgotten beyond it
ABANDONED_TTL_S = 3600.0  # an answer later than this (the workers' default reply TTL) never comes
READ_COUNT = 1024


class Inbox:
    """Reads one inbox stream and routes its entries to the jobs waiting for them."""

    def __init__(self, reader: redis.asyncio.Redis, writer: redis.asyncio.Redis, key: str, block_ms: int,
                 calls: RedisCalls) -> None:
        self.reader = reader  # a connection of its own: its XREAD blocks
        self.writer = writer  # the client's pool: XDEL of consumed entries
        self.key = key
        self.block_ms = block_ms
        self.calls = calls  # the client's: its backoff, and its retry_s (see _wait)
        self.last_read = time.monotonic()  # the last XREAD that returned (every block_ms at most, if healthy)
        self._jobs: dict[str, Waiter] = {}
        # cancelled or given up by the caller: answers are dropped (and deleted) when they come;
        # id -> monotonic time it was given up, oldest first
        self._abandoned: OrderedDict[str, float] = OrderedDict()
        self._unclaimed: OrderedDict[str, Final] = OrderedDict()
        self._last = "0-0"  # everything in the inbox: a reused inbox name picks up earlier replies
        self._consumed: list[str] = []
        self._answers = Answers()
        self._task: asyncio.Task | None = None
        self._deleting: asyncio.Task | None = None
        self._closing = False

    def expect(self, job_id: str, stream: bool = False, fingerprint: bytes | None = None) -> bool:
        """Register a job before it is enqueued, so no reply can arrive unseen; False: another call's waiter stays
        (the same request: it joins that call's job). InvalidRequest, and nothing changes, when a call of this
        client waits on ``job_id`` for a different request (``fingerprint``, ``Outgoing.fingerprint``): one job
        id names one job per inbox, so both would get one request's answer."""
        waiter = self._jobs.get(job_id)
        if waiter is not None and fingerprint is not None:
            if waiter.fingerprint is not None and waiter.fingerprint != fingerprint:
                raise InvalidRequest(f"job id {job_id!r} is in flight in this client with a different request "
                                     "(prompt or parameters): submit it under a new job id")
            waiter.fingerprint = fingerprint
        self._abandoned.pop(job_id, None)
        fresh = waiter is None
        if fresh:
            waiter = self._jobs[job_id] = Waiter(stream, fingerprint)
            if job_id in self._unclaimed:  # its answer came before anyone asked (a retry after an unknown outcome)
                waiter.settle(self._unclaimed.pop(job_id))
        self.start()
        return fresh

    def abandon(self, job_id: str) -> None:
        """Nobody will take this job's answer (given up, or its enqueue's outcome is unknown): an answer
        already here is deleted now, one still to come is deleted when it comes; nothing stays in memory
        past that (or past ABANDONED_TTL_S / MAX_ABANDONED, for an answer that never comes)."""
        waiter = self._jobs.pop(job_id, None)
        taken = self._unclaimed.pop(job_id, None)
        if waiter is not None and (held := waiter.answer()) is not None:
            taken = held
        if taken is not None:
            self.consumed(taken[0])
            return
        now = time.monotonic()
        self._abandoned[job_id] = now
        self._abandoned.move_to_end(job_id)
        while self._abandoned:
            oldest, since = next(iter(self._abandoned.items()))
            if len(self._abandoned) <= MAX_ABANDONED and now - since < ABANDONED_TTL_S:
                break
            del self._abandoned[oldest]

    def forget(self, job_id: str) -> None:
        """Nobody waits on this job now: it was refused (QueueFull, NoWorkers...), or its submit's outcome is unknown
        and the caller may retry under its id. An answer that comes anyway (or came) waits for a later result()."""
        waiter = self._jobs.pop(job_id, None)
        if waiter is not None and (taken := waiter.answer()) is not None:  # read already: never read again
            self._park(job_id, taken)

    def held(self) -> dict[str, int]:
        """How many jobs this inbox holds something for (tests: nothing may stay behind)."""
        return {"waiting": len(self._jobs), "abandoned": len(self._abandoned), "unclaimed": len(self._unclaimed),
                "to_delete": len(self._consumed)}

    def waiter(self, job_id: str) -> Waiter:
        """The job's waiter; one is made for a job this client did not submit (a reused inbox name)."""
        self.expect(job_id)
        return self._jobs[job_id]

    async def final(self, job_id: str, deadline: Deadline) -> Result:
        """The job's Result (raises the error its reply stands for); Timeout when the deadline passes first
        (the job stays expected: a later call may still get it)."""
        entry_id, outcome = await self.take(job_id, deadline)
        try:
            await self._empty(job_id, entry_id, deadline)
        except (WaitExpired, RedisUnavailable, RedisRefused):
            self._park(job_id, (entry_id, outcome))  # still not taken in Redis: a later result() gets it
            raise
        except BaseException:  # cancelled: nobody takes it now (as abandon)
            self.consumed(entry_id)
            raise
        self.consumed(entry_id)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def take(self, job_id: str, deadline: Deadline) -> Final:
        """The job's final reply as (entry id, Result or the error it stands for), left in the inbox until
        the caller calls ``consumed(entry_id)``: a bulk run deletes a reply only once its answer is on disk,
        so a kill at any instant leaves it either written or still in the inbox. WaitExpired as ``final``."""
        self.start()  # (again, should the reader ever have ended)
        taken = await self._wait(job_id, self.waiter(job_id), deadline)  # an unclaimed answer: at once (expect)
        self._jobs.pop(job_id, None)
        return taken

    async def _wait(self, job_id: str, waiter: Waiter, deadline: Deadline) -> Final:
        """The waiter's final reply. With a deadline: WaitExpired when it passes. Without one: it waits as
        long as the reader reaches Redis, and raises RedisUnavailable once Redis has been unreachable for
        the client's ``retry_s``."""
        started = time.monotonic()
        while True:
            step = deadline.sooner(1.0)
            try:  # not wait_for: before 3.12 it can swallow a cancellation (producer/stream.py)
                async with asyncio.timeout(step):
                    return await asyncio.shield(waiter.final)
            except TimeoutError:
                if deadline.left() == 0:
                    raise WaitExpired(f"no result for job {job_id}") from None
                # a healthy XREAD returns at least every block_ms: longer without one is an outage (refused,
                # or frozen: a blocked read that never returns)
                silent = time.monotonic() - max(self.last_read, started)
                if deadline.timeout is None and silent > self.block_ms / 1000 + self.calls.retry_s:
                    raise RedisUnavailable(f"no result for job {job_id}: Redis unreachable for "
                                           f"{silent:.0f} s") from None

    async def _empty(self, job_id: str, entry_id: str, deadline: Deadline) -> None:
        """Record in Redis that this answer is taken before the caller gets it (the fault test's new.A): taken
        and then lost with this process (killed, or its delete refused by a full Redis), the answer was handed
        again to the inbox's next process submitting the id, which must be refused. Retried through outages and
        a full Redis (SET is refused then) until the deadline (WaitExpired) or, without one, ``retry_s``
        (RedisFull, or RedisUnavailable)."""
        delay = 0.05
        give_up = time.monotonic() + self.calls.retry_s
        while True:
            try:
                async with asyncio.timeout(deadline.sooner(5.0)):
                    await self._answers.empty(self.writer, entry_id)
                return
            except (TimeoutError, redis.RedisError) as exc:
                if deadline.left() == 0:
                    raise WaitExpired(f"job {job_id}: answered, but Redis did not record it as taken before the "
                                      f"timeout ({reason(exc) if isinstance(exc, redis.RedisError) else 'no reply'})"
                                      ) from None
                if deadline.timeout is None and time.monotonic() > give_up:
                    what = f"job {job_id}: recording its answer taken"
                    if isinstance(exc, redis.RedisError) and not isinstance(exc, TRANSIENT):
                        raise refused(exc, what) from None  # RedisFull: the answer stays for a later result()
                    raise RedisUnavailable(f"{what}: Redis did not answer for {self.calls.retry_s:g} s") from None
                await asyncio.sleep(deadline.sooner(delay))
                delay = min(1.0, delay * 2)

    def consumed(self, entry_id: str) -> None:
        """The caller has this entry: delete it from the inbox (batched, retried while the process lives; the
        TTL cleans up after a dead one)."""
        self._consumed.append(entry_id)
        if self._deleting is None or self._deleting.done():
            self._deleting = asyncio.get_running_loop().create_task(self._delete())

    @property
    def started(self) -> bool:
        return self._task is not None

    def move(self, key: str) -> bool:
        """Read ``key`` instead (the fleet's layout put this client's inbox on another shard); only before
        the first read: False once reading has started."""
        if self.started:
            return False
        self.key = key
        return True

    def start(self) -> None:
        if not self._closing and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"inbox {self.key}")

    async def close(self) -> None:
        """Stop reading; delete what was consumed (bounded: the TTL removes what this cannot)."""
        if self._deleting is not None and not self._deleting.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._deleting), 1.0)
            except (asyncio.TimeoutError, Exception):
                pass
        if self._consumed:
            try:
                await asyncio.wait_for(self._xdel(self._consumed[:1000]), 1.0)
            except (asyncio.TimeoutError, redis.RedisError):
                pass
        self._closing = True
        tasks = [t for t in (self._task, self._deleting) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            if pending:  # redis-py can swallow a cancel that lands mid-reconnect: cut its connection
                try:
                    await asyncio.wait_for(self.reader.aclose(), 1.0)
                except (asyncio.TimeoutError, redis.RedisError, OSError):
                    pass
                await asyncio.wait(pending, timeout=1.0)

    # ---- the reader task -------------------------------------------------------------------------
    async def _run(self) -> None:
        healthy = True  # the first failure after a success reconnects at once (a restart closed our socket)
        while not self._closing:
            try:
                resp = await xread(self.reader, {self.key: self._last}, READ_COUNT, self.block_ms)
            except TRANSIENT as exc:
                if healthy:
                    healthy = False
                    continue
                await asyncio.sleep(self.calls.backoff.failed(exc))
                continue
            except redis.ResponseError as exc:  # NOPERM and the like: an operator must act; keep trying
                log.error("cannot read this client's inbox: %s", reason(exc))  # never the key: its token is secret
                await asyncio.sleep(self.calls.backoff.failed(exc))
                continue
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:  # whatever a dying connection raises: the reader must outlive it
                if self._closing:
                    return
                log.debug("inbox read failed: %r", exc)
                await asyncio.sleep(self.calls.backoff.failed(exc))
                continue
            self.calls.backoff.ok()
            self.last_read = time.monotonic()
            healthy = True
            entries = [(e.decode() if isinstance(e, bytes) else e, f) for _, got in resp or [] for e, f in got]
            try:
                answers = await self._answers.fetch(self.reader, self.key, entries)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:  # read again from the same place: nothing was dispatched
                log.debug("fetching answers failed: %r", exc)
                await asyncio.sleep(self.calls.backoff.failed(exc))
                continue
            for entry_id, fields in entries:
                self._last = entry_id
                if entry_id in answers:
                    payload = answers[entry_id]
                    if not payload:  # taken already (a second ring) or expired: nothing to hand over
                        job_id = job_id_of(fields)
                        waiter = self._jobs.get(job_id)
                        if waiter is None or waiter.final.done():
                            self.consumed(entry_id)
                        elif payload == b"":  # this waiter's request reused a job id answered here: REUSED
                            waiter.settle((entry_id, JobFailed(job_id, INVALID_REQUEST, REUSED)))
                        else:  # expired before it was read: nothing more comes (save a late first write)
                            self.consumed(entry_id)
                            waiter.expired(job_id, entry_id)
                        continue
                    fields = {b"id": fields.get(b"id", b""), b"p": payload}
                self._dispatch(entry_id, fields)

    def _dispatch(self, entry_id: str, fields: dict) -> None:
        job_id = job_id_of(fields)
        try:
            reply: Result | Delta | BaseException = parse_reply(job_id, fields.get(b"p", b""))
        except Exception as exc:  # the error an Error reply stands for (JobFailed, Cancelled, Timeout)
            reply = exc
        if isinstance(reply, Delta):
            self.consumed(entry_id)  # the text is in memory now; the final reply repeats all of it
            waiter = self._jobs.get(job_id)
            if waiter is not None and waiter.deltas is not None:
                waiter.deltas.put_nowait(reply)
            return
        if job_id in self._abandoned:
            del self._abandoned[job_id]
            self.consumed(entry_id)
            return
        waiter = self._jobs.get(job_id)
        if waiter is not None and not waiter.final.done():
            waiter.settle((entry_id, reply))
            return
        if waiter is None:  # nobody asked (yet): keep it for a later result(job_id)
            self._park(job_id, (entry_id, reply))
        else:
            self.consumed(entry_id)  # a second answer to one job (its done marker expired): drop it

    def _park(self, job_id: str, taken: Final) -> None:
        """Keep a final reply nobody waits on for a later result(job_id); the oldest forgotten past MAX_UNCLAIMED."""
        self._unclaimed[job_id] = taken
        while len(self._unclaimed) > MAX_UNCLAIMED:
            self._answers.forget(self._unclaimed.popitem(last=False)[1][0])

    async def _delete(self) -> None:
        await asyncio.sleep(0.02)  # batch the deletes of one burst of replies
        delay = 0.05
        while self._consumed:
            ids = self._consumed[:1000]
            try:
                await asyncio.wait_for(self._xdel(ids), 5.0)
            except (asyncio.TimeoutError, redis.RedisError):
                # kept and retried: a bulk run's answer not emptied would be handed again to the inbox's next
                # process (and rings pile up); the inbox's TTL removes what a dying process leaves
                if self._closing:
                    return
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            delay = 0.05
            del self._consumed[:len(ids)]

    async def _xdel(self, ids: list[str]) -> None:
        await self._answers.delete(self.writer, self.key, ids)
