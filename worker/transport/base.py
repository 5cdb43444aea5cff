"""What the worker needs from a message transport, declared once: ``Transport`` and its named parts, and the
two values that cross it, ``Entry`` (read) and ``Reply`` (written). No Redis, no torch.

Implementations: ``worker.transport.consumer.StreamConsumer`` (Redis streams, the product),
``worker.transport.sharded.ShardedConsumer`` (one StreamConsumer per cluster shard) and
``worker.benchmark.memqueue.MemQueue`` (in-process, to measure what Redis adds). The worker loop, its intake,
dispatcher, outbox, read-ahead and lease keeper call only what is declared here.

The verbs. ``Transport`` itself declares six methods: ``setup``, ``recover``, ``read``, ``log_batch``, ``ping``
and ``close``. Everything else is reached through a named part, each a small protocol below, so no part's
verb is declared twice:

- ``transport.settler`` (``Settling``): ``write_replies`` (answer), ``write_deltas``, ``give_up``, ``ack``,
  ``answered``, ``hand_back``: every write that ends an entry's stay in its stream;
- ``transport.pending`` (``Leases``): ``reclaim``, ``release``, ``refresh``, ``prune_consumers``;
- ``transport.presence`` (``Membership``): ``join``, ``heartbeat``, ``alive``, ``clock_offset``, ``live_peers``;
- ``transport.cancel_watch`` (``Cancelling``): ``cancels``, ``marks``;
- ``transport.flush`` (``FlushWatch``): ``requested`` (static batching).

Hops of a reply, from the dispatcher that makes it to the pipeline that writes it (single-shard fleet):
``Dispatcher._answer`` -> ``Outbox.send`` (1) -> ``Outbox.flush`` (2) -> ``Settler.write_replies`` (3), which
runs the pipeline. A sharded fleet adds one routing hop (``ShardedSettler.write_replies``).

Contract shared by every implementation: an entry read stays owned by this worker (the transport may
redeliver it elsewhere only after its lease lapses) until ``write_replies``, ``give_up``, ``ack`` or
``hand_back`` settles it; writing a reply is idempotent (first writer wins, the settling is repeatable).
Besides the ``TRANSIENT`` outages, a refused command raises ``StreamsLost`` (call ``recover``) or another
``TransportError``, whichever part sent it, so callers never match a backend's error strings.
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from batchfleet.common.errors import ENGINE_ERROR
from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import INTERACTIVE
from batchfleet.common.wire.protocol import Error, FleetInfo, Result

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One raw stream entry as read from the transport (fields not yet validated)."""

    bucket: int
    entry_id: str  # unique per bucket stream only: two buckets may hold the same id
    fields: dict[bytes, bytes]
    deliveries: int = 1  # times the transport has delivered it (each reclaim adds one)
    oversize: int = 0  # the entry's real size in bytes when it was too large to hold and ``fields`` were cut
    # short (worker/transport/bounded.py): it can only be answered or dead-lettered; 0 = ``fields`` are whole
    priority: str = INTERACTIVE  # the priority of its stream (common/wire/priority.py)
    shard: int = 0  # the shard of its stream (a sharded cluster fleet, worker/transport/sharded.py)
    tenant: str = ""  # the tenant of its stream ("" the default tenant's; common/keys.py ``Keys.stream``)

    @property
    def stream_of(self) -> tuple[int, str, str]:
        """(bucket, priority, tenant): which of its shard's streams holds it (``Keys.stream``'s arguments)."""
        return self.bucket, self.priority, self.tenant

    @property
    def where(self) -> tuple[int, str, str, int, str]:
        """(bucket, priority, entry id, shard, tenant): unique per worker (an entry id is unique per stream only)."""
        return self.bucket, self.priority, self.entry_id, self.shard, self.tenant


