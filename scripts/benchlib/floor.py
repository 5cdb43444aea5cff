"""A decode step against its floor, measured in one run on this machine.

floor = max(time of the step's weight matmuls alone on the kernels the engine chose (linear.py),
(weight bytes + KV bytes the step reads) / bandwidth), with the bandwidth measured here by streaming a
1 GiB tensor (read-only sum, and copy). The step is timed on the real engine at ``batch`` sequences of
``context`` tokens each. Also reported: the same matmuls on torch's default ``F.linear``, GFLOP/s per
weight shape (default vs chosen) and one layer's decode attention per instruction-set path of the C
kernel, so the step splits into matmuls + attention + the rest (Python, small ops, sampling, copies).
The step's attention is the time its C-kernel calls took inside the timed steps (the engine's own block
layout); the per-path figures run one layer on blocks scattered at random (the worst case for the
hardware prefetcher), so they compare paths but overstate what a step spends. ``serial_passes`` runs only
the matmuls and a read of the K/V bytes, layer by layer: the best a step can do without overlapping them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.native import hugepages
from batchfleet.worker.engine.native.engine import NativeEngine
from batchfleet.worker.engine.native.linear import best_times


@contextmanager
def kernel_seconds() -> Iterator[list[float]]:
    """Seconds spent in the C decode kernel while the block runs, accumulated into the yielded one-item
    list (the runner calls ``cpu_kernel.paged_decode`` through the module, so wrapping it there counts
    every call; the original is restored on exit)."""
    from batchfleet.worker.engine.native import cpu_kernel

    spent = [0.0]
    original = cpu_kernel.paged_decode

    def timed(*args: object, **kwargs: object) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    cpu_kernel.paged_decode = timed
    try:
        yield spent
    finally:
        cpu_kernel.paged_decode = original


def time_ms(fn: Callable[[], object], reps: int = 30, best: bool = False) -> float:
    """Median ms of ``reps`` calls after one warm-up call; the fastest call with ``best`` (for the parts of
    the floor, a lower bound: on shared cores a slow call is the neighbours' doing, never the machine's)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return (min(times) if best else statistics.median(times)) * 1000


def matmul_pass(engine: NativeEngine, batch: int, chosen: bool = True,
                after_qkv: Callable[[int], object] | None = None) -> Callable[[], None]:
    """One pass of a decode step's weight matmuls at ``batch`` rows, alone (same weights, same dtype), on the
    kernels the engine chose (``chosen``) or on torch's default ``F.linear``. ``after_qkv(i)`` runs between
    layer i's qkv projection and its other matmuls, where a step attends."""
    m = engine.runner.model
    x = torch.randn(batch, 1, m.hidden, dtype=m.dtype)
    inter = m.layers[0].down.shape[1]
    xo = torch.randn(batch, 1, m.num_heads * m.head_dim, dtype=m.dtype)
    xi = torch.randn(batch, 1, inter, dtype=m.dtype)

    @torch.inference_mode()
    def once() -> None:
        for i, lw in enumerate(m.layers):
            lw.qkv_l(x) if chosen else F.linear(x, lw.qkv, lw.qkv_bias)
            if after_qkv is not None:
                after_qkv(i)
            if chosen:
                lw.o_l(xo), lw.gate_up_l(x), lw.down_l(xi)
            else:
                F.linear(xo, lw.o, lw.o_bias)
                F.linear(x, lw.gate_up, lw.gate_up_bias)
                F.linear(xi, lw.down, lw.down_bias)
        m.lm_head_l(x[:, 0]) if chosen else F.linear(x[:, 0], m.lm_head)

    return once


def matmul_ms(engine: NativeEngine, batch: int, reps: int = 10, chosen: bool = True) -> float:
    """``matmul_pass``'s fastest of ``reps`` (ms)."""
    return time_ms(matmul_pass(engine, batch, chosen), reps, best=True)


def gemm_gflops(engine: NativeEngine, rows: int, reps: int = 10) -> dict[str, dict]:
    """Per distinct weight shape (``"in->out"``): GFLOP/s at ``rows`` rows of torch's default and of the
    chosen kernel, interleaved in one loop (min of ``reps``), and which kernel was chosen."""
    m = engine.runner.model
    shapes = {}
    for lin in [m.lm_head_l, *(x for lw in m.layers for x in (lw.qkv_l, lw.o_l, lw.gate_up_l, lw.down_l))]:
        shapes.setdefault(tuple(lin.weight.shape), lin)
    out = {}
    with torch.inference_mode():
        for (n_out, n_in), lin in shapes.items():
            x = torch.randn(rows, n_in, dtype=m.dtype)
            t_def, t_cho = best_times([partial(F.linear, x, lin.weight, lin.bias), partial(lin, x)], reps)
            flop = 2.0 * rows * n_in * n_out
            out[f"{n_in}->{n_out}"] = {"default": round(flop / t_def / 1e9, 1), "chosen": round(flop / t_cho / 1e9, 1),
                                       "kernel": lin.kernel_for(rows)}
    return out


