"""This CPU's row for docs/BENCHMARKS_HISTORY.md "Per CPU kind": the decode step against its floor, before and
after the per-CPU kernels, in one run.

    python scripts/bench_cpu.py --json docs/bench/cpu_<kind>.json

Loads the ``bench`` preset (``--preset llama1b``: TinyLlama-1.1B's shape, with ``--batch 16`` as
``bench_vs_vllm.py`` measures it) in the worker's default dtype for this CPU and builds the native engine
twice, each measured by ``scripts/benchlib/floor.py`` at ``--batch`` sequences of ``--context`` tokens:

* ``before``: weight matmuls on torch's default ``F.linear`` (``--linear default``), C decode kernel
  capped to its portable loop, the step's small ops (RMSNorm, RoPE + KV write, SiLU * up, argmax) as
  torch ops: what the engine ran before issue 20;
* ``after``: the worker's defaults (``--linear auto``: the kernel measured fastest per shape and row
  count; the decode kernel's best instruction-set path; the small ops in C, ``decode_ops.c``).

Prints one markdown table (step, matmuls, attention, the rest, floor, step / floor, the serial bound:
matmuls then a plain read of the K/V bytes, layer by layer, with nothing else, timed in turn with the step
round by round; GEMM GFLOP/s per shape default vs chosen) and writes everything to ``--json``.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import click
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.worker.benchmark.report import git_commit, machine, write_json
from batchfleet.worker.engine.models import load_model, make_preset
from batchfleet.worker.engine.native import cpu_kernel
from batchfleet.worker.engine.native.engine import NativeEngine
from benchlib.floor import step_vs_floor


def measure(loaded, batch: int, context: int, linear: str, isa: str, kv_gb: float, c_ops: bool) -> dict:
    engine = NativeEngine(loaded, DynamicBatchingConfig(max_batch_size=batch, max_seq_len=1024, buckets=(512,)),
                          EngineConfig(max_running=batch, linear=linear, kv_cache_gb=kv_gb))
    if not c_ops:
        engine.runner.ops = None  # the small ops as torch ops
    lib = engine.runner.kernel
    if lib is not None:
        cpu_kernel.set_isa(lib, isa)
    try:
        out = step_vs_floor(engine, batch=batch, context=context)
    finally:
        if lib is not None:
            cpu_kernel.set_isa(lib, cpu_kernel.TOP_LEVEL)
    out["calibration_s"] = round(engine.runner.model.linears.seconds, 2)
    return out


@click.command(help=__doc__)
@click.option("--batch", type=int, default=32, show_default=True)
@click.option("--context", type=int, default=300, show_default=True)
@click.option("--dtype", default=None, help="Default: the worker's default for this CPU.")
@click.option("--preset", type=click.Choice(["bench", "llama1b"]), default="bench", show_default=True,
              help="The model's shape (random weights).")
@click.option("--kv-cache-gb", type=float, default=2.0, show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(batch: int, context: int, dtype: str | None, preset: str, kv_cache_gb: float, cache_dir: str,
         json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    model_dir = make_preset(preset, Path(cache_dir).expanduser() / "models", max_seq_len=4096)
    loaded = load_model(model_dir, "cpu", dtype)
    runs = {}
    for name, linear, isa, c_ops in (("before", "default", "portable", False),
                                     ("after", "auto", cpu_kernel.TOP_LEVEL, True)):
        click.echo(f"{name}: linear {linear}, decode kernel up to {isa}, small ops in {'C' if c_ops else 'torch'}",
                   err=True)
        runs[name] = measure(loaded, batch, context, linear, isa, kv_cache_gb, c_ops)
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python", "scripts/bench_cpu.py", *sys.argv[1:]]), "commit": git_commit(),
           "machine": machine(), "preset": preset, "dtype": str(loaded.dtype).removeprefix("torch."), **runs}
    click.echo(markdown(doc))
    if json_path:
        write_json(json_path, doc)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    b, a = doc["before"], doc["after"]
    lines = [f"{m.get('cpu_model', '?')}, flags {' '.join(m.get('cpu_flags', []))}, {m['torch_threads']} threads, "
             f"{doc.get('preset', 'bench')} preset, {doc['dtype']}, batch {a['batch']} x {a['context']} tokens",
             "", "| | before | after |", "|---|---:|---:|"]
    rows = [("decode step ms", "step_ms"), ("weight matmuls ms (kernels used)", "matmul_ms"),
            ("attention ms (all layers, C kernel)", "attention_step_ms"), ("the rest ms", "other_ms"),
            ("floor ms (max(matmuls, bytes / read bw))", "floor_read_ms"), ("step / floor", "step_vs_floor_read"),
            ("serial bound ms (matmuls, then K/V bytes read)", "serial_step_ms"),
            ("serial bound / floor", "serial_vs_floor_read"),
            ("step / serial bound, fastest of each (interleaved rounds)", "step_vs_serial_best"),
            ("step / serial bound, medians (same rounds)", "step_vs_serial_median"),
            ("floor ms against the copy bw", "floor_copy_ms"), ("step / that floor", "step_vs_floor_copy")]
    for label, key in rows:
        lines.append(f"| {label} | {b[key]} | {a[key]} |")
    lines.append(f"| matmuls on F.linear ms (same run) | {b['matmul_default_ms']} | {a['matmul_default_ms']} |")
    lines += ["", "| weight shape | GFLOP/s default | GFLOP/s chosen | kernel |", "|---|---:|---:|---|"]
    for shape, g in a["gemm_gflops"].items():
        lines.append(f"| {shape} at {a['batch']} rows | {g['default']} | {g['chosen']} | {g['kernel']} |")
    attn = ", ".join(f"{k} {v}" for k, v in a["attention_layer_ms"].items())
    lines += ["", f"one layer's decode attention ms: {attn}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