@dataclass(frozen=True)
class Reply:
    """A final reply to write to the job's inbox: the typed answer, encoded only by the transport."""

    job_id: str
    message: Result | Error
    bucket: int  # the stream the answered entry sits in
    entry_id: str  # settled (acked and deleted) by the same write that stores the reply
    reply_key: str  # the submitting client's inbox stream
    priority: str = INTERACTIVE  # with ``bucket``, ``shard`` and ``tenant``: the stream the answered entry sits in
    shard: int = 0
    tenant: str = ""  # who sent the job (its usage is counted per tenant)

    @classmethod
    def to(cls, entry: Entry, job_id: str, message: Result | Error, reply_key: str) -> Reply:
        """The reply that answers ``job_id`` and settles ``entry``."""
        return cls(job_id, message, entry.bucket, entry.entry_id, reply_key, entry.priority, entry.shard, entry.tenant)

    @property
    def settles(self) -> Entry:
        """The entry this reply settles (its place only: no fields)."""
        return Entry(self.bucket, self.entry_id, {}, priority=self.priority, shard=self.shard, tenant=self.tenant)

    @property
    def usage(self) -> dict[str, int]:
        """What this answer adds to its tenant's usage (``Keys.usage`` fields after ``<tenant>|``): a result its
        request, prompt, cached and generated tokens; an error its request alone."""
        msg = self.message
        if not isinstance(msg, Result):
            return {"requests": 1}
        cached = msg.extra.get("cached_tokens")
        return {"requests": 1, "prompt_tokens": msg.prompt_tokens, "generated_tokens": msg.completion_tokens,
                "cached_tokens": cached if type(cached) is int and cached > 0 else 0}

    def encode(self) -> bytes:
        """The wire bytes; an answer that cannot be encoded (e.g. text with a lone surrogate) becomes an
        ``engine_error`` reply, so one bad result never blocks the write of the others."""
        try:
            return self.message.encode()
        except Exception as exc:
            log.error("the reply to %s could not be encoded: %r", self.job_id, exc)
            return Error(self.job_id, ENGINE_ERROR, f"result could not be encoded: {exc!r}"[:500]).encode()


class TransportError(Exception):
    """A transport refused a command for a reason a retry alone does not cure (the loop backs off slowly and
    tells the operator). Connection-level outages stay ``common.retry.TRANSIENT``."""


class StreamsLost(TransportError):
    """The backend lost this worker's streams or consumer group (Redis restarted empty): ``recover``."""


@dataclass(frozen=True)
class Cancel:
    """A client asked to stop a job; honoured only when ``reply_key`` is the job's own."""

    job_id: str
    reply_key: str


class Settling(Protocol):
    """``transport.settler``: the writes that end an entry's stay in its stream, and the streamed deltas."""

    @abstractmethod
    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Store each reply (first writer wins) and settle its entry; returns which were first writes."""

    @abstractmethod
    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        """Append streamed-output entries ``(job_id, reply_key, encoded Delta)`` to their inboxes, in order.
        Best effort: they settle nothing, and the final reply carries the whole text anyway."""

    @abstractmethod
    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        """Dead-letter an entry for good and, when its job id is known, answer it with ``reply``."""

    @abstractmethod
    def ack(self, entry: Entry) -> None:
        """Settle an entry that needs no reply of its own (a duplicate of a job this worker holds)."""

    @abstractmethod
    def answered(self, entry: Entry, job_id: str, reply_key: str) -> None:
        """Settle a copy of a job whose answer is stored already (``marks``): tell its client again (the writer
        of the answer may have died before it did), then settle the copy."""

    @abstractmethod
    def hand_back(self, entries: list[Entry]) -> None:
        """Return entries read but never started (shutdown) to their streams for other workers."""


class Leases(Protocol):
    """``transport.pending``: the leases on entries read and not settled (policy: worker/transport/reclaim.py).
    ``release`` is also called from the read-ahead thread, ``refresh`` from the lease keeper's."""

    @abstractmethod
    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """Take over at most ``budget`` entries whose lease lapsed ``min_idle_ms`` ago (their worker died);
        each carries its delivery count."""

    @abstractmethod
    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        """Give up our lease on entries so the next reclaim (any worker's) redelivers them at once.
        ``count_delivery=False`` (entries never started, released to balance load): that redelivery does
        not count towards ``max_deliveries``."""

    @abstractmethod
    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        """Renew our lease on entries we still hold, skipping any idle less than ``min_idle_ms`` (another
        worker may have just taken it over)."""

    @abstractmethod
    def prune_consumers(self, min_idle_ms: int) -> int:
        """Forget consumer names of dead workers (nothing pending, silent ``min_idle_ms``); returns how many."""


