"""What the fleet looks like right now, read from Redis: per-bucket queues and per-worker status.

Shared by the metrics collector (common/metrics.py, any process reports the whole fleet's queues) and
``batchfleet status`` (producer/ops/status.py). Read-only; a few commands per bucket, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import redis

from batchfleet.common.keys import Keys, valid_tenant
from batchfleet.common.redis.clients import same_node
from batchfleet.common.redis.functions import LIVE_WORKER_MS
from batchfleet.common.wire.protocol import FleetInfo


@dataclass(frozen=True)
class QueueStats:
    """One bucket stream of one priority (``priority``: interactive or background). ``depth``: entries not yet
    delivered to any worker (the group's lag, or XLEN minus pending when Redis cannot say); ``pending``:
    delivered, not yet answered; ``lag``: Redis' own figure (None before Redis 7 or when deletions make it
    unknown); ``oldest_age_s``: age of the oldest entry still in the stream (queued or running), 0 when
    empty."""

    bucket: int
    priority: str
    length: int
    depth: int
    pending: int
    lag: int | None
    oldest_age_s: float


def _decode(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def redis_now_ms(r: redis.Redis) -> int:
    """Redis' clock (ms): ages are measured on the clock that stamped the entry ids."""
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def _live_since_ms(sec: int | bytes, usec: int | bytes, within_ms: int) -> int:
    return int(sec) * 1000 + int(usec) // 1000 - within_ms


def live_workers(r: redis.Redis, keys: Keys, within_ms: int = LIVE_WORKER_MS) -> list[str]:
    """The one live-workers query: names of workers whose last heartbeat (scored with Redis' own clock) is
    newer than ``within_ms``. The async twin is ``live_workers_async``; client, health check, status and
    fleet membership all ask through these."""
    sec, usec = r.time()
    since = _live_since_ms(sec, usec, within_ms)
    return [_decode(m) for m in r.zrangebyscore(keys.workers, since, "+inf")]


async def live_workers_async(r, keys: Keys, within_ms: int = LIVE_WORKER_MS) -> list[str]:
    """``live_workers`` on an asyncio redis client."""
    sec, usec = await r.time()
    since = _live_since_ms(sec, usec, within_ms)
    return [_decode(m) for m in await r.zrangebyscore(keys.workers, since, "+inf")]


def fleet_info(r: redis.Redis, keys: Keys) -> FleetInfo | None:
    """The published fleet description, or None when no live worker keeps it."""
    raw = r.get(keys.fleet)
    return FleetInfo.decode(raw) if raw else None


def layout(keys: Keys, info: FleetInfo | None) -> Keys:
    """``keys`` laid out over the shards the fleet description says (common/keys.py)."""
    return keys.with_shards(info.shards) if info is not None and info.shards != keys.shards else keys


def queue_stats(r: redis.Redis, keys: Keys, buckets: tuple[int, ...] | list[int]) -> list[QueueStats]:
    """Depth, pending, lag and oldest age of every bucket stream of both priorities, interactive first: summed
    over the shards of ``keys``' layout (the oldest age: the largest), one pipeline round trip per shard."""
    per_shard = [_queue_stats(r, k, buckets) for k in keys.every_shard]
    if len(per_shard) == 1:
        return per_shard[0]
    out = []
    for rows in zip(*per_shard):
        lags = [q.lag for q in rows]
        out.append(QueueStats(rows[0].bucket, rows[0].priority, sum(q.length for q in rows), sum(q.depth for q in rows),
                              sum(q.pending for q in rows), None if None in lags else sum(q or 0 for q in lags),
                              max(q.oldest_age_s for q in rows)))
    return out


def queued_tenants(r: redis.Redis, keys: Keys) -> list[str]:
    """The named tenants that queued work lately on ``keys``' shard (``Keys.queued_tenants``: idle ones are
    retired, worker/transport/tenant_gc.py). A member that is no label (the enqueue function stores what its caller
    passes: a producer writing it by hand) names no stream of ours: left out, rather than fail every reader of the
    streams (workers, gauges) with it."""
    members = (m.decode(errors="replace") if isinstance(m, bytes) else m for m in r.smembers(keys.queued_tenants))
    return sorted(t for t in members if valid_tenant(t))


def request_streams(r: redis.Redis, keys: Keys, buckets: tuple[int, ...] | list[int]) -> list[tuple[str, int, str]]:
    """Every request stream of ``keys``' shard, every tenant's (``Keys.streams``): one SMEMBERS."""
    return keys.streams(buckets, queued_tenants(r, keys))


