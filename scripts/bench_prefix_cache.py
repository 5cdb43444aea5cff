"""Prefix caching, side by side with vLLM's CPU backend in one run: the fleet (one worker through Redis,
user defaults: continuous mode, default buckets) with the prefix cache on and off (``--no-prefix-cache``),
and vLLM (its defaults: automatic prefix caching on), same token ids, same model, fp32 on both sides.

    python scripts/bench_prefix_cache.py --json docs/bench/prefix_cache.json

Workloads: ``shared``: 32 requests sharing one 448-token system prompt, each with 16-48 tokens of its own,
64 new tokens each; ``mixed``: the workload of scripts/bench_vs_vllm.py (32 requests, prompts 32-512
tokens, 16-256 new tokens, nothing shared), to show the cache costs nothing when nothing hits. Every run
warms up on three unrelated prompts (nothing of the timed prompts is cached before timing on either side).
The fleet's figures of the timed run: hit rate (hits / queries, in tokens, the worker's
``prefix_cache_hits`` / ``prefix_cache_queries``) and prefill tokens computed vs. saved. Run un-niced on an
otherwise idle machine; each part runs alone, one after another.
"""

from __future__ import annotations

import datetime
import random
import sys
import time
from pathlib import Path

import click
import torch

from batchfleet.worker.benchmark.loadgen import Workload, closed_loop, make_workload, summarize
from batchfleet.worker.benchmark.report import machine, write_json
from batchfleet.worker.benchmark.runner import serving_redis
from batchfleet.worker.benchmark.strategies import parse_strategy
from batchfleet.worker.devtools import ensure_redis
from batchfleet.worker.engine.models import make_preset
from batchfleet.worker.engine.native.block_manager import BlockManager
from batchfleet.worker.engine.native.scheduler import Scheduler
from batchfleet.worker.engine.native.sequence import Sequence
from benchlib.vllm_peer import run_offline

HERE = Path(__file__).resolve().parent
MAX_SEQ_LEN = 4096
TOKENS = (4, 259)  # byte tokens of the preset's tokenizer, as make_workload draws them


def shared_workload(n: int, system: int, own: tuple[int, int], new: int, seed: int) -> Workload:
    """``n`` prompts = one ``system``-token prefix + ``own`` (uniform) tokens each; ``new`` tokens each."""
    rng = random.Random(seed)
    head = [rng.randrange(*TOKENS) for _ in range(system)]
    return Workload([head + [rng.randrange(*TOKENS) for _ in range(rng.randint(*own))] for _ in range(n)],
                    [new] * n)


def warmup_prompts(seed: int) -> list[list[int]]:
    """Three prompts sharing nothing with the timed ones (another seed), one per length class."""
    rng = random.Random(seed + 1_000_003)
    return [[rng.randrange(*TOKENS) for _ in range(n)] for n in (40, 200, 480)]


def run_fleet(url: str, workload: Workload, warm: list[list[int]], cache: bool, clients: int,
              cache_dir: str, dtype: str) -> dict:
    strategy = parse_strategy("continuous")  # the default mode, with the default max_wait_ms (50)
    worker = {"preset": "bench", "cache_dir": cache_dir, "dtype": dtype, "prefix_cache": cache}
    with serving_redis(url, strategy, worker) as (client, flush, status):
        for p in warm:
            client.result(client.submit(p, max_new_tokens=2), timeout=900)
        before = status()
        run = closed_loop(client, workload, clients, flush=flush)
        after = status()
    queries = after.get("engine_prefix_cache_queries", 0) - before.get("engine_prefix_cache_queries", 0)
    hits = after.get("engine_prefix_cache_hits", 0) - before.get("engine_prefix_cache_hits", 0)
    prompt_tokens = sum(len(p) for p in workload.prompts)
    row = summarize("prefix cache on" if cache else "prefix cache off", run)
    row.update(prefix_cache=cache, prompt_tokens=prompt_tokens, prefix_cache_queries=queries,
               prefix_cache_hits=hits, hit_rate=round(hits / queries, 4) if queries else 0.0,
               prefill_tokens_saved=hits, prefill_tokens_computed=max(queries, prompt_tokens) - hits,
               preemptions=after.get("engine_preemptions", 0) - before.get("engine_preemptions", 0))
    return row


