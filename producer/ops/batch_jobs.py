"""The OpenAI batch jobs (``/v1/batches``) as the dashboard and ``batchfleet status`` show them, read from
the records the gateway keeps (gateway/batches/store.py): every unfinished job (``keys.openai_batches_due``)
and the last finished ones (``keys.openai_batches_finished``), of every API key. Sync redis-py, read-only;
the producer imports nothing of the gateway, so this reads the record's ``doc`` (OpenAI's batch object)
and ``cancel`` fields itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from batchfleet.common.keys import Keys

SHOWN_RUNNING = 20  # unfinished jobs listed at most (oldest first: the ones holding the queue)
SHOWN_FINISHED = 5
TERMINAL = ("completed", "failed", "expired", "cancelled")


def batch_job_row(doc: dict[str, Any], cancel: int | None, now: float) -> dict[str, Any]:
    """One job: id, status (``cancelling`` once a cancel is asked), progress (total, completed, failed),
    rate (requests answered per second since it started running), ETA (s) and its times (epoch s)."""
    counts = doc.get("request_counts") or {}
    total, completed, failed = (int(counts.get(k) or 0) for k in ("total", "completed", "failed"))
    status = doc.get("status", "?")
    if cancel is not None and status not in TERMINAL:
        status = "cancelling"
    started = doc.get("in_progress_at")
    ended = next((doc[k] for k in ("completed_at", "failed_at", "cancelled_at", "expired_at") if doc.get(k)), None)
    rate = eta = None
    if started and completed + failed:
        elapsed = (ended or now) - started
        rate = round((completed + failed) / elapsed, 2) if elapsed > 0 else None
        if rate and status == "in_progress":
            eta = round(max(0, total - completed - failed) / rate, 1)
    return {"id": doc.get("id"), "status": status, "endpoint": doc.get("endpoint"), "total": total,
            "completed": completed, "failed": failed, "rate": rate, "eta_s": eta,
            "created_at": doc.get("created_at"), "started_at": started, "ended_at": ended,
            "expires_at": doc.get("expires_at")}


def batch_jobs(r: redis.Redis, keys: Keys, running: int = SHOWN_RUNNING,
               finished: int = SHOWN_FINISHED) -> list[dict[str, Any]]:
    """The first ``running`` unfinished jobs (oldest first), then the last ``finished`` finished ones (newest
    first; the gateway keeps the last 20)."""
    due = r.zrange(keys.openai_batches_due, 0, running - 1) if running > 0 else []
    finished_ids = r.zrevrange(keys.openai_batches_finished, 0, finished - 1) if finished > 0 else []
    ids = [i.decode() if isinstance(i, bytes) else i for i in (*due, *finished_ids)]
    pipe = r.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hmget(keys.openai_batch(batch_id), "doc", "cancel")
    now = time.time()
    out = []
    for raw, cancel in pipe.execute() if ids else []:
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = None
        if isinstance(doc, dict):  # gone: expired with its files since it was indexed
            out.append(batch_job_row(doc, int(cancel) if cancel else None, now))
    return out
