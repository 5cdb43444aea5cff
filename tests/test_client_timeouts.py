"""Every client call is bounded whatever Redis does (issue 12, point 2): with Redis frozen (SIGSTOP: the
port accepts, nothing answers) or refusing connections (killed: the port is closed), ``generate(timeout=2)``
raises batchfleet's ``Timeout`` within 3 s, and with no timeout it raises ``RedisUnavailable`` within
``retry_s`` + a margin; never a raw redis-py exception. For ``Client`` and ``AsyncClient``, fresh (no
call made yet, so the fleet fetch is bounded too) and warm (after one successful call).

One private Redis 7 (AOF, so a kill + restart keeps the fleet, the groups and the functions) and one
worker subprocess serve the whole module; each test thaws or restarts Redis before it ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from batchfleet.common.devtools import PrivateRedis, free_port, spawn_worker
from batchfleet.common.options import option_args
from batchfleet.producer import AsyncClient, Client, RedisUnavailable, Timeout

SYSTEM_REDIS = "/usr/bin/redis-server"
PROMPT = [10, 11, 12, 13]
CALL_TIMEOUT_S = 2.0
TIMEOUT_BOUND_S = 3.0  # the acceptance: generate(timeout=2) returns within 3 s
RETRY_S = 1.0
RETRY_MARGIN_S = 2.5  # RedisUnavailable within retry_s + this
WATCHDOG_S = 20.0

pytestmark = [pytest.mark.skipif(not Path(SYSTEM_REDIS).exists(), reason="needs the machine's Redis 7"),
              pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrivateRedis, str]]:
    server = PrivateRedis(port=free_port(), binary=SYSTEM_REDIS,
                          extra_args=("--appendonly", "yes", "--appendfsync", "always")).start()
    ns = f"to-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("timeouts") / "worker.log"
    worker = spawn_worker(server.url, ns, option_args({
        "model": str(tiny_model_dir), "engine": "hf", "mode": "dynamic", "dtype": "float32", "max_seq_len": 512,
        "buckets": (32, 64), "max_wait_ms": 5}), log_path=str(log))
    try:
        yield server, ns
    finally:
        server.thaw()
        worker.stop(10)
        server.stop()


@contextmanager
def fault(server: PrivateRedis, kind: str) -> Iterator[None]:
    """Redis frozen (SIGSTOP) or refusing connections (SIGKILL: nothing listens on the port) inside the
    block; thawed or restarted on the same dir and port (AOF replayed) after it."""
    watchdog = threading.Timer(WATCHDOG_S, server.thaw)  # a call that hangs must not freeze Redis for good
    if kind == "frozen":
        server.freeze()
        watchdog.start()
    else:
        server.kill()
    try:
        yield
    finally:
        watchdog.cancel()
        if kind == "frozen":
            server.thaw()
        else:
            server.start(timeout_s=30)


def expect(exc_type: type[BaseException], bound_s: float, outcome: tuple[BaseException | None, float]) -> float:
    """Assert the call raised ``exc_type`` (not a redis-py error) within ``bound_s``; returns the seconds."""
    exc, took = outcome
    assert exc is not None, f"the call returned after {took:.2f} s instead of raising {exc_type.__name__}"
    assert not isinstance(exc, redis.RedisError), f"raw redis-py error after {took:.2f} s: {exc!r}"
    assert isinstance(exc, exc_type), f"{exc!r} after {took:.2f} s, expected {exc_type.__name__}"
    assert took < bound_s, f"{exc_type.__name__} after {took:.2f} s, bound {bound_s} s"
    return took


def sync_call(server: PrivateRedis, ns: str, kind: str, warm: bool, timeout: float | None,
              retry_s: float) -> tuple[BaseException | None, float]:
    client = Client(server.url, ns, retry_s=retry_s)
    try:
        if warm:
            client.generate(PROMPT, max_new_tokens=2, timeout=30)
        with fault(server, kind):
            t0 = time.monotonic()
            try:
                client.generate(PROMPT, max_new_tokens=2, timeout=timeout)
                exc = None
            except BaseException as e:  # noqa: BLE001 (judged by expect)
                exc = e
            took = time.monotonic() - t0
    finally:
        client.close()
    return exc, took


def async_call(server: PrivateRedis, ns: str, kind: str, warm: bool, timeout: float | None,
               retry_s: float) -> tuple[BaseException | None, float]:
    async def main() -> tuple[BaseException | None, float]:
        client = AsyncClient(server.url, ns, retry_s=retry_s)
        try:
            if warm:
                await client.generate(PROMPT, max_new_tokens=2, timeout=30)
            with fault(server, kind):
                t0 = time.monotonic()
                try:
                    await client.generate(PROMPT, max_new_tokens=2, timeout=timeout)
                    exc = None
                except BaseException as e:  # noqa: BLE001 (judged by expect)
                    exc = e
                took = time.monotonic() - t0
        finally:
            await client.aclose()
        return exc, took

    return asyncio.run(main())


CALLS = {"sync": sync_call, "async": async_call}
CASES = [(kind, api, state) for kind in ("frozen", "refused") for api in CALLS for state in ("fresh", "warm")]


@pytest.mark.parametrize("kind,api,state", CASES)
def test_generate_timeout_holds(fleet, kind: str, api: str, state: str) -> None:
    server, ns = fleet
    took = expect(Timeout, TIMEOUT_BOUND_S,
                  CALLS[api](server, ns, kind, state == "warm", CALL_TIMEOUT_S, retry_s=30.0))
    print(f"\n{kind} {api} {state}: Timeout after {took:.2f} s (timeout={CALL_TIMEOUT_S})")


@pytest.mark.parametrize("kind,api,state", CASES)
def test_no_timeout_raises_redis_unavailable_after_retry_s(fleet, kind: str, api: str, state: str) -> None:
    server, ns = fleet
    took = expect(RedisUnavailable, RETRY_S + RETRY_MARGIN_S,
                  CALLS[api](server, ns, kind, state == "warm", None, retry_s=RETRY_S))
    print(f"\n{kind} {api} {state}: RedisUnavailable after {took:.2f} s (retry_s={RETRY_S})")
