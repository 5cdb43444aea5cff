"""The client's plain enqueue (producer/redis_calls.py ``enqueue``: XADD + XLEN, the enqueue function near the
queue limit), on real Redis with the real client: the queue limit still holds."""

from __future__ import annotations

import redis

from batchfleet.common.errors import QueueFull
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from tests.helpers.loops import request_fields, silent_fleet, wait_until


def test_a_plain_enqueue_past_the_queue_limit_is_withdrawn_and_the_next_refused_without_an_entry(redis_url,
                                                                                               namespace):
    """The client adds with plain XADD + XLEN while it saw its stream below half the limit: an add that finds the
    stream past the limit raises QueueFull and cancels the entry (a worker answers it cancelled, unrun); within
    the next second the client goes through the enqueue function, which refuses before adding."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)
    with silent_fleet(redis_url, namespace, max_queue_len=10), Client(redis_url, namespace) as client:
        client.submit([1, 2], max_new_tokens=1)  # the live-worker check: through the function
        client.submit([1, 2], max_new_tokens=1)  # plain: the stream is 2 long, far below the limit
        for i in range(8):  # another producer fills the queue
            r.xadd(stream, request_fields(keys, f"other-{i}", [1, 2]))
        try:
            client.submit([1, 2], max_new_tokens=1, job_id="past-limit")
            raise AssertionError("the add past the limit was accepted")
        except QueueFull:
            pass
        assert r.xlen(stream) == 11  # added, then withdrawn: its cancel marker names the client's inbox
        wait_until(lambda: r.get(keys.cancel("past-limit")) == client.reply_key.encode(), 10, "the withdrawal")
        try:
            client.submit([1, 2], max_new_tokens=1, job_id="refused")
            raise AssertionError("a full queue accepted a request")
        except QueueFull:
            pass
        assert r.xlen(stream) == 11 and not r.exists(keys.cancel("refused"))  # the function refused: no entry
