"""The CUDA path's Triton kernels on a device: each against the torch op it replaces, for agreement and time.

    python scripts/bench_triton_kernels.py --json docs/bench/triton_kernels_<gpu>.json            # on a GPU
    TRITON_INTERPRET=1 python scripts/bench_triton_kernels.py --device cpu --tiny --json /tmp/t.json  # smoke

At the 7B shape (32 heads of 128, blocks of 16; ``--tiny``: 4 heads of 32, GQA 2:1): decode attention of
``--batch`` sequences of varied contexts up to ``--context`` over scattered blocks, and a packed prefill of 8
chunks of 128 tokens after 64 cached ones, through ``attention.paged_attention`` on the torch path and on the
Triton path: max abs difference, rows whose bits differ from the same query computed alone (batch invariance),
median ms of each. Then the small ops (RMSNorm, add + RMSNorm, RoPE, SiLU * up) at the decode step's rows,
torch against Triton. Prints a table and writes ``--json``. Nothing here has run on a GPU yet.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from collections.abc import Callable

import click
import torch

from batchfleet.worker.benchmark.report import git_commit, machine, write_json
from batchfleet.worker.engine.native import attention as A
from batchfleet.worker.engine.native import triton_support

SHAPES = {False: dict(H=32, Hkv=32, D=128, hidden=4096, inter=11008),
          True: dict(H=4, Hkv=2, D=32, hidden=64, inter=128)}


def ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall ms of ``fn`` (synchronized on CUDA), after one warm-up call (compilation)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def both(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch path, Triton path) of ``fn``."""
    saved = set(triton_support.DEVICES)
    triton_support.DEVICES.clear()
    ref = fn()
    triton_support.DEVICES.update(saved)
    return ref, fn()


def attention_rows(name: str, q: torch.Tensor, pool: torch.Tensor, tables: list[list[int]], starts: list[int],
                   lens: list[int], trash: int, device: torch.device, reps: int) -> dict:
    scale = q.shape[-1] ** -0.5
    layout = A.tile_layout(tables, starts, lens, trash).to(device)
    ref, out = both(lambda: A.paged_attention(q, pool, layout, scale))
    differ, row = 0, 0
    for t, a, n in zip(tables, starts, lens):  # each sequence alone: its last query
        alone = A.paged_attention(q[row + n - 1:row + n], pool, A.tile_layout([t], [a + n - 1], [1], trash).to(device),
                                  scale)
        differ += int(not torch.equal(alone, out[row + n - 1:row + n]))
        row += n
    saved = set(triton_support.DEVICES)
    triton_support.DEVICES.clear()
    t_torch = ms(lambda: A.paged_attention(q, pool, layout, scale), device, reps)
    triton_support.DEVICES.update(saved)
    t_triton = ms(lambda: A.paged_attention(q, pool, layout, scale), device, reps)
    return {"what": name, "max_abs_diff": float((out.float() - ref.float()).abs().max()),
            "alone_differs": f"{differ}/{len(tables)}", "torch_ms": round(t_torch, 4), "triton_ms": round(t_triton, 4)}


