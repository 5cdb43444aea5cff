"""The stream consumer: the Redis ``Transport`` (worker/transport/base.py); everything the worker says to Redis
goes through here or through one of its parts, which share its connection and its registered scripts
(worker/transport/scripts.py).

It owns the connection, sets up the consumer groups, reads the bucket streams (``read``, through its
``BoundedReader``, worker/transport/bounded.py: reads bounded in size), writes the batch audit log and leaves
the fleet on ``close``. Everything else is one of its named parts, which callers reach directly (no method
here passes through to them): ``settler`` (worker/transport/settle.py: replies, dead letters, acks,
hand-back), ``pending`` (worker/transport/pending.py: leases, reclaim), ``presence``
(worker/transport/presence.py: fleet membership, heartbeat), ``cancel_watch`` (worker/transport/cancels.py:
the cancels stream and the markers), ``flush`` (the static batches' flush counter). A command Redis refuses
raises the transport's own ``StreamsLost`` / ``TransportError`` (worker/transport/refused.py), whichever part
sent it, never a bare ``redis.ResponseError``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import create_groups, sync_client
from batchfleet.common.redis.fleetstate import queued_tenants
from batchfleet.common.redis.functions import load_library
from batchfleet.common.redis.retry import TRANSIENT, Backoff
from batchfleet.common.redis.url import is_cluster
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.worker.transport.base import Entry, FlushWatch, Transport
from batchfleet.worker.transport.bounded import GUARDED, BoundedReader
from batchfleet.worker.transport.cancels import CancelWatch
from batchfleet.worker.transport.pending import PendingList
from batchfleet.worker.transport.presence import Presence
from batchfleet.worker.transport.refused import refused as _refused
from batchfleet.worker.transport.scripts import WorkerScripts
from batchfleet.worker.transport.settle import Settler
from batchfleet.worker.transport.tenant_gc import TenantStreams, bell_gone, gone

log = logging.getLogger(__name__)

BATCH_LOG_MAXLEN = 10_000
MAX_BLOCK_MS = 2_000  # also bounds how long SIGTERM waits for an idle blocking read
BLOCK_SLACK_MS = 110  # Redis may end a BLOCK up to one cron tick (100 ms at hz 10) late
POLL_S = 0.002
STARTUP_WAIT_S = 60.0  # setup() waits this long for Redis to come up
TENANTS_CHECK_S = 1.0  # how often a worker looks for new tenants' streams and the tenants' weights

T = TypeVar("T")


def refused_for_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write because it is full (``maxmemory`` under ``noeviction``): the raw
    OutOfMemoryError, a script's OOM error, or the transport's own error raised from either."""
    for e in (exc, exc.__cause__):
        if isinstance(e, redis.exceptions.OutOfMemoryError) or (
                isinstance(e, redis.ResponseError) and str(e).startswith("OOM ")):
            return True
    return False


def wait_writable(call: Callable[[], T], wait_s: float = STARTUP_WAIT_S) -> T:
    """``call()``, retried with capped backoff for ``wait_s`` seconds while Redis is unreachable or full, one
    log line per state change, then raised. For start-up only (setup, the fleet join): Redis may not be up yet
    (compose, k8s), or full until clients take their answers; a worker that exits instead frees no memory, and
    a restart loop would meet the same refusal."""
    outage = Backoff(log, "redis")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = call()
        except BaseException as exc:
            if not (isinstance(exc, TRANSIENT) or refused_for_memory(exc)):
                raise
            delay = outage.failed(exc)
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            continue
        outage.ok()
        return out


def connect(conn: ConnectionConfig) -> redis.Redis:
    """A bytes-mode client whose socket timeout bounds every blocking call and whose guard caps every reply."""
    return sync_client(
        conn.redis_url, socket_timeout=conn.socket_timeout_s, socket_connect_timeout=conn.socket_timeout_s,
        health_check_interval=30, decode_responses=False, wrap_connection=GUARDED,
    )


