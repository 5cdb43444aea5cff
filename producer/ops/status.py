"""``batchfleet status``: the fleet at a glance (queues per bucket and priority, workers, dead letters) and the
work it runs (OpenAI batch jobs: ``/v1/batches``; bulk runs: ``batchfleet bulk``), as a table or as JSON for
scripts. Everything comes from Redis (common/redis/fleetstate.py, producer/ops/batch_jobs.py,
producer/bulk/registry.py); no torch.

Words, here and on the dashboard: a *priority* is interactive or background; a *prefill batch*
is requests a worker admitted into its engine together; a *batch job* is an OpenAI batch (/v1/batches); a
*bulk run* is one ``batchfleet bulk`` file run."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import redis

from batchfleet.common.errors import RedisUnavailable
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import QueueStats, dead_letters, fleet_info, layout, queue_stats, worker_stats
from batchfleet.common.redis.functions import LIVE_WORKER_MS
from batchfleet.common.wire.priority import old_name
from batchfleet.producer.bulk.registry import bulk_runs
from batchfleet.producer.ops.batch_jobs import SHOWN_FINISHED, SHOWN_RUNNING, batch_jobs


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """The fleet as plain data (what ``--json`` prints): fleet, queues, workers, dead_letters."""
    info = fleet_info(r, keys)
    workers = worker_stats(r, keys)
    if info is not None:
        buckets = list(info.buckets)
    else:  # no live worker refreshes the fleet key: show the queues the (gone) workers served
        buckets = sorted({int(b) for w in workers for b in w.get("buckets", ())})
    fleet = None if info is None else {"model": info.model, "buckets": list(info.buckets),
                                       "max_seq_len": info.max_seq_len, "max_batch_size": info.max_batch_size,
                                       "max_queue_len": info.max_queue_len, "batch_queue_len": info.batch_queue_len,
                                       "scale_to_zero": info.scale_to_zero, "shards": info.shards}
    return {"namespace": keys.namespace, "fleet": fleet,
            "queues": [_queue_row(q) for q in queue_stats(r, layout(keys, info), buckets)],
            "workers": [_worker_row(w) for w in sorted(workers, key=lambda w: (not w["alive"], w["name"]))],
            "dead_letters": dead_letters(r, layout(keys, info))}


def work(r: redis.Redis, keys: Keys, unfinished: int = SHOWN_RUNNING, ended: int = SHOWN_FINISHED) -> dict[str, Any]:
    """The work the fleet runs: ``batch_jobs`` (the first ``unfinished`` unfinished, then the last ``ended``
    finished) and ``bulk_runs`` (the ``unfinished`` running ones heard from within a few minutes, then the last
    ``ended`` ended ones)."""
    return {"batch_jobs": batch_jobs(r, keys, unfinished, ended), "bulk_runs": bulk_runs(r, keys, unfinished, ended)}


def read_work(r: redis.Redis, keys: Keys, unfinished: int, ended: int) -> dict[str, Any]:
    """``work``, for callers that import no redis (the gateway's work gauges, gateway/work_metrics.py): Redis
    errors raise RedisUnavailable."""
    try:
        return work(r, keys, unfinished, ended)
    except redis.RedisError as exc:
        raise RedisUnavailable(f"Redis: {exc}"[:300]) from None


def _queue_row(q: QueueStats) -> dict[str, Any]:
    row = asdict(q)
    row["class"] = old_name(q.priority)  # the key and value before "priority": one release
    return row


def _worker_row(w: dict[str, Any]) -> dict[str, Any]:
    reserve = w.get("engine_background_reserve", w.get("engine_batch_reserve"))
    total = w.get("engine_kv_blocks_total")
    kv = (w.get("engine_kv_blocks_used", 0) / total) if total else None
    queries = w.get("engine_prefix_cache_queries")
    hit_rate = (w.get("engine_prefix_cache_hits", 0) / queries) if queries else None
    return {"name": w["name"], "alive": w["alive"], "seen_s": round(w["seen_s"], 1),
            "engine": w.get("engine"), "mode": w.get("mode"), "running": w.get("active"),
            # --max-running, and the background reserve the engine keeps decoding on top of a full interactive load
            # (an older worker's heartbeat names it engine_batch_reserve; "batch_reserve": this key's old name)
            "running_limit": w.get("engine_running_limit"), "background_reserve": reserve, "batch_reserve": reserve,
            "waiting": w.get("waiting"), "kv_usage": None if kv is None else round(kv, 4),
            "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "tokens_per_s": w.get("tokens_per_s"), "last_batch_sizes": w.get("last_batch_sizes"),
            "completed": w.get("completed"), "errors": w.get("errors"), "dead_lettered": w.get("dead_lettered"),
            "prefix_cache_hit_rate": prefix_cache_hit_rate(w)}


def prefix_cache_hit_rate(w: dict[str, Any]) -> float | None:
    """Hits / queries of the engine's prefix cache when the heartbeat carries those counters (as engine
    stats ``engine_prefix_cache_{hits,queries}`` or top-level), else None (no prefix cache, or none yet)."""
    hits = w.get("engine_prefix_cache_hits", w.get("prefix_cache_hits"))
    queries = w.get("engine_prefix_cache_queries", w.get("prefix_cache_queries"))
    if not isinstance(hits, (int, float)) or not isinstance(queries, (int, float)) or queries <= 0:
        return None
    return round(hits / queries, 4)


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (header, *rows)]


def _dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _running(w: dict[str, Any]) -> str:
    """The running count; above --max-running it says that the excess is the background reserve (background sequences
    the engine keeps decoding while interactive work fills the limit), not a limit ignored."""
    running, limit, reserve = w["running"], w.get("running_limit"), w.get("background_reserve")
    if isinstance(running, int) and isinstance(limit, int) and running > limit:
        return f"{running} (max-running {limit} + background reserve {reserve if reserve is not None else '?'})"
    return _dash(running)


def render(snap: dict[str, Any]) -> str:
    """The snapshot as readable text: a fleet line, a queue table (``queued``: read by no worker yet; ``at
    workers``: delivered, not answered), a worker table, dead letters, then the work (``render_work``)."""
    fleet = snap["fleet"]
    live = sum(w["alive"] for w in snap["workers"])
    alive = f"{live} live worker{'s' * (live != 1)} (heartbeat within {LIVE_WORKER_MS // 1000} s)"
    if fleet is None and not snap["workers"]:
        return "\n".join([f"no fleet published under namespace {snap['namespace']!r}; {alive}", *render_work(snap)])
    lines = [f"namespace {snap['namespace']}  model {fleet['model']}  buckets {fleet['buckets']}  "
             f"max_seq_len {fleet['max_seq_len']}  {alive}" if fleet else
             f"namespace {snap['namespace']}  no fleet published: {alive} (queues of the buckets gone workers "
             "served)", ""]
    lines += _table(["bucket", "priority", "queued", "at workers", "oldest", "lag"],
                    [[str(q["bucket"]), q["priority"], str(q["depth"]), str(q["pending"]),
                      _age(q["oldest_age_s"]) if q["length"] else "-", _dash(q["lag"])] for q in snap["queues"]])
    lines.append("")
    rows = []
    for w in snap["workers"]:
        rows.append([w["name"], "alive" if w["alive"] else f"gone ({_age(w['seen_s'])} ago)",
                     f"{w['engine']}/{w['mode']}" if w["engine"] else "-", _running(w), _dash(w["waiting"]),
                     _dash(None if w["kv_usage"] is None else w["kv_usage"] * 100, "{:.0f}%"),
                     _dash(None if w.get("prefix_hit_rate") is None else w["prefix_hit_rate"] * 100, "{:.0f}%"),
                     _dash(w["tokens_per_s"], "{:.1f}"),
                     ",".join(str(b) for b in w["last_batch_sizes"] or []) or "-", _dash(w["completed"])])
    lines += _table(["worker", "state", "engine/mode", "running", "waiting", "kv", "prefix hit", "tok/s(1m)",
                     "last prefill batches", "done"], rows) if rows else ["no workers"]
    lines += ["", f"dead letters: {snap['dead_letters']}"]
    return "\n".join(lines + render_work(snap))


def _progress(done: int, total: int, rate: float | None, eta: float | None) -> list[str]:
    return [f"{done}/{total}" + (f" ({100 * done / total:.0f}%)" if total else ""),
            _dash(rate, "{:.1f}/s"), "-" if eta is None else _age(eta)]


def render_work(snap: dict[str, Any]) -> list[str]:
    """The batch jobs and bulk runs sections (absent from a snapshot: not shown)."""
    lines: list[str] = []
    if "batch_jobs" in snap:
        rows = [[j["id"], j["status"], *_progress(j["completed"] + j["failed"], j["total"], j["rate"], j["eta_s"]),
                 str(j["failed"])] for j in snap["batch_jobs"]]
        lines += ["", "batch jobs (/v1/batches):"]
        lines += _table(["id", "status", "answered", "rate", "eta", "failed"], rows) if rows else ["none"]
    if "bulk_runs" in snap:
        rows = [[b["id"], b["state"], f"{b['input']} -> {b['output']}", *_progress(b["done"], b["total"], b["rate"],
                 b["eta_s"]), str(b["failed"]), f"{b['host']}:{b['pid']}"] for b in snap["bulk_runs"]]
        lines += ["", "bulk runs (batchfleet bulk):"]
        lines += _table(["run", "state", "files", "answered", "rate", "eta", "failed", "where"], rows) if rows \
            else ["none"]
    return lines
