"""Cancellation that holds (issue 22 item 6): the gateway's own 504 cancels the running job; cancelling
``await client.generate(...)`` (asyncio.wait_for, task.cancel()) or its timeout cancels the fleet job;
streams whose client leaves at any moment are all cancelled; abandoned answers leave neither the inbox nor
the client's memory; refused submits (QueueFull) leave nothing behind. Measured in the worker (the job
left the engine long before its end) and in the client (its in-memory routes, its inbox stream)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import AsyncClient, QueueFull, Timeout
from tests.helpers.gateway import engine_stats

LONG = 3000  # tokens: seconds of decoding on the tiny model; a job left running would show
NOTHING = {"waiting": 0, "abandoned": 0, "unclaimed": 0, "to_delete": 0}


@pytest.fixture
def long_worker(start_worker):
    return start_worker(engine="native", mode="continuous", max_wait_ms=5, kv_cache_gb=0.05, max_seq_len=4096)


def wait_until(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def assert_all_left(worker, client: AsyncClient, redis_url: str, jobs: int) -> None:
    """The engine holds nothing and generated far fewer tokens than the jobs would have; the client holds
    no route and its inbox no entry (the cancelled answers came and were deleted)."""
    wait_until(lambda: engine_stats(worker)["running"] == 0 and worker.loop.engine.num_active() == 0,
               "a given-up job is still in the engine")
    assert engine_stats(worker)["tokens_generated"] < jobs * LONG // 2
    wait_until(lambda: client.inbox.held() == NOTHING, f"the client still holds {client.inbox.held()}")
    r = redis.Redis.from_url(redis_url)
    wait_until(lambda: r.xlen(client.inbox.key) == 0, "answers of given-up jobs stay in the inbox")


def test_gateway_timeout_504_cancels_the_running_job(long_worker, start_gateway, redis_url):
    gw = start_gateway()
    body = {"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "timeout": 0.5}
    resp = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 504 and resp.headers["x-should-retry"] == "false", resp.text
    assert_all_left(long_worker, gw.gateway.client, redis_url, 1)
    # the official client (2 retries by default) does not start it again
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", timeout=30)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=LONG,
                                  extra_body={"ignore_eos": True, "timeout": 0.5})
    assert info.value.status_code == 504
    assert_all_left(long_worker, gw.gateway.client, redis_url, 2)
    answered = gw.app.state.metrics.registry.get_sample_value(
        "batchfleet_gateway_requests_total", {"route": "/v1/completions", "method": "POST", "status": "504"})
    assert answered == 2


@pytest.mark.parametrize("how", ["wait_for", "task.cancel", "timeout"])
def test_giving_up_on_generate_cancels_the_fleet_job(how, long_worker, redis_url, namespace):
    async def scenario() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            timeout = 0.5 if how == "timeout" else None
            call = client.generate("Hi", max_new_tokens=LONG, ignore_eos=True, timeout=timeout)
            if how == "wait_for":
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(call, 0.5)
            elif how == "task.cancel":
                task = asyncio.ensure_future(call)
                await asyncio.sleep(0.5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(Timeout):
                    await call
            await asyncio.to_thread(assert_all_left, long_worker, client, redis_url, 1)

    asyncio.run(scenario())


def test_every_stream_whose_client_leaves_is_cancelled(long_worker, start_gateway, redis_url, namespace):
    """Clients leave after a random number of chunks (0 included: before the first): each job is cancelled
    (its cancel marker exists, the engine empties); nothing stays in the gateway's client."""
    gw = start_gateway()
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    rng = random.Random(6)
    ids: list[str] = []

    async def one(http: httpx.AsyncClient, chunks: int) -> None:
        body = {"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "stream": True, "temperature": 0}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            ids.append(resp.headers["x-request-id"])
            async for _ in resp.aiter_lines():
                chunks -= 1
                if chunks <= 0:
                    break

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            await asyncio.gather(*(one(http, rng.choice([0, 1, 2, 5, 20, 60])) for _ in range(24)))

    asyncio.run(scenario())
    wait_until(lambda: all(r.exists(keys.cancel(j)) for j in ids), "a stream whose client left was not cancelled")
    assert_all_left(long_worker, gw.gateway.client, redis_url, len(ids))


def test_refused_submits_leave_nothing_in_memory(start_worker, redis_url, namespace):
    # static batching with batches of 8: the worker holds what it reads and never runs it; a queue of 2
    start_worker(max_wait_ms=float("inf"), max_batch_size=8, max_queue_len=2)

    async def scenario() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            queued = [await client.submit("Hi", max_new_tokens=2) for _ in range(2)]
            # the queue length the client saw no longer stands (on a loaded machine, one pass over 1,000 submits
            # took that long): one plain add probes it, the rest go through the function (issue 54 item 11)
            await asyncio.sleep(1.1)
            refused = await asyncio.gather(*(client.submit("Hi", max_new_tokens=2) for _ in range(1000)),
                                           return_exceptions=True)
            assert all(isinstance(x, QueueFull) for x in refused), {type(x) for x in refused}
            assert client.inbox.held() == {**NOTHING, "waiting": len(queued)}

    asyncio.run(scenario())
