"""The work the fleet runs, as Prometheus gauges on the gateway's ``--metrics-port``: OpenAI batch jobs
(``/v1/batches``) and bulk runs (``batchfleet bulk``, the RQ ``bulk`` job), read from Redis at scrape time:

    batchfleet_batch_jobs{status}                    batch jobs by OpenAI status
    batchfleet_batch_job_requests{priority, state}   requests of unfinished batch jobs: completed, failed, remaining
    batchfleet_bulk_runs{state}                      bulk runs by state: running, finished, stopped
    batchfleet_bulk_run_lines{priority, state}       lines of running bulk runs: completed, failed, remaining

The same records the dashboard and ``batchfleet status`` read (producer/ops/batch_jobs.py, the bulk-run
registry producer/bulk/registry.py), so one scrape of any gateway sees the work of the whole fleet, whichever
gateway, batch runner or host runs it: in PromQL use ``max`` across gateways, not ``sum``. The ended states
count the ended jobs and runs the registries keep (the last 20 of each); the unfinished ones are all counted
(up to READ_MAX). Every status and state is exported from the start, at 0. Like the queue gauges
(common/metrics.py), the reads use a small pool of their own with a short timeout (gateway/connections.py
``metrics_client``), and a scrape still answers without these gauges when Redis does not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from batchfleet.common.wire.priority import BACKGROUND, PRIORITIES
from batchfleet.gateway.batches.store import FINISHED_KEPT
from batchfleet.gateway.scraped import ScrapedCollector
from batchfleet.producer.bulk.registry import ENDED
from batchfleet.producer.bulk.registry import FINISHED_KEPT as RUNS_KEPT
from batchfleet.producer.ops.batch_jobs import TERMINAL
from batchfleet.producer.ops.status import read_work

READ_MAX = 1000  # unfinished batch jobs and running bulk runs read per scrape at most (one pipelined read each)
# OpenAI's batch statuses, in a job's order (``cancelling``: a cancel was asked, the job has not ended yet)
BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
                  "cancelled")
KEPT = max(FINISHED_KEPT, RUNS_KEPT)  # ended jobs and runs: all the registries keep (20 each)
RUN_STATES = ("running", *ENDED)
LINE_STATES = ("completed", "failed", "remaining")


def work_families(jobs: Iterable[dict[str, Any]], runs: Iterable[dict[str, Any]]) -> list[GaugeMetricFamily]:
    """The four gauges from the rows of ``batch_jobs`` and ``bulk_runs`` (pure)."""
    jobs, runs = list(jobs), list(runs)
    by_status = _counted("batchfleet_batch_jobs", "OpenAI batch jobs (/v1/batches) by status: every unfinished "
                         "one; of the ended ones, those the gateway keeps (the last 20).", "status", BATCH_STATUSES,
                         (j["status"] for j in jobs))
    requests = _lines("batchfleet_batch_job_requests", "Requests of the unfinished OpenAI batch jobs, by state: "
                      "completed, failed, remaining (not answered yet). Batch jobs run at background priority.")
    counts = Counter()
    for j in jobs:
        if j["status"] not in TERMINAL:
            counts["completed"] += j["completed"]
            counts["failed"] += j["failed"]
            counts["remaining"] += max(0, j["total"] - j["completed"] - j["failed"])
    for state in LINE_STATES:
        for priority in PRIORITIES:
            requests.add_metric([priority, state], counts[state] if priority == BACKGROUND else 0)
    by_state = _counted("batchfleet_bulk_runs", "Bulk runs (batchfleet bulk) by state: running (reported within "
                        "5 minutes); of the finished and stopped ones, those kept (the last 20).", "state", RUN_STATES,
                        (b.get("state") for b in runs))
    lines = _lines("batchfleet_bulk_run_lines", "Lines of the running bulk runs, by state: completed, failed, "
                   "remaining (not answered yet); priority: each run's (its lines' default).")
    per = Counter()
    for b in runs:
        if b.get("state") == "running":
            priority = b.get("priority") if b.get("priority") in PRIORITIES else BACKGROUND  # older reports
            done, failed, total = int(b.get("done") or 0), int(b.get("failed") or 0), int(b.get("total") or 0)
            per[priority, "completed"] += max(0, done - failed)
            per[priority, "failed"] += failed
            per[priority, "remaining"] += max(0, total - done)
    for state in LINE_STATES:
        for priority in PRIORITIES:
            lines.add_metric([priority, state], per[priority, state])
    return [by_status, requests, by_state, lines]


def _counted(name: str, doc: str, label: str, values: Iterable[str], seen: Iterable[Any]) -> GaugeMetricFamily:
    """A gauge of how many of ``seen`` have each of ``values`` (every value exported, 0 when none)."""
    counts = Counter({v: 0 for v in values})
    counts.update(v for v in seen if v in counts)
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value, n in counts.items():
        family.add_metric([value], n)
    return family


def _lines(name: str, doc: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=["priority", "state"])


class WorkCollector(ScrapedCollector):
    """The gauges of ``work_families``, read from Redis per scrape (batch jobs and bulk runs of ``conn``'s
    namespace)."""

    what = "work gauges"

    def read(self) -> list[GaugeMetricFamily]:
        work = read_work(self.r, self.keys, READ_MAX, KEPT)
        return work_families(work["batch_jobs"], work["bulk_runs"])
