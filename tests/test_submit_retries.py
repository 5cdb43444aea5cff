"""A submit retried under the caller's own job id (PROTOCOL section 4: a retry of a request not yet answered gets
the one answer), on real Redis with the real client: a retry after a submit whose outcome the client could not know
(its reply came too late), and a refused retry of a job a caller already waits on."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from batchfleet.common.errors import QueueFull, Timeout
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import async_client
from batchfleet.common.wire.protocol import Result
from batchfleet.producer import Client
from tests.helpers.loops import request_fields, silent_fleet, wait_inbox_holds_nothing, wait_until


class SlowReplies:
    """A TCP proxy to Redis that forwards every command at once and holds each reply back ``delay`` seconds: a
    network that loses the answer to a command that did run."""

    def __init__(self, redis_url: str) -> None:
        r = redis.Redis.from_url(redis_url)
        kw = r.connection_pool.connection_kwargs
        self.upstream, self.db, self.delay = (kw["host"], kw["port"]), kw.get("db", 0), 0.0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.start_server(self._pipe, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _pipe(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.upstream)

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            try:
                while data := await src.read(65536):
                    if slow and self.delay:
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            dst.close()

        await asyncio.gather(copy(client_r, up_w, False), copy(up_r, client_w, True))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextmanager
def slow_replies(redis_url: str) -> Iterator[SlowReplies]:
    proxy = SlowReplies(redis_url)
    try:
        yield proxy
    finally:
        proxy.close()


def test_a_submit_retried_under_its_id_after_its_reply_came_too_late_gets_the_answer(start_worker, redis_url,
                                                                                    namespace):
    """The add reached Redis but its reply came after the submit's timeout: Timeout, and the job runs. Its answer,
    when it comes, must wait for the caller's retry under the same id (it was dropped and emptied as an abandoned
    job's, so the retry's ring found it taken: never answered, then a reused-id error)."""
    start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    with slow_replies(redis_url) as proxy, Client(proxy.url, namespace) as client:
        assert client.generate([1, 10, 11], max_new_tokens=1, timeout=30).completion_tokens == 1
        proxy.delay = 0.5
        with pytest.raises(Timeout):
            client.submit([1, 10, 12], max_new_tokens=3, job_id="order-42", timeout=0.3)
        proxy.delay = 0.0
        inbox = client._async.inbox
        wait_until(lambda: inbox.held()["unclaimed"] == 1, 30, "the late answer read, kept for a retry")
        got = client.result(client.submit([1, 10, 12], max_new_tokens=3, job_id="order-42", timeout=30), timeout=30)
        assert got.id == "order-42" and got.completion_tokens == 3
        wait_until(lambda: r.xlen(client.reply_key) == 0, 10, "every ring deleted")
        wait_inbox_holds_nothing(inbox)
        assert r.get(keys.done("order-42", client.reply_key)) == b""


def test_an_answer_read_before_its_submit_raised_waits_for_the_retry(start_worker, redis_url, namespace):
    """The enqueue's reply is late on the pool's link while the inbox reader's own link is fast: the answer reaches
    the submit's waiter before the submit's timeout passes. Forgetting that waiter must keep the answer (it was
    dropped: the ring is never read again, so result() timed out and a retry read as a reused id)."""
    start_worker(max_wait_ms=5)
    with slow_replies(redis_url) as proxy, Client(proxy.url, namespace) as client:
        inbox = client._async.inbox

        async def direct_reader() -> None:  # before the reader's first read: its link does not go through the proxy
            inbox.reader = async_client(redis_url, max_connections=1, socket_timeout=inbox.block_ms / 500)

        client._loop.run(direct_reader())
        assert client.generate([1, 10, 11], max_new_tokens=1, timeout=30).completion_tokens == 1
        proxy.delay = 1.0
        with pytest.raises(Timeout):
            client.submit([1, 10, 12], max_new_tokens=3, job_id="slow-1", timeout=0.5)
        proxy.delay = 0.0
        wait_until(lambda: inbox.held()["unclaimed"] == 1, 30, "the answer kept for a retry")
        got = client.result(client.submit([1, 10, 12], max_new_tokens=3, job_id="slow-1", timeout=30), timeout=30)
        assert got.id == "slow-1" and got.completion_tokens == 3
        wait_inbox_holds_nothing(inbox)


def test_a_refused_retry_of_a_job_leaves_the_caller_waiting_on_it_its_answer(redis_url, namespace):
    """A caller waits on job J; a second submit under J ("did it go through?") is refused (QueueFull). The refusal
    must not drop J's waiter: the first caller gets J's answer (it timed out, the answer left unclaimed)."""
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    stream = keys.stream(32)
    with silent_fleet(redis_url, namespace, max_queue_len=3), Client(redis_url, namespace) as client:
        client.submit([1, 2], max_new_tokens=1, job_id="J")  # through the function (the live-worker check)
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(client.result("J", timeout=30)))
        waiting.start()
        for i in range(2):  # another producer fills the queue
            r.xadd(stream, request_fields(keys, f"other-{i}", [1, 2]))
        with pytest.raises(QueueFull):
            client.submit([1, 2], max_new_tokens=1, job_id="J")
        stored = Result("J", [7], "J's answer", "length", 1, 1, 0.0, 0.0, 0.0, "some-worker", 1)
        r.set(keys.done("J", client.reply_key), stored.encode(), nx=True, ex=60)  # a worker answers the first
        r.xadd(client.reply_key, {"id": "J", "done": "1"})
        waiting.join(35)
        assert got and got[0].text == "J's answer"
        assert client._async.inbox.held()["unclaimed"] == 0
