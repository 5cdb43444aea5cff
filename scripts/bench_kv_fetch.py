"""The C decode attention kernel alone against a plain read of the same K/V bytes, in one run.

    python scripts/bench_kv_fetch.py --json docs/bench/kv_fetch_<kind>.json

Builds the native engine on a preset (random weights) in the worker's default dtype for this CPU (or
``--dtype``), runs the prefills of ``--batch`` sequences of ``--context`` tokens, then times, round after
round in turn: every layer's decode attention through the kernel over the engine's own pool and block tables
(the bytes a decode step's attention reads, in the pool's block layout), and a streaming read of as many bytes
(an fp32 sum over buffers on huge pages, one per layer, as the serial bound of ``benchlib/floor.py`` reads
them). Rounds in turn, because the memory bandwidth of a shared VM moves between minutes: only figures from the
same rounds compare. The kernel / read ratio is how far the attention is from the memory's rate; above 1, the
excess is fetching (the arithmetic is a fraction of it: docs/BENCHMARKS_HISTORY.md 13p) or arithmetic not overlapped.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import click
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.worker.benchmark.report import git_commit, machine, write_json
from batchfleet.worker.engine.models import load_model, make_preset
from batchfleet.worker.engine.native import cpu_kernel, hugepages
from batchfleet.worker.engine.native.engine import NativeEngine
from benchlib.floor import fill_decode


def measure(engine: NativeEngine, batch: int, context: int, rounds: int) -> dict:
    """Kernel and plain-read times (ms a pass over every layer: median and fastest of ``rounds`` in turn), the bytes a
    pass reads and their ratio."""
    runner, m = engine.runner, engine.runner.model
    if runner.kernel is None:
        raise click.ClickException("no C decode kernel on this machine (no compiler, or not a CPU)")
    fill_decode(engine, batch, context)
    seqs = list(engine.scheduler.running)
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [runner.trash_block] * (width - len(s.block_table)) for s in seqs],
                          dtype=torch.int64)  # [B, M]
    ctx = torch.tensor([s.num_cached for s in seqs], dtype=torch.int64)  # [B] tokens each attends
    q = torch.randn(len(seqs), m.num_heads, m.head_dim, dtype=m.dtype)  # [B, H, D]
    out = torch.empty_like(q)
    elem = q.element_size()
    kv_bytes = 2 * int(ctx.sum()) * m.num_kv_heads * m.head_dim * elem  # one layer's K and V rows attended
    reads = [hugepages.zeros((kv_bytes // 4,), torch.float32).fill_(1.0) for _ in range(m.num_layers)]

    def kernel() -> None:
        for i in range(m.num_layers):
            cpu_kernel.paged_decode(runner.kernel, q, runner.kv[i], tables, ctx, m.scale, runner.num_threads, out)

    def read() -> None:
        for buf in reads:
            buf.sum()

    kernel(), read()  # warm-up
    times: dict[str, list[float]] = {"kernel": [], "read": []}
    for _ in range(rounds):
        for name, fn in (("read", read), ("kernel", kernel)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    k, r = times["kernel"], times["read"]
    total = kv_bytes * m.num_layers
    return {"batch": len(seqs), "context": context, "dtype": str(m.dtype).removeprefix("torch."),
            "path": cpu_kernel.isa(runner.kernel, m.dtype, m.head_dim, m.num_heads // m.num_kv_heads),
            "block_size": engine.blocks.block_size, "bytes": total, "bytes_mb": round(total / 1e6, 1), "rounds": rounds,
            "kernel_ms": round(statistics.median(k) * 1000, 3), "kernel_best_ms": round(min(k) * 1000, 3),
            "read_ms": round(statistics.median(r) * 1000, 3), "read_best_ms": round(min(r) * 1000, 3),
            "read_gb_s": round(total / statistics.median(r) / 1e9, 1),
            "kernel_vs_read_median": round(statistics.median(k) / statistics.median(r), 3),
            "kernel_vs_read_best": round(min(k) / min(r), 3)}


@click.command(help=__doc__)
@click.option("--preset", type=click.Choice(["tiny", "bench", "llama1b"]), default="bench", show_default=True)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--context", type=int, default=300, show_default=True)
@click.option("--dtype", default=None, help="Default: the worker's default for this CPU.")
@click.option("--block-size", type=int, default=EngineConfig.block_size, show_default=True)
@click.option("--rounds", type=int, default=40, show_default=True)
@click.option("--kv-cache-gb", type=float, default=2.0, show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(preset: str, batch: int, context: int, dtype: str | None, block_size: int, rounds: int, kv_cache_gb: float,
         cache_dir: str, json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    loaded = load_model(make_preset(preset, Path(cache_dir).expanduser() / "models", max_seq_len=4096), "cpu", dtype)
    engine = NativeEngine(loaded, DynamicBatchingConfig(max_batch_size=batch, max_seq_len=1024, buckets=(512,)),
                          EngineConfig(max_running=batch, kv_cache_gb=kv_cache_gb, block_size=block_size))
    res = measure(engine, batch, context, rounds)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "scripts/bench_kv_fetch.py", *sys.argv[1:]]), "commit": git_commit(),
           "machine": machine(), "preset": preset, **res}
    click.echo(f"{doc['machine'].get('cpu_model', '?')}, {preset} preset, {res['dtype']}, kernel path {res['path']}, "
               f"{res['batch']} x {context} tokens, block size {res['block_size']}, {res['bytes_mb']} MB a pass, "
               f"{rounds} rounds in turn\n\n| | median ms | fastest ms |\n|---|---:|---:|\n"
               f"| kernel, every layer | {res['kernel_ms']} | {res['kernel_best_ms']} |\n"
               f"| plain read, same bytes ({res['read_gb_s']} GB/s) | {res['read_ms']} | {res['read_best_ms']} |\n"
               f"| kernel / read | {res['kernel_vs_read_median']} | {res['kernel_vs_read_best']} |")
    if json_path:
        write_json(json_path, doc)


if __name__ == "__main__":
    main()
