"""The ``batchfleet`` command. Subcommands load lazily so ``submit`` never imports torch."""

from __future__ import annotations

import importlib
import logging

import click

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.options import config_options

_COMMANDS = {
    "worker": "batchfleet.worker.cli:worker",
    "demo": "batchfleet.worker.demo:demo",
    "bench": "batchfleet.worker.benchmark.cli:bench",
    "submit": "batchfleet.producer.cli:submit",
    "bulk": "batchfleet.producer.cli:bulk",
    "status": "batchfleet.producer.cli:status",
}


# --redis-url / --namespace (BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE), shared by every command
connection_options = config_options(ConnectionConfig)


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or is listed)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attr = _COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup)
@click.option("--log-level", envvar="BATCHFLEET_LOG_LEVEL", default="INFO", show_default=True)
def main(log_level: str) -> None:
    """batchfleet: a Redis-streams LLM inference fleet with dynamic batching."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    main()