def attention_ms(engine: NativeEngine, batch: int, context: int, reps: int = 20) -> dict[str, float]:
    """One layer's decode attention (ms) at ``batch`` x ``context`` tokens on the engine's shapes (random
    K/V in a pool of scattered blocks), per instruction-set path of the C kernel this CPU has, and of
    gather + SDPA."""
    from batchfleet.worker.engine.native import attention as A
    from batchfleet.worker.engine.native import cpu_kernel

    r, m = engine.runner, engine.runner.model
    H, Hkv, D, bs = m.num_heads, m.num_kv_heads, m.head_dim, r.block_size
    g = torch.Generator().manual_seed(0)
    M = -(-context // bs)
    pool = torch.randn(2, batch * M + 1, bs, Hkv, D, generator=g).to(m.dtype)
    tables = torch.randperm(batch * M, generator=g).view(batch, M).contiguous()
    q = torch.randn(batch, H, D, generator=g).to(m.dtype)
    ctx = torch.full((batch,), context)
    mask = A.decode_mask(ctx, M * bs)
    out = {"gather_sdpa": time_ms(lambda: A.decode_attention_gather(q, pool, tables, mask, m.scale), reps)}
    lib = r.kernel
    if lib is not None:
        try:
            for level in cpu_kernel.ISA_LEVELS:
                cpu_kernel.set_isa(lib, level)
                path = cpu_kernel.isa(lib, m.dtype, D, H // Hkv)
                if cpu_kernel.PATH_LEVELS[path] == cpu_kernel.ISA_LEVELS[level]:  # not a lower path again
                    out[f"kernel_{path}"] = time_ms(
                        lambda: cpu_kernel.paged_decode(lib, q, pool, tables, ctx, m.scale, r.num_threads), reps)
        finally:
            cpu_kernel.set_isa(lib, cpu_kernel.TOP_LEVEL)
    return {k: round(v, 3) for k, v in out.items()}


def serial_passes(engine: NativeEngine, batch: int,
                  max_context: int) -> tuple[Callable[[int], None], Callable[[], None]]:
    """A decode step with nothing but its two unavoidable parts, one after the other: each layer's weight
    matmuls on the chosen kernels (``matmul_pass``), with a streaming read of as many bytes as that layer's
    K/V where the step attends (a buffer of its own per layer, so the bytes come from memory as the step's
    do). What a step reaches with no Python, no small ops and attention at the machine's read bandwidth,
    but without overlapping the compute-bound matmuls and the memory-bound K/V reads: the floor (a max of
    the two) assumes they overlap. Returns (that serial pass at a context of up to ``max_context`` tokens, the
    matmuls alone) as callables."""
    m = engine.runner.model
    elem = torch.empty((), dtype=m.dtype).element_size()
    per_token = 2 * batch * m.num_kv_heads * m.head_dim * elem // 4  # bytes one token adds to a layer's K/V, / 4
    # summed as fp32 (torch's sum streams at bandwidth), on huge pages as the engine's KV pool (hugepages.py)
    kv = [hugepages.zeros((per_token * max_context,), torch.float32).fill_(1.0) for _ in m.layers]
    ctx = [max_context]
    read = matmul_pass(engine, batch, after_qkv=lambda i: kv[i][:per_token * ctx[0]].sum())

    def serial(context: int) -> None:
        ctx[0] = context
        read()

    return serial, matmul_pass(engine, batch)


def _seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bandwidth_gb_s(n_bytes: int = 1 << 30) -> dict[str, float]:
    """Streaming bandwidth: ``read`` (sum of an fp32 tensor), ``copy`` (bytes copied per second); the
    fastest of 10 passes each, as the floor takes the best the machine does."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = time_ms(src.sum, 10, best=True)
    copy = time_ms(lambda: dst.copy_(src), 10, best=True)
    return {"read": round(n_bytes / read / 1e6, 1), "copy": round(n_bytes / copy / 1e6, 1)}


def fill_decode(engine: NativeEngine, batch: int, context: int, max_new_tokens: int = 400, seed: int = 0) -> None:
    """Add ``batch`` random prompts of ``context`` tokens and run their prefill: every further step is a
    decode step of ``batch`` sequences (for ``max_new_tokens`` steps)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.runner.model.vocab_size
    engine.add([GenRequest(id=f"f{i}", prompt=torch.randint(4, vocab, (context,), generator=g).tolist(),
                           bucket=max(engine.batching.buckets), params=Params(max_new_tokens=max_new_tokens))
                for i in range(batch)])
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()


def step_vs_floor(engine: NativeEngine, batch: int = 32, context: int = 300, seed: int = 0,
                  rounds: int = 30) -> dict[str, float]:
    """Decode step ms at ``batch`` x ``context`` tokens (median of ``rounds``), its matmuls alone, bytes read,
    floor, serial bound and the ratios."""
    fill_decode(engine, batch, context, seed=seed)
    # the step, its serial bound and the matmuls alone timed in turn, round by round, so that all three come
    # from the same minutes of a shared machine (whose memory bandwidth moved 2x within an hour on EPYC Zen 4)
    # round r's step attends context + 2 + r tokens (the warm-up step context + 1); its serial pass reads as many
    serial_pass, alone_pass = serial_passes(engine, batch, context + 2 + rounds)
    engine.step(), serial_pass(context + 1), alone_pass()  # warm-up
    steps, in_kernel, serial, alone = [], [], [], []
    with kernel_seconds() as spent:
        for r in range(rounds):
            spent[0] = 0.0
            steps.append(_seconds(engine.step))
            in_kernel.append(spent[0])
            serial.append(_seconds(partial(serial_pass, context + 2 + r)))
            alone.append(_seconds(alone_pass))
    step = statistics.median(steps) * 1000
    in_step_attn = statistics.median(in_kernel) * 1000
    engine.reset()
    m = engine.runner.model
    elem = torch.empty((), dtype=m.dtype).element_size()
    weights = sum(t.numel() for lw in m.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)) + m.lm_head.numel()
    kv = m.num_layers * 2 * batch * (context + rounds // 2) * m.num_kv_heads * m.head_dim
    mm = matmul_ms(engine, batch)
    mm_default = matmul_ms(engine, batch, chosen=False)
    attn = attention_ms(engine, batch, context + rounds // 2)
    # the kernel's time inside the steps; an estimate from the per-layer figure where no kernel ran
    attn_step = in_step_attn or attn.get(f"kernel_{_kernel_path(engine)}", attn["gather_sdpa"]) * m.num_layers
    serial_mm = min(alone) * 1000  # the floor of the same minutes: matmuls timed with the serial passes
    bw = bandwidth_gb_s()
    out = {"batch": batch, "context": context, "dtype": str(m.dtype).removeprefix("torch."),
           "step_ms": round(step, 2), "matmul_ms": round(mm, 2), "matmul_default_ms": round(mm_default, 2),
           "attention_layer_ms": attn, "attention_step_ms": round(attn_step, 2),
           "other_ms": round(step - mm - attn_step, 2), "serial_step_ms": round(min(serial) * 1000, 2),
           "serial_matmul_ms": round(serial_mm, 2),
           # the step against its serial bound, each statistic on both sides (same rounds): the fastest of each
           # (what the machine does at its best) and the medians (typical); step_ms / serial_step_ms, as
           # reported before these rounds were interleaved, mixes the step's median with the bound's best
           "step_vs_serial_best": round(min(steps) / min(serial), 3),
           "step_vs_serial_median": round(statistics.median(steps) / statistics.median(serial), 3),
           "step_best_ms": round(min(steps) * 1000, 2),
           "serial_median_ms": round(statistics.median(serial) * 1000, 2),
           "gemm_gflops": gemm_gflops(engine, batch),
           "linear_kernels": engine.runner.describe(),
           "bytes_read_mb": round((weights + kv) * elem / 1e6, 1), "read_gb_s": bw["read"], "copy_gb_s": bw["copy"]}
    for kind in ("read", "copy"):
        floor = max(mm, (weights + kv) * elem / bw[kind] / 1e6)
        out[f"floor_{kind}_ms"] = round(floor, 2)
        out[f"step_vs_floor_{kind}"] = round(step / floor, 3)
        # against the floor of the same minutes: the matmuls timed interleaved with the serial step
        same_minutes = max(serial_mm, (weights + kv) * elem / bw[kind] / 1e6)
        out[f"serial_vs_floor_{kind}"] = round(min(serial) * 1000 / same_minutes, 3)
    return out


def _kernel_path(engine: NativeEngine) -> str:
    """The decode attention path the engine runs: an ISA name of the C kernel, or "" (gather / NPU)."""
    desc = engine.runner.describe()["decode_attention"].split()
    return desc[1] if len(desc) == 2 else ""
