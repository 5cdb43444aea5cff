"""Every client call is bounded whatever Redis does (issue 12, point 2): with Redis frozen (SIGSTOP: the
port accepts, nothing answers) or refusing connections (killed: the port is closed), ``generate(timeout=2)``
raises batchfleet's ``Timeout`` within 3 s, and with no timeout it raises ``RedisUnavailable`` within
``retry_s`` + a margin; never a raw redis-py exception. For ``Client`` and ``AsyncClient``, fresh (no
call made yet, so the fleet fetch is bounded too) and warm (after one successful call); and for a
``result`` wait already in progress when Redis goes away (``RedisUnavailable`` within the inbox reader's
block + ``retry_s`` + a margin).

One private Redis 7 (AOF, so a kill + restart keeps the fleet, the groups and the functions) and one
worker subprocess serve the whole module; each test thaws or restarts Redis before it ends. Each call
runs under an outer guard, so a call that blocks is reported as such instead of hanging the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.options import option_args
from batchfleet.producer import AsyncClient, Client, RedisUnavailable, Timeout
from batchfleet.worker.devtools import PrivateRedis, WorkerProcess, free_port, spawn_worker

SYSTEM_REDIS = "/usr/bin/redis-server"
PROMPT = [10, 11, 12, 13]
CALL_TIMEOUT_S = 2.0
TIMEOUT_BOUND_S = 3.0  # the acceptance: generate(timeout=2) returns within 3 s
RETRY_S = 1.0
RETRY_MARGIN_S = 2.5  # RedisUnavailable within retry_s + this
# A result() wait hears from Redis through the inbox reader, whose XREAD blocks up to this long when all is
# well, so silence means an outage only after it (a frozen Redis looks like a long block until then).
READER_BLOCK_S = ConnectionConfig().socket_timeout_s / 2
GUARD_S = 15.0  # a call still blocked after this long is reported as blocked (and left to finish later)

pytestmark = [pytest.mark.skipif(not Path(SYSTEM_REDIS).exists(), reason="needs the machine's Redis 7"),
              pytest.mark.timeout(120)]

Outcome = tuple[BaseException | None, float]  # (what the call raised, None if it returned; seconds taken)


class Blocked(AssertionError):
    """The call neither returned nor raised within GUARD_S."""


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[PrivateRedis, str, WorkerProcess]]:
    server = PrivateRedis(port=free_port(), binary=SYSTEM_REDIS,
                          extra_args=("--appendonly", "yes", "--appendfsync", "always")).start()
    ns = f"to-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("timeouts") / "worker.log"
    worker = spawn_worker(server.url, ns, option_args({
        "model": str(tiny_model_dir), "engine": "hf", "mode": "dynamic", "dtype": "float32", "max_seq_len": 512,
        "buckets": (32, 64), "max_wait_ms": 5}), log_path=str(log))
    try:
        yield server, ns, worker
    finally:
        server.thaw()
        os.kill(worker.proc.pid, signal.SIGCONT)
        worker.stop(10)
        server.stop()


@contextmanager
def fault(server: PrivateRedis, kind: str) -> Iterator[None]:
    """Redis frozen (SIGSTOP) or refusing connections (SIGKILL: nothing listens on the port) inside the
    block; thawed or restarted on the same dir and port (AOF replayed) after it."""
    if kind == "frozen":
        server.freeze()
    else:
        server.kill()
    try:
        yield
    finally:
        if kind == "frozen":
            server.thaw()
        else:
            server.start(timeout_s=30)


def timed_sync(call: Callable[[], object]) -> Outcome:
    """Run a blocking call on a daemon thread, at most GUARD_S."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            box.append(None)
        except BaseException as e:  # noqa: BLE001 (judged by expect)
            box.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    took = time.monotonic() - t0
    return (box[0] if box else Blocked(f"still blocked after {took:.1f} s")), took