def default_consumer_name() -> str:
    """hostname-pid-random: unique per worker process, readable in XINFO and heartbeats."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StreamConsumer(Transport):
    """Owns the worker's Redis connection and every command it sends, itself or through its parts (see
    ``Transport`` and the part protocols for each method)."""

    def __init__(self, conn: ConnectionConfig, buckets: tuple[int, ...], name: str, reply_ttl_s: int,
                 keys: Keys | None = None, r: redis.Redis | None = None, tenant_idle_s: float = 300.0) -> None:
        """``keys``: one shard's (worker/transport/sharded.py), default the namespace's; ``r``: a client to share (the
        shards' consumers share one cluster client), default a new one; ``tenant_idle_s``: how long a named tenant's
        streams stay empty before it is retired (worker/transport/tenant_gc.py)."""
        self.conn = conn
        self.keys: Keys = keys or conn.keys
        self.buckets = buckets
        self.name = name
        self.reply_ttl_s = reply_ttl_s
        self.r = r if r is not None else connect(conn)
        scripts = WorkerScripts(self.r)  # registered once for this connection, shared by every part
        self._scripts = scripts
        # reads are capped while parsed, then cut down (or recovered in Redis): memory never follows entry sizes
        self.reader = BoundedReader(self.r, scripts, self.keys.group, name, self.keys, buckets)
        self.admission_order = self.reader.order  # the reader's fair share also orders what is held
        self._tenants_at = -float("inf")  # time.monotonic() of the last look at the tenants (follow_tenants)
        self._tenants_stale = False  # a read on another thread met a tenant's stream gone (tenants_gone)
        self.tenant_streams = TenantStreams(self.r, scripts, self.keys, buckets, name, tenant_idle_s)
        self.presence = Presence(self.r, scripts, self.keys, name)
        self.presence.chores.append(self._retire_idle_tenants)  # on the lease keeper's thread: never the loop's
        self.settler = Settler(self.r, self.keys, conn.wait_replicas, name, reply_ttl_s, served=self.reader.served)
        self.cancel_watch = CancelWatch(self.r, scripts, self.keys)
        self.pending = PendingList(self.r, scripts, self.keys, name, buckets, self.reader)
        self.flush = FlushWatch(_refused(self._flush_counter))  # baseline taken by setup()
        # A blocking read must return before the socket times out, with margin.
        self.max_block_ms = int(min(MAX_BLOCK_MS, conn.socket_timeout_s * 1000 / 2))

    @_refused
    def setup(self, wait_s: float = STARTUP_WAIT_S) -> None:
        """Create the consumer group on every bucket stream (reading from the start of each stream) and
        take the flush counter's baseline (first call only).

        At startup Redis may not be up yet (compose, k8s), or full: connection errors and out-of-memory
        refusals are retried with capped backoff for ``wait_s`` seconds, one log line per state change, then
        raised.
        """
        wait_writable(self._setup_once, wait_s)

    def follow_tenants(self, force: bool = False, ensure_all: bool = False) -> None:
        """At most every TENANTS_CHECK_S: read the streams of the tenants queued here now (``Keys.queued_tenants``:
        a tenant first seen has its other streams made, a retired one is dropped, worker/transport/tenant_gc.py)
        and take the configured weights (``Keys.tenants``, on the fleet's shard 0) into the fair share. One round
        trip (two for new tenants); an unreadable weight counts as 1.
        ``ensure_all``: make every queued tenant's streams, not only new ones' (after a read met one missing)."""
        now = time.monotonic()
        if self._tenants_stale:
            self._tenants_stale, force, ensure_all = False, True, True
        if not force and now - self._tenants_at < TENANTS_CHECK_S:
            return
        self._tenants_at = now
        queued = set(queued_tenants(self.r, self.keys))
        known = set(self.reader.tenants)
        new = queued if ensure_all else queued - known
        # the enqueue made only the stream it added to: a read naming a missing stream fails (NOGROUP); a tenant's
        # streams are made only while it is queued (a retired tenant's never again here, worker/transport/tenant_gc.py)
        kept = (queued & known) - new | set(self.tenant_streams.ensure(new))
        self.reader.set_tenants(kept)
        weights: dict[str, float] = {}
        for label, raw in self.r.hgetall(self.keys.of_shard(0).tenants).items():
            try:
                w = float(json.loads(raw).get("weight", 1))
            except (ValueError, TypeError, AttributeError):
                continue
            if math.isfinite(w) and w > 0:
                weights[label.decode(errors="replace") if isinstance(label, bytes) else label] = w
        for share in self.reader.shares.values():
            share.weigh(weights)

    def tenants_gone(self) -> None:
        """A read on another thread (a shard waiter, worker/transport/shard_waiters.py) met a tenant's stream gone:
        the loop's next ``follow_tenants`` looks at once and makes every queued tenant's streams (a tenant retired and
        queued again between two looks is still in the reader's list, its streams not all there)."""
        self._tenants_stale = True

    def _retire_idle_tenants(self) -> None:
        """When due, retire the idle tenants among those read here (``TenantStreams.sweep``). From the lease keeper's
        thread (``presence.chores``): a sweep of many tenants takes tens of ms, which the loop never waits for; the
        loop drops the retired at its next look at the set (``follow_tenants``), or at once if a read meets one.
        Never raises: an outage is the loop's to report."""
        try:
            self.tenant_streams.sweep(self.reader.tenants)
        except (redis.RedisError, *TRANSIENT) as exc:
            log.debug("idle tenants not swept: %r", exc)

    def _setup_once(self) -> None:
        self.follow_tenants(force=True, ensure_all=True)  # the named tenants' streams: made only while queued
        defaults = [s for s, _, _ in self.keys.streams(self.buckets)]
        create_groups(self.r, self.keys.group, [*defaults, self.keys.tenant_bell])
        self._load_functions()
        if is_cluster(self.conn.redis_url):  # pipelines on a cluster do not load a missing script
            self._scripts.load()
        self.cancel_watch.start()
        self.flush.start()

    def _load_functions(self) -> None:
        """Load the producers' function library (Redis 7+). Without the permission (an admin loads it, see
        docs/SECURITY.md) or on Redis 6.2, producers fall back to EVALSHA of the same bodies."""
        try:
            load_library(self.r)
        except redis.ResponseError as exc:
            if isinstance(exc, TRANSIENT):  # a cluster failing over: the caller retries
                raise
            log.warning("could not load the batchfleet function library (%s); an admin must load it "
                        "(docs/SECURITY.md) or producers need EVAL", exc)

    @_refused
    def recover(self) -> None:
        """Redis came back without our state (NOGROUP): re-create the groups and re-publish the fleet."""
        self.setup(wait_s=0)  # the loop retries with its own backoff
        self.pending.reset()
        self.presence.rejoin()

    @_refused
    def read(self, count: int | dict[str, int], block_ms: int | None, exact: bool = True) -> list[Entry]:
        """New entries of every bucket, interactive streams first: up to ``count`` per stream (a dict: per
        stream of each priority, 0 = that priority is not read); blocks at most ``block_ms``.

        Redis only expires a BLOCK at its cron tick (1000/hz ms: 100 ms by default), so a 50 ms block
        would really last ~100 ms and every batch deadline would slip. Short waits therefore poll
        (non-blocking read, then a 2 ms sleep) and long ones block until ~BLOCK_SLACK_MS before the end.
        Without a deadline to keep (``exact=False``: an idle worker) one blocking read is the whole wait.
        """
        counts = dict.fromkeys(PRIORITIES, count) if isinstance(count, int) else count
        try:
            self.follow_tenants(force=self._heard_bell())
            out = self._read(counts, block_ms, exact)
            if self._heard_bell():  # a tenant new to the set rang during this read: its streams now, its entry at once
                self.follow_tenants(force=True)
                out = out or self.reader.read(counts, None)
            return out
        except redis.ResponseError as exc:
            if bell_gone(exc, self.keys.tenant_bell):  # an operator deleted the bell: made again, heard from now on
                log.info("the tenant bell %s had no group: made again", self.keys.tenant_bell)
                create_groups(self.r, self.keys.group, [self.keys.tenant_bell])
                return []
            if not gone(exc):
                raise
            # a retired tenant's stream (worker/transport/tenant_gc.py), or one retired and queued again since
            # the last look: look again, making what is queued; what the read delivered elsewhere is owed
            log.debug("a tenant's stream went away under a read: %s", exc)
            self.follow_tenants(force=True, ensure_all=True)
            return []

    def _heard_bell(self) -> bool:
        """Whether a read took a ring of the tenant bell since the last call (``BoundedReader.rang``)."""
        rang = self.reader.rang.is_set()
        self.reader.rang.clear()
        return rang

    def _read(self, counts: dict[str, int], block_ms: int | None, exact: bool) -> list[Entry]:
        if block_ms is None:
            return self.reader.read(counts, None)
        if not exact:
            return self.reader.read(counts, max(1, min(int(block_ms), self.max_block_ms)))
        end = time.monotonic() + max(1, min(int(block_ms), self.max_block_ms)) / 1000
        while True:
            left_ms = (end - time.monotonic()) * 1000
            block = int(left_ms - BLOCK_SLACK_MS) if left_ms > BLOCK_SLACK_MS + 10 else None
            out = self.reader.read(counts, block)
            if out or left_ms <= 0 or self.reader.rang.is_set():
                return out
            if block is None:
                time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def log_batch(self, record: dict) -> None:
        """Append a batch record (worker, bucket, ids, size) to the capped audit stream; best effort: the
        batch runs whether or not its record is written."""
        fields = {k: (",".join(v) if isinstance(v, list) else str(v)) for k, v in record.items()}
        try:
            self.r.xadd(self.keys.batches, fields, maxlen=BATCH_LOG_MAXLEN, approximate=True)
        except redis.RedisError as exc:
            log.debug("batch record not written: %r", exc)

    def ping(self) -> None:
        self.r.ping()

    def _flush_counter(self) -> int:
        """The flush counter a load generator bumps (static batching: ``flush.requested``)."""
        raw = self.r.get(self.keys.flush)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def close(self, disconnect: bool = True) -> None:
        """Drop the heartbeat and, when nothing is pending on us any more, our consumer names; then
        disconnect, unless the client is shared (``disconnect=False``: the sharded consumer's parts)."""
        try:
            self.r.delete(self.keys.worker(self.name))
            if self.presence.leave():  # the last live worker: producers now get NoWorkers
                log.info("last live worker of %r stopped: fleet description deleted", self.keys.namespace)
            for stream, _, _ in self.reader.streams:
                try:
                    if not self.r.xpending_range(stream, self.keys.group, "-", "+", 1, consumername=self.name):
                        self.r.xgroup_delconsumer(stream, self.keys.group, self.name)  # would drop its PEL: empty
                except redis.ResponseError:  # a retired tenant's stream (worker/transport/tenant_gc.py): the others
                    continue
            # the bell's name goes whatever it holds: a ring pending on us is a wake-up nobody reclaims (the
            # tenant is in the set, every worker's next look finds it)
            try:
                self.r.xgroup_delconsumer(self.keys.tenant_bell, self.keys.group, self.name)
            except redis.ResponseError:  # the bell deleted (worker/transport/tenant_gc.py ``bell_gone``)
                pass
        except redis.RedisError:
            pass
        if disconnect:
            self.r.close()

