"""Load generation: identical request sets, closed-loop or open-loop (Poisson), and per-request samples.

Works against any client with ``submit(prompt_ids, max_new_tokens=) -> job`` and
``result(job, timeout=) -> Result``: the Redis ``producer.Client`` or the in-process ``MemClient``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from batchfleet.common.wire.protocol import Result


@dataclass(frozen=True)
class Workload:
    """The same requests for every strategy and engine: token-id prompts and their max_new_tokens."""

    prompts: list[list[int]]
    max_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)


def make_workload(n: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int], seed: int = 0,
                  token_range: tuple[int, int] = (4, 259)) -> Workload:
    """n prompts with lengths uniform in prompt_len and max_new_tokens uniform in new_tokens (inclusive)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*token_range) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*new_tokens) for _ in range(n)])


@dataclass(frozen=True)
class Sample:
    """One finished request as the user saw it."""

    completion_tokens: int
    ttft_ms: float  # from submission (the result's clock starts at enqueue, which is the submit call)
    e2e_ms: float  # client-measured: submit call -> result in hand
    batch_size: int
    worker_total_ms: float
    queue_ms: float = 0.0  # enqueue -> its prefill started (the batching window and any backlog)


@dataclass
class Run:
    samples: list[Sample]
    wall_s: float
    errors: int


def _sample(res: Result, t_submit: float) -> Sample:
    return Sample(res.completion_tokens, res.ttft_ms, (time.time() - t_submit) * 1000, res.batch_size, res.total_ms,
                  res.queue_ms)


class _Flusher:
    """Once every request is submitted, bump the flush counter until the run ends (static batching)."""

    def __init__(self, flush: Callable[[], None] | None) -> None:
        self.flush = flush
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.flush is None or self.thread is not None:
            return

        def bump() -> None:
            while not self.done.wait(0.1):
                self.flush()

        self.flush()
        self.thread = threading.Thread(target=bump, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()


def closed_loop(client, load: Workload, clients: int, flush: Callable[[], None] | None = None,
                timeout_s: float = 600.0) -> Run:
    """``clients`` threads; each sends its next request when its last one was answered."""
    next_index = iter(range(len(load)))
    lock = threading.Lock()
    submitted = [0]
    samples: list[Sample] = []
    errors = [0]
    flusher = _Flusher(flush)

    def client_thread() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            t0 = time.time()
            try:
                job = client.submit(load.prompts[i], max_new_tokens=load.max_new_tokens[i])
                with lock:
                    submitted[0] += 1
                    if submitted[0] == len(load):
                        flusher.start()
                res = client.result(job, timeout=timeout_s)
                with lock:
                    samples.append(_sample(res, t0))
            except Exception:  # counted, not fatal: a benchmark reports failures
                with lock:
                    errors[0] += 1

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flusher.stop()
    return Run(samples, time.perf_counter() - t_start, errors[0])


def open_loop(client, load: Workload, rate: float, seed: int = 0, flush: Callable[[], None] | None = None,
              timeout_s: float = 600.0) -> Run:
    """Poisson arrivals at ``rate`` requests/s, whatever the fleet's speed (the wait/size trade-off shows here)."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    errors = [0]
    lock = threading.Lock()
    flusher = _Flusher(flush)

    def wait(job: str, t0: float) -> None:
        try:
            res = client.result(job, timeout=timeout_s)
            with lock:
                samples.append(_sample(res, t0))
        except Exception:
            with lock:
                errors[0] += 1

    t_start = time.perf_counter()
    next_at = t_start
    with ThreadPoolExecutor(max_workers=min(512, len(load))) as pool:
        for i in range(len(load)):
            next_at += rng.expovariate(rate)
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            t0 = time.time()
            try:
                job = client.submit(load.prompts[i], max_new_tokens=load.max_new_tokens[i])
            except Exception:
                errors[0] += 1
                continue
            pool.submit(wait, job, t0)
        flusher.start()
    flusher.stop()
    return Run(samples, time.perf_counter() - t_start, errors[0])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(name: str, run: Run) -> dict:
    """One table row: the JSON object for a strategy."""
    s = run.samples
    tokens = sum(x.completion_tokens for x in s)
    return {
        "strategy": name,
        "requests": len(s),
        "errors": run.errors,
        "output_tokens": tokens,
        "wall_s": round(run.wall_s, 3),
        "throughput_tok_s": round(tokens / run.wall_s, 2) if run.wall_s > 0 else 0.0,
        "ttft_p50_ms": round(percentile([x.ttft_ms for x in s], 50), 1),
        "ttft_p99_ms": round(percentile([x.ttft_ms for x in s], 99), 1),
        "e2e_p50_ms": round(percentile([x.e2e_ms for x in s], 50), 1),
        "e2e_p99_ms": round(percentile([x.e2e_ms for x in s], 99), 1),
        "queue_p50_ms": round(percentile([x.queue_ms for x in s], 50), 2),
        "queue_p99_ms": round(percentile([x.queue_ms for x in s], 99), 2),
        "mean_batch_size": round(sum(x.batch_size for x in s) / len(s), 2) if s else 0.0,
    }
