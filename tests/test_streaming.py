"""Token streaming and cancellation through a real worker (native engine, continuous mode) and Redis:
deltas join to the non-streamed text and never split a UTF-8 character; a cancelled request leaves the
engine at once (KV blocks freed) and its batchmates' outputs do not change."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchfleet.common.errors import Cancelled
from batchfleet.producer import AsyncClient, Client
from tests.helpers.loops import wait_until
from tests.helpers.streaming import CYCLE_TEXT, make_cycle_model

NATIVE = {"engine": "native", "mode": "continuous", "kv_cache_gb": 0.02, "max_wait_ms": 5}


def test_streamed_deltas_join_to_the_generated_text(start_worker, redis_url, namespace):
    start_worker(stream_interval_ms=0, **NATIVE)
    with Client(redis_url, namespace) as client:
        for params in ({}, {"temperature": 0.8, "seed": 7}):
            full = client.generate("Once upon a time", max_new_tokens=40, **params)
            stream = client.stream("Once upon a time", max_new_tokens=40, **params)
            deltas = list(stream)
            assert "".join(d.text for d in deltas) == full.text == stream.result.text
            assert sum(len(d.token_ids) for d in deltas) == full.completion_tokens
            assert stream.result.token_ids == full.token_ids and stream.result.prompt_tokens == full.prompt_tokens


def test_multibyte_characters_never_split_at_a_delta_boundary(start_worker, redis_url, namespace, cache_dir):
    model = make_cycle_model(cache_dir / "cycle-model")
    w = start_worker(model_dir=model, stream_interval_ms=0, **NATIVE)
    n_bytes = len(CYCLE_TEXT.encode())
    with Client(redis_url, namespace) as client:
        full = client.generate(CYCLE_TEXT[0], max_new_tokens=3 * n_bytes)
        assert full.text == (CYCLE_TEXT[1:] + CYCLE_TEXT * 3)[: len(full.text)] and "é日ж€" in full.text

        async def collect() -> list[str]:
            async with AsyncClient(redis_url, namespace) as aclient:
                return [d.text async for d in aclient.stream(CYCLE_TEXT[0], max_new_tokens=3 * n_bytes)]

        texts = asyncio.run(collect())
    assert "".join(texts) == full.text
    assert len(texts) > 6, "stream_interval_ms=0: a delta per step with text"
    assert all("\ufffd" not in t for t in texts)
    # one step = one token = one byte: a delta per step would cut characters if text were not held back
    assert w.loop.ledger["deltas"] >= len(texts) - 1


def test_cancel_running_frees_kv_at_once_batchmates_unchanged(start_worker, redis_url, namespace):
    w = start_worker(**NATIVE)
    engine = w.loop.engine
    seen: list[int] = []  # engine steps done when the worker read the cancel
    freed: list[tuple[int, int, int]] = []  # (steps done, KV blocks before, after) at the abort
    real_cancels, real_abort = w.loop.transport.cancel_watch.cancels, engine.abort

    def cancels(waiting: bool = False):
        out = real_cancels(waiting)
        if out:
            seen.append(engine.stats()["steps"])
        return out

    def abort(ids):
        before = engine.stats()["kv_blocks_used"]
        found = real_abort(ids)
        freed.append((engine.stats()["steps"], before, engine.stats()["kv_blocks_used"]))
        return found

    w.loop.transport.cancel_watch.cancels, engine.abort = cancels, abort
    prompts = [f"batchmate {i}" for i in range(3)]
    with Client(redis_url, namespace) as client:
        alone = [client.generate(p, max_new_tokens=24) for p in prompts]
        victim = client.submit("a long one", max_new_tokens=400)
        mates = [client.submit(p, max_new_tokens=24) for p in prompts]
        wait_until(lambda: engine.stats()["decode_steps"] > 0 and w.loop.requests.stage(victim) is not None
                   and w.loop.requests.stage(victim).value == "running", 30, "the victim running")
        client.cancel(victim)
        with pytest.raises(Cancelled):
            client.result(victim, timeout=30)
        # it left in the tick that read the cancel, before the next engine step, and its blocks went with it
        assert len(seen) == 1 and len(freed) == 1 and freed[0][0] == seen[0] and freed[0][2] < freed[0][1]
        assert victim not in {s.id for s in engine.scheduler.running}
        assert [client.result(j, timeout=30).token_ids for j in mates] == [r.token_ids for r in alone]
    assert w.loop.ledger["cancelled"] == 1
    wait_until(lambda: w.loop.engine.stats()["kv_blocks_used"] == 0, 10, "every block freed")


def test_cancel_before_it_runs_and_closing_a_stream(start_worker, redis_url, namespace):
    w = start_worker(**NATIVE)
    with Client(redis_url, namespace) as client:
        w.loop.stopping.set()  # nobody reads: the job stays queued in Redis
        time.sleep(0.5)
    w.thread.join(10)
    with Client(redis_url, namespace, require_workers=False) as client:
        job = client.submit("never runs", max_new_tokens=8)
        client.cancel(job)
        w2 = start_worker(**NATIVE)
        with pytest.raises(Cancelled):
            client.result(job, timeout=30)
        assert w2.loop.ledger["cancelled"] == 1 and w2.loop.ledger["completed"] == 0
        stream = client.stream("closing early", max_new_tokens=400)
        first = next(iter(stream))
        assert first.text or first.token_ids
        stream.close()  # cancels the job
        wait_until(lambda: w2.loop.ledger["cancelled"] == 2, 30, "the stream's job cancelled")
        assert client.generate("still fine", max_new_tokens=3).completion_tokens == 3