async def timed_async(call: Callable[[], Awaitable[object]]) -> Outcome:
    """Await a call, at most GUARD_S (asyncio.wait: batchfleet's Timeout is a TimeoutError, as is
    wait_for's own, so the guard must not be told apart by exception type)."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(call())
    done, _ = await asyncio.wait({task}, timeout=GUARD_S)
    took = time.monotonic() - t0
    if not done:
        return Blocked(f"still blocked after {took:.1f} s"), took
    return task.exception(), took


def expect(exc_type: type[BaseException], bound_s: float, outcome: Outcome) -> float:
    """Assert the call raised ``exc_type`` (not a redis-py error) within ``bound_s``; returns the seconds."""
    exc, took = outcome
    assert exc is not None, f"the call returned after {took:.2f} s instead of raising {exc_type.__name__}"
    assert not isinstance(exc, Blocked), f"{exc} (expected {exc_type.__name__} within {bound_s} s)"
    assert not isinstance(exc, redis.RedisError), f"raw redis-py error after {took:.2f} s: {exc!r}"
    assert isinstance(exc, exc_type), f"{exc!r} after {took:.2f} s, expected {exc_type.__name__}"
    assert took < bound_s, f"{exc_type.__name__} after {took:.2f} s, bound {bound_s} s"
    return took


def generate_sync(server: PrivateRedis, ns: str, kind: str, warm: bool, timeout: float | None,
                  retry_s: float) -> Outcome:
    client = Client(server.url, ns, retry_s=retry_s)
    try:
        if warm:
            client.generate(PROMPT, max_new_tokens=2, timeout=30)
        with fault(server, kind):
            return timed_sync(lambda: client.generate(PROMPT, max_new_tokens=2, timeout=timeout))
    finally:
        client.close()


def generate_async(server: PrivateRedis, ns: str, kind: str, warm: bool, timeout: float | None,
                   retry_s: float) -> Outcome:
    async def main() -> Outcome:
        client = AsyncClient(server.url, ns, retry_s=retry_s)
        try:
            if warm:
                await client.generate(PROMPT, max_new_tokens=2, timeout=30)
            with fault(server, kind):
                return await timed_async(lambda: client.generate(PROMPT, max_new_tokens=2, timeout=timeout))
        finally:
            await client.aclose()

    return asyncio.run(main())


GENERATE = {"sync": generate_sync, "async": generate_async}
CASES = [(kind, api, state) for kind in ("frozen", "refused") for api in GENERATE for state in ("fresh", "warm")]

@pytest.mark.parametrize("kind,api,state", CASES)
def test_generate_timeout_holds(fleet, kind: str, api: str, state: str) -> None:
    server, ns, _ = fleet
    took = expect(Timeout, TIMEOUT_BOUND_S,
                  GENERATE[api](server, ns, kind, state == "warm", CALL_TIMEOUT_S, retry_s=30.0))
    print(f"\n{kind} {api} {state}: Timeout after {took:.2f} s (timeout={CALL_TIMEOUT_S})")


@pytest.mark.parametrize("kind,api,state", CASES)
def test_no_timeout_raises_redis_unavailable_after_retry_s(fleet, kind: str, api: str, state: str) -> None:
    server, ns, _ = fleet
    took = expect(RedisUnavailable, RETRY_S + RETRY_MARGIN_S,
                  GENERATE[api](server, ns, kind, state == "warm", None, retry_s=RETRY_S))
    print(f"\n{kind} {api} {state}: RedisUnavailable after {took:.2f} s (retry_s={RETRY_S})")


@contextmanager
def paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker SIGSTOPped: jobs are enqueued (its heartbeat is still fresh) but not answered."""
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("kind", ["frozen", "refused"])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_result_wait_without_timeout_raises_redis_unavailable(fleet, kind: str, api: str) -> None:
    server, ns, worker = fleet
    if api == "sync":
        client = Client(server.url, ns, retry_s=RETRY_S)
        try:
            client.generate(PROMPT, max_new_tokens=2, timeout=30)
            with paused(worker):
                job = client.submit(PROMPT, max_new_tokens=2)
                with fault(server, kind):
                    outcome = timed_sync(lambda: client.result(job))
        finally:
            client.close()
    else:
        async def main() -> Outcome:
            client = AsyncClient(server.url, ns, retry_s=RETRY_S)
            try:
                await client.generate(PROMPT, max_new_tokens=2, timeout=30)
                with paused(worker):
                    job = await client.submit(PROMPT, max_new_tokens=2)
                    with fault(server, kind):
                        return await timed_async(lambda: client.result(job))
            finally:
                await client.aclose()

        outcome = asyncio.run(main())
    took = expect(RedisUnavailable, RETRY_S + READER_BLOCK_S + RETRY_MARGIN_S, outcome)
    print(f"\nresult wait, {kind} {api}: RedisUnavailable after {took:.2f} s (retry_s={RETRY_S})")
