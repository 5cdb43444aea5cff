"""Regressions found in review: a real WorkerLoop, ticked by hand, on real Redis with the real native
engine (tiny model): redelivered requests run alone even in continuous mode, and reclaim tells entries
of different buckets apart even when their stream ids are equal."""

from __future__ import annotations

import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.protocol import Request, decode_reply
from batchfleet.worker.compose import build_worker
from batchfleet.worker.requests import Stage
from tests.conftest import worker_config


def enqueue(r: redis.Redis, keys: Keys, bucket: int, job_id: str, prompt: list[int], entry_id: str = "*") -> str:
    req = Request(id=job_id, prompt=prompt, max_new_tokens=6, reply_key=keys.reply(job_id), enqueued_at=time.time())
    return r.xadd(keys.stream(bucket), {"id": job_id, "p": req.encode()}, id=entry_id).decode()


def tick_until(loop, cond, limit: int = 400) -> None:
    for _ in range(limit):
        loop.tick()
        if cond():
            return
    raise AssertionError("condition not reached")


def test_redelivered_request_runs_alone_in_continuous_mode(redis_url, namespace, tiny_model_dir, cache_dir):
    cfg = worker_config(redis_url, namespace, tiny_model_dir, engine="native", mode="continuous",
                        max_wait_ms=5, max_deliveries=3, claim_idle_ms=1000, kv_cache_gb=0.02)
    loop = build_worker(cfg)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    try:
        enqueue(r, keys, 32, "a32", [1, 10, 11])
        tick_until(loop, lambda: r.exists(keys.done("a32")))  # loop.bucket is now 32
        eid = enqueue(r, keys, 64, "suspect", [1] + list(range(10, 50)))  # left by a dead worker, 3rd delivery
        r.xreadgroup(keys.group, "dead-worker", {keys.stream(64): ">"}, count=1)
        r.xclaim(keys.stream(64), keys.group, "dead-worker", 0, [eid], idle=5000, retrycount=2)
        loop.intake.next_reclaim = 0
        tick_until(loop, lambda: loop.requests.stage("suspect") is Stage.RUNNING)
        for i in range(3):  # bucket-32 traffic arrives while the suspect runs
            enqueue(r, keys, 32, f"b{i}", [1, 20 + i])
        tick_until(loop, lambda: all(r.exists(keys.done(j)) for j in ("suspect", "b0", "b1", "b2")))
        records = [f for _, f in r.xrange(keys.batches)]
        solo = [f for f in records if f[b"kind"] == b"solo"]
        assert solo and solo[0][b"ids"] == b"suspect" and solo[0][b"size"] == b"1"
        assert not [f for f in records if f[b"kind"] == b"join"], "nothing may join a request running alone"
        assert type(decode_reply(r.lpop(keys.reply("suspect")))).__name__ == "Result"
    finally:
        loop.stopping.set()
        loop.transport.close()


def test_reclaim_tells_equal_entry_ids_of_two_buckets_apart(redis_url, namespace, tiny_model_dir, cache_dir):
    cfg = worker_config(redis_url, namespace, tiny_model_dir, engine="native", max_wait_ms=float("inf"),
                        max_batch_size=4, claim_idle_ms=1000)
    loop = build_worker(cfg)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    try:
        same = f"{int(time.time() * 1000)}-0"
        enqueue(r, keys, 32, "held", [1, 10], entry_id=same)  # this worker reads and holds it (static batch)
        tick_until(loop, lambda: loop.requests.stage("held") is Stage.QUEUED)
        enqueue(r, keys, 64, "orphan", [1] + list(range(10, 45)), entry_id=same)  # same id, other stream
        r.xreadgroup(keys.group, "dead-worker", {keys.stream(64): ">"}, count=1)
        r.xclaim(keys.stream(64), keys.group, "dead-worker", 0, [same], idle=5000)
        loop.intake.next_reclaim = 0
        # before the fix the orphan was filtered out as "already held" on every reclaim until its
        # delivery count ran out; now it is taken over (a redelivery runs alone) and answered
        tick_until(loop, lambda: r.exists(keys.done("orphan")), limit=200)
        assert loop.counters["reclaimed"] == 1 and loop.counters["dead_lettered"] == 0
        assert type(decode_reply(r.lpop(keys.reply("orphan")))).__name__ == "Result"
        r.incr(keys.flush)  # close the partial static batch holding "held"
        tick_until(loop, lambda: r.exists(keys.done("held")))
    finally:
        loop.stopping.set()
        loop.transport.close()
