"""Operator mistakes are detected (issue #12, points 6a, 6b, 7) with real workers and the tiny model:

- a worker whose fingerprint (model, tokenizer, buckets, ...) differs from the live fleet's refuses to
  start with one clear line, unless ``--replace-fleet``;
- a clean stop of the last live worker deletes the fleet description, so a producer then gets
  ``FleetUnavailable`` / ``NoWorkers`` instead of enqueueing into streams nobody reads;
- a worker stopping while Redis is down does not log "redis available again".
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import redis

from batchfleet.common.errors import FleetUnavailable
from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.producer import Client
from batchfleet.worker.devtools import PrivateRedis, free_port
from batchfleet.worker.transport.fleet import FLEET_TTL_MS, FleetConflict
from tests.conftest import worker_config
from tests.helpers.loops import LoopThread, wait_until


def test_a_worker_with_other_buckets_refuses_to_join_a_live_fleet_unless_replacing(
        start_worker, redis_url, namespace, tiny_model_dir, cache_dir):
    from batchfleet.worker.compose import build_worker

    a = start_worker()  # the test buckets 32,64,128,256
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    published = FleetInfo.decode(r.get(keys.fleet))
    assert published.fingerprint and 0 < r.pttl(keys.fleet) <= FLEET_TTL_MS
    with pytest.raises(FleetConflict, match="--replace-fleet"):
        build_worker(worker_config(redis_url, namespace, tiny_model_dir, buckets=(32, 64), name="other"))
    # the command line: one clear line, no traceback, non-zero exit
    cmd = [sys.executable, "-m", "batchfleet.worker", "--redis-url", redis_url, "--namespace", namespace,
           "--model", str(tiny_model_dir), "--cache-dir", str(cache_dir), "--engine", "hf", "--mode", "dynamic",
           "--dtype", "float32", "--max-seq-len", "512", "--buckets", "32,64", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "refusing to join" in line]
    assert done.returncode != 0 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "buckets 32,64,128,256" in errors[0] and "buckets 32,64," in errors[0]
    assert FleetInfo.decode(r.get(keys.fleet)).fingerprint == published.fingerprint  # untouched
    same = start_worker(max_batch_size=4)  # same model/tokenizer/buckets, other tuning: joins
    b = start_worker(buckets=(32, 64), replace_fleet=True)  # the operator replaces the fleet
    assert FleetInfo.decode(r.get(keys.fleet)).buckets == (32, 64)
    for w in (a, same, b):
        w.stop()


def test_last_worker_stopping_deletes_the_fleet_and_producers_get_no_workers(
        start_worker, redis_url, namespace):
    keys = Keys(namespace)
    r = redis.Redis.from_url(redis_url)
    a, b = start_worker(), start_worker()
    with Client(redis_url, namespace) as client:
        assert client.generate([5, 6], max_new_tokens=2, timeout=30).completion_tokens == 2
    a.stop()
    assert r.exists(keys.fleet)  # b is live
    b.stop()
    assert not r.exists(keys.fleet) and r.zcard(keys.workers) == 0
    # the mistake of the issue: a worker with other buckets started and stopped
    c = start_worker(buckets=(32, 64))
    assert FleetInfo.decode(r.get(keys.fleet)).buckets == (32, 64)
    c.stop()
    assert not r.exists(keys.fleet)
    t0 = time.monotonic()
    with Client(redis_url, namespace) as client, pytest.raises(FleetUnavailable):
        client.generate([5, 6], max_new_tokens=2, timeout=10)
    assert time.monotonic() - t0 < 10
    assert all(r.xlen(keys.stream(b)) == 0 for b in (32, 64, 128, 256))  # nothing stranded


def test_no_redis_available_again_line_while_stopping_with_redis_down(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO)
    server = PrivateRedis(port=free_port()).start()
    try:
        t = LoopThread(worker_config(server.url, "down", tiny_model_dir, max_wait_ms=5, name="w-down"))
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: r.exists(Keys("down").worker("w-down")), 30, "first heartbeat")
        server.kill()
        wait_until(lambda: any("unavailable" in rec.getMessage() for rec in caplog.records), 30, "outage noticed")
        t.stop()
    finally:
        server.stop()
    lines = [rec.getMessage() for rec in caplog.records if rec.name.startswith("batchfleet")]
    assert not [m for m in lines if "available again" in m], lines


def test_a_producer_clock_60s_behind_does_not_expire_requests(redis_url, namespace, tiny_model_dir, cache_dir,
                                                               tmp_path, monkeypatch):
    from batchfleet.worker.devtools import spawn_worker

    w = spawn_worker(redis_url, namespace, ["--model", str(tiny_model_dir), "--cache-dir", str(cache_dir),
                                            "--engine", "hf", "--mode", "dynamic", "--dtype", "float32",
                                            "--max-seq-len", "512", "--buckets", "32,64", "--threads", "1"],
                     log_path=str(tmp_path / "worker.log"))
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 60)  # this process (the producer) runs 60 s behind
        with Client(redis_url, namespace) as client:
            results = [client.generate([5 + i, 6], max_new_tokens=2, timeout=30) for i in range(5)]
        assert [res.completion_tokens for res in results] == [2] * 5
        assert all(0 <= res.queue_ms < 30_000 for res in results)  # measured on the worker's clock
    finally:
        monkeypatch.undo()
        w.stop()


def test_a_deleted_fleet_description_is_published_again(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    r.delete(keys.fleet)
    wait_until(lambda: r.exists(keys.fleet), 10, "the fleet description re-published by a heartbeat")
    assert 0 < r.ttl(keys.fleet) <= 90
