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
from batchfleet.common.keys import Keys
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


def test_a_worker_joining_the_fleet_while_redis_is_full_waits_then_joins(full_redis, caplog):
    """The rest of new.B (25-minute fault runs): a worker whose set-up passed and whose fleet join then met a
    full Redis exited 1 (``presence.join`` refused in ``compose._build``). The join is waited out the same way."""
    import dataclasses
    import logging
    import threading
    import time

    from batchfleet.common.config import ConnectionConfig
    from batchfleet.common.wire.protocol import FleetInfo
    from batchfleet.worker.transport import fleet
    from batchfleet.worker.transport.consumer import StreamConsumer, refused_for_memory, wait_writable

    url, r = full_redis
    consumer = StreamConsumer(ConnectionConfig(redis_url=url, namespace=NS), (32, 64), "w1", 60)
    consumer.setup()  # memory free: set up
    info = fleet.with_fingerprint(dataclasses.replace(FleetInfo(
        model="tiny", tokenizer_json="{}", buckets=(32, 64), max_seq_len=256, max_batch_size=8, vocab_size=320,
        eos_token_ids=(2,))))
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(Exception) as refused:  # what the join raised before (the worker exited with it)
            consumer.presence.join(info)
        assert refused_for_memory(refused.value), repr(refused.value)

        def free_memory_later() -> None:
            time.sleep(1.0)
            r.config_set("maxmemory", 0)

        threading.Thread(target=free_memory_later, daemon=True).start()
        with caplog.at_level(logging.WARNING):
            wait_writable(lambda: consumer.presence.join(info), wait_s=60)
        assert "redis unavailable" in caplog.text and "available again" in caplog.text, caplog.text
        assert r.zscore(Keys(NS).workers, "w1") is not None  # joined: live
    finally:
        r.config_set("maxmemory", 0)
        consumer.close()


def test_an_answer_read_while_redis_is_full_is_handed_over_once_redis_records_it_taken(full_redis):
    """new.A under a full Redis: the answer is read (reads pass) but emptying it is refused (SET). The call waits
    until Redis records it taken, then returns it; past its timeout it raises Timeout and the answer stays for a
    later result() (it was handed over before, its emptying dropped: a later process got it a second time)."""
    import threading
    import time

    from batchfleet.common.errors import Timeout
    from batchfleet.common.wire.protocol import Result
    from batchfleet.producer import Client

    url, r = full_redis
    keys = Keys(NS)
    with Client(url, NS, require_workers=False) as client:
        for job in ("first", "second"):
            r.set(keys.done(job, client.reply_key),
                  Result(job, [7], "stored", "length", 1, 1, 0.0, 0.0, 0.0, "w", 1).encode(), ex=60)
            r.xadd(client.reply_key, {"id": job, "done": "1"})
        r.config_set("maxmemory", 1)
        with pytest.raises(Timeout):
            client.result("first", timeout=1.0)
        assert r.get(keys.done("first", client.reply_key)) != b""  # not taken: kept for a later call

        def free_memory_later() -> None:
            time.sleep(1.5)
            r.config_set("maxmemory", 0)

        threading.Thread(target=free_memory_later, daemon=True).start()
        started = time.monotonic()
        assert client.result("second", timeout=30).text == "stored"
        assert time.monotonic() - started > 1.0  # it waited for the full Redis
        assert r.get(keys.done("second", client.reply_key)) == b""
        assert client.result("first", timeout=10).text == "stored"
        assert r.get(keys.done("first", client.reply_key)) == b""


def test_a_wait_without_timeout_on_an_answer_redis_cannot_record_taken_raises_redis_full(full_redis):
    """Without a timeout the call waits the client's ``retry_s`` for Redis to record the answer taken, then raises
    RedisFull (one of the fleet's types, no inbox token in it); the answer stays for a later result()."""
    from batchfleet.common.wire.protocol import Result
    from batchfleet.producer import Client

    url, r = full_redis
    keys = Keys(NS)
    with Client(url, NS, retry_s=1.0, require_workers=False) as client:
        r.set(keys.done("nowait", client.reply_key),
              Result("nowait", [7], "stored", "length", 1, 1, 0.0, 0.0, 0.0, "w", 1).encode(), ex=60)
        r.xadd(client.reply_key, {"id": "nowait", "done": "1"})
        r.config_set("maxmemory", 1)
        with pytest.raises(RedisFull) as err:
            client.result("nowait")
        assert token_of(client._async) not in str(err.value) and "retry later" in str(err.value), err.value
        r.config_set("maxmemory", 0)
        assert client.result("nowait", timeout=10).text == "stored"
        assert r.get(keys.done("nowait", client.reply_key)) == b""
