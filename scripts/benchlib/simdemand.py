"""The demand figure the simulated KEDA scales on (scripts/autoscale_sim.py), read from Redis.

A stand-in for ``batchfleet.producer.ops.demand.read_demand`` (issue 56 item 1) until it is in main: every
request not yet answered (the length of every request stream: a worker deletes an entry when it writes its reply,
deploy/k8s/keda.yaml) plus the lines running bulk runs still have to send (their registry reports, less what is
already in the background streams). ``worker_equivalents`` is the one function the simulation calls: point it at
``read_demand`` when that exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.priority import INTERACTIVE
from batchfleet.producer.bulk.registry import bulk_runs


@dataclass(frozen=True)
class Demand:
    interactive: int  # unanswered interactive requests
    background: int  # unanswered background requests (a bulk run's window among them)
    unsent: int  # lines bulk runs have not sent yet

    def worker_equivalents(self, max_running: int, background_cap: float) -> float:
        """Workers that would run all of it at once; background work alone claims at most ``background_cap``."""
        return self.interactive / max_running + min((self.background + self.unsent) / max_running, background_cap)


def read_demand(r: redis.Redis, keys: Keys, buckets: tuple[int, ...]) -> Demand:
    streams = keys.streams(buckets)
    with r.pipeline(transaction=False) as p:
        for name, _, _ in streams:
            p.xlen(name)
        lengths = p.execute()
    interactive = sum(n for n, (_, _, prio) in zip(lengths, streams) if prio == INTERACTIVE)
    background = sum(lengths) - interactive
    remaining = sum(max(0, int(run.get("total", 0)) - int(run.get("done", 0)))
                    for run in bulk_runs(r, keys, finished=0) if run.get("state") == "running")
    return Demand(interactive, background, max(0, remaining - background))


def worker_equivalents(r: redis.Redis, keys: Keys, buckets: tuple[int, ...], max_running: int,
                       background_cap: float) -> float:
    return read_demand(r, keys, buckets).worker_equivalents(max_running, background_cap)
