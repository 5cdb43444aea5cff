"""The worker's composition root: config -> model -> engine -> transport -> loop, and the process runner.

Every way of starting a worker goes through ``build_worker``: the CLI, the demo and the benchmarks
(subprocess workers), the in-process benchmark transport, the GPU script and the tests.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from batchfleet.common import logs
from batchfleet.common.config import DynamicBatchingConfig, WorkerConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.metrics import MetricsServer, reserve_metrics
from batchfleet.common.startup import PHASES
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.engine.base import Engine
from batchfleet.worker.engine.models import LoadedModel, load_model, make_preset, resolve_dtype
from batchfleet.worker.engine.native.kernel_cache import KernelChoices
from batchfleet.worker.engine.native.linear import process_choices
from batchfleet.worker.kernel_store import KernelStore
from batchfleet.worker.loop import WorkerLoop
from batchfleet.worker.metrics import LoopStats, WorkerMetrics
from batchfleet.worker.requests.validate import Limits
from batchfleet.worker.transport.base import Transport
from batchfleet.worker.transport.consumer import default_consumer_name, wait_writable
from batchfleet.worker.transport.fleet import with_fingerprint
from batchfleet.worker.transport.sharded import redis_transport

log = logging.getLogger(__name__)


def resolve_model_path(cfg: WorkerConfig) -> Path:
    """The checkpoint dir to load: --model, else the built-in preset (created once under cache_dir)."""
    if cfg.engine.model:
        return Path(cfg.engine.model)
    return make_preset(cfg.engine.preset, Path(cfg.engine.cache_dir).expanduser() / "models", seed=cfg.engine.seed,
                       max_seq_len=cfg.batching.max_seq_len)


def build_engine(cfg: EngineConfig, batching: DynamicBatchingConfig, loaded: LoadedModel,
                 kernel_choices: KernelChoices | None = None) -> Engine:
    """Construct the configured engine around an already loaded model (``kernel_choices``: the native engine's
    measured kernel choices to look up first and add to; default: this process's)."""
    if cfg.engine == "hf":
        from batchfleet.worker.engine.hf import HFEngine

        return HFEngine(loaded, batching, cfg.pooling)
    from batchfleet.worker.engine.native.engine import NativeEngine

    return NativeEngine(loaded, batching, cfg, kernel_choices=kernel_choices)


def fleet_info(cfg: WorkerConfig, loaded: LoadedModel) -> FleetInfo:
    return FleetInfo(
        model=loaded.path.name, tokenizer_json=loaded.tokenizer.backend_tokenizer.to_str(),
        buckets=cfg.batching.buckets, max_seq_len=cfg.batching.max_seq_len,
        max_batch_size=cfg.batching.max_batch_size, vocab_size=int(loaded.model.config.vocab_size),
        eos_token_ids=tuple(sorted(loaded.eos_ids)), max_queue_len=cfg.max_queue_len,
        batch_queue_len=cfg.background_queue_len,
        chat_template=chat_template_of(loaded.tokenizer), bos_token=loaded.tokenizer.bos_token or "",
        eos_token=loaded.tokenizer.eos_token or "", scale_to_zero=cfg.scale_to_zero, pooling=cfg.engine.pooling,
        shards=cfg.shards,
    )


def chat_template_of(tokenizer) -> str:
    """The tokenizer's chat template (one string; a dict of named templates gives its "default")."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default", "")
    return template if isinstance(template, str) else ""


def build_worker(cfg: WorkerConfig, transport: Transport | None = None, loaded: LoadedModel | None = None,
                 wrap_engine: Callable[[Engine], Engine] | None = None,
                 metrics_server: MetricsServer | None = None) -> WorkerLoop:
    """Everything a worker needs, wired; does not start serving.

    ``transport`` replaces the Redis StreamConsumer (the benchmark's in-process transport); ``loaded``
    replaces loading ``cfg``'s model (a model built in memory, e.g. the GPU benchmark's random weights);
    ``wrap_engine`` wraps the engine built (tests: a fault-injecting wrapper).
    With ``metrics_port`` the port is bound first (MetricsPortInUse before any model is loaded), unless
    the caller bound it already (``metrics_server``, from ``reserve_metrics``: the CLI does, before it
    imports torch); whatever fails later leaves the fleet at once (transport closed: out of the live set)
    and frees the port.
    """
    server = metrics_server
    if server is None and cfg.metrics_port:
        server = reserve_metrics(cfg.metrics_port, cfg.metrics_host)  # served empty until the loop's metrics join
    observe = None if server is None else (lambda loop: WorkerMetrics(loop, server.registry, server))
    try:
        return _build(cfg, transport, loaded, wrap_engine, observe)
    except BaseException:
        if server is not None:
            server.close()
        raise


def _build(cfg: WorkerConfig, transport: Transport | None, loaded: LoadedModel | None,
           wrap_engine: Callable[[Engine], Engine] | None,
           observe: Callable[[WorkerLoop], LoopStats] | None) -> WorkerLoop:
    if loaded is None:
        path = resolve_model_path(cfg)
        dtype = str(resolve_dtype(cfg.engine.dtype, cfg.engine.device)).removeprefix("torch.")
        with PHASES.phase("model", "loading the model %s on %s (%s)", path.name, cfg.engine.device, dtype):
            loaded = load_model(path, cfg.engine.device, cfg.engine.dtype)
    store = None
    if cfg.engine.engine == "native" and loaded.device.type == "cpu":  # the kernel choices are measured on CPU only
        store = KernelStore(cfg, process_choices(), fleet=transport is None)
        with PHASES.phase("cache", "reading the kernel choices kept for this CPU kind"):
            store.read()
    with PHASES.phase("engine", "building the %s engine", cfg.engine.engine):
        engine = build_engine(cfg.engine, cfg.batching, loaded, store and store.choices)
    if store is not None:
        with PHASES.phase("cache"):
            store.write()
    guides = engine.guides  # type: ignore[attr-defined]  # both engines' GuideCompiler (before any wrapper)
    if wrap_engine is not None:
        engine = wrap_engine(engine)
    if transport is None:
        transport = redis_transport(cfg.connection, cfg.keys, cfg.batching.buckets,
                                    cfg.name or default_consumer_name(), cfg.reply_ttl_s, cfg.claim_idle_ms,
                                    cfg.tenant_idle_s)
    with PHASES.phase("redis", "setting up the streams (namespace %s)", cfg.connection.namespace):
        transport.setup()
    info = with_fingerprint(fleet_info(cfg, loaded))
    try:  # refuses (FleetConflict) when live workers serve another model, tokenizer or buckets; a full Redis is
        # waited out as in setup (the fault test's new.B: a worker that exits frees no memory)
        with PHASES.phase("join", "joining the fleet (namespace %s)", cfg.connection.namespace):
            wait_writable(lambda: transport.presence.join(info, replace=cfg.replace_fleet))
    except BaseException:
        transport.close()
        raise
    try:
        limits = Limits(max_seq_len=cfg.batching.max_seq_len, vocab_size=int(loaded.model.config.vocab_size))
        tokenizer = loaded.tokenizer
        with PHASES.phase("loop"):
            return WorkerLoop(cfg, engine, transport, limits,
                              decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), observe=observe,
                              guides=guides)
    except BaseException:
        transport.close()  # joined: leave the live set now, not LIVE_WORKER_MS later
        raise


def run_worker(cfg: WorkerConfig, metrics_server: MetricsServer | None = None) -> int:
    """Serve until SIGTERM/SIGINT; the running batch finishes, queued entries are handed back. Exit 0.
    ``metrics_server``: the metrics port, already bound (``reserve_metrics``)."""
    logs.configure()  # a handler when the caller set none (the CLI set the level and format already)
    if logs.current_format() == "json":  # keep stderr one JSON object per line: no progress bars in between
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    torch.set_grad_enabled(False)
    if cfg.engine.threads:  # process-wide, once, before any kernel reads it
        torch.set_num_threads(cfg.engine.threads)
    cfg = replace(cfg, name=cfg.name or default_consumer_name())
    logs.set_context(worker=cfg.name)  # on every log line of this process, model loading included
    loop = build_worker(cfg, metrics_server=metrics_server)

    def on_signal(signum, _frame) -> None:
        log.info("signal %d: finishing the running batch, then exiting", signum)
        loop.stopping.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    log.info("worker %s serving buckets %s (engine %s, mode %s, max_wait_ms %s, max_batch_size %d)",
             loop.transport.name, cfg.batching.buckets, cfg.engine.engine, cfg.engine.mode,
             cfg.batching.max_wait_ms, cfg.batching.max_batch_size)
    choices = process_choices()
    PHASES.report(note=f"kernel choices: {choices.hits} found cached, {choices.measured} measured")
    if logs.current_format() != "json":  # JSON mode: the log line above says it; nothing else is printed
        print(f"batchfleet worker {loop.transport.name} ready", flush=True)
    try:
        loop.run()
    finally:
        loop.observer.close()
        loop.transport.close()
    log.info("worker %s stopped", loop.transport.name)
    return 0
