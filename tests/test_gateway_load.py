"""The gateway under load and when clients leave: 200 concurrent streamed requests through one gateway
to one worker (all complete, batches form, the event loop never stalls), and closing an HTTP stream
mid-generation cancels its job (KV blocks freed within a step, batchmates' outputs unchanged)."""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time

import httpx
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import AsyncClient
from batchfleet.worker.transport.cancels import CANCELS_EVERY_S
from tests.helpers.gateway import engine_stats, joined_text, loop_lag, parse_events, stream_events

N_STREAMS = 200


def test_200_concurrent_streams(start_worker, start_gateway, redis_url, namespace):
    start_worker(engine="native", mode="continuous", max_wait_ms=20, kv_cache_gb=0.05)
    gw = start_gateway()
    assert isinstance(gw.gateway.client, AsyncClient)  # the app's only way to Redis (see test_gateway.py)
    health_ms: list[float] = []

    async def scenario() -> list[list]:
        limits = httpx.Limits(max_connections=N_STREAMS + 10, max_keepalive_connections=N_STREAMS + 10)
        async with httpx.AsyncClient(base_url=gw.url, timeout=300, limits=limits) as http:
            async def one(i: int) -> list:
                body = {"prompt": f"Request number {i} says", "max_tokens": 12, "temperature": 0,
                        "stream_options": {"include_usage": True}}
                return await stream_events(http, "/v1/completions", body)

            streams = asyncio.gather(*(one(i) for i in range(N_STREAMS)))
            while not streams.done():  # /health stays fast while every stream is open
                t0 = time.monotonic()
                resp = await http.get("/health")
                assert resp.status_code == 200, resp.text
                health_ms.append((time.monotonic() - t0) * 1000)
                await asyncio.wait([streams], timeout=0.05)
            return streams.result()

    stop = threading.Event()
    lag = asyncio.run_coroutine_threadsafe(loop_lag(stop), gw.loop)
    t0 = time.monotonic()
    results = asyncio.run(scenario())
    elapsed = time.monotonic() - t0
    stop.set()
    worst_lag_s = lag.result(10)

    sizes = []
    for events in results:
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        *_, finish, usage, _ = events
        assert finish["choices"][0]["finish_reason"] in ("stop", "length") and usage["choices"] == []
        assert 1 <= usage["usage"]["completion_tokens"] <= 12 and joined_text(events) is not None
        sizes.append(finish["batchfleet"]["batch_size"])
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    # each record: a batch the worker admitted (ids) and the sequences running with it then (size)
    records = [rec for _, rec in r.xrange(Keys(namespace).batches)]
    logged = [len(rec["ids"].split(",")) for rec in records]
    print(f"\n{N_STREAMS} streams in {elapsed:.1f} s; batch log: {len(logged)} batches of "
          f"{sum(logged) / len(logged):.1f} requests, running with {max(int(rec['size']) for rec in records)} at "
          f"most; result batch_size mean {sum(sizes) / len(sizes):.1f}; /health "
          f"{len(health_ms)} calls, max {max(health_ms):.0f} ms; event loop lag max {worst_lag_s * 1000:.0f} ms")
    assert sum(logged) == N_STREAMS and sum(logged) / len(logged) > 1
    assert sum(sizes) / len(sizes) > 1
    # a synchronous Redis call (or any blocking work) in a handler would stall every stream at once
    # A handler blocking the loop (a synchronous Redis call, a sleep) would stall every stream at once and
    # show here as seconds. The bounds are loose because this process also runs the worker and the 200
    # clients, all sharing one GIL: a burst of 200 arrivals alone takes the loop a few hundred ms, and
    # /health queues for the client's pool behind the submissions. test_gateway.py checks structurally
    # that the gateway holds no synchronous Redis client.
    assert worst_lag_s < 3.0
    assert statistics.median(health_ms) < 750 and max(health_ms) < 8000


