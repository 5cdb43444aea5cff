"""The stream consumer: the Redis ``Transport`` (worker/transport.py); everything the worker says to Redis
goes through here.

Reads bucket streams in one consumer group, writes replies (first writer wins, then ack + delete, in
one server-side script so a crash can never ack an unanswered entry), dead-letters what cannot be
answered, publishes the fleet description and a heartbeat. Commands on the pending entries list (leases,
reclaim) live in worker/pending.py (``PendingList``, a part this class delegates to).
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
from batchfleet.common.functions import load_library
from batchfleet.common.keys import Keys
from batchfleet.common.protocol import FleetInfo
from batchfleet.common.redis_conn import WAIT_TIMEOUT_MS, require_replicas, sync_client
from batchfleet.common.retry import TRANSIENT, Backoff
from batchfleet.worker import fleet
from batchfleet.worker.bounded import BoundedReader
from batchfleet.worker.pending import PendingList
from batchfleet.worker.presence import Presence
from batchfleet.worker.transport import Cancel, Entry, FlushWatch, Reply, Transport

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
BATCH_LOG_MAXLEN = 10_000
MAX_BLOCK_MS = 1_000  # also bounds how long SIGTERM waits for an idle blocking read
BLOCK_SLACK_MS = 110  # Redis may end a BLOCK up to one cron tick (100 ms at hz 10) late
POLL_S = 0.002
STARTUP_WAIT_S = 60.0  # setup() waits this long for Redis to come up


# KEYS: done, inbox, stream. ARGV: group, entry id ('' = none), payload, ttl seconds, job id.
# Returns 1 when this call wrote the reply, 0 when an earlier writer already had. The inbox is a stream the
# client reads without consuming (it deletes what it has handled), so a crash at any instant loses nothing.
_REPLY_SCRIPT = """
-- pcall: a stream or group lost with Redis' data must not fail the reply that was just written.
local first = redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[4])
if first then
  redis.call('XADD', KEYS[2], '*', 'id', ARGV[5], 'p', ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
if ARGV[2] ~= '' then
  redis.pcall('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.pcall('XDEL', KEYS[3], ARGV[2])
end
if first then return 1 end
return 0
"""


_DEAD_FIELDS = {b"reason", b"bucket", b"worker", b"entry_id", b"deliveries"}


def connect(conn: ConnectionConfig) -> redis.Redis:
    """A bytes-mode client whose socket timeout bounds every blocking call (plain or Sentinel URL)."""
    return sync_client(
        conn.redis_url, socket_timeout=conn.socket_timeout_s, socket_connect_timeout=conn.socket_timeout_s,
        health_check_interval=30, decode_responses=False,
    )


def default_consumer_name() -> str:
    """hostname-pid-random: unique per worker process, readable in XINFO and heartbeats."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StreamConsumer(Transport):
    """Owns the worker's Redis connection and every command it sends (see ``Transport`` for each method)."""

    def __init__(self, conn: ConnectionConfig, buckets: tuple[int, ...], name: str, reply_ttl_s: int) -> None:
        self.conn = conn
        self.keys: Keys = conn.keys
        self.buckets = buckets
        self.name = name
        self.reply_ttl_s = reply_ttl_s
        self.r = connect(conn)
        self._reply = self.r.register_script(_REPLY_SCRIPT)
        self.presence = Presence(self.r, self.keys, name)
        self._cancels_from = "$"  # last cancels entry seen ($: none yet; set by setup)
        self.pel = PendingList(self.r, self.keys, name, buckets)
        self._flush = FlushWatch(self._flush_counter)  # baseline taken by setup()
        # every read goes through a size-checking script: memory never follows hostile entry sizes
        self.reader = BoundedReader(self.r, self.keys.group, name, {self.keys.stream(b): b for b in buckets})
        # A blocking read must return before the socket times out, with margin.
        self.max_block_ms = int(min(MAX_BLOCK_MS, conn.socket_timeout_s * 1000 / 2))

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
                for b in self.buckets:
                    try:
                        self.r.xgroup_create(self.keys.stream(b), self.keys.group, id="0", mkstream=True)
                    except redis.ResponseError as exc:
                        if "BUSYGROUP" not in str(exc):
                            raise
                self._load_functions()
                if self._cancels_from == "$":  # follow cancels published from now on
                    last = self.r.xrevrange(self.keys.cancels, count=1)
                    self._cancels_from = last[0][0].decode() if last else "0-0"
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
            log.warning("could not load the batchfleet function library (%s); an admin must load it "
                        "(docs/SECURITY.md) or producers need EVAL", exc)

    def publish_fleet(self, info: FleetInfo, replace: bool = False) -> None:
        """Join the fleet (worker/presence.py, worker/fleet.py): publish its description with a TTL unless live
        workers serve another fingerprint (FleetConflict; ``replace`` publishes anyway). Kept for ``recover``."""
        self.presence.join(info, replace)

    def recover(self) -> None:
        """Redis came back without our state (NOGROUP): re-create the groups and re-publish the fleet."""
        self.setup(wait_s=0)  # the loop retries with its own backoff
        self.pel.reset()
        self.presence.rejoin()

    def heartbeat(self, status: dict) -> None:
        """The status, msgpack-encoded, under this worker's key for 10 s; marks the worker live and renews
        the fleet description's TTL."""
        self.presence.beat(msgpack.packb(status, use_bin_type=True))

    def alive(self) -> None:
        """Mark this worker live in the live-worker set (from any thread)."""
        self.presence.beat(b"")

    def clock_offset(self) -> float:
        """Redis time minus this host's time (s), as measured by the last heartbeat."""
        return self.presence.offset

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries of every bucket (up to ``count`` per stream); blocks at most ``block_ms``.

        Redis only expires a BLOCK at its cron tick (1000/hz ms: 100 ms by default), so a 50 ms block
        would really last ~100 ms and every batch deadline would slip. Short waits therefore poll
        (non-blocking read, then a 2 ms sleep) and long ones block until ~BLOCK_SLACK_MS before the end.
        """
        if block_ms is None:
            return self._xread(count, None)
        end = time.monotonic() + max(1, min(int(block_ms), self.max_block_ms)) / 1000
        while True:
            left_ms = (end - time.monotonic()) * 1000
            block = int(left_ms - BLOCK_SLACK_MS) if left_ms > BLOCK_SLACK_MS + 10 else None
            out = self._xread(count, block)
            if out or left_ms <= 0:
                return out
            if block is None:
                time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))

    def _xread(self, count: int, block_ms: int | None) -> list[Entry]:
        return self.reader.read(count, block_ms)

    def write_replies(self, replies: list[Reply]) -> list[bool]:
        """Write replies and ack their entries in one round trip; returns which were first writes."""
        if not replies:
            return []
        pipe = self.r.pipeline(transaction=False)
        for rep in replies:
            self._queue_reply(pipe, rep)
        wanted = self.conn.wait_replicas
        if wanted:  # WAIT on the same connection: every reply above is on `wanted` replicas, else retried
            pipe.execute_command("WAIT", wanted, WAIT_TIMEOUT_MS)
        out = pipe.execute()
        if wanted:  # too few: NotReplicated (transient) keeps the replies in the outbox; rewrites are idempotent
            require_replicas(out.pop(), wanted, f"{len(replies)} replies")
        return [bool(x) for x in out]

    def _queue_reply(self, pipe, rep: Reply) -> None:
        """The reply script (first writer wins, then XACK + XDEL of its entry), queued on ``pipe``."""
        self._reply(keys=[self.keys.done(rep.job_id), rep.reply_key, self.keys.stream(rep.bucket)],
                    args=[self.keys.group, rep.entry_id, rep.payload, self.reply_ttl_s, rep.job_id], client=pipe)

    def write_deltas(self, deltas: list[tuple[str, str, bytes]]) -> None:
        """XADD each streamed delta to its inbox (+ EXPIRE), in one round trip."""
        if not deltas:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id, reply_key, payload in deltas:
            pipe.xadd(reply_key, {b"id": job_id.encode(), b"p": payload})
            pipe.expire(reply_key, self.reply_ttl_s)
        pipe.execute()

    def cancels(self) -> list[Cancel]:
        """New entries of the cancels stream since the last call (non-blocking XREAD)."""
        resp = self.r.xread({self.keys.cancels: self._cancels_from}, count=1000)
        out: list[Cancel] = []
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                self._cancels_from = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    out.append(Cancel(fields[b"id"].decode(), fields[b"r"].decode()))
                except (KeyError, UnicodeDecodeError):
                    continue  # malformed: nothing to cancel
        return out

    def marks(self, job_ids: list[str]) -> list[tuple[str | None, bool]]:
        """Each job's cancel marker (the reply key of whoever cancelled it) and whether its ``done`` marker
        exists, in one MGET."""
        if not job_ids:
            return []
        raw = self.r.mget([self.keys.cancel(j) for j in job_ids] + [self.keys.done(j) for j in job_ids])
        n = len(job_ids)
        return [(c.decode(errors="replace") if c is not None else None, d is not None)
                for c, d in zip(raw[:n], raw[n:])]

    def log_batch(self, record: dict) -> None:
        """Append a batch record (worker, bucket, ids, size) to the capped audit stream."""
        fields = {k: (",".join(v) if isinstance(v, list) else str(v)) for k, v in record.items()}
        self.r.xadd(self.keys.batches, fields, maxlen=BATCH_LOG_MAXLEN, approximate=True)

    def give_up(self, entry: Entry, reason: str, reply: Reply | None) -> None:
        """Dead-letter an entry and, when its job id is known, answer it, in one transaction (then ack)."""
        # bounded copy: at most 16 fields of 4 KiB each, so the capped stream stays small in bytes too
        fields = {k[:64]: v[:4096] for k, v in list(entry.fields.items())[:16] if k not in _DEAD_FIELDS}
        fields.update({b"reason": reason[:500].encode(), b"bucket": str(entry.bucket).encode(),
                       b"worker": self.name.encode(), b"entry_id": entry.entry_id.encode(),
                       b"deliveries": str(entry.deliveries).encode()})
        stream = self.keys.stream(entry.bucket)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=False)  # rare: exact cap
        if reply is not None:
            self._queue_reply(pipe, reply)  # reply.bucket/entry_id are the entry's
        else:
            pipe.xack(stream, self.keys.group, entry.entry_id)
            pipe.xdel(stream, entry.entry_id)
        pipe.execute()

    def ack(self, entry: Entry) -> None:
        """Acknowledge and delete an entry that needs no reply of its own (a duplicate delivery)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.keys.stream(entry.bucket), self.keys.group, entry.entry_id)
        pipe.xdel(self.keys.stream(entry.bucket), entry.entry_id)
        pipe.execute()

    def hand_back(self, entries: list[Entry]) -> None:
        """Return entries this worker read but will not run (shutdown): re-add, then ack + delete."""
        if not entries:
            return
        pipe = self.r.pipeline(transaction=True)
        for e in entries:
            pipe.xadd(self.keys.stream(e.bucket), e.fields)
            pipe.xack(self.keys.stream(e.bucket), self.keys.group, e.entry_id)
            pipe.xdel(self.keys.stream(e.bucket), e.entry_id)
        pipe.execute()

    # ---- pending entries (worker/pending.py) -----------------------------------------------------
    def reclaim(self, min_idle_ms: int, budget: int) -> list[Entry]:
        """XAUTOCLAIM, resuming where a budget cut the last scan (``PendingList.reclaim``)."""
        return self.pel.reclaim(min_idle_ms, budget)

    def release(self, entries: list[Entry], idle_ms: int, count_delivery: bool = True) -> None:
        """XCLAIM JUSTID making them look ``idle_ms`` idle (``PendingList.release``)."""
        self.pel.release(entries, idle_ms, count_delivery)

    def live_peers(self) -> int:
        """ZCOUNT of the live-worker set over the live window (Redis time), ourselves excluded."""
        return fleet.live_workers(self.r, self.keys, exclude=self.name)

    def ping(self) -> None:
        self.r.ping()

    def refresh(self, entries: list[Entry], min_idle_ms: int) -> None:
        """XCLAIM JUSTID resetting their idle time (``PendingList.refresh``); lease keeper thread."""
        self.pel.refresh(entries, min_idle_ms)

    def prune_consumers(self, min_idle_ms: int) -> int:
        """XGROUP DELCONSUMER of silent names holding nothing (``PendingList.prune_consumers``)."""
        return self.pel.prune_consumers(min_idle_ms)

    # ---- static batching -------------------------------------------------------------------------
    def flush_requested(self) -> bool:
        """GET of the flush counter, at most every 50 ms; True once per change."""
        return self._flush.requested()

    def _flush_counter(self) -> int:
        raw = self.r.get(self.keys.flush)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def close(self) -> None:
        """Drop the heartbeat and, when nothing is pending on us any more, our consumer names."""
        try:
            self.r.delete(self.keys.worker(self.name))
            if self.presence.leave():  # the last live worker: producers now get NoWorkers
                log.info("last live worker of %r stopped: fleet description deleted", self.keys.namespace)
            for b in self.buckets:
                stream = self.keys.stream(b)
                if not self.r.xpending_range(stream, self.keys.group, "-", "+", 1, consumername=self.name):
                    self.r.xgroup_delconsumer(stream, self.keys.group, self.name)  # would drop its PEL: empty
        except redis.RedisError:
            pass
        self.r.close()

