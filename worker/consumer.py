"""The stream consumer: everything the worker says to Redis goes through here.

Reads bucket streams in one consumer group, writes replies (first writer wins, then ack + delete, in
one server-side script so a crash can never ack an unanswered entry), dead-letters what cannot be
answered, publishes the fleet description and a heartbeat.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

import msgpack
import redis

from common.config import ConnectionConfig
from common.keys import Keys
from common.protocol import FleetInfo

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
BATCH_LOG_MAXLEN = 10_000
MAX_BLOCK_MS = 2_000

# KEYS: done, reply, stream. ARGV: group, entry id ('' = none), payload, ttl seconds.
# Returns 1 when this call wrote the reply, 0 when an earlier writer already had.
_REPLY_SCRIPT = """
local first = redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[4])
if first then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
if ARGV[2] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[3], ARGV[2])
end
if first then return 1 end
return 0
"""


@dataclass(frozen=True)
class Entry:
    """One raw stream entry as read from Redis (fields not yet validated)."""

    bucket: int
    entry_id: str
    fields: dict[bytes, bytes]


@dataclass(frozen=True)
class Reply:
    """A reply to write: payload is an encoded Result or Error."""

    job_id: str
    payload: bytes
    bucket: int | None  # stream to ack in; None when nothing to ack
    entry_id: str = ""


def connect(conn: ConnectionConfig) -> redis.Redis:
    """A bytes-mode client whose socket timeout bounds every blocking call."""
    return redis.Redis.from_url(
        conn.redis_url, socket_timeout=conn.socket_timeout_s, socket_connect_timeout=conn.socket_timeout_s,
        health_check_interval=30, decode_responses=False,
    )


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StreamConsumer:
    """Owns the worker's Redis connection and every command it sends."""

    def __init__(self, conn: ConnectionConfig, buckets: tuple[int, ...], name: str, reply_ttl_s: int) -> None:
        self.conn = conn
        self.keys: Keys = conn.keys
        self.buckets = buckets
        self.name = name
        self.reply_ttl_s = reply_ttl_s
        self.r = connect(conn)
        self._reply = self.r.register_script(_REPLY_SCRIPT)
        # A blocking read must return before the socket times out, with margin.
        self.max_block_ms = int(min(MAX_BLOCK_MS, conn.socket_timeout_s * 1000 / 2))

    def setup(self) -> None:
        """Create the consumer group on every bucket stream (reading from the start of each stream)."""
        for b in self.buckets:
            try:
                self.r.xgroup_create(self.keys.stream(b), self.keys.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def publish_fleet(self, info: FleetInfo) -> None:
        self.r.set(self.keys.fleet, info.encode())

    def heartbeat(self, status: dict) -> None:
        self.r.set(self.keys.worker(self.name), msgpack.packb(status, use_bin_type=True), ex=10)

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries of every bucket (up to ``count`` per stream); blocks at most ``block_ms``."""
        if block_ms is not None:
            block_ms = max(1, min(int(block_ms), self.max_block_ms))
        streams = {self.keys.stream(b): ">" for b in self.buckets}
        resp = self.r.xreadgroup(self.keys.group, self.name, streams, count=count, block=block_ms)
        by_name = {self.keys.stream(b).encode(): b for b in self.buckets}
        out: list[Entry] = []
        for stream, entries in resp or []:
            bucket = by_name[stream if isinstance(stream, bytes) else stream.encode()]
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append(Entry(bucket, eid, fields or {}))
        return out

    def write_replies(self, replies: list[Reply], batch_record: dict | None = None) -> list[bool]:
        """Write replies and ack their entries in one round trip; returns which were first writes."""
        if not replies and batch_record is None:
            return []
        pipe = self.r.pipeline(transaction=False)
        for rep in replies:
            stream = self.keys.stream(rep.bucket) if rep.bucket is not None else self.keys.stream(0)
            self._reply(
                keys=[self.keys.done(rep.job_id), self.keys.reply(rep.job_id), stream],
                args=[self.keys.group, rep.entry_id if rep.bucket is not None else "", rep.payload,
                      self.reply_ttl_s],
                client=pipe,
            )
        if batch_record is not None:
            self.log_batch(batch_record, pipe)
        results = pipe.execute()
        return [bool(x) for x in results[: len(replies)]]

    def log_batch(self, record: dict, pipe=None) -> None:
        """Append a batch record (worker, bucket, ids, size) to the capped audit stream."""
        target = pipe if pipe is not None else self.r
        fields = {k: (",".join(v) if isinstance(v, list) else str(v)) for k, v in record.items()}
        target.xadd(self.keys.batches, fields, maxlen=BATCH_LOG_MAXLEN, approximate=True)

    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move an entry nobody can be answered for to the capped dead-letter stream, then ack it."""
        fields = {k: v for k, v in list(entry.fields.items())[:16]}
        fields.update({b"reason": reason[:500].encode(), b"bucket": str(entry.bucket).encode(),
                       b"worker": self.name.encode(), b"entry_id": entry.entry_id.encode()})
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.xack(self.keys.stream(entry.bucket), self.keys.group, entry.entry_id)
        pipe.xdel(self.keys.stream(entry.bucket), entry.entry_id)
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

    def flush_counter(self) -> int:
        raw = self.r.get(self.keys.flush)
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def server_time(self) -> float:
        sec, usec = self.r.time()
        return sec + usec / 1e6

    def close(self) -> None:
        try:
            self.r.delete(self.keys.worker(self.name))
        except redis.RedisError:
            pass
        self.r.close()


def wait_for_redis(conn: ConnectionConfig, timeout_s: float = 10.0) -> None:
    """Raise ConnectionError unless Redis answers PING within timeout_s."""
    deadline = time.monotonic() + timeout_s
    client = connect(conn)
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            client.close()
