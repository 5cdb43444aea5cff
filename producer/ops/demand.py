"""The fleet's demand: the one figure the workers' autoscaler scales on (deploy/k8s/keda.yaml reads it from the
gateway's ``batchfleet_demand_requests`` gauge, gateway/demand_metrics.py; scripts may call it directly).

    read_demand(r: redis.Redis, keys: Keys, buckets: Iterable[int] | None = None) -> Demand
    Demand(interactive: int, background: int, unsent: int)
    Demand.worker_equivalents(max_running: int, background_max_workers: float | None = None,
                              interactive_utilization: float = 1.0) -> float
    Demand.workers(max_running: int, background_max_workers: float | None = None,
                   interactive_utilization: float = 1.0) -> int   (rounded up)

What it counts, read from Redis (sync redis-py; a Redis Cluster client too; Redis errors raise
RedisUnavailable):

- ``interactive``, ``background``: every request not yet answered, per priority: the length (XLEN) of every
  request stream (``request_streams``: every bucket of the fleet description and DEFAULT_BUCKETS, both
  priorities, every shard of a sharded Cluster fleet). A worker deletes an entry only when it writes the
  entry's reply, so a stream's length counts the requests not yet delivered, read ahead by a worker, waiting
  in its batcher or engine, and running.
- ``unsent``: the lines bulk runs (producer/bulk/registry.py) and OpenAI batch jobs (gateway/batches/store.py)
  still have to send: they keep only a window in flight, which the streams already count. Their records give
  each run's and job's lines not yet answered (``total - done``, reported every few seconds); the lines sent
  and not answered are entries of the streams of the run's priority, so per priority ``unsent`` = those lines
  less that priority's stream entries (never below 0). Exact while the runs' windows are the only entries of
  that priority; other traffic of that priority hides as many unsent lines, at most the runs' windows
  (a lower bound, never a double count). A line counts as one request (one with ``n`` > 1 or several
  embedding inputs is several).

``Demand.workers`` is the autoscaler's arithmetic (the same as keda.yaml's ``scalingModifiers`` formula):
ceil((interactive / u + min(background + unsent, cap * max_running)) / max_running) workers
(``worker_equivalents``: the same unrounded, for a simulation that applies the HPA's tolerance itself), the cap
being ``background_max_workers`` (None: no cap) and u ``interactive_utilization`` (keda.yaml's
INTERACTIVE_UTILIZATION: interactive demand asks for 1/u workers' worth, so the fleet keeps spare slots for a
burst while new workers start; 1: none). Interactive demand is never capped; the unsent lines are capped
whatever their priority (a bulk run's backlog is bulk work even when its lines run at interactive priority).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from batchfleet.common.config import DEFAULT_BUCKETS
from batchfleet.common.errors import RedisUnavailable
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import fleet_info, layout, queued_tenants
from batchfleet.common.wire.priority import BACKGROUND, INTERACTIVE, PRIORITIES
from batchfleet.producer.bulk.registry import bulk_runs
from batchfleet.producer.ops.batch_jobs import batch_jobs

READ_MAX = 1000  # running bulk runs and unfinished batch jobs read at most (as gateway/work_metrics.py)


@dataclass(frozen=True)
class Demand:
    """Requests the fleet has to answer: queued or running per priority, and the lines bulk runs and batch
    jobs have not sent yet (module docstring)."""

    interactive: int
    background: int
    unsent: int

    @property
    def capped(self) -> int:
        """The requests an operator's cap applies to: background ones and the lines not sent yet."""
        return self.background + self.unsent

    def worker_equivalents(self, max_running: int, background_max_workers: float | None = None,
                           interactive_utilization: float = 1.0) -> float:
        """Workers of ``max_running`` sequences each that run it all at once, unrounded (KEDA's composed metric
        over its target, before the HPA's tolerance and ceil); background work (``capped``) claims at most
        ``background_max_workers`` of them (None: no cap); interactive work asks for its slots at
        ``interactive_utilization`` (0 < u <= 1: 0.75 asks 4 slots for every 3 interactive requests)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if not 0 < interactive_utilization <= 1:
            raise ValueError(f"interactive_utilization must be in (0, 1], got {interactive_utilization}")
        background = float(self.capped)
        if background_max_workers is not None:
            background = min(background, background_max_workers * max_running)
        return (self.interactive / interactive_utilization + background) / max_running

    def workers(self, max_running: int, background_max_workers: float | None = None,
                interactive_utilization: float = 1.0) -> int:
        """``worker_equivalents`` rounded up: the replicas KEDA asks for (before min/maxReplicaCount). 0 only
        when nothing is asked."""
        return math.ceil(self.worker_equivalents(max_running, background_max_workers, interactive_utilization)
                         - 1e-9)  # 672 / 0.7 is 960.0000000000001: float noise must not ask one worker more


def request_streams(r: redis.Redis, keys: Keys, buckets: Iterable[int] | None = None) -> list[tuple[str, str]]:
    """(stream, priority) of every request stream the fleet may hold work in: the buckets of the fleet
    description, DEFAULT_BUCKETS and ``buckets``, both priorities, every tenant's (``Keys.queued_tenants``, one
    SMEMBERS per shard), on every shard of the fleet's layout. The one list every demand reader counts."""
    info = fleet_info(r, keys)
    every = sorted({*DEFAULT_BUCKETS, *(buckets or ()), *(info.buckets if info is not None else ())})
    return [(stream, priority) for shard in layout(keys, info).every_shard
            for stream, _, priority in shard.streams(every, queued_tenants(r, shard))]


def read_demand(r: redis.Redis, keys: Keys, buckets: Iterable[int] | None = None) -> Demand:
    """The fleet's demand now (module docstring): two pipelined reads of the streams and the work registries.
    ``buckets``: counted beside the fleet's own (a fleet that has published no description yet)."""
    try:
        streams = request_streams(r, keys, buckets)
        pipe = r.pipeline(transaction=False)
        for stream, _ in streams:
            pipe.xlen(stream)
        queued = dict.fromkeys(PRIORITIES, 0)
        for (_, priority), length in zip(streams, pipe.execute()):
            queued[priority] += int(length)
        runs = bulk_runs(r, keys, running=READ_MAX, finished=0)
        jobs = batch_jobs(r, keys, running=READ_MAX, finished=0)
    except redis.RedisError as exc:
        raise RedisUnavailable(f"Redis: {exc}"[:300]) from None
    return Demand(queued[INTERACTIVE], queued[BACKGROUND], unsent(queued, runs, jobs))


def unsent(queued: dict[str, int], runs: Iterable[dict], jobs: Iterable[dict]) -> int:
    """Lines not sent yet (module docstring), from the running bulk runs' reports and the batch jobs' rows
    (producer/ops/batch_jobs.py ``batch_job_row``): per priority, their unanswered lines less what the streams
    of that priority hold."""
    left = dict.fromkeys(PRIORITIES, 0)
    for run in runs:
        if run.get("state") == "running":
            priority = str(run.get("priority")) if run.get("priority") in PRIORITIES else BACKGROUND  # older reports
            left[priority] += max(0, int(run.get("total") or 0) - int(run.get("done") or 0))
    for job in jobs:  # a job cancelling or finalizing sends nothing more; batch jobs run at background priority
        if job.get("status") == "in_progress":
            left[BACKGROUND] += max(0, job["total"] - job["completed"] - job["failed"])
    return sum(max(0, left[p] - queued[p]) for p in PRIORITIES)
