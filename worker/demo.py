"""``batchfleet demo``: the main job on embedded defaults, end to end on one machine.

Uses the configured Redis if reachable (else a private one), starts one worker with the default model,
sends 64 prompts from 32 client threads through one Client, prints throughput / TTFT / batch size, and cleans
up every process and key it created.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.options import build_worker_config, config_options, option_args
from batchfleet.common.redis.url import redact_url
from batchfleet.worker.benchmark.loadgen import percentile
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

WORDS = ("fleet batch token queue redis stream worker bucket cache paged decode prefill latency "
         "throughput accelerator prompt model reply").split()


def make_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """Prompts of mixed lengths (8 to max_chars bytes) so several buckets are used."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = max_chars
        target = rng.choice([rng.randint(8, m // 4), rng.randint(m // 3, m * 6 // 10), rng.randint(m * 65 // 100, m)])
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:target])
    return out


@click.command()
@connection_options
@config_options(EngineConfig, DynamicBatchingConfig)  # all passed on to the demo's worker
@click.option("--requests", "n_requests", type=int, default=64, show_default=True, help="Prompts to send.")
@click.option("--clients", type=int, default=32, show_default=True, help="Concurrent client threads.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
def demo(redis_url: str, namespace: str, n_requests: int, clients: int, max_new_tokens: int, **worker_kw) -> None:
    """Run a worker and --clients client threads against it; print a results table."""
    from batchfleet.producer import Client

    try:
        cfg = build_worker_config(**worker_kw)  # validated here, before any process starts
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    url, private = ensure_redis(redis_url)
    click.echo(f"redis: {redact_url(url)}" + (" (private, started by the demo)" if private else ""))
    ns = f"{namespace}-demo-{uuid.uuid4().hex[:6]}"
    log = Path(tempfile.gettempdir()) / f"batchfleet-{ns}.log"
    worker = None
    try:
        click.echo(f"starting worker (namespace {ns}, log {log}) ...")
        worker = spawn_worker(url, ns, option_args(worker_kw), log_path=str(log))
        prompts = make_prompts(n_requests)
        with Client(url, ns) as client:
            client.generate("warm up", max_new_tokens=2)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda p: client.generate(p, max_new_tokens=max_new_tokens), prompts))
            wall = time.perf_counter() - t0
        tokens = sum(r.completion_tokens for r in results)
        ttft = [r.ttft_ms for r in results]
        rows = [
            ("requests", f"{len(results)} from {clients} client threads"),
            ("engine / mode", f"{cfg.engine.engine} / {cfg.engine.mode}"),
            ("max_wait_ms / max_batch_size", f"{worker_kw['max_wait_ms']:g} / {worker_kw['max_batch_size']}"),
            ("output tokens", str(tokens)),
            ("wall time", f"{wall:.2f} s"),
            ("throughput", f"{tokens / wall:.1f} tok/s"),
            ("TTFT p50 / p99", f"{percentile(ttft, 50):.0f} / {percentile(ttft, 99):.0f} ms"),
            ("mean batch size", f"{statistics.mean(r.batch_size for r in results):.1f}"),
            ("buckets used", ", ".join(sorted({str(r.extra.get('bucket')) for r in results}))),
        ]
        click.echo("\n| metric | value |\n|---|---|")
        for k, v in rows:
            click.echo(f"| {k} | {v} |")
    finally:
        if worker is not None:
            worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
