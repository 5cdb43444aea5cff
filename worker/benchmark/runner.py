"""Run one strategy over the real Redis path (a worker subprocess) or in-process (same loop, MemQueue)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis

from common.keys import Keys
from producer import Client
from worker.benchmark.loadgen import Run, Workload, closed_loop, open_loop, percentile, summarize
from worker.benchmark.memqueue import MemClient, MemQueue
from worker.benchmark.strategies import Strategy
from worker.cli import build_worker_config
from worker.spawn import delete_namespace, spawn_worker


@dataclass(frozen=True)
class LoadSpec:
    workload: Workload
    clients: int = 32
    rate: float | None = None  # requests/s: open loop; None: closed loop with `clients`
    seed: int = 0


def _drive(client, spec: LoadSpec, flush) -> Run:
    # warm-up: one request per prompt length class, so lazy init/compilation is not timed
    for i in range(min(3, len(spec.workload))):
        job = client.submit(spec.workload.prompts[i], max_new_tokens=2)
        if flush is not None:
            flush()  # a lone warm-up request never fills a static batch
        client.result(job, timeout=600)
    if spec.rate is None:
        return closed_loop(client, spec.workload, spec.clients, flush=flush)
    return open_loop(client, spec.workload, spec.rate, seed=spec.seed, flush=flush)


def kv_fields(status: dict) -> dict:
    """KV accounting reported by the engine's stats (native engine), for the table."""
    out = {}
    if "engine_kv_slots_wasted_peak" in status:
        out["kv_waste_peak_slots"] = status["engine_kv_slots_wasted_peak"]
        out["kv_waste_contiguous_peak_slots"] = status.get("engine_kv_slots_wasted_contiguous_peak")
        out["kv_blocks_peak"] = status.get("engine_kv_blocks_peak")
    return out


def run_redis(url: str, strategy: Strategy, engine_kw: dict, cache_dir: str, spec: LoadSpec,
              namespace: str | None = None, log_dir: str | None = None, probe_n: int = 0) -> dict:
    """Start a worker subprocess for the strategy, drive the load through producer.Client, stop it."""
    from worker.cli import engine_args

    attach = namespace is not None
    ns = namespace or f"bench-{strategy.name}-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    worker = None
    if not attach:
        args = ["--cache-dir", cache_dir, *engine_args(engine_kw), *strategy.worker_args()]
        log = str(Path(log_dir) / f"worker-{strategy.name}.log") if log_dir else None
        worker = spawn_worker(url, ns, args, log_path=log, wait_s=900)
    r = redis.Redis.from_url(url)
    try:
        with Client(url, ns) as client:
            run = _drive(client, spec, (lambda: r.incr(keys.flush)) if strategy.static else None)
            probe = latency_probe(client, spec.workload, probe_n) if probe_n else []
        time.sleep(2.2)  # one more heartbeat, so the engine's peak KV figures are current
        status = {}
        for key in r.scan_iter(match=keys.worker("*")):
            raw = r.get(key)
            if raw:
                status = msgpack.unpackb(raw, raw=False)
        return {**summarize(strategy.name, run), **kv_fields(status), **_probe_fields(probe), "path": "redis"}
    finally:
        if worker is not None:
            worker.stop()
            delete_namespace(url, keys)
        r.close()


def run_inproc(strategy: Strategy, engine_kw: dict, cache_dir: str, spec: LoadSpec, probe_n: int = 0) -> dict:
    """The same worker loop and engine in this process, with the in-memory transport instead of Redis."""
    from worker.main import build_loop

    ns = f"inproc-{uuid.uuid4().hex[:6]}"
    kw = {**engine_kw, "max_wait_ms": strategy.max_wait_ms, "max_batch_size": strategy.max_batch_size,
          "mode": strategy.mode}
    cfg = build_worker_config(redis_url="redis://unused:0/0", namespace=ns, **kw)
    queue = MemQueue(ns, cfg.batching.buckets)
    loop = build_loop(cfg, cache_dir, consumer=queue)  # publishes the fleet info into the queue
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        client = MemClient(queue)
        run = _drive(client, spec, queue.bump_flush if strategy.static else None)
        probe = latency_probe(client, spec.workload, probe_n) if probe_n else []
        return {**summarize(strategy.name, run), **kv_fields(loop.status()), **_probe_fields(probe),
                "path": "in-process"}
    finally:
        loop.stopping.set()
        thread.join(120)


def _probe_fields(probe: list[float]) -> dict:
    return {"probe_e2e_p50_ms": round(percentile(probe, 50), 3)} if probe else {}


def latency_probe(client, workload: Workload, n: int = 20) -> list[float]:
    """Sequential single requests (1 new token): end-to-end ms each; isolates per-request transport cost."""
    out = []
    for i in range(n):
        prompt = workload.prompts[i % len(workload)][:32]
        t0 = time.perf_counter()
        client.result(client.submit(prompt, max_new_tokens=1), timeout=120)
        out.append((time.perf_counter() - t0) * 1000)
    return out
