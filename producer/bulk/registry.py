"""The bulk-run registry: every ``batchfleet bulk`` run (producer/bulk/file_run.py ``run_file``, also the RQ ``bulk``
job) reports its progress to Redis every REPORT_EVERY_S, so the dashboard, ``batchfleet status`` and the
gateway's metrics show the runs of the whole fleet, not only the terminal that started each.

One JSON report per run under ``keys.bulk_run(run id)``. A running run's report has a TTL of RUN_TTL_S and is
indexed by the sorted set ``keys.bulk_runs`` (score: when it reported, ms): a killed run stops reporting, its key
expires and the next writer prunes its index entry. A run that ends (finished, or stopped: a rerun resumes it)
writes its last report without a TTL and moves to ``keys.bulk_runs_finished``, which keeps the last FINISHED_KEPT
ended runs as the batch store keeps the last finished batch jobs: the run that pushes one out deletes its report,
so the registry stays bounded. Redis cost: three commands per run every REPORT_EVERY_S, never per line, and
two short round trips when it ends. The run id is the run key kept beside the output, so a resumed run reports
under the same entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from typing import Any

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import BACKGROUND, priority_of
from batchfleet.producer.bulk.rate import RecentRate
from batchfleet.producer.bulk.work import Summary

log = logging.getLogger(__name__)

REPORT_EVERY_S = 5.0
RUN_TTL_S = 300  # a running run not heard from for this long is gone (killed)
SHOWN = 20  # running runs read at most, newest report first
FINISHED_KEPT = 20  # ended runs kept (as gateway/batches/store.py keeps the last finished batch jobs)
SHOWN_FINISHED = 5  # of those, listed by the dashboard and status (as producer/ops/batch_jobs.py)
ENDED = ("finished", "stopped")


class RunReporter:
    """Reports one run (``report``; ``every`` in a task until its event is set) through the run's async client."""

    def __init__(self, r: Any, keys: Keys, run_id: str, input_path: str | None, output_path: str | None,
                 summary: Summary, priority: str = BACKGROUND) -> None:
        """``priority``: the run's (its lines' default; a line may ask for another)."""
        self.r, self.keys, self.id, self.summary = r, keys, run_id, summary
        self.base = {"id": run_id, "input": os.path.basename(input_path) if input_path else "-",
                     "output": os.path.basename(output_path) if output_path else "-", "priority": priority,
                     "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
        self.pace = RecentRate()  # of the lines this run wrote: no rate (nor ETA) until it is measured
        self.reported = False  # the first report takes a resumed run out of the ended ones

    def doc(self, state: str) -> dict[str, Any]:
        s = self.summary
        self.pace.add(time.monotonic(), s.written)
        rate = self.pace.rate()
        eta = self.pace.eta(max(0, s.total - s.done)) if state == "running" else None
        error = None if s.error is None else str(s.error)[:300]
        return {**self.base, "state": state, "total": s.total, "done": s.done, "failed": s.failed_lines,
                "kept": s.kept, "rate": None if rate is None else round(rate, 2),
                "eta_s": None if eta is None else round(eta, 1), "updated_at": time.time(), "error": error}

    async def report(self, state: str = "running") -> None:
        """Write the run's report now (best effort: a registry write never fails the run); an ended ``state``
        (ENDED) keeps it among the last FINISHED_KEPT ended runs."""
        now_ms = int(time.time() * 1000)
        key, doc = self.keys.bulk_run(self.id), json.dumps(self.doc(state))
        try:
            async with self.r.pipeline(transaction=False) as p:
                if state in ENDED:
                    p.set(key, doc)  # no TTL: kept while the ended index lists it
                    p.zrem(self.keys.bulk_runs, self.id)
                    p.zadd(self.keys.bulk_runs_finished, {self.id: now_ms})
                    p.zrange(self.keys.bulk_runs_finished, 0, -FINISHED_KEPT - 1)  # the ones past the cap
                else:
                    p.set(key, doc, ex=RUN_TTL_S)
                    p.zadd(self.keys.bulk_runs, {self.id: now_ms})
                    p.zremrangebyscore(self.keys.bulk_runs, "-inf", now_ms - RUN_TTL_S * 1000)
                    if not self.reported:  # resumed: running again
                        p.zrem(self.keys.bulk_runs_finished, self.id)
                done = await p.execute()
            self.reported = True
            dropped = [i.decode() if isinstance(i, bytes) else i for i in done[-1]] if state in ENDED else []
            if dropped:  # exactly those: a run ending meanwhile stays
                async with self.r.pipeline(transaction=False) as p:
                    p.delete(*(self.keys.bulk_run(i) for i in dropped))
                    p.zrem(self.keys.bulk_runs_finished, *dropped)
                    await p.execute()
        except (redis.RedisError, OSError) as exc:
            log.debug("bulk run %s: report not written: %s", self.id, exc)

    async def every(self, done: asyncio.Event, seconds: float = REPORT_EVERY_S) -> None:
        """Report every ``seconds`` until ``done`` is set. Never cancelled mid-write: a redis-py call cancelled
        inside a bounded pool can keep its connection, and the run's pool is small."""
        while not done.is_set():
            await self.report()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), seconds)

    def final_state(self) -> str:
        """finished (every line answered) or stopped (Ctrl-C, or a fleet outage: ``error`` says which; a rerun
        resumes it)."""
        return "stopped" if self.summary.interrupted or self.summary.error is not None else "finished"


def run_priority(params: dict[str, Any] | None) -> str:
    """The priority a run's lines get unless a line asks for another: its ``defaults``' (as the run record keeps
    them, producer/bulk/lines.py), else background."""
    asked = ((params or {}).get("defaults") or {}).get("priority")
    try:
        return BACKGROUND if asked is None else priority_of(asked)
    except ValueError:  # refused where the lines are made; the report still goes out
        return BACKGROUND


def bulk_runs(r: redis.Redis, keys: Keys, running: int = SHOWN,
              finished: int = SHOWN_FINISHED) -> list[dict[str, Any]]:
    """The last ``running`` running runs that reported within RUN_TTL_S (newest report first), then the last
    ``finished`` ended ones (newest first) (sync: the dashboard's, status' and the gateway's metrics' read)."""
    since = int(time.time() * 1000) - RUN_TTL_S * 1000
    live = r.zrevrangebyscore(keys.bulk_runs, "+inf", since, start=0, num=running) if running > 0 else []
    ended = r.zrevrange(keys.bulk_runs_finished, 0, finished - 1) if finished > 0 else []
    ids = list(dict.fromkeys(i.decode() if isinstance(i, bytes) else i for i in (*live, *ended)))
    raws = r.mget([keys.bulk_run(i) for i in ids]) if ids else []
    out = []
    for raw in raws:
        try:
            run = json.loads(raw) if raw else None
        except ValueError:
            run = None
        if isinstance(run, dict):
            out.append(run)
    return out