def run_vllm(python: str, model_dir: Path, workload: Workload, warm: list[list[int]], dtype: str) -> dict:
    spec = {"model": str(model_dir), "prompts": workload.prompts, "max_new_tokens": workload.max_new_tokens,
            "dtype": dtype, "max_model_len": MAX_SEQ_LEN, "warmup": warm}
    out = run_offline(python, spec)
    if out.get("prefix_cache_queries"):
        out["hit_rate"] = out["prefix_cache_hits"] / out["prefix_cache_queries"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def scheduler_overhead(workload: Workload, repeats: int = 5) -> dict:
    """CPU time (process time: robust to other processes) of the pure-Python scheduler over a workload with
    the prefix cache on and off, fake tokens, no model: what the cache's hashing and lookups cost per step."""
    def once(cache: bool) -> tuple[float, int]:
        s = Scheduler(BlockManager(4096, 16, enable_caching=cache), max_batch_size=32, max_prefill_tokens=2048,
                      max_running=64, chunked=True)
        for i, (p, m) in enumerate(zip(workload.prompts, workload.max_new_tokens)):
            s.add(Sequence(id=str(i), token_ids=list(p), max_new_tokens=m, bucket=512))
        t0, steps = time.process_time(), 0
        while s.has_work():
            batch = s.schedule()
            s.postprocess(batch, [7] * len(batch.sampled))
            steps += 1
        return time.process_time() - t0, steps
    out = {}
    for cache in (False, True):
        runs = [once(cache) for _ in range(repeats)]
        best = min(t for t, _ in runs)
        out["on" if cache else "off"] = {"steps": runs[0][1], "best_ms": round(best * 1000, 2),
                                         "per_step_us": round(best / runs[0][1] * 1e6, 1)}
    return out


def table(name: str, part: dict) -> list[str]:
    on, off, vllm = part["fleet_cache_on"], part["fleet_cache_off"], part["vllm"]
    lines = [f"\n{name}\n", "| run | tok/s | wall s | TTFT p50 ms | hit rate | prefill tokens computed / saved |",
             "|---|---:|---:|---:|---:|---|"]
    for label, row in (("fleet, prefix cache on (default)", on), ("fleet, --no-prefix-cache", off)):
        lines.append(f"| {label} | {row['throughput_tok_s']} | {row['wall_s']} | {row['ttft_p50_ms']} | "
                     f"{row['hit_rate']:.1%} | {row['prefill_tokens_computed']} / {row['prefill_tokens_saved']} |")
    if vllm is not None:
        rate = f"{vllm['hit_rate']:.1%}" if "hit_rate" in vllm else "-"
        lines.append(f"| vLLM CPU backend (defaults) | {vllm['throughput_tok_s']} | {vllm['wall_s']} | "
                     f"{vllm.get('ttft_p50_ms') or '-'} | {rate} | - |")
        lines.append(f"\nfleet (cache on) / vLLM = {part['fleet_vs_vllm']:.2f}; ")
    lines.append(f"cache on / cache off = {part['on_vs_off']:.2f}")
    return lines


@click.command(help=__doc__)
@click.option("--redis-url", envvar="BATCHFLEET_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True)
@click.option("--vllm-python", envvar="VLLM_PYTHON", default="/work/vllm-venv/bin/python", show_default=True)
@click.option("--workloads", default="shared,mixed", show_default=True, help="Comma-separated: shared, mixed.")
@click.option("--no-vllm", is_flag=True, help="Only the fleet (cache on and off).")
@click.option("--requests", "n", type=int, default=32, show_default=True)
@click.option("--clients", type=int, default=32, show_default=True)
@click.option("--system-tokens", type=int, default=448, show_default=True)
@click.option("--own-tokens", default="16-48", show_default=True)
@click.option("--new-tokens", type=int, default=64, show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet", show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(redis_url: str, vllm_python: str, workloads: str, no_vllm: bool, n: int, clients: int, system_tokens: int,
         own_tokens: str, new_tokens: int, dtype: str, seed: int, cache_dir: str, json_path: str | None) -> None:
    torch.set_grad_enabled(False)
    lo, hi = (int(x) for x in own_tokens.split("-"))
    model_dir = make_preset("bench", Path(cache_dir).expanduser() / "models", max_seq_len=MAX_SEQ_LEN)
    loads = {"shared": shared_workload(n, system_tokens, (lo, hi), new_tokens, seed),
             "mixed": make_workload(n, (32, 512), (16, 256), seed=seed)}
    warm = warmup_prompts(seed)
    doc: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["python", "scripts/bench_prefix_cache.py", *sys.argv[1:]]),
                 "machine": machine(), "model": f"bench preset ({dtype} both sides)",
                 "workloads": {"shared": {"requests": n, "system_tokens": system_tokens, "own_tokens": own_tokens,
                                          "new_tokens": new_tokens, "seed": seed},
                               "mixed": {"requests": n, "prompt_len": "32-512", "max_new_tokens": "16-256",
                                         "seed": seed}}}
    url, private = ensure_redis(redis_url)
    lines: list[str] = []
    try:
        for name in workloads.split(","):
            load = loads[name]
            part: dict = {}
            for cache in (True, False):
                click.echo(f"{name}: fleet, prefix cache {'on' if cache else 'off'} ...", err=True)
                part["fleet_cache_on" if cache else "fleet_cache_off"] = run_fleet(
                    url, load, warm, cache, clients, cache_dir, dtype)
            part["vllm"] = None
            if not no_vllm:
                click.echo(f"{name}: vLLM CPU backend ...", err=True)
                part["vllm"] = run_vllm(vllm_python, model_dir, load, warm, dtype)
                part["fleet_vs_vllm"] = round(part["fleet_cache_on"]["throughput_tok_s"]
                                              / part["vllm"]["throughput_tok_s"], 3)
            part["on_vs_off"] = round(part["fleet_cache_on"]["throughput_tok_s"]
                                      / part["fleet_cache_off"]["throughput_tok_s"], 3)
            part["scheduler_overhead"] = sched = scheduler_overhead(load)
            doc[name] = part
            lines += table(name, part)
            lines.append(f"scheduler CPU per step (no model): cache off {sched['off']['per_step_us']} us, "
                         f"on {sched['on']['per_step_us']} us")
            click.echo("\n".join(table(name, part)), err=True)
    finally:
        if private is not None:
            private.stop()
    click.echo("\n".join(lines))
    if json_path:
        write_json(json_path, doc)


if __name__ == "__main__":
    main()
