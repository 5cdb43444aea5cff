"""The stream consumer: the Redis ``Transport`` (worker/transport/base.py); everything the worker says to Redis
goes through here or through one of its parts, which share its connection and its registered scripts
(worker/transport/scripts.py).

Reads bucket streams in one consumer group and the cancels stream, publishes the fleet description and a
heartbeat. Its parts: ``Settler`` (worker/transport/settle.py: replies, dead letters, acks, hand-back),
``PendingList`` (worker/transport/pending.py: leases, reclaim), ``Presence`` (worker/transport/presence.py: fleet
membership,
heartbeat), ``BoundedReader`` (worker/transport/bounded.py: reads bounded in size), ``CancelWatch``
(worker/transport/cancels.py:
the cancels stream and the markers). A command Redis refuses raises the
transport's own ``StreamsLost`` / ``TransportError`` (``_refused``), never a bare ``redis.ResponseError``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import msgpack
import redis

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.fleetstate import live_workers
from batchfleet.common.redis.functions import load_library
from batchfleet.common.redis.retry import TRANSIENT, Backoff
from batchfleet.common.redis.url import is_cluster
from batchfleet.common.wire.lanes import LANES
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.transport.base import Cancel, Entry, FlushWatch, Reply, Transport
from batchfleet.worker.transport.bounded import GUARDED, BoundedReader
from batchfleet.worker.transport.cancels import CancelWatch
from batchfleet.worker.transport.pending import PendingList
from batchfleet.worker.transport.presence import Presence
from batchfleet.worker.transport.refused import refused as _refused
from batchfleet.worker.transport.scripts import WorkerScripts
from batchfleet.worker.transport.settle import Settler

log = logging.getLogger(__name__)

BATCH_LOG_MAXLEN = 10_000
MAX_BLOCK_MS = 2_000  # also bounds how long SIGTERM waits for an idle blocking read
BLOCK_SLACK_MS = 110  # Redis may end a BLOCK up to one cron tick (100 ms at hz 10) late
POLL_S = 0.002
STARTUP_WAIT_S = 60.0  # setup() waits this long for Redis to come up
# the lease keeper's alive() (every 2.5 s) beats only when no heartbeat went out for this long: the loop's
# own (every 2-5 s, a tick late at most) makes it a no-op unless a long engine step holds the loop; a beat is
# then never older than 9.5 s (worker/health.py reads 10 s as not ready)
ALIVE_WITHIN_S = 7.0


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
    """Owns the worker's Redis connection and every command it sends (see ``Transport`` for each method)."""

    def __init__(self, conn: ConnectionConfig, buckets: tuple[int, ...], name: str, reply_ttl_s: int,
                 keys: Keys | None = None, r: redis.Redis | None = None) -> None:
        """``keys``: one shard's (worker/transport/sharded.py), default the namespace's; ``r``: a client to share (the
        shards' consumers share one cluster client), default a new one."""
        self.conn = conn
        self.keys: Keys = keys or conn.keys
        self.buckets = buckets
        self.name = name
        self.reply_ttl_s = reply_ttl_s
        self.r = r if r is not None else connect(conn)
        scripts = WorkerScripts(self.r)  # registered once for this connection, shared by every part
        self.presence = Presence(self.r, scripts, self.keys, name)
        self.settler = Settler(self.r, self.keys, conn.wait_replicas, name, reply_ttl_s)
        self._scripts = scripts
        self.cancel_watch = CancelWatch(self.r, scripts, self.keys)
        self.pel = PendingList(self.r, scripts, self.keys, name, buckets)
        self._flush = FlushWatch(self._flush_counter)  # baseline taken by setup()
        # reads are capped while parsed, then cut down (or recovered in Redis): memory never follows entry sizes
        self.reader = BoundedReader(self.r, scripts, self.keys.group, name, self.keys.streams(buckets))
        # A blocking read must return before the socket times out, with margin.
        self.max_block_ms = int(min(MAX_BLOCK_MS, conn.socket_timeout_s * 1000 / 2))

    @_refused
    def setup(self, wait_s: float = STARTUP_WAIT_S) -> None:
        """Create the consumer group on every bucket stream (reading from the start of each stream) and
        take the flush counter's baseline (first call only).

        At startup Redis may not be up yet (compose, k8s): connection errors are retried with capped
        backoff for ``wait_s`` seconds, one log line per state change, then raised.
        """
        outage = Backoff(log, "redis")
        deadline = time.monotonic() + wait_s
        while True:
            try:
                for stream, _, _ in self.keys.streams(self.buckets):
                    try:
                        self.r.xgroup_create(stream, self.keys.group, id="0", mkstream=True)
                    except redis.ResponseError as exc:
                        if "BUSYGROUP" not in str(exc):
                            raise
                self._load_functions()
                if is_cluster(self.conn.redis_url):  # pipelines on a cluster do not load a missing script
                    self._scripts.load()
                self.cancel_watch.start()
                self._flush.start()
                outage.ok()
                return
            except TRANSIENT as exc:
                delay = outage.failed(exc)
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)

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
    def publish_fleet(self, info: FleetInfo, replace: bool = False) -> None:
        """Join the fleet (worker/transport/presence.py, worker/transport/fleet.py): publish its description with a
        TTL unless live
        workers serve another fingerprint (FleetConflict; ``replace`` publishes anyway). Kept for ``recover``."""
        self.presence.join(info, replace)

    @_refused
    def recover(self) -> None:
        """Redis came back without our state (NOGROUP): re-create the groups and re-publish the fleet."""
        self.setup(wait_s=0)  # the loop retries with its own backoff
        self.pel.reset()
        self.presence.rejoin()

    @_refused
    def heartbeat(self, status: dict) -> None:
        """The status, msgpack-encoded, under this worker's key for 10 s; marks the worker live and renews
        the fleet description's TTL."""
        self.presence.beat(msgpack.packb(status, use_bin_type=True))

    @_refused
    def alive(self) -> None:
        """Mark this worker live in the live-worker set (from any thread), unless a heartbeat just did."""
        self.presence.keep_alive(ALIVE_WITHIN_S)

    def clock_offset(self) -> float:
        """Redis time minus this host's time (s), as measured by the last heartbeat."""
        return self.presence.offset

    @_refused
    def read(self, count: int | dict[str, int], block_ms: int | None, exact: bool = True) -> list[Entry]:
        """New entries of every bucket, interactive streams first: up to ``count`` per stream (a dict: per
        stream of each lane, 0 = that lane is not read); blocks at most ``block_ms``.

        Redis only expires a BLOCK at its cron tick (1000/hz ms: 100 ms by default), so a 50 ms block
        would really last ~100 ms and every batch deadline would slip. Short waits therefore poll
        (non-blocking read, then a 2 ms sleep) and long ones block until ~BLOCK_SLACK_MS before the end.
        Without a deadline to keep (``exact=False``: an idle worker) one blocking read is the whole wait.
        """
        counts = dict.fromkeys(LANES, count) if isinstance(count, int) else count
        if block_ms is None:
            return self._xread(counts, None)
        if not exact:
            return self._xread(counts, max(1, min(int(block_ms), self.max_block_ms)))
        end = time.monotonic() + max(1, min(int(block_ms), self.max_block_ms)) / 1000
        while True:
            left_ms = (end - time.monotonic()) * 1000
            block = int(left_ms - BLOCK_SLACK_MS) if left_ms > BLOCK_SLACK_MS + 10 else None
            out = self._xread(counts, block)
            if out or left_ms <= 0:
                return out
            if block is None:
                time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def _xread(self, counts: dict[str, int], block_ms: int | None) -> list[Entry]:
        return self.reader.read(counts, block_ms)

    # ---- settling (worker/transport/settle.py) -----------------------------------------------------------------
    @_refused
    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Replies written and their entries acked in one round trip (``Settler.write_replies``)."""
        return self.settler.write_replies(replies)

    @_refused
    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        """XADD each streamed delta to its inbox (``Settler.write_deltas``)."""
        self.settler.write_deltas(deltas)

    @_refused
    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        """Dead-letter + answer in one transaction (``Settler.give_up``)."""
        self.settler.give_up(entry, reason, reply)

    @_refused
    def ack(self, entry: Entry) -> None:
        """XACK + XDEL of a duplicate delivery (``Settler.ack``)."""
        self.settler.ack(entry)

    @_refused
    def answered(self, entry: Entry, job_id: str, reply_key: str) -> None:
        """Ring the inbox again, then XACK + XDEL, for a copy of a job answered already (``Settler.answered``)."""
        self.settler.answered(entry, job_id, reply_key)

    @_refused
    def hand_back(self, entries: list[Entry]) -> None:
        """Re-add, then ack + delete, entries never started (``Settler.hand_back``)."""
        self.settler.hand_back(entries)

    @_refused
    def cancels(self, waiting: bool = False) -> list[Cancel]:
        """New cancels since the last call (``CancelWatch.cancels``)."""
        return self.cancel_watch.cancels(waiting)

    @_refused
    def marks(self, job_ids: list[str], reply_keys: list[str | None]) -> list[tuple[str | None, bool]]:
        """Each job's cancel marker and whether it is done (``CancelWatch.marks``)."""
        return self.cancel_watch.marks(job_ids, reply_keys)

    def log_batch(self, record: dict) -> None:
        """Append a batch record (worker, bucket, ids, size) to the capped audit stream; best effort: the
        batch runs whether or not its record is written."""
        fields = {k: (",".join(v) if isinstance(v, list) else str(v)) for k, v in record.items()}
        try:
            self.r.xadd(self.keys.batches, fields, maxlen=BATCH_LOG_MAXLEN, approximate=True)
        except redis.RedisError as exc:
            log.debug("batch record not written: %r", exc)

    # ---- pending entries (worker/transport/pending.py) -----------------------------------------------------
    @_refused
    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """XAUTOCLAIM, resuming where a budget cut the last scan (``PendingList.reclaim``); noted by the reader."""
        return self.reader.held(self.pel.reclaim(min_idle_ms, budget))

    @_refused
    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        """XCLAIM JUSTID making them look ``idle_ms`` idle (``PendingList.release``)."""
        self.pel.release(entries, idle_ms, count_delivery)

    @_refused
    def live_peers(self) -> int:
        """Live workers (the one live-workers query, common/redis/fleetstate.py), ourselves excluded."""
        return sum(w != self.name for w in live_workers(self.r, self.keys))

    def ping(self) -> None:
        self.r.ping()

    @_refused
    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        """XCLAIM JUSTID resetting their idle time (``PendingList.refresh``); lease keeper thread."""
        self.pel.refresh(entries, min_idle_ms)

    @_refused
    def prune_consumers(self, min_idle_ms: int) -> int:
        """XGROUP DELCONSUMER of silent names holding nothing (``PendingList.prune_consumers``)."""
        return self.pel.prune_consumers(min_idle_ms)

    # ---- static batching -------------------------------------------------------------------------
    @_refused
    def flush_requested(self) -> bool:
        """GET of the flush counter, at most every 50 ms; True once per change."""
        return self._flush.requested()

    def _flush_counter(self) -> int:
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
            for stream, _, _ in self.keys.streams(self.buckets):
                if not self.r.xpending_range(stream, self.keys.group, "-", "+", 1, consumername=self.name):
                    self.r.xgroup_delconsumer(stream, self.keys.group, self.name)  # would drop its PEL: empty
        except redis.RedisError:
            pass
        if disconnect:
            self.r.close()

