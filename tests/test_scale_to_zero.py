"""Scale from zero (KEDA minReplicaCount 0): with --scale-to-zero the last worker's exit keeps the fleet
description, producers and the gateway keep enqueueing, and a worker started afterwards (as KEDA would on
the streams' lag) answers what waited. Real Redis, real workers, real HTTP."""

from __future__ import annotations

import threading

import httpx
import pytest
import redis

from batchfleet.common.errors import NoWorkers
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import live_workers
from batchfleet.producer import Client
from tests.helpers.gateway import gateways


def test_last_worker_stops_request_waits_next_worker_answers(start_worker, redis_url: str, namespace: str):
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    first = start_worker(scale_to_zero=True)
    assert r.ttl(keys.fleet) == -1, "a fleet that scales to zero publishes its description without a TTL"
    with gateways(redis_url, namespace) as start_gateway:
        gw = start_gateway()
        with httpx.Client(base_url=gw.url, timeout=120) as http, Client(redis_url, namespace) as client:
            assert client.generate("warm up", max_new_tokens=2, timeout=60).completion_tokens == 2
            first.stop()  # the last worker leaves: out of the live set at once, the description stays
            assert len(live_workers(r, keys)) == 0 and r.zscore(keys.workers, first.loop.transport.name) is None
            assert r.exists(keys.fleet) and r.ttl(keys.fleet) == -1
            health = http.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "scaled_to_zero", "redis": True,
                                                                   "workers": 0}
            # zero workers: the default client (require_workers=True) and the gateway both enqueue
            job = client.submit("queued while the fleet sleeps", max_new_tokens=3, timeout=120)
            answer: dict = {}
            body = {"prompt": "hello at zero", "max_tokens": 3, "temperature": 0, "timeout": 120}  # greedy: no EOS
            post = threading.Thread(target=lambda: answer.update(resp=http.post("/v1/completions", json=body)))
            post.start()
            client.fleet()  # the description the producers cached is the kept one
            assert r.xlen(keys.stream(32)) >= 1
            start_worker(scale_to_zero=True)  # what KEDA does when the demand rises above activationTarget
            result = client.result(job, timeout=120)
            post.join(120)
            assert result.completion_tokens == 3 and result.worker != first.loop.transport.name
            resp = answer["resp"]
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
            assert http.get("/health").json()["status"] == "ok"
    r.close()


def test_without_scale_to_zero_the_last_worker_takes_the_fleet_away(start_worker, redis_url: str, namespace: str):
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    w = start_worker()
    assert 0 < r.pttl(keys.fleet)
    w.stop()
    assert not r.exists(keys.fleet) and len(live_workers(r, keys)) == 0
    with Client(redis_url, namespace) as client, pytest.raises(NoWorkers):
        client.submit("nobody serves this", max_new_tokens=2, timeout=10)
    r.close()
