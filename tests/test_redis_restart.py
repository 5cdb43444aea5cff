"""Redis faults: a private redis-server (AOF, appendfsync always) is killed and restarted on the same
port and dir in the middle of a load; the in-process worker and the producers recover by themselves and
no request is lost."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import AsyncClient, Client, RedisUnavailable
from batchfleet.worker.devtools import PrivateRedis, free_port
from tests.conftest import worker_config
from tests.helpers.loops import LoopThread, wait_until


@pytest.fixture
def aof_redis():
    server = PrivateRedis(port=free_port(), extra_args=("--appendonly", "yes", "--appendfsync", "always")).start()
    yield server
    server.stop()


def test_redis_restart_mid_load_nothing_lost(aof_redis, tiny_model_dir, cache_dir, caplog):
    caplog.set_level(logging.WARNING)
    ns = f"rs-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    worker = LoopThread(worker_config(aof_redis.url, ns, tiny_model_dir, max_wait_ms=20, max_batch_size=8,
                                      claim_idle_ms=2000))
    results: dict[str, object] = {}
    inboxes: dict[str, str] = {}  # job id -> the inbox its answer is stored under
    errors: list[BaseException] = []
    restarted = threading.Event()
    killed = threading.Event()
    after_restart: list[float] = []

    def producer(p: int) -> None:
        try:
            with Client(aof_redis.url, ns) as client:
                for i in range(12):
                    if i == 6 and p < 2:  # half the producers go on only once Redis is down: load spans the
                        killed.wait(60)  # restart however fast the first half ran (the others run free)
                    res = client.generate([10 + p, 11 + i, 12], max_new_tokens=8, timeout=60)
                    results[res.id] = res
                    inboxes[res.id] = client.reply_key
                    if restarted.is_set() and not after_restart:
                        after_restart.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)

    # both clients are blocked in BLPOP on jobs submitted only after the restart
    waited: dict[str, object] = {}

    # each waits on an inbox whose name it shares with the client that submits after the restart
    async def async_wait() -> None:
        async with AsyncClient(aof_redis.url, ns, inbox="waiter-async-0123456") as client:
            waited["async"] = await client.result("waited-async", timeout=60)

    def sync_wait() -> None:
        with Client(aof_redis.url, ns, inbox="waiter-sync-01234567") as client:
            waited["sync"] = client.result("waited-sync", timeout=60)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(4)]
    try:
        for t in threads:
            t.start()
        waiters = [threading.Thread(target=sync_wait), threading.Thread(target=lambda: asyncio.run(async_wait()))]
        for t in waiters:
            t.start()
        wait_until(lambda: len(results) >= 8, 60, "some results before the restart")
        time.sleep(0.3)
        aof_redis.kill()
        killed.set()
        time.sleep(1.0)
        aof_redis.start()
        t_up = time.monotonic()
        restarted.set()
        with Client(aof_redis.url, ns, inbox="waiter-sync-01234567") as client:
            client.submit([9, 9], max_new_tokens=2, job_id="waited-sync")
        with Client(aof_redis.url, ns, inbox="waiter-async-0123456") as client:
            client.submit([9, 9], max_new_tokens=2, job_id="waited-async")
        for t in threads + waiters:
            t.join(120)
    finally:
        worker.stop()
    assert not errors, errors
    assert len(results) == 48 and set(waited) == {"sync", "async"}
    outage_lines = [rec for rec in caplog.records if "unavailable" in rec.getMessage()]
    # one line per outage state change per component (worker loop, each client), not one per retry
    assert 1 <= len(outage_lines) <= 8, [rec.getMessage() for rec in outage_lines]
    assert not any(rec.exc_info for rec in caplog.records)
    r = redis.Redis.from_url(aof_redis.url)
    assert all(r.exists(keys.done(j, inboxes[j])) for j in results)
    assert sum(r.xlen(keys.stream(b)) for b in (32, 64, 128, 256)) == 0
    print(f"\nredis restart: first result {after_restart[0] - t_up:.2f}s after redis was back; 48/48 answered")


def test_submit_retries_through_an_outage_with_bounded_backoff(tiny_model_dir):
    from batchfleet.common.wire.protocol import FleetInfo

    server = PrivateRedis(port=free_port()).start()
    ns = "retry"
    keys = Keys(ns)
    try:
        info = FleetInfo(model="tiny", tokenizer_json=(tiny_model_dir / "tokenizer.json").read_text(),
                         buckets=(32,), max_seq_len=64, max_batch_size=4, vocab_size=320, eos_token_ids=(2,))
        redis.Redis.from_url(server.url).set(keys.fleet, info.encode())
        with Client(server.url, ns, retry_s=0.5, require_workers=False) as client:
            client.fleet()  # cached
            server.kill()
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailable):
                client.submit([5, 6], max_new_tokens=2)
            gave_up = time.monotonic() - t0
            client._async.retry_s = 30
            threading.Timer(0.7, server.start).start()
            t0 = time.monotonic()
            job = client.submit([5, 6], max_new_tokens=2)  # waits for Redis to come back
            resumed = time.monotonic() - t0
        assert 0.3 <= gave_up < 3 and 0.6 <= resumed < 5
        r = redis.Redis.from_url(server.url)
        assert [f[b"id"].decode() for _, f in r.xrange(keys.stream(32))] == [job]  # enqueued once
    finally:
        server.stop()
