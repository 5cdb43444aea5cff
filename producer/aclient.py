"""The asyncio client, for async web backends; the sync ``Client`` runs one of these on its own thread.

Connections: one pool of at most ``max_connections`` (enqueue, cancel, fleet reads; callers queue for a
connection instead of failing) plus the inbox reader's own, whatever the number of jobs in flight.
Every call honours its ``timeout`` whatever Redis does (frozen, refusing, slow): each Redis call is
bounded by what is left of it, connection errors are retried with capped backoff until it passes, then
``Timeout``; a call without a timeout retries for ``retry_s``, then raises ``RedisUnavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from batchfleet.common.config import connection_from_env
from batchfleet.common.errors import InvalidRequest, RedisFull, Timeout
from batchfleet.common.keys import TENANT_MAX_CHARS, Keys, valid_inbox, valid_tenant
from batchfleet.common.redis.clients import async_client, close_async
from batchfleet.common.redis.fleetstate import live_workers_async
from batchfleet.common.redis.functions import CANCELS_MAXLEN
from batchfleet.common.tenants import estimated_tokens
from batchfleet.common.wire.protocol import Result
from batchfleet.producer.ask import Ask
from batchfleet.producer.core import (
    INLINE_PROMPT_CHARS,
    LIVENESS_TRUST_S,
    RETRY_S,
    Deadline,
    FleetView,
    Prompt,
    prompt_size,
)
from batchfleet.producer.inbox import Inbox
from batchfleet.producer.limits import Limits
from batchfleet.producer.outgoing import Outgoing
from batchfleet.producer.redis_calls import RedisCalls
from batchfleet.producer.shards import Router
from batchfleet.producer.stream import AsyncTokenStream
from batchfleet.producer.waiters import WaitExpired

log = logging.getLogger("producer")

CANCEL_TTL_S = 3600  # a cancel marker outlives any queue wait worth having
LIVENESS_CHECK_S = 0.3  # budget of the "how many workers are alive" question a Timeout message asks
GIVE_UP_CANCEL_TIMEOUT_S = 5.0


class AsyncClient:
    """``await client.generate(prompt)``; safe for any number of concurrent tasks on one instance.

    Args:
        redis_url: defaults to $BATCHFLEET_REDIS_URL, else redis://127.0.0.1:6379/0.
        namespace: defaults to $BATCHFLEET_NAMESPACE, else ``bf``.
        retry_s: how long a call without a ``timeout`` keeps retrying through a Redis outage before it
            raises ``RedisUnavailable`` (a call with a timeout retries until the timeout: ``Timeout``).
        inbox: this client's inbox token (16-64 chars of [A-Za-z0-9_-]); default: 192 random bits. Reuse
            one (keep it secret) to collect, after a restart, replies of jobs submitted before it.
        require_workers: submit raises ``NoWorkers`` when no worker has a fresh heartbeat; False enqueues
            anyway, using the last fleet description seen. A fleet whose workers run with ``--scale-to-zero``
            publishes that, and every client then enqueues without live workers (a worker started later,
            e.g. by KEDA, answers).
        max_connections: the pool's size (the inbox reader has one more connection of its own).
        tenant: on whose account this client's requests run (a label an operator configured: docs/TENANTS.md;
            a call's ``tenant=`` wins); "" the default tenant. A limited tenant's request over its limits raises
            ``RateLimited`` (with ``retry_after_s``) before anything is enqueued.
    """

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S,
                 *, inbox: str | None = None, require_workers: bool = True, max_connections: int = 4,
                 tenant: str = "") -> None:
        self.conn = connection_from_env(redis_url, namespace)
        if tenant != "" and not valid_tenant(tenant):
            raise InvalidRequest(f"tenant must be 1-{TENANT_MAX_CHARS} chars of [a-z0-9_-], got {str(tenant)[:40]!r}")
        self.tenant = tenant
        token = inbox or secrets.token_urlsafe(24)
        if not valid_inbox(token):
            raise InvalidRequest("inbox must be 16-64 chars of [A-Za-z0-9_-]")
        if max_connections < 1:
            raise InvalidRequest("max_connections must be >= 1")
        self.require_workers = require_workers
        # named connections: an operator sees in CLIENT LIST which process holds which (never the inbox token)
        self.client_name = f"batchfleet-producer-{secrets.token_hex(4)}"
        kwargs: dict[str, Any] = {"socket_timeout": self.conn.socket_timeout_s, "decode_responses": False,
                                  "socket_connect_timeout": min(self.conn.socket_timeout_s, 5.0),
                                  "client_name": self.client_name}
        self.r = async_client(self.conn.redis_url, max_connections=max_connections, **kwargs)
        reader = async_client(self.conn.redis_url, max_connections=1, **kwargs)
        self.calls = RedisCalls(self.r, self.conn, retry_s)
        self.router = Router(self.conn.keys, token, self.r)
        self.limits = Limits(self.calls, lambda: self.keys)
        self.functions = self.calls.functions  # shared with the gateway's batch store (gateway/connections.py)
        # the reader blocks at most half the socket timeout, so a healthy idle wait never times out
        self.inbox = Inbox(reader, self.r, self.keys.inbox(token), int(self.conn.socket_timeout_s * 500),
                           self.calls)
        self._fleet = FleetView()
        self._live_seen = -math.inf  # time.monotonic() of the last enqueue that found a live worker
        self._checking = -math.inf  # time.monotonic() the last live-worker check was sent (one at a time)
        self._fleet_lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()  # cancels of given-up jobs (a reference keeps them alive)

    @property
    def retry_s(self) -> float:
        """How long a call without a timeout retries through a Redis outage (``RedisUnavailable`` after)."""
        return self.calls.retry_s

    @retry_s.setter
    def retry_s(self, value: float) -> None:
        self.calls.retry_s = value

    @property
    def keys(self) -> Keys:
        """Shard 0 of the fleet's layout: the keys of the fleet as a whole (``Router``)."""
        return self.router.keys

    @property
    def home(self) -> Keys:
        """The shard of this client's inbox and of its jobs' cancel and done markers (``Router``)."""
        return self.router.home

    @property
    def reply_key(self) -> str:
        """This client's inbox stream: workers write every answer to its jobs there."""
        return self.inbox.key

    # ---- the API -----------------------------------------------------------------------------------
    async def fleet(self, timeout: float | None = None) -> FleetView:
        """The fleet description workers published (tokenizer, chat template, buckets, limits)."""
        return await self._fleet_view(Deadline(timeout))

    async def _fleet_view(self, deadline: Deadline, require: bool = True) -> FleetView:
        if self._fleet.stale():
            async with self._fleet_lock:
                if self._fleet.stale():
                    raw = await self.calls.io(lambda: self.r.get(self.keys.fleet), deadline, "fleet description")
                    if raw is not None or self.require_workers:
                        self._fleet.update(raw)
                    self.router.follow(self._fleet.info, self.inbox)
        return self._fleet.require(self.keys) if require else self._fleet

    async def learn_layout(self, deadline: Deadline) -> None:
        """Before this client's inbox is first read: the fleet's layout, if a fleet description is there."""
        if not self.inbox.started:
            await self._fleet_view(deadline, require=False)

    async def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
                     stream: bool = False, ask: Ask | None = None, placed: Callable[[str, str], None] | None = None,
                     **params: Any) -> str:
        """Enqueue one prompt; returns its job id. Raises InvalidRequest / PromptTooLong / QueueFull / NoWorkers
        / RateLimited before anything runs; RedisFull (nothing enqueued: retry later) or RedisRefused when Redis
        refuses it.
        ``timeout`` (s) bounds this call and is the job's deadline. ``job_id``: one answered and taken within the
        reply TTL gets JobFailed (invalid_request); one in flight here joins for the same request, else InvalidRequest.
        ``params`` (generation parameters, priority, kind: ``Ask.of``), or ``ask``, one made already, sent as is.
        ``placed(job id, stream key)``: called once the job is in a stream (a bulk run counts what waits unread,
        producer/bulk/queued.py)."""
        job = await self._submit(prompt, Deadline(timeout), job_id, stream, Ask.called(ask, params))
        if placed is not None:
            placed(job.id, job.stream)
        return job.id

    async def _submit(self, prompt: Prompt, deadline: Deadline, job_id: str | None, stream: bool,
                      ask: Ask, admit: bool = True) -> Outgoing:
        fleet = await self._fleet_view(deadline)
        job = await self._build(fleet, prompt, ask, deadline.left(), job_id, stream)
        if admit:  # a limited tenant's request: counted in its window, or RateLimited (before anything is sent)
            await self.limits.admit(job.request.tenant, job.id, self._estimate(job), deadline)
        job, shard = await self.router.route(job)
        fresh = self.inbox.expect(job.id, stream, job.fingerprint)  # False: another call's job, kept (same request)
        # the live-worker check (the function's TIME + ZCOUNT) is skipped while an enqueue of this client found a
        # live worker within LIVENESS_TRUST_S, or while another enqueue's check is on its way (one at a time: on a
        # slow host, every enqueue of a burst would check otherwise)
        asked_at = time.monotonic()
        check = (self.require_workers and not fleet.scales_to_zero and asked_at - self._live_seen > LIVENESS_TRUST_S
                 and asked_at - self._checking > LIVENESS_TRUST_S)
        if check:
            self._checking = asked_at
        try:
            code = await self.calls.enqueue(job, shard.workers, check, deadline, shard.queued_tenants, shard.group,
                                            shard.tenant_bell)
        except BaseException as exc:  # enqueued or not, nobody can tell: cancel it in case it was (a cancellation)
            cancelled = isinstance(exc, asyncio.CancelledError)  # or keep a late answer for a retry under caller's id
            if fresh and (cancelled or job_id is None) and not isinstance(exc, RedisFull):
                self._give_up_later(job.id, cancel=cancelled)
            elif fresh:  # its answer, should it come, waits unclaimed for a retry's result() (RedisFull: none comes)
                self.inbox.forget(job.id)
            raise
        finally:
            if check:  # answered or not: the next enqueue may check again (or trusts what this one found)
                self._checking = -math.inf
        try:
            job.accepted(code, self.keys.namespace)
        except BaseException:  # refused (QueueFull, NoWorkers, too large): no answer will ever come, save one to
            # an add withdrawn after a worker read it (RedisCalls.enqueue), kept for a retry under the same job id
            if fresh:
                self.inbox.forget(job.id)
            raise
        if check:
            self._live_seen = max(self._live_seen, asked_at)
        return job

    async def _build(self, fleet: FleetView, prompt: Prompt, ask: Ask, timeout: float | None,
                     job_id: str | None, stream: bool) -> Outgoing:
        """Tokenize (chat: render the template) and build the request; a large prompt on a worker thread,
        so one multi-MB prompt or thousand-message chat never stalls the event loop (and every other
        request of a web backend with it)."""
        if prompt_size(prompt) <= INLINE_PROMPT_CHARS:  # small: a thread hop would cost more than it saves
            return fleet.build(self.keys, self.inbox.key, prompt, ask, timeout, job_id, stream, self.tenant)
        return await asyncio.to_thread(fleet.build, self.keys, self.inbox.key, prompt, ask, timeout, job_id,
                                       stream, self.tenant)

    @staticmethod
    def _estimate(job: Outgoing) -> int:
        """The tokens a request counts at admission (common/tenants.py ``estimated_tokens``)."""
        return estimated_tokens(len(job.request.prompt), job.request.params.max_new_tokens)

    def _give_up_later(self, job_id: str, cancel: bool = True) -> None:
        """Nobody will wait for this job: drop its answer when it comes and (``cancel``) stop it in the
        fleet, from a task of its own (the caller may be being cancelled: its own awaits would not run)."""
        self.inbox.abandon(job_id)
        if not cancel:
            return
        task = asyncio.get_running_loop().create_task(self._cancel_quietly(job_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_quietly(self, job_id: str) -> None:
        try:
            await self.cancel(job_id, GIVE_UP_CANCEL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - best effort: the job's deadline still bounds it
            log.warning("could not cancel job %s: %r", job_id, exc)

    async def give_up(self, job_id: str, timeout: float | None = GIVE_UP_CANCEL_TIMEOUT_S) -> None:
        """Stop waiting for a job: cancel it in the fleet and drop its answer (deleted from the inbox, and
        from memory) whenever it comes. ``cancel`` instead keeps the answer for ``result()``."""
        self.inbox.abandon(job_id)
        await self.cancel(job_id, timeout)

    async def result(self, job_id: str, timeout: float | None = None, *, give_up: bool = False) -> Result:
        """Wait for the result of a job this client submitted (or one submitted under the same inbox).
        Raises Timeout, Cancelled or JobFailed. Survives Redis restarts and dropped connections.
        ``give_up``: a call that ends without the answer (its timeout passed, or it was cancelled) cancels
        the job and drops its answer, as ``generate`` does; without it the job stays expected (a later
        ``result`` may still get it)."""
        return await self._result(job_id, Deadline(timeout), give_up)

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, ask: Ask | None = None,
                       **params: Any) -> Result:
        """Submit and wait. ``timeout`` (s) bounds the whole call and is also the job's deadline. A call
        that ends without the answer (its timeout passed, or the awaiting task was cancelled: a web
        framework's timeout, ``asyncio.wait_for``) cancels the job and drops its answer."""
        deadline = Deadline(timeout)
        job = await self._submit(prompt, deadline, None, False, Ask.called(ask, params))
        return await self._result(job.id, deadline, give_up=True)

    async def _result(self, job_id: str, deadline: Deadline, give_up: bool = False) -> Result:
        await self.learn_layout(deadline)
        try:
            return await self.inbox.final(job_id, deadline)
        except WaitExpired:
            if give_up:
                self._give_up_later(job_id)
            raise Timeout(f"no result for job {job_id} within {deadline.timeout:g} s; "
                          f"{await self._liveness()}") from None
        except asyncio.CancelledError:
            if give_up:
                self._give_up_later(job_id)
            raise

    def stream(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               ask: Ask | None = None, **params: Any) -> AsyncTokenStream:
        """``async for delta in client.stream(prompt)``: text deltas as they are generated, then
        ``stream.result``. Closing it early (``aclose``, leaving ``async with``) cancels the job."""
        return AsyncTokenStream(self, prompt, timeout, job_id, Ask.called(ask, params))

    async def submit_many(self, prompts: Sequence[Prompt], *, job_ids: Sequence[str] | None = None,
                          timeout: float | None = None, ask: Ask | None = None, **params: Any) -> list[str]:
        """Submit every prompt, all or nothing: each is validated first (nothing is sent if one is bad), then
        all are enqueued at once (concurrently, over the pool) rather than one round trip after another.
        ``job_ids``: theirs (default new ones). Returns the job ids in order. When one is refused (QueueFull,
        NoWorkers...), the others enqueued are given up (cancelled, their answers dropped) and its error
        raised."""
        return await self._submit_many(prompts, job_ids, Deadline(timeout), Ask.called(ask, params))

    async def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None, ask: Ask | None = None,
                            **params: Any) -> list[Result]:
        """``submit_many``, then the answers gathered in order; when one fails or the call is cancelled,
        nobody waits for the others (each is given up: cancelled, its answer dropped)."""
        deadline = Deadline(timeout)
        submitted = await self._submit_many(prompts, None, deadline, Ask.called(ask, params))
        waits = [asyncio.ensure_future(self._result(j, deadline, give_up=True)) for j in submitted]
        try:
            return list(await asyncio.gather(*waits))
        except BaseException:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            raise

    async def _submit_many(self, prompts: Sequence[Prompt], job_ids: Sequence[str] | None, deadline: Deadline,
                           ask: Ask) -> list[str]:
        ids: Sequence[str | None] = [None] * len(prompts) if job_ids is None else job_ids
        if len(ids) != len(prompts):
            raise InvalidRequest(f"{len(ids)} job ids for {len(prompts)} prompts")
        fleet = await self._fleet_view(deadline)
        built = []
        for prompt in prompts:  # raises before anything is sent (a long prompt tokenized on a worker thread)
            built.append(await self._build(fleet, prompt, ask, None, None, False))
        if built:  # one call is one request against its tenant's limits, with every prompt's tokens
            await self.limits.admit(built[0].request.tenant, built[0].id, sum(map(self._estimate, built)), deadline)
        jobs = await asyncio.gather(*(self._submit(x, deadline, jid, False, ask, admit=False)
                                      for x, jid in zip(prompts, ids)), return_exceptions=True)
        if failed := [j for j in jobs if isinstance(j, BaseException)]:
            for j in jobs:
                if isinstance(j, Outgoing):
                    self._give_up_later(j.id)
            raise failed[0]
        return [j.id for j in jobs if isinstance(j, Outgoing)]  # all of them: none failed

    async def cancel(self, job_id: str, timeout: float | None = 5.0) -> None:
        """Ask the fleet to stop a job this client submitted: a queued job is skipped, a running one leaves
        its batch at the next step (its KV blocks are freed); it is answered once with ``cancelled``."""
        await self.calls.io(lambda: self.calls.function("cancel", [self.home.cancel(job_id), self.home.cancels],
                                              [job_id, self.inbox.key, CANCEL_TTL_S, CANCELS_MAXLEN]),
                       Deadline(timeout), f"cancel of job {job_id}")

    async def live_workers(self, timeout: float = 1.0) -> int:
        """Workers with a fresh heartbeat (Redis' clock)."""
        async def count() -> int:
            return len(await live_workers_async(self.r, self.keys))
        return await self.calls.io(count, Deadline(timeout), "live workers")

    async def _liveness(self) -> str:
        try:
            n = await self.live_workers(LIVENESS_CHECK_S)
        except Exception:
            return "Redis did not say whether any worker is alive"
        return f"{n} live worker(s)" if n else "no live worker (none sent a heartbeat recently)"

    async def aclose(self) -> None:
        """Stop the inbox reader and close the connections (bounded: a dead Redis cannot hold it up)."""
        if self._background:  # cancels of given-up jobs still on their way
            await asyncio.wait(set(self._background), timeout=GIVE_UP_CANCEL_TIMEOUT_S)
        await self.inbox.close()
        for r in (self.inbox.reader, self.r):
            try:
                await asyncio.wait_for(close_async(r), 4.0)
            except (asyncio.TimeoutError, redis.RedisError, OSError):
                pass

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

