"""Regressions found in review: a real WorkerLoop, ticked by hand, on real Redis with the real native
engine (tiny model): redelivered requests run alone even in continuous mode, and reclaim tells entries
of different buckets apart even when their stream ids are equal."""

from __future__ import annotations

import time

import redis

from batchfleet.common.keys import Keys
from batchfleet.worker.compose import build_worker
from batchfleet.worker.requests.table import Stage
from tests.conftest import worker_config
from tests.helpers.loops import inbox_replies, raw_inbox, reply_of, request_fields, wait_until


def enqueue(r: redis.Redis, keys: Keys, bucket: int, job_id: str, prompt: list[int], entry_id: str = "*",
            max_new_tokens: int = 6) -> str:
    fields = request_fields(keys, job_id, prompt, max_new_tokens=max_new_tokens)
    return r.xadd(keys.stream(bucket), fields, id=entry_id).decode()


def answered_with_result(r: redis.Redis, keys: Keys, job_id: str) -> bool:
    return type(reply_of(r, keys, job_id)).__name__ == "Result"


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
        tick_until(loop, lambda: r.exists(keys.done("a32", raw_inbox(keys))))  # loop.bucket is now 32
        eid = enqueue(r, keys, 64, "suspect", [1] + list(range(10, 50)))  # left by a dead worker, 3rd delivery
        r.xreadgroup(keys.group, "dead-worker", {keys.stream(64): ">"}, count=1)
        r.xclaim(keys.stream(64), keys.group, "dead-worker", 0, [eid], idle=5000, retrycount=2)
        loop.intake.next_reclaim = 0
        tick_until(loop, lambda: loop.requests.stage("suspect") is Stage.RUNNING)
        for i in range(3):  # bucket-32 traffic arrives while the suspect runs
            enqueue(r, keys, 32, f"b{i}", [1, 20 + i])
        tick_until(loop, lambda: all(r.exists(keys.done(j, raw_inbox(keys))) for j in ("suspect", "b0", "b1", "b2")))
        records = [f for _, f in r.xrange(keys.batches)]
        solo = [f for f in records if f[b"kind"] == b"solo"]
        assert solo and solo[0][b"ids"] == b"suspect" and solo[0][b"size"] == b"1"
        assert not [f for f in records if f[b"kind"] == b"join"], "nothing may join a request running alone"
        steps = [{i for i, _ in step} for _, step in loop.engine.step_log]
        assert all(ids == {"suspect"} for ids in steps if "suspect" in ids), "a step shared the suspect's"
        assert answered_with_result(r, keys, "suspect")
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
        tick_until(loop, lambda: r.exists(keys.done("orphan", raw_inbox(keys))), limit=200)
        assert loop.ledger["reclaimed"] == 1 and loop.ledger["dead_lettered"] == 0
        assert answered_with_result(r, keys, "orphan")
        r.incr(keys.flush)  # close the partial static batch holding "held"
        tick_until(loop, lambda: r.exists(keys.done("held", raw_inbox(keys))))
    finally:
        loop.stopping.set()
        loop.transport.close()


def test_failed_prefill_step_costs_only_its_requests_in_continuous_mode(redis_url, namespace, tiny_model_dir,
                                                                         cache_dir):
    """A prefill step that raises while another bucket's request decodes: the engine is reset, the
    step's request runs alone next, the bystander goes back to the batcher (not alone), both answered."""
    cfg = worker_config(redis_url, namespace, tiny_model_dir, engine="native", mode="continuous",
                        max_wait_ms=5, kv_cache_gb=0.02)
    loop = build_worker(cfg)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    real_run, raised = loop.engine.runner.run, []

    def flaky(batch):
        if batch.is_prefill and any(s.id == "poison" for s in batch.seqs) and not raised:
            raised.append(True)
            raise RuntimeError("simulated prefill failure")
        return real_run(batch)

    loop.engine.runner.run = flaky
    try:
        enqueue(r, keys, 32, "long", [1, 10, 11], max_new_tokens=200)
        tick_until(loop, lambda: loop.engine.stats()["decode_steps"] > 0)
        enqueue(r, keys, 64, "poison", [1] + list(range(10, 50)))
        tick_until(loop, lambda: bool(raised))
        assert loop.requests.stage("poison") in (Stage.SOLO, Stage.RUNNING)
        assert loop.requests.stage("long") in (Stage.QUEUED, Stage.RUNNING)  # requeued, not made to run alone
        assert loop.engine.stats()["kv_blocks_used"] == 0 or loop.requests.stage("poison") is Stage.RUNNING
        tick_until(loop, lambda: all(r.exists(keys.done(j, raw_inbox(keys))) for j in ("long", "poison")), limit=2000)
        for job in ("long", "poison"):
            assert answered_with_result(r, keys, job)
        assert loop.ledger["internal_errors"] == 0
    finally:
        loop.stopping.set()
        loop.transport.close()


def test_a_copy_of_an_answered_job_is_acked_without_running(start_worker, redis_url, namespace):
    """A re-enqueued job (a resumed bulk run, a retried submit) whose answer exists is not computed again."""
    w = start_worker(max_wait_ms=5)
    keys, r = Keys(namespace), redis.Redis.from_url(redis_url)
    enqueue(r, keys, 32, "twice", [1, 10, 11])
    wait_until(lambda: r.exists(keys.done("twice", raw_inbox(keys))), 30, "the first copy answered")
    batches = w.loop.ledger["batches"]
    enqueue(r, keys, 32, "twice", [1, 10, 11])
    wait_until(lambda: w.loop.ledger["duplicates"] == 1, 30, "the copy acked")
    assert w.loop.ledger["batches"] == batches and r.xlen(keys.stream(32)) == 0
    assert len(inbox_replies(r, keys)["twice"]) == 1
