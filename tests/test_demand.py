"""The fleet's demand (producer/ops/demand.py): the autoscaler's arithmetic, what counts as unsent, the gauges
the gateway exports, and a read over real streams and work records (tests/test_keda_signal.py runs it under
KEDA's arithmetic against a live fleet)."""

from __future__ import annotations

import json
import time

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.gateway.demand_metrics import demand_families
from batchfleet.producer.ops.demand import Demand, read_demand, request_streams, unsent


@pytest.mark.unit
def test_workers_sums_both_priorities_and_caps_only_background():
    assert Demand(0, 0, 0).workers(64) == 0
    assert Demand(1, 0, 0).workers(64) == 1
    assert Demand(320, 0, 0).workers(64) == 5
    assert Demand(0, 256, 19_744).workers(64) == 313
    assert Demand(0, 256, 19_744).workers(64, 8) == 8  # background capped
    assert Demand(320, 256, 19_744).workers(64, 8) == 13  # interactive on top, never capped
    assert Demand(320, 0, 0).workers(64, 0) == 5
    assert Demand(96, 64, 0).worker_equivalents(64, 0.5) == 2.0  # unrounded: what the HPA's tolerance compares
    with pytest.raises(ValueError):
        Demand(1, 0, 0).workers(0)


@pytest.mark.unit
def test_interactive_utilization_asks_headroom_for_interactive_demand_only():
    assert Demand(192, 0, 0).workers(64, 8, 0.75) == 4  # 192 requests on 48 of 64 slots a worker
    assert Demand(256, 0, 0).workers(64, 8, 0.8) == 5
    assert Demand(672, 0, 0).workers(64, 8, 0.7) == 15  # exactly 960 slots: no worker more for float noise
    assert Demand(0, 256, 19_744).workers(64, 8, 0.75) == 8  # background: no headroom, capped
    assert Demand(96, 64, 0).worker_equivalents(64, None, 0.75) == 3.0
    assert Demand(0, 0, 0).workers(64, 8, 0.75) == 0
    for u in (0.0, 1.5):
        with pytest.raises(ValueError):
            Demand(1, 0, 0).workers(64, 8, u)


@pytest.mark.unit
def test_unsent_lines_are_the_unanswered_ones_less_what_the_streams_of_their_priority_hold():
    runs = [{"state": "running", "priority": "background", "total": 20_000, "done": 1_000},
            {"state": "running", "priority": "interactive", "total": 100, "done": 0},
            {"state": "finished", "priority": "background", "total": 5, "done": 5},
            {"state": "running", "total": 10, "done": 0}]  # an older report names no priority: background
    jobs = [{"status": "in_progress", "total": 50, "completed": 10, "failed": 5},
            {"status": "cancelling", "total": 500, "completed": 0, "failed": 0}]  # sends nothing more
    queued = {"interactive": 100, "background": 256}
    assert unsent(queued, runs, jobs) == 19_000 + 10 + 35 - 256
    assert unsent({"interactive": 0, "background": 0}, [], []) == 0
    assert unsent({"interactive": 5, "background": 900}, runs[:1], []) == 19_000 - 900  # never below 0 per priority
    assert unsent({"interactive": 500, "background": 0}, runs[1:2], []) == 0


@pytest.mark.unit
def test_the_gauges_carry_background_with_the_unsent_lines():
    (requests, lines) = demand_families(Demand(3, 4, 5))
    assert {s.labels["priority"]: s.value for s in requests.samples} == {"interactive": 3, "background": 9}
    assert [s.value for s in lines.samples] == [5]


def test_read_demand_counts_every_stream_and_the_work_left_to_send(redis_url: str, namespace: str):
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    streams = dict(request_streams(r, keys, (32,)))
    assert keys.stream(32) in streams and keys.stream(4096, "background") in streams
    for stream, n in ((keys.stream(32), 3), (keys.stream(128), 2), (keys.stream(4096, "background"), 4)):
        for _ in range(n):
            r.xadd(stream, {"x": "1"})
    assert read_demand(r, keys, (32,)) == Demand(5, 4, 0)
    now = time.time()
    r.set(keys.bulk_run("run1"), json.dumps({"id": "run1", "state": "running", "priority": "background",
                                             "total": 1000, "done": 100, "updated_at": now}))
    r.zadd(keys.bulk_runs, {"run1": int(now * 1000)})
    doc = {"id": "batch_1", "status": "in_progress", "request_counts": {"total": 40, "completed": 4, "failed": 1}}
    r.hset(keys.openai_batch("batch_1"), "doc", json.dumps(doc))
    r.zadd(keys.openai_batches_due, {"batch_1": now})
    assert read_demand(r, keys, (32,)) == Demand(5, 4, 900 + 35 - 4)
