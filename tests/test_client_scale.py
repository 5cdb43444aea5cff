"""One client process, many requests in flight: 10,000 concurrent ``AsyncClient.generate`` calls and 500
threads sharing one ``Client`` finish with at most 8 Redis connections from the process and no warning
logged (a waiting request holds no connection: one inbox reader serves them all)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from batchfleet.producer import AsyncClient, Client

MAX_CONNECTIONS = 8
SERVER = {"engine": "native", "mode": "continuous", "kv_cache_gb": 0.05, "max_wait_ms": 20, "max_batch_size": 64,
          "max_queue_len": 20_000}


def _connections(r: redis.Redis, name: str) -> int:
    return sum(1 for c in r.client_list() if c.get("name") == name)


class _PeakConnections:
    """Samples CLIENT LIST every 50 ms while running, keeping the peak count of ``name``'s connections."""

    def __init__(self, redis_url: str, name: str) -> None:
        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.name = name
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _connections(self.r, self.name))

    def __enter__(self) -> _PeakConnections:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_ten_thousand_async_requests_over_a_few_connections(start_worker, redis_url, namespace, caplog):
    start_worker(**SERVER)
    caplog.set_level(logging.WARNING)
    n = 10_000

    async def go() -> tuple[list, int, float]:
        async with AsyncClient(redis_url, namespace) as client:
            with _PeakConnections(redis_url, client.client_name) as peak:
                t0 = time.monotonic()
                results = await asyncio.gather(*(client.generate([5 + i % 200, 6], max_new_tokens=2, timeout=600)
                                                 for i in range(n)))
                elapsed = time.monotonic() - t0
            return results, peak.peak, elapsed

    results, peak, elapsed = asyncio.run(go())
    assert len(results) == n and all(r.completion_tokens == 2 for r in results)
    assert 1 <= peak <= MAX_CONNECTIONS, peak
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.records[:5]
    print(f"\n{n} async requests in flight: {elapsed:.1f}s, peak {peak} connections")


def test_five_hundred_threads_share_one_sync_client(start_worker, redis_url, namespace, caplog):
    start_worker(**SERVER)
    caplog.set_level(logging.WARNING)
    with Client(redis_url, namespace) as client, _PeakConnections(redis_url, client.client_name) as peak:
        with ThreadPoolExecutor(500) as pool:
            t0 = time.monotonic()
            results = list(pool.map(lambda i: client.generate([5 + i % 200, 7], max_new_tokens=2, timeout=300),
                                    range(2000)))
            elapsed = time.monotonic() - t0
    assert len(results) == 2000 and all(r.completion_tokens == 2 for r in results)
    assert 1 <= peak.peak <= MAX_CONNECTIONS, peak.peak
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.records[:5]
    print(f"\n500 threads, 2000 requests: {elapsed:.1f}s, peak {peak.peak} connections")
