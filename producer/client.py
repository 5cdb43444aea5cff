"""Thread-safe synchronous client: many threads may call ``generate`` on one instance at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis

from batchfleet.common.protocol import Result
from batchfleet.common.retry import TRANSIENT
from batchfleet.producer.base import ClientBase
from batchfleet.producer.core import RETRY_S, FleetView, Params, Prompt
from batchfleet.producer.plan import ResultWait, RetryPlan, retry_deadline, time_left

T = TypeVar("T")


class Client(ClientBase):
    """Submit prompts to a batchfleet and wait for results.

    Args:
        redis_url: defaults to $BATCHFLEET_REDIS_URL, else redis://127.0.0.1:6379/0.
        namespace: defaults to $BATCHFLEET_NAMESPACE, else ``bf``.
        retry_s: how long ``submit``/``fleet`` keep retrying through a Redis outage (capped exponential
            backoff) before raising the connection error; ``result`` retries until its own timeout.
    """

    def __init__(self, redis_url: str | None = None, namespace: str | None = None, retry_s: float = RETRY_S) -> None:
        super().__init__(redis.Redis, threading.Lock(), redis_url, namespace, retry_s)

    def _retry(self, call: Callable[[], T], deadline: float | None) -> T:
        """Run ``call``; on a connection error back off and retry until ``deadline`` (monotonic)."""
        plan = RetryPlan(self._backoff, deadline)
        while True:
            try:
                out = call()
            except TRANSIENT as exc:
                time.sleep(plan.failed(exc))
                continue
            plan.succeeded()
            return out

    def fleet(self) -> FleetView:
        """The fleet description workers published (tokenizer, buckets, limits)."""
        if self._fleet.stale():
            with self._lock:
                if self._fleet.stale():
                    self._fleet.update(self._retry(lambda: self.r.get(self.keys.fleet), retry_deadline(self.retry_s)))
        return self._fleet.require(self.keys)

    def submit(self, prompt: Prompt, *, timeout: float | None = None, job_id: str | None = None,
               **params) -> str:
        """Enqueue one prompt; returns its job id. Raises PromptTooLong / QueueFull before enqueueing.

        Connection errors are retried for ``retry_s`` (bounded by ``timeout``). A retry after a reply
        was lost in flight may enqueue the job twice: workers answer it once (first writer wins).
        """
        job = self.fleet().build(self.keys, prompt, Params(**params), timeout, job_id)
        ok = self._retry(lambda: self._enqueue(keys=[job.stream], args=job.script_args()),
                         retry_deadline(self.retry_s, timeout))
        return job.accepted(ok)

    def result(self, job_id: str, timeout: float | None = None) -> Result:
        """Wait for a job's result (once: the reply is consumed). Raises Timeout or JobFailed.

        Survives Redis restarts and dropped connections while waiting: it reconnects with capped backoff
        until ``timeout``. (A reply lost with Redis' data never comes: resubmit after Timeout.)
        """
        wait = ResultWait(job_id, timeout, self.conn.socket_timeout_s / 2, self._backoff)
        while True:
            pop_s = wait.next_pop_s()
            try:
                got = self.r.blpop([self.keys.reply(job_id)], timeout=pop_s)
            except TRANSIENT as exc:
                time.sleep(wait.failed(exc))
                continue
            if (result := wait.popped(got)) is not None:
                return result

    def generate(self, prompt: Prompt, *, timeout: float | None = None, **params) -> Result:
        """Submit and wait. ``timeout`` (s) is also the request's deadline: a worker skips it once expired."""
        start = time.monotonic()
        job_id = self.submit(prompt, timeout=timeout, **params)
        return self.result(job_id, timeout=time_left(start, timeout))

    def generate_many(self, prompts: Sequence[Prompt], *, timeout: float | None = None, **params) -> list[Result]:
        """Submit all prompts at once (so they can share batches), then collect results in order."""
        jobs = self.fleet().build_many(self.keys, prompts, Params(**params), timeout)

        def enqueue_all() -> list:
            pipe = self.r.pipeline(transaction=False)
            for job in jobs:
                self._enqueue(keys=[job.stream], args=job.script_args(), client=pipe)
            return pipe.execute()

        start = time.monotonic()
        for job, ok in zip(jobs, self._retry(enqueue_all, retry_deadline(self.retry_s, timeout))):
            job.accepted(ok, in_batch=True)
        # one deadline for the whole call: each wait gets what is left of it
        return [self.result(job.id, timeout=time_left(start, timeout)) for job in jobs]

    def close(self) -> None:
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
