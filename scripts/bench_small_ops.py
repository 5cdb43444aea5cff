"""The decode step with its small ops in C (decode_ops.c) against the same step on torch ops, in one run.

    python scripts/bench_small_ops.py --json docs/bench/small_ops_<kind>.json

Builds the native engine on the ``bench`` preset, fills it with ``--batch`` sequences of ``--context``
tokens, then times decode steps alternately with the C small ops (RMSNorm, RoPE + KV write, SiLU * up,
argmax) and without them (``runner.ops`` unset: the torch ops), interleaved so that drift on shared cores
hits both alike; median of ``--steps`` each, per dtype. Prints a table and writes ``--json``.
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
from batchfleet.worker.engine.native.engine import NativeEngine
from benchlib.floor import fill_decode


def ab(model_dir: Path, dtype: str, batch: int, context: int, steps: int) -> dict:
    """Median decode step ms with the C small ops and with the torch ops, interleaved."""
    engine = NativeEngine(load_model(model_dir, "cpu", dtype),
                          DynamicBatchingConfig(max_batch_size=batch, max_seq_len=1024, buckets=(512,)),
                          EngineConfig(max_running=batch, kv_cache_gb=2.0))
    ops = engine.runner.ops
    if ops is None:
        raise click.ClickException("the C small ops are unavailable here (no C compiler?)")
    fill_decode(engine, batch, context, max_new_tokens=steps * 2 + 10)
    times: dict[str, list[float]] = {"c": [], "torch": []}
    for _ in range(steps):
        for name in times:
            engine.runner.ops = ops if name == "c" else None
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    engine.runner.ops = ops  # so that describe() names the C side's ops
    c, ref = (statistics.median(times[k]) * 1000 for k in ("c", "torch"))
    return {"step_ms_c_ops": round(c, 2), "step_ms_torch_ops": round(ref, 2), "saved_ms": round(ref - c, 2),
            "faster_pct": round((ref - c) / ref * 100, 1), "small_ops": engine.runner.describe()["decode_small_ops"]}


@click.command(help=__doc__)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--context", type=int, default=300, show_default=True)
@click.option("--steps", type=int, default=40, show_default=True, help="Timed steps per side and dtype.")
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(batch: int, context: int, steps: int, cache_dir: str, json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    model_dir = make_preset("bench", Path(cache_dir).expanduser() / "models", max_seq_len=4096)
    runs = {dtype: ab(model_dir, dtype, batch, context, steps) for dtype in ("bfloat16", "float32")}
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "scripts/bench_small_ops.py", *sys.argv[1:]]), "commit": git_commit(),
           "machine": machine(), "batch": batch, "context": context, "steps": steps, **runs}
    click.echo("| dtype | step, C small ops (ms) | step, torch ops (ms) | faster |\n|---|---:|---:|---:|")
    for dtype, r in runs.items():
        click.echo(f"| {dtype} | {r['step_ms_c_ops']} | {r['step_ms_torch_ops']} | {r['faster_pct']}% |")
    if json_path:
        write_json(json_path, doc)


if __name__ == "__main__":
    main()
