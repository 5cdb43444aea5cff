"""What batch invariance costs the native engine, in one process, interleaved (min of N runs: load only adds).

The two changes it made, each toggled on the same loaded model (the ``bench`` preset, bf16, prefix cache
off so every run computes the same tokens):

* prefill attention through the C paged kernel with the C RMSNorm / SiLU (now) against one SDPA per
  prompt with the torch ops (before): the runner's SDPA prefill path is what a ``decode_mode`` other than
  ``kernel`` takes, so a prefill-only workload (max_new_tokens=1) is run with it set to ``gather``;
* weight matmuls on prepacked oneDNN at every row count (``--linear auto``, now) against the kernel
  measured fastest per shape and row count (``--linear fastest``, before).

``--torch-path``: the path CUDA/NPU run, on this CPU (``--no-native-kernel``, ``--linear auto``): prefill and
decode attention through the tiled torch paged attention (now) against SDPA prefill and gather + SDPA decode
(before), toggled by the runner's ``attention`` on one engine.

Workloads: ``prefill`` (8 prompts of 400 tokens, one token each: chunks of 2,048) and ``decode`` (32
prompts of 40 tokens, 48 new tokens each: mostly decode steps at batch 32).

    python scripts/bench_batch_invariance.py --reps 12
    python scripts/bench_batch_invariance.py --torch-path --reps 3
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import click
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import load_model, make_preset
from batchfleet.worker.engine.native.engine import NativeEngine

VARIANTS = {  # name: (linear, SDPA prefill with torch ops)
    "now: kernel prefill, linear auto": ("auto", False),
    "before: SDPA prefill, linear fastest": ("fastest", True),
    "kernel prefill, linear fastest": ("fastest", False),
    "SDPA prefill, linear auto": ("auto", True),
}


def requests(g: torch.Generator, n: int, prompt_len: int, new: int) -> list[GenRequest]:
    return [GenRequest(id=f"r{i}", prompt=torch.randint(4, 30000, (prompt_len,), generator=g).tolist(), bucket=512,
                       params=Params(max_new_tokens=new)) for i in range(n)]


TORCH_VARIANTS = {"now: paged torch attention": "paged", "before: SDPA prefill, gather + SDPA decode": "sdpa"}


def run(engine: NativeEngine, reqs: list[GenRequest], sdpa_prefill: bool) -> float:
    """Seconds to run ``reqs`` to completion (``sdpa_prefill``: the runner's SDPA prefill path; on an engine
    without the C kernel, SDPA decode too)."""
    kernel = engine.runner.decode_mode == "kernel"
    if kernel and sdpa_prefill:
        engine.runner.decode_mode = "gather"
    engine.runner.attention = "sdpa" if sdpa_prefill else "paged"
    engine.add([replace(r) for r in reqs])
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    engine.runner.decode_mode = "kernel" if kernel else engine.runner.decode_mode
    engine.runner.attention = "paged"
    return time.perf_counter() - t


@click.command()
@click.option("--reps", type=int, default=12, show_default=True)
@click.option("--cache-dir", default=str(Path(EngineConfig.cache_dir) / "models"), show_default=True)
@click.option("--torch-path", is_flag=True, help="Compare the torch path's attention (--no-native-kernel).")
@click.option("--dtype", default="bfloat16", show_default=True)
def main(reps: int, cache_dir: str, torch_path: bool, dtype: str) -> None:
    loaded = load_model(make_preset("bench", Path(cache_dir).expanduser()), "cpu", dtype)
    batching = DynamicBatchingConfig(max_batch_size=32, max_seq_len=1024, buckets=(64, 128, 256, 512))
    engines = {lin: NativeEngine(loaded, batching, EngineConfig(engine="native", mode="continuous", max_running=32,
                                                                kv_cache_gb=1.0, linear=lin, prefix_cache=False,
                                                                native_kernel=not torch_path))
               for lin in (("auto",) if torch_path else ("auto", "fastest"))}
    g = torch.Generator().manual_seed(0)
    workloads = {"prefill": requests(g, 8, 400, 1), "decode": requests(g, 32, 40, 48)}
    variants = {name: ("auto", att == "sdpa") for name, att in TORCH_VARIANTS.items()} if torch_path else VARIANTS
    best: dict[tuple[str, str], float] = {}
    for _ in range(reps):
        for name, (lin, sdpa) in variants.items():
            for wl, reqs in workloads.items():
                if wl == "decode" and sdpa and not torch_path:  # the kernel decode does not change with prefill
                    continue
                s = run(engines[lin], reqs, sdpa)
                best[(wl, name)] = min(best.get((wl, name), float("inf")), s)
    print(f"| workload | variant | best of {reps} (s) |\n|---|---|---:|")
    for (wl, name), s in sorted(best.items()):
        print(f"| {wl} | {name} | {s:.3f} |")


if __name__ == "__main__":
    main()
