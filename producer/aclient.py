"""asyncio client with the same API as Client, for async web backends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as aredis

from batchfleet.common.protocol import Result
from batchfleet.common.retry import TRANSIENT
from batchfleet.producer.base import ClientBase
from batchfleet.producer.core import RETRY_S, FleetView, Params, Prompt
from batchfleet.producer.plan import ResultWait, RetryPlan, retry_deadline, time_left

T = TypeVar("T")


class AsyncClient(ClientBase):
    """``await client.generate(prompt)``; safe for many concurrent tasks on one instance.

    The same API, arguments, errors and retry semantics as Client (both follow producer/plan.py).
    """

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S) -> None:
        super().__init__(aredis.Redis, asyncio.Lock(), redis_url, namespace, retry_s)

    async def _retry(self, call: Callable[[], Awaitable[T]], deadline: float | None) -> T:
        """Await ``call()``; on a connection error back off and retry until ``deadline`` (monotonic)."""
        plan = RetryPlan(self._backoff, deadline)
        while True:
            try:
                out = await call()
            except TRANSIENT as exc:
                await asyncio.sleep(plan.failed(exc))
                continue
            plan.succeeded()
            return out

    async def fleet(self) -> FleetView:
        """The fleet description workers published (tokenizer, buckets, limits)."""
        if self._fleet.stale():
            async with self._lock:
                if self._fleet.stale():
                    raw = await self._retry(lambda: self.r.get(self.keys.fleet), retry_deadline(self.retry_s))
                    self._fleet.update(raw)
        return self._fleet.require(self.keys)

    async def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
                     **params) -> str:
        """Enqueue one prompt; returns its job id (see Client.submit)."""
        job = (await self.fleet()).build(self.keys, prompt, Params(**params), timeout, job_id)
        ok = await self._retry(lambda: self._enqueue(keys=[job.stream], args=job.script_args()),
                               retry_deadline(self.retry_s, timeout))
        return job.accepted(ok)

    async def result(self, job_id: str, timeout: float | None = None) -> Result:
        """Wait for a job's result, reconnecting through Redis outages until ``timeout`` (see Client.result)."""
        wait = ResultWait(job_id, timeout, self.conn.socket_timeout_s / 2, self._backoff)
        while True:
            pop_s = wait.next_pop_s()
            try:
                got = await self.r.blpop([self.keys.reply(job_id)], timeout=pop_s)
            except TRANSIENT as exc:
                await asyncio.sleep(wait.failed(exc))
                continue
            if (result := wait.popped(got)) is not None:
                return result

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, **params) -> Result:
        """Submit and wait; ``timeout`` (s) is also the request's deadline."""
        start = time.monotonic()
        job_id = await self.submit(prompt, timeout=timeout, **params)
        return await self.result(job_id, timeout=time_left(start, timeout))

    async def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                            **params) -> list[Result]:
        """Validate every prompt first (PromptTooLong before anything is sent), then enqueue and gather."""
        jobs = (await self.fleet()).build_many(self.keys, prompts, Params(**params), timeout)
        ids = [await self.submit(job.request.prompt, timeout=timeout, job_id=job.id, **params) for job in jobs]
        return list(await asyncio.gather(*(self.result(i, timeout=timeout) for i in ids)))
    async def aclose(self) -> None:
        await self.r.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