def _queue_stats(r: redis.Redis, keys: Keys, buckets: tuple[int, ...] | list[int]) -> list[QueueStats]:
    """One row per bucket and priority, summed over the tenants' streams (the oldest age: the largest)."""
    rows = _stream_stats(r, keys, request_streams(r, keys, buckets))
    merged: dict[tuple[int, str], QueueStats] = {}
    for q in rows:
        m = merged.get((q.bucket, q.priority))
        merged[q.bucket, q.priority] = q if m is None else QueueStats(
            q.bucket, q.priority, m.length + q.length, m.depth + q.depth, m.pending + q.pending,
            None if None in (m.lag, q.lag) else (m.lag or 0) + (q.lag or 0), max(m.oldest_age_s, q.oldest_age_s))
    return list(merged.values())


def _stream_stats(r: redis.Redis, keys: Keys, streams: list[tuple[str, int, str]]) -> list[QueueStats]:
    pipe = r.pipeline(transaction=False)
    pipe.execute_command("TIME", **same_node(r, keys.workers))  # the clock that stamps the entry ids
    for stream, _, _ in streams:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        pipe.xrange(stream, "-", "+", count=1)
    res = pipe.execute(raise_on_error=False)
    sec, usec = res[0]
    now_ms = int(sec) * 1000 + int(usec) // 1000
    out = []
    for i, (_, b, priority) in enumerate(streams):
        length, groups, first = res[1 + 3 * i: 4 + 3 * i]
        length = length if isinstance(length, int) else 0
        group: dict = {}
        if isinstance(groups, list):  # an error (no such stream yet) counts as an empty queue
            group = next((g for g in groups if _decode(g.get("name")) == keys.group), {})
        pending = int(group.get("pending") or 0)
        lag = group.get("lag")
        lag = int(lag) if lag is not None else None
        depth = lag if lag is not None else max(0, length - pending)
        age = 0.0
        if isinstance(first, list) and first:
            entry_ms = int(_decode(first[0][0]).split("-")[0])
            age = max(0.0, (now_ms - entry_ms) / 1000)
        out.append(QueueStats(b, priority, length, depth, pending, lag, age))
    return out


def worker_stats(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every worker of the live-worker set: its last status (when its status key has not expired) plus
    ``alive`` (heartbeat within LIVE_WORKER_MS of Redis' clock) and ``seen_s`` (seconds since it)."""
    live = set(live_workers(r, keys))
    now_ms = redis_now_ms(r)
    members = r.zrange(keys.workers, 0, -1, withscores=True)
    names = [_decode(m) for m, _ in members]
    raws = r.mget([keys.worker(n) for n in names]) if names else []
    out = []
    for (name, (_, score)), raw in zip(zip(names, members), raws):
        status = msgpack.unpackb(raw, raw=False) if raw else {}
        seen_ms = max(0, now_ms - int(score))
        out.append({**status, "name": name, "alive": name in live, "seen_s": seen_ms / 1000})
    return out


def dead_letters(r: redis.Redis, keys: Keys) -> int:
    """Entries in the dead-letter streams (capped, so the most recent ones) of every shard of ``keys``."""
    return sum(int(r.xlen(k.dead)) for k in keys.every_shard)


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _text_fields(fields: dict) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in fields.items()}


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _entry_time_s(entry_id: Any) -> float:
    """The Redis time (s since the epoch) an entry id was stamped with."""
    return int(_decode(entry_id).split("-")[0]) / 1000


def recent_batches(r: redis.Redis, keys: Keys, count: int = 20) -> list[dict[str, Any]]:
    """The newest ``count`` batch records (``<ns>:batches``), newest first: worker, kind, bucket, size
    (sequences in the engine after it started), requests (entries of this batch), time (Redis' clock)."""
    out = []
    for entry_id, fields in r.xrevrange(keys.batches, count=count):
        f = _text_fields(fields)
        ids = [i for i in f.get("ids", "").split(",") if i]
        out.append({"time": _entry_time_s(entry_id), "worker": f.get("worker"), "kind": f.get("kind"),
                    "bucket": _int(f.get("bucket")), "size": _int(f.get("size")), "requests": len(ids)})
    return out


DEAD_LETTER_SHOWN = ("reason", "bucket", "worker", "entry_id", "deliveries", "id")  # never the payload


def dead_letter_entries(r: redis.Redis, keys: Keys, count: int = 20) -> list[dict[str, Any]]:
    """The newest ``count`` dead letters of every shard of ``keys``, newest first: when, why, which
    bucket/worker/entry/job. Their fields come from hostile input (the entry as received): text only, each cut
    to 300 chars."""
    out = []
    newest = sorted((x for k in keys.every_shard for x in r.xrevrange(k.dead, count=count)),
                    key=lambda x: _entry_time_s(x[0]), reverse=True)[:count]
    for entry_id, fields in newest:
        f = _text_fields({k: v for k, v in fields.items() if _str(k) in DEAD_LETTER_SHOWN})
        row: dict[str, Any] = {"time": _entry_time_s(entry_id)}
        row.update({k: f[k][:300] for k in DEAD_LETTER_SHOWN if k in f})
        out.append(row)
    return out
