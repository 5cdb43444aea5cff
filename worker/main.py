"""Start one worker process: load the model, build the engine, publish the fleet, serve until told to stop."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import torch
from batchfleet.common.config import WorkerConfig
from batchfleet.common.protocol import FleetInfo
from batchfleet.worker.consumer import StreamConsumer, default_consumer_name
from batchfleet.worker.engine import build_engine
from batchfleet.worker.engine.models import LoadedModel, load_model, make_preset
from batchfleet.worker.intake import Limits
from batchfleet.worker.loop import WorkerLoop

log = logging.getLogger(__name__)


def resolve_model_path(cfg: WorkerConfig, cache_dir: str | Path) -> Path:
    """The checkpoint dir to load: --model, else the built-in preset (created once in cache_dir)."""
    if cfg.engine.model:
        return Path(cfg.engine.model)
    return make_preset(cfg.engine.preset, Path(cache_dir) / "models", seed=cfg.engine.seed,
                       max_seq_len=cfg.batching.max_seq_len)


def fleet_info(cfg: WorkerConfig, loaded: LoadedModel) -> FleetInfo:
    eos = loaded.model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return FleetInfo(
        model=loaded.path.name, tokenizer_json=loaded.tokenizer.backend_tokenizer.to_str(),
        buckets=cfg.batching.buckets, max_seq_len=cfg.batching.max_seq_len,
        max_batch_size=cfg.batching.max_batch_size, vocab_size=int(loaded.model.config.vocab_size),
        eos_token_ids=tuple(eos_ids), max_queue_len=cfg.max_queue_len,
    )


def build_loop(cfg: WorkerConfig, cache_dir: str | Path, consumer=None) -> WorkerLoop:
    """Everything a worker needs, wired; does not start serving.

    ``consumer`` replaces the Redis StreamConsumer (the benchmark's in-process transport).
    """
    loaded = load_model(resolve_model_path(cfg, cache_dir), cfg.engine.device, cfg.engine.dtype)
    engine = build_engine(cfg.engine, cfg.batching, loaded)
    if consumer is None:
        consumer = StreamConsumer(cfg.connection, cfg.batching.buckets, cfg.name or default_consumer_name(),
                                  cfg.reply_ttl_s)
    consumer.setup()
    consumer.publish_fleet(fleet_info(cfg, loaded))
    limits = Limits(max_seq_len=cfg.batching.max_seq_len, vocab_size=int(loaded.model.config.vocab_size))
    return WorkerLoop(cfg, engine, consumer, limits)


def run_worker(cfg: WorkerConfig, cache_dir: str | Path) -> int:
    """Serve until SIGTERM/SIGINT; the running batch finishes, queued entries are handed back. Exit 0."""
    torch.set_grad_enabled(False)
    if cfg.engine.threads:  # process-wide, once, before any kernel reads it
        torch.set_num_threads(cfg.engine.threads)
    loop = build_loop(cfg, cache_dir)

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: finishing the running batch, then exiting", signum)
        loop.stopping.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    log.info("worker %s serving buckets %s (engine %s, mode %s, max_wait_ms %s, max_batch_size %d)",
             loop.consumer.name, cfg.batching.buckets, cfg.engine.engine, cfg.engine.mode,
             cfg.batching.max_wait_ms, cfg.batching.max_batch_size)
    print(f"batchfleet worker {loop.consumer.name} ready", flush=True)
    try:
        loop.run()
    finally:
        loop.consumer.close()
    log.info("worker %s stopped", loop.consumer.name)
    return 0
