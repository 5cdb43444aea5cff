"""Load for the fleet benchmarks (scripts/bench_scale.py): closed-loop and open-loop (Poisson) clients,
spread over several client processes so that the load generator is not what limits a large fleet.

Every process starts sending at the same wall-clock instant (``start_at``) and records one sample per
answered request (when it was sent, when it was answered, its queue wait). Throughput is counted over a
steady window only, ``[start_at + warmup_s, start_at + seconds]``: the first answers of a closed loop come
in one synchronized wave and the last ones straggle, and neither says what the fleet carries.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import secrets
import statistics
import time
from dataclasses import dataclass

from batchfleet.common.keys import Keys
from batchfleet.producer import AsyncClient


@dataclass(frozen=True)
class Load:
    """One load run: ``clients`` back-to-back senders (closed loop) or Poisson arrivals at ``rate``/s."""

    url: str
    namespace: str
    seconds: float
    new_tokens: int
    prompt_len: int
    clients: int = 0  # closed loop when > 0
    rate: float = 0.0  # open loop when > 0
    warmup_s: float = 3.0
    homes: int = 1  # a sharded cluster fleet's shards: each process' client gets its inbox on shard share % homes


def inbox_on(namespace: str, shards: int, shard: int) -> str:
    """A random inbox token whose home shard (common/keys.py ``Keys.home_shard``) is ``shard``: a benchmark's
    client processes spread their inboxes evenly, as many clients do by chance."""
    keys = Keys(namespace, hashtag=True, shards=shards)
    while keys.home_shard(token := secrets.token_urlsafe(24)) != shard:
        pass
    return token


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else (xs or [0.0])[0]


async def _send(load: Load, share: int, of: int, start_at: float) -> dict:
    """This process' part: ``share`` of ``of`` of the clients or of the rate. Samples: (sent, done, queue_ms)."""
    rng = random.Random(1000 + share)
    samples: list[tuple[float, float, float]] = []
    errors = 0
    end = start_at + load.seconds
    inbox = inbox_on(load.namespace, load.homes, share % load.homes) if load.homes > 1 else None
    async with AsyncClient(load.url, load.namespace, max_connections=16, inbox=inbox) as client:
        await client.fleet(timeout=30)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu0 = time.process_time()  # the sending only: not the interpreter's start nor the imports

        async def one() -> None:
            nonlocal errors
            sent = time.time()
            try:
                res = await client.generate([rng.randrange(1, 500) for _ in range(load.prompt_len)],
                                            max_new_tokens=load.new_tokens, timeout=120)
            except Exception:
                errors += 1
                return
            samples.append((sent, time.time(), res.queue_ms))

        async def closed() -> None:
            while time.time() < end:
                await one()

        if load.clients:
            n = load.clients // of + (1 if share < load.clients % of else 0)
            await asyncio.gather(*(closed() for _ in range(n)))
        else:
            tasks, at = [], time.time()
            while at < end:
                at += rng.expovariate(load.rate / of)
                await asyncio.sleep(max(0.0, at - time.time()))
                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)
    return {"samples": samples, "errors": errors, "cpu_s": time.process_time() - cpu0}


def _process(load: Load, share: int, of: int, start_at: float, out: mp.Queue) -> None:
    out.put(asyncio.run(_send(load, share, of, start_at)))


def run(load: Load, processes: int) -> dict:
    """Run ``load`` from ``processes`` client processes; what they saw, counted over the steady window."""
    ctx = mp.get_context("spawn")  # a clean interpreter each: no inherited Redis connections or threads
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 2.0 + 0.2 * processes  # every process connected and waiting by then
    procs = [ctx.Process(target=_process, args=(load, i, processes, start_at, out)) for i in range(processes)]
    for p in procs:
        p.start()
    parts = [out.get(timeout=load.seconds + 300) for _ in procs]
    for p in procs:
        p.join(30)
    samples = [s for part in parts for s in part["samples"]]
    lo, hi = start_at + load.warmup_s, start_at + load.seconds
    steady = [s for s in samples if lo <= s[1] <= hi]  # answered within the window
    queue = [s[2] for s in samples if s[0] >= lo]  # sent within it: past the start-up wave
    e2e = [(s[1] - s[0]) * 1000 for s in samples if s[0] >= lo]
    window = hi - lo
    return {"requests": len(samples), "steady_requests": len(steady), "window_s": window,
            "errors": sum(p["errors"] for p in parts), "rps": len(steady) / window,
            "client_cpu_us_per_req": sum(p["cpu_s"] for p in parts) / max(len(samples), 1) * 1e6,
            "tok_s": len(steady) * load.new_tokens / window, "offered_rps": load.rate or None,
            "queue_p50_ms": pct(queue, 50), "queue_p99_ms": pct(queue, 99),
            "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99)}
