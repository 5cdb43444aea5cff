"""``batchfleet worker`` (also ``python -m batchfleet.worker``): every option is also a BATCHFLEET_* env var.

The options, their defaults and env vars come from the config dataclasses (common/options.py).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from batchfleet.common import logs
from batchfleet.common.errors import ConfigError
from batchfleet.common.options import CONFIG_CLASSES, build_worker_config, config_options, fatal, log_options
from batchfleet.common.startup import PHASES


@click.command()
@config_options(*CONFIG_CLASSES)
@log_options
def worker(**values) -> None:
    """Serve bucket streams: read up to max_batch_size entries within max_wait_ms, run, reply."""
    try:
        cfg = build_worker_config(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    from batchfleet.common.metrics import MetricsPortInUse, reserve_metrics

    server = None
    try:
        if cfg.metrics_port:  # checked first: a port in use stops this worker in a second, before torch loads
            server = reserve_metrics(cfg.metrics_port, cfg.metrics_host)
        from batchfleet.worker.transport.consumer import default_consumer_name  # no torch

        cfg = replace(cfg, name=cfg.name or default_consumer_name())
        logs.set_context(worker=cfg.name)  # named from the first line on, as every line of a worker process
        with PHASES.phase("imports", "loading torch and transformers"):
            from batchfleet.worker.compose import run_worker
            from batchfleet.worker.transport.fleet import FleetConflict

        try:
            code = run_worker(cfg, metrics_server=server)
        except FleetConflict as exc:  # one clear line, no traceback: an operator mistake, not a crash
            raise fatal(str(exc)) from None
    except MetricsPortInUse as exc:
        raise fatal(str(exc)) from None
    sys.exit(code)
