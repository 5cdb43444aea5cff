"""A job id names one job per inbox (docs/PROTOCOL.md section 4), on real Redis with a real worker (issue 54
items 1 and 5): two inboxes that chose one job id each get their own answer, also a restarted process (a new
inbox) retrying under its id while the old copy is still held; one client's second submit of an id it has in
flight with a different request is refused at once, the same request joins the first.

The worker batches statically in pairs (``max_wait_ms`` infinite): it holds the first request it reads and runs
nothing until a second one is held beside it, so a second request of the same id that the worker dropped (as it
did: its duplicate check looked at the job id alone) leaves both unanswered, whatever the timing."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import decode_reply
from batchfleet.producer import AsyncClient, Client
from tests.helpers.loops import wait_until

PAIRS = {"max_wait_ms": float("inf"), "max_batch_size": 2}
PROMPTS = ([1, 20, 21, 22], [1, 30, 31, 32])


def reference(client: Client) -> list[str]:
    """The two prompts' greedy answers, run as a pair under ids of their own."""
    ids = [client.submit(p, max_new_tokens=6, timeout=60) for p in PROMPTS]
    return [client.result(j, timeout=60).text for j in ids]


def test_two_inboxes_submitting_one_job_id_at_once_both_get_their_answer(start_worker, redis_url, namespace):
    start_worker(**PAIRS)
    with Client(redis_url, namespace) as a, Client(redis_url, namespace) as b, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda c=c, p=p: c.result(c.submit(p, max_new_tokens=6, job_id="same", timeout=60),
                                                         timeout=60))
                   for c, p in ((a, PROMPTS[0]), (b, PROMPTS[1]))]
        got = [f.result(70) for f in futures]
        assert [g.id for g in got] == ["same", "same"]
        assert [g.text for g in got] == reference(a)


def test_a_restarted_process_retrying_under_its_id_while_the_old_copy_is_held_gets_its_answer(
        start_worker, redis_url, namespace):
    worker = start_worker(**PAIRS)
    with Client(redis_url, namespace) as old:
        old.submit(PROMPTS[0], max_new_tokens=6, job_id="order-7", timeout=60)
        old_inbox = old.reply_key
        # the process dies: its inbox is gone with it; the worker holds its copy, waiting for a batchmate
    wait_until(lambda: len(worker.loop.requests.snapshot) == 1, 30, "the worker holds the old copy")
    with Client(redis_url, namespace) as new:  # restarted: a new inbox, the same job id
        got = new.result(new.submit(PROMPTS[0], max_new_tokens=6, job_id="order-7", timeout=60), timeout=60)
        assert got.id == "order-7" and got.completion_tokens == 6
    # the old copy ran beside it, answered into the old inbox: the same prompt in the same batch, the same text
    stored = redis.Redis.from_url(redis_url).get(Keys(namespace).done("order-7", old_inbox))
    assert decode_reply(stored).text == got.text


def test_one_client_submitting_an_id_in_flight_with_another_request_is_refused_at_once(start_worker, redis_url,
                                                                                       namespace):
    start_worker(**PAIRS)

    async def scenario() -> None:
        async with AsyncClient(redis_url, namespace) as client:
            first, second = await asyncio.gather(
                client.submit(PROMPTS[0], max_new_tokens=6, job_id="x", timeout=60),
                client.submit(PROMPTS[1], max_new_tokens=6, job_id="x", timeout=60), return_exceptions=True)
            assert first == "x" and isinstance(second, InvalidRequest), second
            assert "x" in str(second) and "different request" in str(second)
            for other in ({"max_new_tokens": 7}, {"max_new_tokens": 6, "temperature": 0.5},
                          {"max_new_tokens": 6, "priority": "background"}):
                with pytest.raises(InvalidRequest):  # a parameter, or the priority, makes another request too
                    await client.submit(PROMPTS[0], job_id="x", timeout=60, **other)
            # the same request (a retry: "did it go through?") joins the first, whatever its timeout
            assert await client.submit(PROMPTS[0], max_new_tokens=6, job_id="x", timeout=30) == "x"
            pair = await client.submit(PROMPTS[1], max_new_tokens=6, timeout=60)  # the first's batchmate
            got, mate = await client.result("x", timeout=60), await client.result(pair, timeout=60)
            refs = await asyncio.gather(*(client.submit(p, max_new_tokens=6, timeout=60) for p in PROMPTS))
            texts = [(await client.result(j, timeout=60)).text for j in refs]
            assert [got.text, mate.text] == texts
            # answered and taken: the id is free in this client again (a new request under it is refused by the
            # fleet, one answer per id and inbox, not by this check)
            assert client.inbox.held()["waiting"] == 0

    asyncio.run(scenario())
