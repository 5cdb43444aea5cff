"""Helpers shared by the reliability, fuzz and ACL tests (no tests here).

``PoisonEngine`` is TEST ONLY: it wraps a real engine and raises whenever a request holding the marker
token is in the running batch. It is never built by the worker itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from batchfleet.common.config import WorkerConfig
from batchfleet.common.keys import Keys
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import Delta, Error, Request, Result, decode_reply
from batchfleet.worker.engine.base import Completion, GenRequest
from batchfleet.worker.loop import WorkerLoop

POISON_TOKEN = 7


class PoisonEngine:
    """TEST ONLY engine wrapper: a step raises while a request containing ``marker`` is active."""

    def __init__(self, inner, marker: int = POISON_TOKEN) -> None:
        self.inner = inner
        self.marker = marker
        self._poisoned: set[str] = set()
        self.failures = 0

    def add(self, requests: list[GenRequest]) -> None:
        self._poisoned |= {r.id for r in requests if self.marker in r.prompt}
        self.inner.add(requests)

    def step(self) -> list[Completion]:
        if self._poisoned:
            self.failures += 1
            raise RuntimeError(f"test poison in {sorted(self._poisoned)}")
        return self.inner.step()

    def has_work(self) -> bool:
        return self.inner.has_work()

    def num_active(self) -> int:
        return self.inner.num_active()

    def room(self, priority: int = 0) -> int:
        return self.inner.room(priority)

    def failed_ids(self) -> list[str]:
        return []  # it raises before the inner engine steps: it cannot tell which requests were in the step

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def reset(self) -> None:
        self._poisoned.clear()
        self.inner.reset()

    def abort(self, ids: list[str]) -> list[str]:
        self._poisoned -= set(ids)
        return self.inner.abort(ids)

    def progress(self, ids: list[str]) -> dict[str, list[int]]:
        return self.inner.progress(ids)


class LoopThread:
    """A real WorkerLoop in a thread; ``wrap`` may replace its engine (e.g. PoisonEngine)."""

    def __init__(self, cfg: WorkerConfig, wrap: Callable | None = None) -> None:
        from batchfleet.worker.compose import build_worker

        self.loop: WorkerLoop = build_worker(cfg, wrap_engine=wrap)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.error = exc

    @property
    def lease_failures(self) -> int:
        return self.loop.lease.failures

    def stop(self) -> None:
        self.loop.stopping.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "worker thread did not stop"
        self.loop.transport.close()
        if self.error is not None:
            raise self.error


TEST_INBOX = "testinbox0123456789"  # the inbox token of raw requests the tests XADD themselves


def raw_inbox(keys: Keys) -> str:
    """The inbox stream raw test requests are answered on."""
    return keys.inbox(TEST_INBOX)


def request_fields(keys: Keys, job_id: str, prompt: list[int], **kw) -> dict[str, bytes]:
    """The stream entry the enqueue function would XADD for this request (answered on ``test_inbox``)."""
    envelope = {k: kw.pop(k) for k in ("timeout_ms", "stream") if k in kw}
    req = Request(id=job_id, prompt=prompt, reply_key=raw_inbox(keys), **envelope,
                  params=Params(**{"max_new_tokens": 2, **kw}))
    return {"id": job_id.encode(), "r": raw_inbox(keys).encode(), "p": req.encode()}


def inbox_replies(r: redis.Redis, keys: Keys, inbox: str | None = None) -> dict[str, list[Result | Error]]:
    """Final replies (no deltas) rung for in an inbox, by job id, in the order rung: each job's stored answer
    (``Keys.done``) once, however many times it was rung for; a reply written into the inbox itself (the
    protocol before v5) counts as another."""
    out: dict[str, list[Result | Error]] = {}
    inbox = inbox or raw_inbox(keys)
    for _, fields in r.xrange(inbox):
        job = fields[b"id"].decode()
        if b"done" in fields:
            if job not in out and (answer := r.get(Keys.done(job, inbox))):
                out[job] = [decode_reply(answer)]
            continue
        reply = decode_reply(fields[b"p"])
        if not isinstance(reply, Delta):
            out.setdefault(job, []).append(reply)
    return out


def reply_of(r: redis.Redis, keys: Keys, job_id: str) -> Result | Error | None:
    """The one final reply of a raw test request (asserts it was not answered twice), or None yet."""
    got = inbox_replies(r, keys).get(job_id, [])
    assert len(got) <= 1, f"{job_id} answered {len(got)} times"
    return got[0] if got else None


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.02) -> float:
    """Poll ``cond`` until true; returns the seconds it took. Fails the test on timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)
    return time.monotonic() - t0


def beside(background: Callable[[threading.Event], None], tenants: list[str],
           sender: Callable[[str, int, list], None]) -> dict[str, list]:
    """One ``sender(tenant, index, out)`` thread per tenant while ``background(stop)`` runs on a thread of its own
    (until every sender ended, each within 300 s); each tenant's ``out``. Fails when a sender did not end."""
    stop = threading.Event()
    thread = threading.Thread(target=background, args=(stop,), daemon=True)
    thread.start()
    results: dict[str, list] = {t: [] for t in tenants}
    senders = [threading.Thread(target=sender, args=(t, i, results[t]), daemon=True) for i, t in enumerate(tenants)]
    try:
        for s in senders:
            s.start()
        for s in senders:
            s.join(300)
    finally:
        stop.set()
        thread.join(10)
    assert not any(s.is_alive() for s in senders), f"a sender did not end: {results}"
    return results


HOLDS_NOTHING = {"waiting": 0, "abandoned": 0, "unclaimed": 0, "to_delete": 0}


def wait_inbox_holds_nothing(inbox: Any) -> None:
    """Wait until a client's inbox holds nothing. Its reader drops a ring from its to-delete record only after Redis
    answered the XDEL, a moment after the ring left the stream: checking at once fails under load."""
    wait_until(lambda: inbox.held() == HOLDS_NOTHING, 10, "the inbox holding nothing")


def dead_letters(r: redis.Redis, keys: Keys) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(keys.dead)]


@contextlib.contextmanager
def silent_fleet(redis_url: str, namespace: str, **info: object) -> Iterator[None]:
    """A live "worker" that publishes the fleet (the tiny preset's tokenizer; ``info``: other FleetInfo fields)
    and never reads: enqueues are accepted and no answer ever comes. A bulk run queues at most its
    ``max_batch_size`` (8 unless ``info`` says) unread (producer/bulk/queued.py)."""
    from batchfleet.common.config import ConnectionConfig
    from batchfleet.common.wire.protocol import FleetInfo
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer
    from batchfleet.worker.transport.consumer import StreamConsumer
    from tests.conftest import TEST_BUCKETS

    probe = StreamConsumer(ConnectionConfig(redis_url=redis_url, namespace=namespace), TEST_BUCKETS,
                           f"probe-{uuid.uuid4().hex[:6]}", reply_ttl_s=60)
    probe.setup()
    fields: dict = {"max_batch_size": 8, **info}
    probe.presence.join(FleetInfo(model="none", tokenizer_json=byte_level_tokenizer().backend_tokenizer.to_str(),
                                  buckets=TEST_BUCKETS, max_seq_len=512, vocab_size=320, eos_token_ids=(2,), **fields))
    try:
        yield
    finally:
        probe.close()
