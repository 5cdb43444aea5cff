"""Redis full (``maxmemory`` reached under ``noeviction``), issue 54 item 6: every Redis refusal reaches a caller
as one of the fleet's error types (RedisFull, a RedisRefused), with no secret in its text, and the gateway
answers 503 with Retry-After. On a private redis-server of this test's own (the shared one's config is never
touched): ``maxmemory 1`` refuses every write from the first byte."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import redis

from batchfleet.common.errors import RedisFull, RedisRefused
from batchfleet.producer import AsyncClient
from tests.helpers.acl import start_redis7
from tests.helpers.gateway import gateways
from tests.helpers.loops import silent_fleet

NS = "full"


@pytest.fixture
def full_redis() -> Iterator[tuple[str, redis.Redis]]:
    server = start_redis7("--maxmemory-policy", "noeviction")
    try:
        yield server.url, redis.Redis.from_url(server.url)
    finally:
        server.stop()


def token_of(client: AsyncClient) -> str:
    return client.reply_key.rsplit(":", 1)[1]


def test_a_submit_to_a_full_redis_raises_redis_full_without_the_inbox_token(full_redis):
    url, r = full_redis

    async def scenario() -> None:
        async with AsyncClient(url, NS) as client:
            await client.submit("Hi", max_new_tokens=1, job_id="a")  # through the function: a live worker seen
            r.config_set("maxmemory", 1)
            # within a second of that check: a plain XADD + XLEN pipeline, whose error text named the command
            # (with a short job id, the whole inbox name) before
            with pytest.raises(RedisFull) as plain:
                await client.submit("Hi", max_new_tokens=1, job_id="b")
            client._live_seen = float("-inf")  # the live-worker check is due: through the enqueue function
            with pytest.raises(RedisFull) as function:
                await client.submit("Hi", max_new_tokens=1, job_id="c")
            for info in (plain, function):
                text = str(info.value)
                assert isinstance(info.value, RedisRefused) and "full" in text and "retry later" in text, text
                assert token_of(client) not in text and "inbox:" not in text.replace("inbox:<token>", ""), text
            assert client.inbox.held()["waiting"] == 1  # "a" only: refused submits leave nothing behind
            assert r.xlen(f"{NS}:stream:32") == 1
            r.config_set("maxmemory", 0)  # memory back: the same submit goes through
            assert await client.submit("Hi", max_new_tokens=1, job_id="b") == "b"

    with silent_fleet(url, NS):
        asyncio.run(scenario())


def test_the_gateway_answers_503_with_retry_after_when_redis_is_full(full_redis):
    url, r = full_redis
    with silent_fleet(url, NS), gateways(url, NS) as start:
        gw = start()
        body = {"model": "none", "prompt": "Hi", "max_tokens": 1}
        ok = httpx.post(gw.url + "/v1/completions", json={**body, "timeout": 0.5}, timeout=30)
        assert ok.status_code == 504, ok.text  # accepted: nobody answers
        r.config_set("maxmemory", 1)
        for _ in range(3):  # a plain add (a live worker seen within the second), then through the function
            resp = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
            assert resp.json()["error"]["code"] == "redis_full", resp.text
            assert token_of(gw.gateway.client) not in resp.text


@pytest.mark.unit
def test_a_refusal_keeps_redis_reason_and_drops_the_command():
    from batchfleet.common.redis.refusals import reason, refused

    exc = redis.exceptions.OutOfMemoryError("Command # 1 (XADD bf:stream:32 * id b r bf:inbox:uFJtb5rL-Dpo_xvrqyz"
                                            "JWQ15I24mEYQn p...) of pipeline caused error: command not allowed when "
                                            "used memory > 'maxmemory'.")
    assert reason(exc) == "command not allowed when used memory > 'maxmemory'."
    assert isinstance(refused(exc, "enqueue of job b"), RedisFull)
    other = refused(redis.exceptions.ResponseError("NOPERM no permissions to access bf:inbox:abcdefghijklmnop1"), "x")
    assert type(other) is RedisRefused and "abcdefghijklmnop1" not in str(other) and "inbox:<token>" in str(other)


def test_a_worker_started_while_redis_is_full_waits_and_then_serves(full_redis, tiny_model_dir, tmp_path):
    """The fault test's new.B: a worker starting on a full Redis exited 1 at its first write (XGROUP CREATE
    MKSTREAM refused); it waits the outage out as it waits for a Redis that is not up yet."""
    import threading
    import time

    from batchfleet.common.options import option_args
    from batchfleet.producer import Client
    from batchfleet.worker.devtools import spawn_worker

    url, r = full_redis
    log = tmp_path / "worker.log"
    r.config_set("maxmemory", 1)
    refused = threading.Event()

    def free_memory_once_refused() -> None:  # memory back once the worker has logged Redis' refusal
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not refused.is_set():
            refused.set() if log.exists() and "maxmemory" in log.read_text(errors="replace") else time.sleep(0.1)
        r.config_set("maxmemory", 0)

    threading.Thread(target=free_memory_once_refused, daemon=True).start()
    worker = spawn_worker(url, NS, option_args({
        "model": str(tiny_model_dir), "engine": "hf", "mode": "dynamic", "dtype": "float32", "max_seq_len": 512,
        "buckets": (32, 64), "max_wait_ms": 5}), log_path=str(log), wait_s=180)
    try:
        assert refused.is_set() and worker.proc.poll() is None  # it met the full Redis, and lived
        with Client(url, NS) as client:
            assert client.generate("Hi", max_new_tokens=2, timeout=60).completion_tokens == 2
    finally:
        worker.stop(10)
