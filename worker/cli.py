"""``batchfleet worker`` (also ``python -m batchfleet.worker``): every option is also a BATCHFLEET_* env var.

The options, their defaults and env vars come from the config dataclasses (common/options.py).
"""

from __future__ import annotations

import sys

import click

from batchfleet.common.errors import ConfigError
from batchfleet.common.options import CONFIG_CLASSES, build_worker_config, config_options, fatal, log_options


@click.command()
@config_options(*CONFIG_CLASSES)
@log_options
def worker(**values) -> None:
    """Serve bucket streams: read up to max_batch_size entries within max_wait_ms, run, reply."""
    try:
        cfg = build_worker_config(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    from batchfleet.common.metrics import MetricsPortInUse
    from batchfleet.worker.compose import run_worker
    from batchfleet.worker.fleet import FleetConflict

    try:
        code = run_worker(cfg)
    except (FleetConflict, MetricsPortInUse) as exc:  # one clear line, no traceback: an operator mistake
        raise fatal(str(exc)) from None
    sys.exit(code)
