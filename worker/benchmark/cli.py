"""``batchfleet bench``: the dynamic-batching table for your model and hardware, in one command."""

from __future__ import annotations

import datetime
import sys
import tempfile

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.options import config_options
from batchfleet.common.redis.url import redact_url
from batchfleet.worker.benchmark.loadgen import make_workload
from batchfleet.worker.benchmark.report import machine, markdown_table, plot, write_json
from batchfleet.worker.benchmark.runner import LoadSpec, latency_probe, run_load, serving_inproc, serving_redis
from batchfleet.worker.benchmark.strategies import DEFAULT_STRATEGIES, parse_strategies, parse_strategy
from batchfleet.worker.devtools import ensure_redis


def parse_range(text: str) -> tuple[int, int]:
    """``LO-HI`` (or ``N``) as (LO, HI); a click usage error otherwise."""
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise click.BadParameter(f"expected LO-HI with 0 < LO <= HI, got {text!r}")
    return a, b


@click.command()
@connection_options
# the worker options the benchmarked workers get; --strategies sets max_wait_ms, mode and window (and
# max_batch_size for staticN), so the command takes none of them
@config_options(EngineConfig, DynamicBatchingConfig, exclude=("max_wait_ms", "mode", "window"),
                defaults={"preset": "bench"})
@click.option("--strategies", default=DEFAULT_STRATEGIES, show_default=True,
              help="staticN (wait for N, no timeout), dynamicX (max_wait X ms), fixedX (continuous mode, fixed X ms "
                   "window), continuous (the default: continuous mode, adaptive window).")
@click.option("--clients", type=int, default=32, show_default=True, help="Closed loop: concurrent clients.")
@click.option("--rate", type=float, default=None, help="Open loop: Poisson arrivals, requests/s (overrides clients).")
@click.option("--requests", "n_requests", type=int, default=32, show_default=True,
              help="Requests per strategy (the same workload for each).")
@click.option("--prompt-len", default="32-512", show_default=True, help="Prompt tokens, uniform LO-HI.")
@click.option("--max-new-tokens", "new_tokens", default="16-256", show_default=True, help="Uniform LO-HI.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the workload (prompt lengths, new tokens, arrivals): the same seed, the same load.")
@click.option("--attach", is_flag=True, help="Use the fleet already serving --namespace instead of starting one.")
@click.option("--overhead/--no-overhead", default=True, show_default=True,
              help="Also run --overhead-strategy in-process (no Redis) and report what the queue adds.")
@click.option("--overhead-strategy", default="static8", show_default=True,
              help="Strategy for the throughput comparison (static batches form the same way on both paths).")
@click.option("--json", "json_path", default=None, help="Write results as JSON here.")
@click.option("--plot", "plot_path", default=None, help="Write the throughput/TTFT plot (PNG) here.")
def bench(redis_url: str, namespace: str, strategies: str, clients: int, rate: float | None,
          n_requests: int, prompt_len: str, new_tokens: str, seed: int, attach: bool, overhead: bool,
          overhead_strategy: str, json_path: str | None, plot_path: str | None, **worker_kw) -> None:
    """Load one worker through the real Redis path under each strategy; print, save and plot the table."""
    max_batch_size = worker_kw.pop("max_batch_size")  # reaches the workers through the strategies
    try:
        plan = parse_strategies(strategies, max_batch_size)
        over = parse_strategy(overhead_strategy, max_batch_size) if overhead and not attach else None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if worker_kw["engine"] == "hf":
        skipped = [s.name for s in plan if s.mode == "continuous"]
        plan = [s for s in plan if s.mode != "continuous"]
        if skipped:
            click.echo("note: the hf engine cannot join running batches; skipping continuous", err=True)
    if attach and len(plan) != 1:
        raise click.UsageError("--attach measures the fleet as it runs: give exactly one --strategies label")
    workload = make_workload(n_requests, parse_range(prompt_len), parse_range(new_tokens), seed=seed)
    spec = LoadSpec(workload, clients=clients, rate=rate, seed=seed)
    url, private = ensure_redis(redis_url)
    log_dir = tempfile.mkdtemp(prefix="batchfleet-bench-")
    click.echo(f"redis {redact_url(url)}; {len(workload)} requests; worker logs in {log_dir}", err=True)
    if not worker_kw["model"]:  # create the preset once, before any worker races to it
        from batchfleet.common.options import build_worker_config
        from batchfleet.worker.compose import resolve_model_path

        resolve_model_path(build_worker_config(**worker_kw))
    rows, overhead_doc = [], None
    try:
        for strategy in plan:
            click.echo(f"running {strategy.name} ...", err=True)
            serving = serving_redis(url, strategy, worker_kw, namespace if attach else None, log_dir)
            rows.append(run_load(serving, strategy, spec, "redis"))
            click.echo(f"  {rows[-1]['throughput_tok_s']} tok/s, TTFT p50 {rows[-1]['ttft_p50_ms']} ms", err=True)
        if over is not None:
            click.echo(f"queue overhead: {over.name} over Redis vs in-process, then latency probes ...", err=True)
            via_redis = run_load(serving_redis(url, over, worker_kw, None, log_dir), over, spec, "redis")
            inproc = run_load(serving_inproc(over, worker_kw), over, spec, "in-process")
            idle = parse_strategy("dynamic0")
            short = [p[:8] for p in workload.prompts]
            probe_redis = latency_probe(serving_redis(url, idle, worker_kw, None, log_dir), short).e2e_p50_ms
            probe_inproc = latency_probe(serving_inproc(idle, worker_kw), short).e2e_p50_ms
            overhead_doc = {
                "strategy": over.name, "redis": via_redis, "in_process": inproc,
                "throughput_ratio": round(via_redis["throughput_tok_s"] / inproc["throughput_tok_s"], 3),
                "probe": "sequential single requests, 8-token prompt, 1 new token, max_wait_ms 0",
                "probe_e2e_p50_ms": {"redis": probe_redis, "in_process": probe_inproc},
                "added_latency_p50_ms": round(probe_redis - probe_inproc, 3),
            }
    finally:
        if private is not None:
            private.stop()
    mode = f"open loop {rate} req/s" if rate else f"closed loop {clients} clients"
    title = (f"{worker_kw['model'] or worker_kw['preset']} / {worker_kw['engine']} / {worker_kw['device']} / "
             f"{mode} / {n_requests} requests")
    click.echo(f"\n{title}\n")
    click.echo(markdown_table(rows))
    if overhead_doc:
        o = overhead_doc
        click.echo(f"\nqueue overhead ({o['strategy']}): Redis/in-process throughput {o['throughput_ratio']:.3f}; "
                   f"added latency p50 {o['added_latency_p50_ms']:.2f} ms")
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["batchfleet", *sys.argv[1:]]), "machine": machine(), "title": title,
           "engine": worker_kw, "load": {"mode": mode, "requests": n_requests, "prompt_len": prompt_len,
                                         "max_new_tokens": new_tokens, "seed": seed},
           "rows": rows, "overhead": overhead_doc}
    if json_path:
        write_json(json_path, doc)
    if plot_path:
        plot(rows, plot_path, title)
