"""An in-process ``Transport`` (worker/transport/base.py), for measuring what Redis adds.

The worker loop, batcher, validation and engine are the real ones; only the transport differs: entries
and replies are the same encoded bytes, handed over through a deque and a condition variable.
Benchmark-only: never used by a worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

from batchfleet.common.config import bucket_for
from batchfleet.common.keys import Keys
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.priority import INTERACTIVE
from batchfleet.common.wire.protocol import FleetInfo, Request, Result
from batchfleet.producer.core import parse_reply
from batchfleet.worker.transport.base import (
    Cancel,
    Cancelling,
    Entry,
    FlushWatch,
    Leases,
    Membership,
    Reply,
    Settling,
    Transport,
)

INBOX = "inproc000000000000"  # the one inbox token of this process's MemClient


class MemQueue(Transport, Settling, Leases, Membership, Cancelling):
    """The worker side implements ``Transport`` and plays each of its parts itself (``settler``, ``pending``,
    ``presence``, ``cancel_watch`` are this object: in one process there is no connection to share, so nothing
    to split); the producer side (put, wait_reply, bump_flush, fleet, batch_records, last_status) serves
    MemClient and the benchmark runner."""

    max_block_ms = 2000

    def __init__(self, namespace: str, buckets: tuple[int, ...], name: str = "inproc") -> None:
        self.keys = Keys(namespace)
        self.buckets = buckets
        self.name = name
        self.fleet: FleetInfo | None = None
        self._entries: deque[Entry] = deque()
        self._replies: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._seq = 0
        self._flush = 0
        self.flush = FlushWatch(lambda: self._flush, seen=0)  # the counter starts at 0: no bump yet
        self.settler = self.pending = self.presence = self.cancel_watch = self
        self.batch_records: list[dict] = []
        self.last_status: dict = {}

    # --- producer side -----------------------------------------------------------------------------
    def put(self, bucket: int, job_id: str, payload: bytes) -> None:
        """Enqueue one encoded Request (what the enqueue function's XADD does; the id carries the time)."""
        with self._cv:
            self._seq += 1
            fields = {b"id": job_id.encode(), b"r": self.keys.inbox(INBOX).encode(), b"p": payload}
            self._entries.append(Entry(bucket, f"{int(time.time() * 1000)}-{self._seq}", fields))
            self._cv.notify_all()

    def wait_reply(self, job_id: str, timeout: float | None) -> bytes:
        """Block until the job's reply is written (what a producer's BLPOP does); TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while job_id not in self._replies:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(job_id)
                self._cv.wait(left)
            return self._replies.pop(job_id)

    def bump_flush(self) -> None:
        """Ask the worker to close partial static batches (what ``INCR <ns>:flush`` does)."""
        with self._cv:
            self._flush += 1

    # --- worker side (Transport) -------------------------------------------------------------------
    def setup(self) -> None:
        self.flush.start()

    def join(self, info: FleetInfo, replace: bool = False) -> None:
        self.fleet = info  # one worker per in-memory queue: nothing to conflict with

    def heartbeat(self, status: dict) -> None:
        self.last_status = status

    def read(self, count: int | dict[str, int], block_ms: int | None, exact: bool = True) -> list[Entry]:
        if not isinstance(count, int):  # every entry here is interactive
            count = count.get(INTERACTIVE, 0)
        with self._cv:
            if not self._entries and block_ms:
                self._cv.wait(min(block_ms, self.max_block_ms) / 1000)
            out = []
            while self._entries and len(out) < count:
                out.append(self._entries.popleft())
            return out

    def write_replies(self, replies: list[Reply]) -> list[bool]:
        firsts = []
        with self._cv:
            for rep in replies:
                first = rep.job_id not in self._replies
                if first:
                    self._replies[rep.job_id] = rep.encode()  # encoded at the edge, as Redis would get it
                firsts.append(first)
            self._cv.notify_all()
        return firsts

    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        pass  # the benchmark client does not stream

    def cancels(self, waiting: bool = False) -> list[Cancel]:
        return []

    def marks(self, job_ids: list[str], reply_keys: list[str | None]) -> list[tuple[str | None, bool]]:
        return [(None, False)] * len(job_ids)

    def clock_offset(self) -> float:
        return 0.0

    def alive(self) -> None:
        pass

    def log_batch(self, record: dict) -> None:
        self.batch_records.append(record)

    def ack(self, entry: Entry) -> None:
        pass

    def answered(self, entry: Entry, job_id: str, reply_key: str) -> None:
        pass  # marks() never reports an answered job here

    def hand_back(self, entries: list[Entry]) -> None:
        with self._cv:
            self._entries.extendleft(reversed(entries))

    def live_peers(self) -> int:
        return 0  # one worker per in-memory queue

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass

    # Reliability hooks: in one process nothing is ever left pending by a dead peer, so there is
    # nothing to reclaim, renew or prune.
    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        return []

    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        self.hand_back(entries)

    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        pass

    def prune_consumers(self, min_idle_ms: int) -> int:
        return 0

    def recover(self) -> None:
        pass

    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        if reply is not None:
            self.write_replies([reply])


class MemClient:
    """Same submit/result API as producer.Client, over a MemQueue."""

    def __init__(self, queue: MemQueue) -> None:
        self.q = queue

    def submit(self, prompt: list[int], max_new_tokens: int = 64, **_params) -> str:
        info = self.q.fleet
        assert info is not None, "start the in-process worker first"
        bucket = bucket_for(info.buckets, info.max_seq_len, len(prompt), max_new_tokens)
        job_id = uuid.uuid4().hex
        req = Request(id=job_id, prompt=list(prompt), params=Params(max_new_tokens=max_new_tokens),
                      reply_key=self.q.keys.inbox(INBOX))
        self.q.put(bucket, job_id, req.encode())
        return job_id

    def result(self, job_id: str, timeout: float | None = None) -> Result:
        return parse_reply(job_id, self.q.wait_reply(job_id, timeout))
