"""The demand figure the simulated KEDA scales on (scripts/autoscale_sim.py): the fleet's own
(``batchfleet.producer.ops.demand``, what deploy/k8s/keda.yaml scales on through the gateway's gauge), in
worker-equivalents with the background cap and the interactive utilization of keda.yaml's formula.
``worker_equivalents`` is the one function the simulation's KEDA reads.

The first figures of docs/BENCHMARKS.md section 16 were measured with a stand-in of the same arithmetic written
before ``producer.ops.demand`` was in main (XLEN of every request stream + the running bulk runs' unanswered lines
less the background streams' entries, background capped), which counts this workload identically.
"""

from __future__ import annotations

import redis

from batchfleet.common.keys import Keys
from batchfleet.producer.ops.demand import Demand, read_demand

__all__ = ["Demand", "read_demand", "worker_equivalents"]


def worker_equivalents(r: redis.Redis, keys: Keys, buckets: tuple[int, ...], max_running: int,
                       background_cap: float, interactive_utilization: float = 1.0) -> float:
    return read_demand(r, keys, buckets).worker_equivalents(max_running, background_cap, interactive_utilization)
