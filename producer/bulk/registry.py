"""The bulk-run registry: every ``batchfleet bulk`` run (producer/bulk/file_run.py ``run_file``, also the RQ ``bulk``
job)
reports its progress to Redis every REPORT_EVERY_S, so the dashboard and ``batchfleet status`` show the runs
of the whole fleet, not only the terminal that started each.

One JSON report per run under ``keys.bulk_run(run id)`` with a TTL of RUN_TTL_S, indexed by the sorted set
``keys.bulk_runs`` (score: when it reported, ms). A killed run stops reporting: its key expires and the
next writer prunes its index entry, so the registry holds only runs heard from within RUN_TTL_S (a finished
run stays listed, as finished, that long). Redis cost: three commands per run every REPORT_EVERY_S, never
per line. The run id is the run key kept beside the output, so a resumed run reports under the same entry.
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
from batchfleet.producer.bulk.rate import RecentRate
from batchfleet.producer.bulk.work import Summary

log = logging.getLogger(__name__)

REPORT_EVERY_S = 5.0
RUN_TTL_S = 300  # a run not heard from for this long is gone (killed, or finished that long ago)
SHOWN = 20  # runs read at most, newest report first


class RunReporter:
    """Reports one run (``report``; ``every`` in a task until its event is set) through the run's async client."""

    def __init__(self, r: Any, keys: Keys, run_id: str, input_path: str | None, output_path: str | None,
                 summary: Summary) -> None:
        self.r, self.keys, self.id, self.summary = r, keys, run_id, summary
        self.base = {"id": run_id, "input": os.path.basename(input_path) if input_path else "-",
                     "output": os.path.basename(output_path) if output_path else "-",
                     "host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}
        self.pace = RecentRate()  # of the lines this run wrote: no rate (nor ETA) until it is measured

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
        """Write the run's report now (best effort: a registry write never fails the run)."""
        now_ms = int(time.time() * 1000)
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.set(self.keys.bulk_run(self.id), json.dumps(self.doc(state)), ex=RUN_TTL_S)
                p.zadd(self.keys.bulk_runs, {self.id: now_ms})
                p.zremrangebyscore(self.keys.bulk_runs, "-inf", now_ms - RUN_TTL_S * 1000)
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


def bulk_runs(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The runs that reported within RUN_TTL_S, newest report first (sync: the dashboard's and status' read)."""
    since = int(time.time() * 1000) - RUN_TTL_S * 1000
    ids = [i.decode() if isinstance(i, bytes) else i
           for i in r.zrevrangebyscore(keys.bulk_runs, "+inf", since, start=0, num=SHOWN)]
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
