"""Thread-safe synchronous client: many threads may call ``generate`` on one instance at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import redis

from common.config import connection_from_env
from common.errors import FleetUnavailable, QueueFull, Timeout
from common.protocol import Result
from producer.core import FleetView, Params, Prompt, parse_reply

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
    """

    def __init__(self, redis_url: str | None = None, namespace: str | None = None) -> None:
        self.conn = connection_from_env(redis_url, namespace)
        self.keys = self.conn.keys
        # redis-py's pool hands each thread its own connection, so blocking waits do not serialize.
        self.r = redis.Redis.from_url(self.conn.redis_url, socket_timeout=self.conn.socket_timeout_s,
                                      socket_connect_timeout=self.conn.socket_timeout_s, decode_responses=False)
        self._enqueue = self.r.register_script(ENQUEUE_SCRIPT)
        self._fleet = FleetView()
        self._lock = threading.Lock()

    def fleet(self) -> FleetView:
        """The fleet description workers published (tokenizer, buckets, limits)."""
        if self._fleet.stale():
            with self._lock:
                if self._fleet.stale():
                    self._fleet.update(self.r.get(self.keys.fleet))
        if self._fleet.info is None:
            raise FleetUnavailable(f"no worker has published a fleet under namespace {self.keys.namespace!r}; "
                                   "start a worker first")
        return self._fleet

    def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               **params) -> str:
        """Enqueue one prompt; returns its job id. Raises PromptTooLong / QueueFull before enqueueing."""
        fleet = self.fleet()
        bucket, req = fleet.build(self.keys, prompt, Params(**params), timeout, job_id)
        ok = self._enqueue(keys=[self.keys.stream(bucket)], args=[fleet.info.max_queue_len, req.id, req.encode()])
        if not ok:
            raise QueueFull(f"bucket {bucket} holds {fleet.info.max_queue_len} entries; retry later")
        return req.id

    def result(self, job_id: str, timeout: float | None = None) -> Result:
        """Wait for a job's result (once: the reply is consumed). Raises Timeout or JobFailed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Each blocking pop stays well inside the socket timeout.
        chunk = self.conn.socket_timeout_s / 2
        while True:
            wait = chunk if deadline is None else min(chunk, deadline - time.monotonic())
            if wait <= 0:
                raise Timeout(f"no result for job {job_id} within {timeout} s")
            got = self.r.blpop([self.keys.reply(job_id)], timeout=max(wait, 0.01))
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
        pipe = self.r.pipeline(transaction=False)
        for bucket, req in built:
            self._enqueue(keys=[self.keys.stream(bucket)], args=[fleet.info.max_queue_len, req.id, req.encode()],
                          client=pipe)
        for (bucket, _), ok in zip(built, pipe.execute()):
            if not ok:
                raise QueueFull(f"bucket {bucket} is full; earlier prompts of this call were enqueued")
        return [self.result(req.id, timeout=timeout) for _, req in built]

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
