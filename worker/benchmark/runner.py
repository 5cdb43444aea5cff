"""Run one strategy over the real Redis path (a worker subprocess) or in-process (same loop, MemQueue)."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.options import build_worker_config, option_args
from batchfleet.producer import Client
from batchfleet.worker.benchmark.loadgen import Run, Workload, closed_loop, open_loop, percentile, summarize
from batchfleet.worker.benchmark.memqueue import MemClient, MemQueue
from batchfleet.worker.benchmark.strategies import Strategy
from batchfleet.worker.devtools import delete_namespace, spawn_worker


@dataclass(frozen=True)
class LoadSpec:
    """The load one table row drives: the workload and closed- or open-loop arrivals."""

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


@contextmanager
def serving_redis(url: str, strategy: Strategy, worker_kw: dict, namespace: str | None = None,
                  log_dir: str | None = None) -> Iterator[tuple[Client, Callable[[], None] | None, Callable[[], dict]]]:
    """A worker subprocess with ``worker_kw`` (worker option values) under the strategy, or the fleet already
    serving ``namespace``.

    Yields (client, flush or None, status getter); stops the worker and deletes its keys afterwards.
    """
    attach = namespace is not None
    ns = namespace or f"bench-{strategy.name}-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    worker = None
    if not attach:
        args = option_args({**worker_kw, **strategy.worker_values()})
        log = str(Path(log_dir) / f"worker-{strategy.name}.log") if log_dir else None
        worker = spawn_worker(url, ns, args, log_path=log, wait_s=900)
    r = redis.Redis.from_url(url)

    def status() -> dict:
        """The worker's status from a heartbeat after this call, so the engine's peak KV figures are current
        (while anything changed, heartbeats are at most 2 s apart: worker/loop.py HEARTBEAT_S; after 2.2 s
        nothing changed since the last one, which is returned)."""
        since, last = time.time(), {}
        while True:
            for key in r.scan_iter(match=keys.worker("*")):
                raw = r.get(key)
                if raw:
                    last = msgpack.unpackb(raw, raw=False)
            if last.get("at", 0) > since or time.time() - since > 2.2:
                return last
            time.sleep(0.05)

    try:
        with Client(url, ns) as client:
            yield client, (lambda: r.incr(keys.flush)) if strategy.static else None, status
    finally:
        if worker is not None:
            worker.stop()
            delete_namespace(url, keys.namespace)
        r.close()


@contextmanager
def serving_inproc(strategy: Strategy,
                   worker_kw: dict) -> Iterator[tuple[MemClient, Callable[[], None] | None, Callable[[], dict]]]:
    """The same worker loop and engine in this process, with the in-memory transport instead of Redis."""
    from batchfleet.worker.compose import build_worker

    ns = f"inproc-{uuid.uuid4().hex[:6]}"
    cfg = build_worker_config(**{**worker_kw, **strategy.worker_values(), "namespace": ns})
    if cfg.engine.threads:  # what run_worker does in the subprocess workers, so both paths compute alike
        import torch

        torch.set_num_threads(cfg.engine.threads)
    queue = MemQueue(ns, cfg.batching.buckets)
    loop = build_worker(cfg, transport=queue)  # publishes the fleet info into the queue
    thread = threading.Thread(target=loop.run, daemon=True)
    # Clients and worker share one GIL here: with the default 5 ms switch interval every hand-off
    # between them can cost milliseconds, which would bill Python threading to "no Redis". A short
    # interval makes this baseline as fast as in-process can be.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread.start()
    try:
        yield MemClient(queue), queue.bump_flush if strategy.static else None, loop.status
    finally:
        loop.stopping.set()
        thread.join(120)
        sys.setswitchinterval(interval)


def run_load(serving, strategy: Strategy, spec: LoadSpec, path: str) -> dict:
    """One table row: drive ``spec`` through a ``serving_*`` context."""
    with serving as (client, flush, status):
        run = _drive(client, spec, flush)
        return {**summarize(strategy.name, run), **kv_fields(status()), "path": path}


@dataclass(frozen=True)
class Probe:
    """Sequential lone requests on an idle worker: end-to-end p50, and the queue time (enqueue -> the step
    that started it, the worker's own figure) p50 and max."""

    e2e_p50_ms: float
    queue_p50_ms: float
    queue_max_ms: float


def latency_probe(serving, prompts: list, n: int = 30, new_tokens: int = 1, gap_s: float = 0.0) -> Probe:
    """``n`` sequential single requests (after 3 warm-up ones), ``gap_s`` apart, cycling over ``prompts``.

    Run against a max_wait_ms=0 worker with short prompts and 1 new token, the end-to-end figure is transport
    + one tiny forward; the difference between the Redis and the in-process transport is what the queue adds
    to each request. With the adaptive window, the queue time is how long a lone request waits to start.
    """
    e2e, queue = [], []
    with serving as (client, _flush, _status):
        for i in range(n + 3):
            t0 = time.perf_counter()
            res = client.result(client.submit(prompts[i % len(prompts)], max_new_tokens=new_tokens), timeout=120)
            if i >= 3:  # the first ones warm up
                e2e.append((time.perf_counter() - t0) * 1000)
                queue.append(res.queue_ms)
            if gap_s:
                time.sleep(gap_s)
    return Probe(round(percentile(e2e, 50), 3), round(percentile(queue, 50), 2), round(max(queue), 2))