def test_closing_a_stream_cancels_its_job(start_worker, start_gateway, redis_url, namespace):
    """A victim with a long prompt (many KV blocks) decodes with three batchmates; closing its HTTP stream
    frees its blocks within a step of the worker's next cancels read (at most CANCELS_EVERY_S after the cancel
    reaches Redis), and the batchmates' greedy outputs equal those of a run where nobody left."""
    from tests.helpers.native import prompt

    # the tiny model decodes a step in about a millisecond: long outputs keep everyone running long enough
    worker = start_worker(engine="native", mode="continuous", max_wait_ms=10, kv_cache_gb=0.05, max_seq_len=4096)
    gw = start_gateway()
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    block = engine_stats(worker)["kv_block_size"]
    mates = [{"prompt": prompt(10 + i, 12), "max_tokens": 400, "temperature": 0} for i in range(3)]
    victim = {"prompt": prompt(99, 200), "max_tokens": 3000, "temperature": 0}
    # the victim holds at least its prompt's blocks; the three batchmates may each take a new one meanwhile
    freed_at_least = math.ceil(200 / block) - len(mates)

    def all_decoding(steps: int) -> int:
        """Wait until the victim and its batchmates have all decoded ``steps`` steps together; KV blocks
        used then. (Engine stats, not streamed text, say when: a random model's bytes are often
        incomplete UTF-8, which the worker rightly holds back.)"""
        deadline, since = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            stats = engine_stats(worker)
            if stats["running"] == len(mates) + 1 and since is None:
                since = stats["steps"]
            if since is not None and stats["steps"] >= since + steps:
                return stats["kv_blocks_used"]
            time.sleep(0.0005)
        raise AssertionError("the four requests never decoded together")

    async def run(cancel: bool) -> tuple[list[str], dict]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as http:
            mate_runs = [asyncio.ensure_future(stream_events(http, "/v1/completions", m)) for m in mates]
            seen: dict = {}
            async with http.stream("POST", "/v1/completions", json={**victim, "stream": True}) as resp:
                job_id = resp.headers["x-request-id"]
                if cancel:  # leaving this block mid-generation closes the victim's connection
                    before = await asyncio.to_thread(all_decoding, 20)
                    watching = asyncio.ensure_future(asyncio.to_thread(watch_release, job_id, before))
                else:
                    events = parse_events([line async for line in resp.aiter_lines()])
                    assert events[-2]["choices"][0]["finish_reason"] == "length", "the victim must run long"
            if cancel:
                seen = await watching
            mates_events = await asyncio.gather(*mate_runs)
        for events in mates_events:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"], events[-3:]
        return [joined_text(e) for e in mates_events], seen

    def watch_release(job_id: str, before: int) -> dict:
        """Engine steps when the cancel appeared in Redis, the last step within CANCELS_EVERY_S after that (a
        worker running only started requests reads the cancels stream that often), and when the victim's
        blocks were freed."""
        deadline = time.monotonic() + 30
        peak, cancel_step, cancel_at, window_step, trace = before, None, 0.0, 0, []
        while time.monotonic() < deadline:
            stats, now = engine_stats(worker), time.monotonic()
            peak = max(peak, stats["kv_blocks_used"])
            trace.append((stats["steps"], stats["kv_blocks_used"], stats["running"]))
            if cancel_step is None and r.exists(keys.cancel(job_id)):
                cancel_step, cancel_at = stats["steps"], now
            if cancel_step is not None and now <= cancel_at + CANCELS_EVERY_S:
                window_step = stats["steps"]
            if cancel_step is not None and stats["running"] == len(mates) and \
                    stats["kv_blocks_used"] <= peak - freed_at_least:
                return {"cancel_step": cancel_step, "window_step": window_step, "freed_step": stats["steps"],
                        "running": stats["running"]}
            time.sleep(0.0005)
        raise AssertionError(f"victim's blocks not freed (cancel seen at step {cancel_step}, peak {peak}): "
                             f"{sorted(set(trace))[-20:]}")

    reference, _ = asyncio.run(run(cancel=False))
    outputs, seen = asyncio.run(run(cancel=True))
    print(f"\ncancel seen at engine step {seen['cancel_step']}, blocks freed by step {seen['freed_step']}, "
          f"{seen['running']} batchmates still running")
    assert seen["running"] >= 1, "the batchmates had finished: the cancel came too late to test anything"
    # the worker's next read of the cancels stream (within CANCELS_EVERY_S), the step under way then, the next:
    # 2 steps as the engine counts them; this thread samples every 0.5 ms beside the worker and the gateway on
    # a shared GIL (a step is ~1 ms), so a few steps' slack; the victim had thousands of steps left
    assert seen["freed_step"] - max(seen["cancel_step"], seen["window_step"]) <= 20, seen
    assert outputs == reference
