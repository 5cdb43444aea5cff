"""A decode step against its floor, measured in one run on this machine.

floor = max(time of the step's weight matmuls alone, (weight bytes + KV bytes the step reads) / bandwidth),
with the bandwidth measured here by streaming a 1 GiB tensor (read-only sum, and copy). The step is
timed on the real engine at ``batch`` sequences of ``context`` tokens each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.native.engine import NativeEngine


def time_ms(fn: Callable[[], object], reps: int = 30) -> float:
    """Median ms of ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def matmul_ms(engine: NativeEngine, batch: int, reps: int = 10) -> float:
    """The weight matmuls of one decode step at ``batch`` rows, alone (same weights, same dtype)."""
    m = engine.runner.model
    x = torch.randn(batch, 1, m.hidden, dtype=m.dtype)
    inter = m.layers[0].down.shape[1]
    xo = torch.randn(batch, 1, m.num_heads * m.head_dim, dtype=m.dtype)
    xi = torch.randn(batch, 1, inter, dtype=m.dtype)

    def once() -> None:
        for lw in m.layers:
            F.linear(x, lw.qkv, lw.qkv_bias)
            F.linear(xo, lw.o, lw.o_bias)
            F.linear(x, lw.gate_up, lw.gate_up_bias)
            F.linear(xi, lw.down, lw.down_bias)
        F.linear(x[:, 0], m.lm_head)

    with torch.inference_mode():
        return time_ms(once, reps)


def bandwidth_gb_s(n_bytes: int = 1 << 30) -> dict[str, float]:
    """Streaming bandwidth: ``read`` (sum of an fp32 tensor), ``copy`` (bytes copied per second)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = time_ms(src.sum, 5)
    copy = time_ms(lambda: dst.copy_(src), 5)
    return {"read": round(n_bytes / read / 1e6, 1), "copy": round(n_bytes / copy / 1e6, 1)}


def step_vs_floor(engine: NativeEngine, batch: int = 32, context: int = 300, seed: int = 0) -> dict[str, float]:
    """Decode step ms at ``batch`` x ``context`` tokens, its matmuls alone, bytes read, floor and ratio."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.runner.model.vocab_size
    reqs = [GenRequest(id=f"f{i}", prompt=torch.randint(4, vocab, (context,), generator=g).tolist(),
                       bucket=max(engine.batching.buckets), max_new_tokens=400)
            for i in range(batch)]
    engine.add(reqs)
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    step = time_ms(engine.step, 20)
    engine.reset()
    m = engine.runner.model
    elem = torch.empty((), dtype=m.dtype).element_size()
    weights = sum(t.numel() for lw in m.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)) + m.lm_head.numel()
    kv = m.num_layers * 2 * batch * (context + 10) * m.num_kv_heads * m.head_dim  # mid-measurement context
    mm = matmul_ms(engine, batch)
    bw = bandwidth_gb_s()
    out = {"batch": batch, "context": context, "step_ms": round(step, 2), "matmul_ms": round(mm, 2),
           "bytes_read_mb": round((weights + kv) * elem / 1e6, 1), "read_gb_s": bw["read"], "copy_gb_s": bw["copy"]}
    for kind in ("read", "copy"):
        floor = max(mm, (weights + kv) * elem / bw[kind] / 1e6)
        out[f"floor_{kind}_ms"] = round(floor, 2)
        out[f"step_vs_floor_{kind}"] = round(step / floor, 3)
    return out
