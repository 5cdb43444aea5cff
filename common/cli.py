"""The ``batchfleet`` command. Subcommands load lazily so ``submit`` never imports torch."""

from __future__ import annotations

import importlib
import importlib.util

import click

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.options import config_options, log_options

_COMMANDS = {
    "worker": "batchfleet.worker.cli:worker",
    "demo": "batchfleet.worker.demo:demo",
    "bench": "batchfleet.worker.benchmark.cli:bench",
    "submit": "batchfleet.producer.cli:submit",
    "bulk": "batchfleet.gateway.cli.bulk:bulk",
    "status": "batchfleet.producer.cli:status",
    "serve": "batchfleet.gateway.cli.serve:serve",
    "batches": "batchfleet.gateway.cli.serve:batches",
    "dashboard": "batchfleet.producer.cli:dashboard",
    "tenants": "batchfleet.producer.ops.tenants:tenants",
    "usage": "batchfleet.producer.ops.tenants:usage",
}

# `pip install batchfleet` is the client only: a command that needs an extra's packages says which
# extra to install (one line) instead of failing with a traceback deep in an import.
_EXTRAS = {"worker": ("torch", "transformers"), "serve": ("fastapi", "uvicorn")}
_NEEDS = {"worker": "worker", "demo": "worker", "bench": "worker", "serve": "serve", "batches": "serve"}


# --redis-url / --namespace (BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE), shared by every command
# --wait-replicas is a worker option; clients (submit, bulk, the gateway, Python) read BATCHFLEET_WAIT_REPLICAS
# --log-level / --log-format come with them, so every command takes them (not only the group)
_connection = config_options(ConnectionConfig, exclude=("wait_replicas",))


def connection_options(fn):
    """--redis-url, --namespace, --log-level, --log-format (each with its BATCHFLEET_* variable)."""
    return log_options(_connection(fn))


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (or is listed); a subcommand whose
    extra is not installed (``worker``, ``demo``, ``bench``: [worker]; ``serve``: [serve]) fails with one
    line naming the extra."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _COMMANDS:
            return None
        module, attr = _COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attr)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:
        # checked before the subcommand's module is imported: that import may be what fails
        extra = _NEEDS.get(args[0]) if args else None
        if extra and not ctx.resilient_parsing:
            missing = [m for m in _EXTRAS[extra] if importlib.util.find_spec(m) is None]  # finds, never imports
            if missing:
                raise click.ClickException(f"batchfleet {args[0]} needs {', '.join(missing)}, which this install "
                                           f"lacks: pip install 'batchfleet[{extra}]'")
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup)
@connection_options
def main(redis_url: str, namespace: str) -> None:
    """batchfleet: a Redis-streams LLM inference fleet with dynamic batching.

    Every option of the fleet's configuration also reads BATCHFLEET_<OPTION> (shown in each command's
    --help). --redis-url, --namespace, --log-level and --log-format work here, for whichever command
    follows, and on every command (the command's own option wins)."""
    # nothing to do here: each subcommand's option takes the group's value (common/options.py _group_value)


if __name__ == "__main__":
    main()
