"""Thread-safe synchronous client: many threads may call ``generate`` on one instance at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis

from batchfleet.common.config import connection_from_env
from batchfleet.common.errors import QueueFull, Timeout
from batchfleet.common.protocol import Result
from batchfleet.producer.core import (
    RETRY_S,
    TRANSIENT,
    Backoff,
    FleetView,
    Params,
    Prompt,
    connection_kwargs,
    no_fleet,
    parse_reply,
)

T = TypeVar("T")

# KEYS: stream. ARGV: max_len (0 = unbounded), id, payload. Returns 0 when the queue is full.
ENQUEUE_SCRIPT = """
local max_len = tonumber(ARGV[1])
if max_len > 0 and redis.call('XLEN', KEYS[1]) >= max_len then return 0 end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'p', ARGV[3])
return 1
"""


class Client:
    """Submit prompts to a batchfleet and wait for results.

    Args:
        redis_url: defaults to $BATCHFLEET_REDIS_URL, else redis://127.0.0.1:6379/0.
        namespace: defaults to $BATCHFLEET_NAMESPACE, else ``bf``.
        retry_s: how long ``submit``/``fleet`` keep retrying through a Redis outage (capped exponential
            backoff) before raising the connection error; ``result`` retries until its own timeout.
    """

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S) -> None:
        self.conn = connection_from_env(redis_url, namespace)
        self.keys = self.conn.keys
        # redis-py's pool hands each thread its own connection, so blocking waits do not serialize.
        self.r = redis.Redis.from_url(self.conn.redis_url, **connection_kwargs(self.conn))
        self._enqueue = self.r.register_script(ENQUEUE_SCRIPT)
        self._fleet = FleetView()
        self._lock = threading.Lock()
        self.retry_s = retry_s
        self._backoff = Backoff()

    def _retry(self, call: Callable[[], T], deadline: float | None) -> T:
        """Run ``call``; on a connection error back off and retry until ``deadline`` (monotonic)."""
        attempt = 0
        while True:
            try:
                out = call()
                self._backoff.ok()
                return out
            except TRANSIENT as exc:
                wait = Backoff.wait_left(deadline, self._backoff.delay(attempt, exc))
                if wait <= 0:
                    raise
                time.sleep(wait)
                attempt += 1

    def fleet(self) -> FleetView:
        """The fleet description workers published (tokenizer, buckets, limits)."""
        if self._fleet.stale():
            with self._lock:
                if self._fleet.stale():
                    raw = self._retry(lambda: self.r.get(self.keys.fleet), time.monotonic() + self.retry_s)
                    self._fleet.update(raw)
        if self._fleet.info is None:
            raise no_fleet(self.keys)
        return self._fleet

    def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               **params) -> str:
        """Enqueue one prompt; returns its job id. Raises PromptTooLong / QueueFull before enqueueing.

        Connection errors are retried for ``retry_s`` (bounded by ``timeout``). A retry after a reply
        was lost in flight may enqueue the job twice: workers answer it once (first writer wins).
        """
        fleet = self.fleet()
        bucket, req = fleet.build(self.keys, prompt, Params(**params), timeout, job_id)
        limit = self.retry_s if timeout is None else min(self.retry_s, timeout)
        ok = self._retry(lambda: self._enqueue(keys=[self.keys.stream(bucket)],
                                               args=[fleet.info.max_queue_len, req.id, req.encode()]),
                         time.monotonic() + limit)
        if not ok:
            raise QueueFull(f"bucket {bucket} holds {fleet.info.max_queue_len} entries; retry later")
        return req.id

    def result(self, job_id: str, timeout: float | None = None) -> Result:
        """Wait for a job's result (once: the reply is consumed). Raises Timeout or JobFailed.

        Survives Redis restarts and dropped connections while waiting: it reconnects with capped backoff
        until ``timeout``. (A reply lost with Redis' data never comes: resubmit after Timeout.)
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each blocking pop stays well inside the socket timeout.
        chunk = self.conn.socket_timeout_s / 2
        attempt = 0
        while True:
            wait = chunk if deadline is None else min(chunk, deadline - time.monotonic())
            if wait <= 0:
                raise Timeout(f"no result for job {job_id} within {timeout} s")
            try:
                got = self.r.blpop([self.keys.reply(job_id)], timeout=max(wait, 0.01))
            except TRANSIENT as exc:
                time.sleep(max(0.0, Backoff.wait_left(deadline, self._backoff.delay(attempt, exc))))
                attempt += 1
                continue
            self._backoff.ok()
            attempt = 0
            if got is not None:
                return parse_reply(job_id, got[1])

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **params) -> Result:
        """Submit and wait. ``timeout`` (s) is also the request's deadline: a worker skips it once expired."""
        start = time.monotonic()
        job_id = self.submit(prompt, timeout=timeout, **params)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self.result(job_id, timeout=left)

    def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None, **params) -> list[Result]:
        """Submit all prompts at once (so they can share batches), then collect results in order."""
        fleet = self.fleet()
        p = Params(**params)
        built = [fleet.build(self.keys, prompt, p, timeout, None) for prompt in prompts]  # validates all first

        def enqueue_all() -> list:
            pipe = self.r.pipeline(transaction=False)
            for bucket, req in built:
                self._enqueue(keys=[self.keys.stream(bucket)],
                              args=[fleet.info.max_queue_len, req.id, req.encode()], client=pipe)
            return pipe.execute()

        start = time.monotonic()
        limit = self.retry_s if timeout is None else min(self.retry_s, timeout)
        for (bucket, _), ok in zip(built, self._retry(enqueue_all, start + limit)):
            if not ok:
                raise QueueFull(f"bucket {bucket} is full; earlier prompts of this call were enqueued")
        # one deadline for the whole call: each wait gets what is left of it
        return [self.result(req.id, timeout=None if timeout is None else max(0.0, start + timeout - time.monotonic()))
                for _, req in built]

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