def run(device: torch.device, dtype: torch.dtype, tiny: bool, batch: int, context: int, reps: int) -> list[dict]:
    from batchfleet.worker.engine.native import triton_ops  # after TRITON_INTERPRET is settled

    s = SHAPES[tiny]
    H, Hkv, D, bs = s["H"], s["Hkv"], s["D"], 16
    g = torch.Generator().manual_seed(0)
    per = -(-context // bs)
    nb = batch * per + 8 * 13
    pool = torch.randn(2, nb + 1, bs, Hkv, D, generator=g).to(dtype).to(device)
    perm = torch.randperm(nb, generator=g).tolist()  # scattered blocks
    tables = [perm[b * per:(b + 1) * per] for b in range(batch)]
    ctx = torch.randint(context // 4, context + 1, (batch,), generator=g).tolist()
    q = torch.randn(batch, H, D, generator=g).to(dtype).to(device)
    rows = [attention_rows(f"decode attention {batch} x <= {context}", q, pool, tables, [c - 1 for c in ctx],
                           [1] * batch, nb, device, reps)]
    ptables = [perm[batch * per + 13 * i:batch * per + 13 * (i + 1)] for i in range(8)]  # 192 + 16 slots each
    qp = torch.randn(8 * 128, H, D, generator=g).to(dtype).to(device)
    rows.append(attention_rows("prefill 8 x 128 after 64 cached", qp, pool, ptables, [64] * 8, [128] * 8, nb,
                               device, reps))
    x, res = (torch.randn(batch, 1, s["hidden"], generator=g).to(dtype).to(device) for _ in range(2))
    w = torch.randn(s["hidden"], generator=g).to(dtype).to(device)
    qkv = torch.randn(batch, 1, H + 2 * Hkv, D, generator=g).to(dtype).to(device)
    cos, sin = (torch.randn(batch, 1, 1, D, generator=g).to(dtype).to(device) for _ in range(2))
    gate_up = torch.randn(batch, 1, 2 * s["inter"], generator=g).to(dtype).to(device)

    def norm(v: torch.Tensor) -> torch.Tensor:
        vf = v.float()
        return w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(v.dtype)

    def rope(v: torch.Tensor) -> torch.Tensor:
        rot = torch.cat((v[..., D // 2:], v[..., :D // 2]), dim=-1)
        return v * cos + rot * sin

    ops = {"rms_norm": (lambda: norm(x), lambda: triton_ops.rms_norm(x, w, 1e-5)),
           "add + rms_norm": (lambda: norm(res + x), lambda: triton_ops.add_rms_norm(x, res, w, 1e-5)[1]),
           "rope": (lambda: rope(qkv[:, :, :H + Hkv]), lambda: triton_ops.rope(qkv[:, :, :H + Hkv], cos, sin)),
           "silu * up": (lambda: torch.nn.functional.silu(gate_up[..., :s["inter"]]) * gate_up[..., s["inter"]:],
                         lambda: triton_ops.silu_mul(gate_up))}
    for name, (ref_fn, tri_fn) in ops.items():
        diff = float((tri_fn().float() - ref_fn().float()).abs().max())
        rows.append({"what": f"{name} {batch} rows", "max_abs_diff": diff, "alone_differs": "",
                     "torch_ms": round(ms(ref_fn, device, reps), 4), "triton_ms": round(ms(tri_fn, device, reps), 4)})
    return rows


@click.command()
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu under TRITON_INTERPRET=1")
@click.option("--dtype", "dtypes", multiple=True, default=["bfloat16", "float32"], show_default=True)
@click.option("--tiny", is_flag=True, help="tiny heads (a CPU smoke run under the interpreter)")
@click.option("--batch", default=32, show_default=True)
@click.option("--context", default=1024, show_default=True, help="longest decode context (tokens)")
@click.option("--reps", default=20, show_default=True)
@click.option("--json", "json_path", required=True, type=click.Path())
def main(device: str, dtypes: tuple[str, ...], tiny: bool, batch: int, context: int, reps: int,
         json_path: str) -> None:
    dev = torch.device(device)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise click.ClickException("on CPU the kernels run only under TRITON_INTERPRET=1 (set it for this command)")
    triton_support.DEVICES.add(dev.type)
    if not triton_support.runs_on(dev):
        raise click.ClickException("triton is not installed")
    results = {dt: run(dev, getattr(torch, dt), tiny, batch, context, reps) for dt in dtypes}
    print(f"{'dtype':9} {'what':42} {'max |diff|':>11} {'alone differs':>13} {'torch ms':>9} {'triton ms':>9}")
    for dt, rows in results.items():
        for r in rows:
            print(f"{dt:9} {r['what']:42} {r['max_abs_diff']:11.3g} {r['alone_differs']:>13} {r['torch_ms']:9.3f} "
                  f"{r['triton_ms']:9.3f}")
    write_json(json_path, {"commit": git_commit(), "date": datetime.date.today().isoformat(), "machine": machine(),
                           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
                           "torch": torch.__version__, "results": results})


if __name__ == "__main__":
    main()
