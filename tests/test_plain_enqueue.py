"""The client's plain enqueue (producer/redis_calls.py ``enqueue``: XADD + XLEN, the enqueue function near the
queue limit), on real Redis with the real client: the queue limit still holds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis

from batchfleet.common.errors import QueueFull
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import Result
from batchfleet.producer import AsyncClient, Client
from tests.helpers.loops import request_fields, silent_fleet, wait_until


def test_a_plain_enqueue_past_the_queue_limit_is_withdrawn_and_the_next_refused_without_an_entry(redis_url,
                                                                                               namespace):
    """The client adds with plain XADD + XLEN while it saw its stream below half the limit: an add that finds the
    stream past the limit raises QueueFull and deletes the entry (no cancel: that would answer its job id); within
    the next second the client goes through the enqueue function, which refuses before adding."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)
    with silent_fleet(redis_url, namespace, max_queue_len=10), Client(redis_url, namespace) as client:
        client.submit([1, 2], max_new_tokens=1)  # the live-worker check: through the function
        client.submit([1, 2], max_new_tokens=1)  # plain: the stream is 2 long, far below the limit
        for i in range(8):  # another producer fills the queue
            r.xadd(stream, request_fields(keys, f"other-{i}", [1, 2]))
        with pytest.raises(QueueFull):
            client.submit([1, 2], max_new_tokens=1, job_id="past-limit")
        assert r.xlen(stream) == 10 and not r.exists(keys.cancel("past-limit"))  # added, then deleted
        assert [f[b"id"] for _, f in r.xrange(stream)].count(b"past-limit") == 0
        with pytest.raises(QueueFull):
            client.submit([1, 2], max_new_tokens=1, job_id="refused")
        assert r.xlen(stream) == 10 and not r.exists(keys.cancel("refused"))  # the function refused: no entry


def test_a_job_id_retried_after_its_add_was_withdrawn_gets_its_answer(start_worker, redis_url, namespace):
    """QueueFull says "retry later", and a caller that names its job ids (a bulk run: ids derive from the line)
    retries under the same id: the withdrawal of the add past the limit must not decide that retry's answer (a
    cancel by job id would: the retry answered ``cancelled``, or, once the withdrawn copy's answer was taken,
    never answered)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)
    with Client(redis_url, namespace) as client:
        with silent_fleet(redis_url, namespace, max_queue_len=10):
            client.submit([1, 2], max_new_tokens=1)  # the live-worker check: through the function
            for i in range(9):  # another producer fills the queue
                r.xadd(stream, request_fields(keys, f"other-{i}", [1, 2]))
            with pytest.raises(QueueFull):
                client.submit([1, 2], max_new_tokens=1, job_id="line-7")
        start_worker(max_wait_ms=5, max_queue_len=10)  # the backlog drains
        wait_until(lambda: r.xlen(stream) == 0, 60, "the backlog answered")
        time.sleep(1.1)  # the stream length the client saw no longer stands
        got = client.result(client.submit([1, 2], max_new_tokens=1, job_id="line-7"), timeout=30)
        assert got.id == "line-7" and got.completion_tokens == 1


def test_an_add_a_worker_read_before_its_withdrawal_answers_a_retry_under_its_id(redis_url, namespace):
    """The withdrawal (XDEL) comes a round trip after the add: a worker blocked on the stream may hold the entry by
    then, run it and answer. That answer is the one of a retry under the same job id (the worker finds it stored
    and rings again), so the client must keep it, not drop and empty it as an abandoned job's: the retry was then
    never answered."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)
    with silent_fleet(redis_url, namespace, max_queue_len=1), Client(redis_url, namespace) as client:
        client.submit([1, 2], max_new_tokens=1, job_id="first")  # through the function (the live-worker check)
        r.xreadgroup(keys.group, "busy", {stream: ">"}, count=1)  # running: the stream stays 1 long
        held: list = []
        fast = threading.Thread(target=lambda: held.append(redis.Redis.from_url(redis_url).xreadgroup(
            keys.group, "fast", {stream: ">"}, count=1, block=10_000)))
        fast.start()
        time.sleep(0.3)  # blocked on the stream
        with pytest.raises(QueueFull):
            client.submit([1, 2], max_new_tokens=1, job_id="raced")  # plain: past the limit, withdrawn
        fast.join(10)
        assert held[0][0][1][0][1][b"id"] == b"raced"  # ... after the blocked worker had read it
        answer = keys.done("raced", client.reply_key)
        stored = Result("raced", [7], "the raced answer", "length", 1, 1, 0.0, 0.0, 0.0, "fast", 1)
        r.set(answer, stored.encode(), nx=True, ex=60)  # the worker answers it
        r.xadd(client.reply_key, {"id": "raced", "done": "1"})
        time.sleep(0.5)  # the client reads the ring
        for entry_id, _ in r.xrange(stream):  # "first" answered: room for the retry
            r.xack(stream, keys.group, entry_id)
            r.xdel(stream, entry_id)
        job = client.submit([1, 2], max_new_tokens=1, job_id="raced")
        r.xadd(client.reply_key, {"id": "raced", "done": "1"})  # a worker finds the retry answered: rings again
        assert client.result(job, timeout=10).text == "the raced answer"


def test_a_burst_of_submits_past_a_length_no_longer_trusted_adds_at_most_one_entry(redis_url, namespace):
    """Issue 54 item 11 (test_cancel_holds.py::test_refused_submits_leave_nothing_in_memory failed under load):
    a burst of submits to a full queue whose length the client saw over LENGTH_TRUST_S ago all decided on a plain
    add before the first one answered, so every one of them added an entry (withdrawn at once, but a worker may
    read it first and run it: there a static batch filled with such entries, ran, and emptied the queue for a
    later submit). One plain add probes the length; the rest go through the function, which adds nothing."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)

    async def scenario() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            await client.submit([1, 2], max_new_tokens=1)  # the live-worker check: through the function
            await client.submit([1, 2], max_new_tokens=1)  # plain: the queue is full now (2 of 2)
            await asyncio.sleep(1.1)  # that length no longer stands (nor does the live worker seen)
            added = r.xinfo_stream(stream)["entries-added"]
            refused = await asyncio.gather(*(client.submit([1, 2], max_new_tokens=1) for _ in range(200)),
                                           return_exceptions=True)
            assert all(isinstance(x, QueueFull) for x in refused), {type(x) for x in refused}
            assert r.xinfo_stream(stream)["entries-added"] - added <= 1  # one probe at most
            assert r.xlen(stream) == 2

    with silent_fleet(redis_url, namespace, max_queue_len=2):
        asyncio.run(scenario())
