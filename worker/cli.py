"""``batchfleet worker`` (also ``python -m batchfleet.worker``): every option is also a BATCHFLEET_* env var."""

from __future__ import annotations

import sys

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import (
    DEFAULT_BUCKETS,
    ENGINE_CHOICES,
    MODE_CHOICES,
    PADDING_CHOICES,
    ConfigError,
    ConnectionConfig,
    DynamicBatchingConfig,
    EngineConfig,
    WorkerConfig,
    parse_buckets,
)

DEFAULT_CACHE_DIR = "~/.cache/batchfleet"


def engine_options(fn=None, *, default_preset: str = "tiny"):
    """Options that choose and shape the engine (shared with demo and bench)."""
    if fn is None:
        return lambda f: engine_options(f, default_preset=default_preset)
    opts = [
        click.option("--model", envvar="BATCHFLEET_MODEL", default=None,
                     help="Local HF checkpoint dir (Llama/Mistral/Qwen2). Default: built-in preset."),
        click.option("--preset", envvar="BATCHFLEET_PRESET", type=click.Choice(["tiny", "bench"]),
                     default=default_preset, show_default=True,
                     help="Built-in model made locally when --model is not given."),
        click.option("--device", envvar="BATCHFLEET_DEVICE", default="cpu", show_default=True,
                     help="cpu | cuda[:i] | npu[:i]"),
        click.option("--dtype", envvar="BATCHFLEET_DTYPE", type=click.Choice(["float32", "bfloat16", "float16"]),
                     default=None, help="Default: measured per device (bf16 on AMX/AVX512-BF16 CPUs, GPU, NPU)."),
        click.option("--engine", envvar="BATCHFLEET_ENGINE", type=click.Choice(ENGINE_CHOICES),
                     default=EngineConfig.engine, show_default=True),
        click.option("--mode", envvar="BATCHFLEET_MODE", type=click.Choice(MODE_CHOICES), default="dynamic",
                     show_default=True, help="dynamic: a batch runs to completion; continuous: joins between steps."),
        click.option("--max-wait-ms", envvar="BATCHFLEET_MAX_WAIT_MS", type=float, default=50.0, show_default=True),
        click.option("--max-batch-size", envvar="BATCHFLEET_MAX_BATCH_SIZE", type=int, default=32,
                     show_default=True, help="Per bucket."),
        click.option("--max-seq-len", envvar="BATCHFLEET_MAX_SEQ_LEN", type=int, default=4096, show_default=True),
        click.option("--buckets", envvar="BATCHFLEET_BUCKETS", default=",".join(map(str, DEFAULT_BUCKETS)),
                     show_default=True, help="Prompt-length buckets (one stream each), comma-separated."),
        click.option("--padding", envvar="BATCHFLEET_PADDING", type=click.Choice(PADDING_CHOICES),
                     default="bucket", show_default=True),
        click.option("--block-size", envvar="BATCHFLEET_BLOCK_SIZE", type=int, default=16, show_default=True,
                     help="KV cache block size (native engine)."),
        click.option("--kv-cache-gb", envvar="BATCHFLEET_KV_CACHE_GB", type=float, default=None,
                     help="KV pool size (native engine). Default: a fraction of free memory."),
        click.option("--threads", envvar="BATCHFLEET_THREADS", type=int, default=None,
                     help="CPU threads per worker (torch + kernels). Default: all cores. With N workers on one "
                          "host give each cores/N: OpenMP threads fighting over cores slow everything down."),
        click.option("--cache-dir", envvar="BATCHFLEET_CACHE_DIR", default=DEFAULT_CACHE_DIR, show_default=True,
                     help="Where built-in presets are created."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def engine_args(engine_kw: dict) -> list[str]:
    """Turn engine_options values back into CLI args (to start a worker subprocess with them)."""
    args: list[str] = []
    for key, value in engine_kw.items():
        if value is not None:
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def build_worker_config(redis_url: str, namespace: str, reply_ttl: int = 3600, max_queue_len: int = 10_000,
                        name: str | None = None, claim_idle_ms: int = 30_000, max_deliveries: int = 3,
                        stall_timeout_s: float = 600.0, **kw) -> WorkerConfig:
    """The one place a WorkerConfig is assembled from CLI values."""
    return WorkerConfig(
        connection=ConnectionConfig(redis_url=redis_url, namespace=namespace),
        batching=DynamicBatchingConfig(max_wait_ms=kw["max_wait_ms"], max_batch_size=kw["max_batch_size"],
                                       max_seq_len=kw["max_seq_len"], buckets=parse_buckets(kw["buckets"]),
                                       padding=kw["padding"]),
        engine=EngineConfig(model=kw["model"], preset=kw["preset"], engine=kw["engine"], mode=kw["mode"],
                            device=kw["device"], dtype=kw["dtype"], block_size=kw["block_size"],
                            kv_cache_gb=kw["kv_cache_gb"], threads=kw.get("threads"),
                            cache_dir=kw.get("cache_dir", DEFAULT_CACHE_DIR),
                            native_kernel=kw.get("native_kernel", True)),
        reply_ttl_s=reply_ttl, max_queue_len=max_queue_len, name=name, claim_idle_ms=claim_idle_ms,
        max_deliveries=max_deliveries, stall_timeout_s=stall_timeout_s,
    )


@click.command()
@connection_options
@engine_options
@click.option("--reply-ttl", envvar="BATCHFLEET_REPLY_TTL", type=int, default=3600, show_default=True,
              help="Seconds a reply waits for its client.")
@click.option("--max-queue-len", envvar="BATCHFLEET_MAX_QUEUE_LEN", type=int, default=10_000, show_default=True,
              help="Per-bucket queue length at which producers get QueueFull (0 = unbounded).")
@click.option("--claim-idle-ms", envvar="BATCHFLEET_CLAIM_IDLE_MS", type=int, default=30_000, show_default=True,
              help="Reclaim entries a silent (dead) worker left pending this long.")
@click.option("--max-deliveries", envvar="BATCHFLEET_MAX_DELIVERIES", type=int, default=3, show_default=True,
              help="Deliveries before an entry is dead-lettered and answered worker_failed.")
@click.option("--stall-timeout-s", envvar="BATCHFLEET_STALL_TIMEOUT_S", type=float, default=600.0, show_default=True,
              help="A worker whose loop makes no progress this long (one engine step included) stops renewing "
                   "its leases, so other workers take its requests over.")
@click.option("--name", envvar="BATCHFLEET_WORKER_NAME", default=None, help="Consumer name (default host-pid-rand).")
def worker(**kw) -> None:
    """Serve bucket streams: read up to max_batch_size entries within max_wait_ms, run, reply."""
    try:
        cfg = build_worker_config(**kw)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    from batchfleet.worker.compose import run_worker

    sys.exit(run_worker(cfg))
