"""The blocking client: the AsyncClient's API for threads and scripts, over one private event loop.

Every call runs as a coroutine of one ``AsyncClient`` on a daemon thread's event loop, so the sync and
async clients share one implementation (retries, timeouts, the inbox reader) and a process with 500
threads calling ``generate`` still uses the AsyncClient's few connections.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import Delta, Result
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.ask import Ask
from batchfleet.producer.core import RETRY_S, FleetView, Prompt
from batchfleet.producer.stream import AsyncTokenStream

T = TypeVar("T")


class _Loop:
    """An event loop on a daemon thread; ``run`` executes a coroutine there and waits for its outcome."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="batchfleet-client", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt in the caller: do not leave the coroutine running
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


class TokenStream:
    """``for delta in client.stream(prompt)``; ``.result`` once exhausted; ``close()`` cancels the job."""

    def __init__(self, loop: _Loop, inner: AsyncTokenStream) -> None:
        self._loop = loop
        self._inner = inner

    @property
    def job_id(self) -> str | None:
        return self._inner.job_id

    @property
    def result(self) -> Result | None:
        return self._inner.result

    @property
    def text(self) -> str:
        return self._inner.text

    def start(self) -> TokenStream:
        """Submit now (else the first ``next`` does); raises what ``submit`` raises."""
        self._loop.run(self._inner.start())
        return self

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        try:
            return self._loop.run(self._inner.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self._loop.run(self._inner.aclose())

    def __enter__(self) -> TokenStream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client:
    """Submit prompts to a batchfleet and wait for results; thread-safe. Same arguments, errors and
    semantics as ``AsyncClient`` (see its docstring), blocking."""

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S,
                 *, inbox: str | None = None, require_workers: bool = True, max_connections: int = 4,
                 tenant: str = "") -> None:
        self._loop = _Loop()

        async def make() -> AsyncClient:  # built on its loop (asyncio objects belong to one loop)
            return AsyncClient(redis_url, namespace, retry_s, inbox=inbox, require_workers=require_workers,
                               max_connections=max_connections, tenant=tenant)

        try:
            self._async = self._loop.run(make())
        except BaseException:
            self._loop.stop()
            raise
        self.conn = self._async.conn
        self.tenant = self._async.tenant
        self.client_name = self._async.client_name

    @property
    def keys(self) -> Keys:
        return self._async.keys

    @property
    def reply_key(self) -> str:
        return self._async.reply_key

    def fleet(self, timeout: float | None = None) -> FleetView:
        return self._loop.run(self._async.fleet(timeout))

    def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               stream: bool = False, ask: Ask | None = None, **params: Any) -> str:
        """Enqueue one prompt; returns its job id (see AsyncClient.submit)."""
        return self._loop.run(self._async.submit(prompt, timeout=timeout, job_id=job_id, stream=stream, ask=ask,
                                                 **params))

    def result(self, job_id: str, timeout: float | None = None, *, give_up: bool = False) -> Result:
        """Wait for a job's result (see AsyncClient.result)."""
        return self._loop.run(self._async.result(job_id, timeout, give_up=give_up))

    def generate(self, prompt: Prompt, *, timeout: float | None = None, ask: Ask | None = None,
                 **params: Any) -> Result:
        """Submit and wait; ``timeout`` (s) bounds the call and is the job's deadline."""
        return self._loop.run(self._async.generate(prompt, timeout=timeout, ask=ask, **params))

    def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None, ask: Ask | None = None,
                      **params: Any) -> list[Result]:
        """Submit all prompts at once (so they can share batches), then collect results in order."""
        return self._loop.run(self._async.generate_many(prompts, timeout=timeout, ask=ask, **params))

    def stream(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               ask: Ask | None = None, **params: Any) -> TokenStream:
        """Text deltas as they are generated (see AsyncClient.stream); ``close()`` early cancels."""
        return TokenStream(self._loop, self._async.stream(prompt, timeout=timeout, job_id=job_id, ask=ask, **params))

    def cancel(self, job_id: str, timeout: float | None = 5.0) -> None:
        """Stop a job this client submitted (see AsyncClient.cancel)."""
        self._loop.run(self._async.cancel(job_id, timeout))

    def give_up(self, job_id: str, timeout: float | None = 5.0) -> None:
        """Cancel a job and drop its answer whenever it comes (see AsyncClient.give_up)."""
        self._loop.run(self._async.give_up(job_id, timeout))

    def live_workers(self, timeout: float = 1.0) -> int:
        return self._loop.run(self._async.live_workers(timeout))

    def close(self) -> None:
        try:
            self._loop.run(self._async.aclose())
        finally:
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
