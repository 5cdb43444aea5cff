"""asyncio client with the same API as Client, for async web backends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as aredis

from batchfleet.common.config import connection_from_env
from batchfleet.common.errors import QueueFull, Timeout
from batchfleet.common.protocol import Result
from batchfleet.producer.client import ENQUEUE_SCRIPT
from batchfleet.producer.core import (
    RETRY_S,
    TRANSIENT,
    Backoff,
    FleetView,
    Params,
    Prompt,
    connection_kwargs,
    no_fleet,
    parse_reply,
)

T = TypeVar("T")


class AsyncClient:
    """``await client.generate(prompt)``; safe for many concurrent tasks on one instance."""

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S) -> None:
        self.conn = connection_from_env(redis_url, namespace)
        self.keys = self.conn.keys
        self.r = aredis.Redis.from_url(self.conn.redis_url, **connection_kwargs(self.conn))
        self._enqueue = self.r.register_script(ENQUEUE_SCRIPT)
        self._fleet = FleetView()
        self._lock = asyncio.Lock()
        self.retry_s = retry_s
        self._backoff = Backoff()

    async def _retry(self, call: Callable[[], Awaitable[T]], deadline: float | None) -> T:
        """Await ``call()``; on a connection error back off and retry until ``deadline`` (monotonic)."""
        attempt = 0
        while True:
            try:
                out = await call()
                self._backoff.ok()
                return out
            except TRANSIENT as exc:
                wait = Backoff.wait_left(deadline, self._backoff.delay(attempt, exc))
                if wait <= 0:
                    raise
                await asyncio.sleep(wait)
                attempt += 1

    async def fleet(self) -> FleetView:
        if self._fleet.stale():
            async with self._lock:
                if self._fleet.stale():
                    raw = await self._retry(lambda: self.r.get(self.keys.fleet), time.monotonic() + self.retry_s)
                    self._fleet.update(raw)
        if self._fleet.info is None:
            raise no_fleet(self.keys)
        return self._fleet

    async def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
                     **params) -> str:
        fleet = await self.fleet()
        bucket, req = fleet.build(self.keys, prompt, Params(**params), timeout, job_id)
        limit = self.retry_s if timeout is None else min(self.retry_s, timeout)
        ok = await self._retry(lambda: self._enqueue(keys=[self.keys.stream(bucket)],
                                                     args=[fleet.info.max_queue_len, req.id, req.encode()]),
                               time.monotonic() + limit)
        if not ok:
            raise QueueFull(f"bucket {bucket} holds {fleet.info.max_queue_len} entries; retry later")
        return req.id

    async def result(self, job_id: str, timeout: float | None = None) -> Result:
        deadline = None if timeout is None else time.monotonic() + timeout
        chunk = self.conn.socket_timeout_s / 2
        attempt = 0
        while True:
            wait = chunk if deadline is None else min(chunk, deadline - time.monotonic())
            if wait <= 0:
                raise Timeout(f"no result for job {job_id} within {timeout} s")
            try:
                got = await self.r.blpop([self.keys.reply(job_id)], timeout=max(wait, 0.01))
            except TRANSIENT as exc:  # Redis restarting or connection dropped: reconnect until timeout
                await asyncio.sleep(max(0.0, Backoff.wait_left(deadline, self._backoff.delay(attempt, exc))))
                attempt += 1
                continue
            self._backoff.ok()
            attempt = 0
            if got is not None:
                return parse_reply(job_id, got[1])

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, **params) -> Result:
        start = time.monotonic()
        job_id = await self.submit(prompt, timeout=timeout, **params)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return await self.result(job_id, timeout=left)

    async def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None,
                            **params) -> list[Result]:
        """Validate every prompt first (PromptTooLong before anything is sent), then enqueue and gather."""
        fleet = await self.fleet()
        p = Params(**params)
        built = [fleet.build(self.keys, prompt, p, timeout, None) for prompt in prompts]
        ids = [await self.submit(req.prompt, timeout=timeout, job_id=req.id, **params) for _, req in built]
        return list(await asyncio.gather(*(self.result(i, timeout=timeout) for i in ids)))

    async def aclose(self) -> None:
        await self.r.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