class Membership(Protocol):
    """``transport.presence``: this worker's place in its fleet. ``alive`` is called from the lease keeper's
    thread, ``live_peers`` from the read-ahead thread."""

    @abstractmethod
    def join(self, info: FleetInfo, replace: bool = False) -> None:
        """Publish the fleet description producers read (tokenizer, buckets, limits); kept for ``recover``.
        Raises worker.transport.fleet.FleetConflict when live workers serve another fingerprint, unless
        ``replace``."""

    @abstractmethod
    def heartbeat(self, status: dict) -> None:
        """Publish this worker's status (expires when the worker stops refreshing it)."""

    @abstractmethod
    def alive(self) -> None:
        """Mark this worker live (the live-worker set producers check), unless a heartbeat just did."""

    @abstractmethod
    def clock_offset(self) -> float:
        """Seconds to subtract from a stream entry's Redis timestamp to get this host's ``time.time()``."""

    @abstractmethod
    def live_peers(self) -> int:
        """How many other live workers serve this namespace (0 when the transport cannot tell)."""


class Cancelling(Protocol):
    """``transport.cancel_watch``: what clients cancelled, and which jobs are answered already."""

    @abstractmethod
    def cancels(self, waiting: bool = False) -> list[Cancel]:
        """Cancel requests published since the last call; called every tick while the worker holds requests
        (``waiting``: some have not started yet, so a cancel read now saves a whole job: never throttled)."""

    @abstractmethod
    def marks(self, job_ids: list[str], reply_keys: list[str | None]) -> list[tuple[str | None, bool]]:
        """For each job: the reply key of a pending cancel request (else None), and whether it was answered
        already (its answer is stored under ``reply_keys``, the entries' own, None where invalid: a duplicate
        enqueue, or a copy reclaimed from a worker that died after answering). Checked when entries are read."""


class Transport(Protocol):
    """What the worker asks of a transport: six verbs of its own, the rest through its named parts (module
    docstring).

    Implementations subclass it (and each part its protocol) explicitly, so a missing method fails at
    construction. Called from the loop's thread except where a part says otherwise.
    """

    name: str  # this worker's consumer name (also in replies and batch records)
    keys: Keys  # key names of the namespace served
    max_block_ms: int  # the longest ``read`` may block (bounds how long a stop request waits)
    settler: Settling
    pending: Leases
    presence: Membership
    cancel_watch: Cancelling
    flush: FlushWatch
    # whose held entries start next: (priority, tenant -> entries held not started, n) -> the tenants of the next n
    # admissions by the fair share (worker/transport/fair_share.py); None: deadline, then arrival, across tenants
    admission_order: Callable[[str, Mapping[str, int], int], list[str]] | None = None

    @abstractmethod
    def setup(self) -> None:
        """Prepare to serve (create consumer groups, waiting for the backend to come up) and take the
        flush counter's current value as the baseline for ``flush.requested``."""

    @abstractmethod
    def recover(self) -> None:
        """The backend lost our state (Redis restarted empty): re-create groups and re-publish the fleet."""

    @abstractmethod
    def read(self, count: int | dict[str, int], block_ms: int | None, exact: bool = True) -> list[Entry]:
        """New entries of every bucket, interactive ones first: up to ``count`` per bucket (a dict: per
        bucket of each priority, 0 = not that priority); blocks at most ``block_ms`` (capped by ``max_block_ms``);
        ``None`` does not block. ``exact=False``: the wait ends at no deadline (an idle worker), so it may
        end up to one Redis cron tick early or late, for the fewest round trips."""

    @abstractmethod
    def log_batch(self, record: dict) -> None:
        """Append one batch record (worker, kind, bucket, size, ids, at) to the audit log; best effort."""

    @abstractmethod
    def ping(self) -> None:
        """One round trip to the backend (raises when it is unreachable); a no-op where there is none."""

    @abstractmethod
    def close(self) -> None:
        """Drop this worker's presence (heartbeat, consumer name when nothing is pending) and disconnect."""


FLUSH_POLL_S = 0.05  # how often a waiting static batch looks at the flush counter


class FlushWatch:
    """``transport.flush``, the flush-counter polling every transport shares: throttled reads, change since the
    last one seen (static batching: whether partial batches should close now)."""

    def __init__(self, read: Callable[[], int], seen: int | None = None, every_s: float = FLUSH_POLL_S) -> None:
        self._read = read
        self._seen = seen  # None until ``start`` (or the first poll) takes the baseline
        self._every_s = every_s
        self._checked = float("-inf")

    def start(self) -> None:
        """Take the current counter as the baseline, once: only bumps after this count."""
        if self._seen is None:
            self._seen = self._read()

    def requested(self) -> bool:
        """True once per change of the counter; reads it at most every ``every_s`` seconds."""
        now = time.monotonic()
        if now - self._checked < self._every_s:
            return False
        self._checked = now
        value = self._read()
        changed = self._seen is not None and value != self._seen
        self._seen = value
        return changed
