"""``batchfleet tenants`` (the operator's tenants: set, list, remove, apply a file) and ``batchfleet usage`` (tokens
and requests per tenant), over ``Keys.tenants`` and ``Keys.usage`` (common/tenants.py). No torch, no fleet needed:
settings written before any worker starts apply when it does; a change reaches every client and gateway within
a few seconds (producer/limits.py ``SETTINGS_TRUST_S``) and every worker's scheduler at its next read."""

from __future__ import annotations

import json
from typing import Any

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import valid_tenant
from batchfleet.common.tenants import (
    LIMITS,
    Tenant,
    decode_tenants,
    read_tenants_file,
    read_usage,
    render_usage,
    usage_table,
    write_tenants,
)
from batchfleet.producer.cli import _redis, check_reachable, one_line_errors


def _limit_option(name: str, what: str):
    return click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(min=0), default=None,
                        help=f"{what}; 0 removes the limit. Unset: kept as it was (a new tenant: none).")


@click.group()
@connection_options
def tenants(redis_url: str, namespace: str) -> None:
    """The fleet's tenants (docs/TENANTS.md): each a label with a weight (its share of each priority class when
    several tenants wait) and optional limits (requests and tokens per minute, tokens per day). API keys map to
    labels in the gateway (`batchfleet serve --tenant-key LABEL:KEY`); Python clients name theirs
    (`Client(tenant=...)`, `batchfleet bulk --tenant`)."""


@tenants.command("set")
@connection_options
@click.argument("label")
@click.option("--weight", type=float, default=None, help="Share of each class when tenants wait (> 0; default 1).")
@_limit_option("requests_per_minute", "Requests admitted per sliding minute")
@_limit_option("tokens_per_minute", "Tokens (prompt + max_tokens) admitted per sliding minute")
@_limit_option("tokens_per_day", "Tokens (prompt + generated) per UTC day")
@one_line_errors
def set_tenant(redis_url: str, namespace: str, label: str, weight: float | None, **limits: int | None) -> None:
    """Create or change tenant LABEL (what is not given is kept)."""
    conn = ConnectionConfig(redis_url, namespace)
    check_reachable(conn)
    with _redis(conn) as r:
        raw = r.hget(conn.keys.tenants, label) if valid_tenant(label) else None
        stored = _checked(lambda: Tenant.decode(label, raw).settings(), f"; `batchfleet tenants remove {label}` "
                          "drops what is stored") if raw is not None else {}
        settings: dict[str, Any] = stored
        if weight is not None:
            settings["weight"] = weight
        for name, value in limits.items():
            if value == 0:
                settings.pop(name, None)
            elif value is not None:
                settings[name] = value
        tenant = _checked(lambda: Tenant.of(label, settings))
        write_tenants(r, conn.keys, [tenant])
    click.echo(f"tenant {label}: {json.dumps(tenant.settings())}")


@tenants.command("list")
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: label -> settings.")
@one_line_errors
def list_tenants(redis_url: str, namespace: str, as_json: bool) -> None:
    """The configured tenants and their settings."""
    conn = ConnectionConfig(redis_url, namespace)
    with _redis(conn) as r:
        raw = r.hgetall(conn.keys.tenants)
    stored = decode_tenants(raw)
    # an entry that does not decode (written by hand) counts as no tenant everywhere: say so, never hide it
    broken = sorted({k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in raw} - set(stored))
    for label in broken:
        click.echo(f"tenant {label[:40]!r}: stored settings do not decode (ignored: weight 1, no limit); "
                   "`batchfleet tenants remove` drops them", err=True)
    if as_json:
        click.echo(json.dumps({label: t.settings() for label, t in sorted(stored.items())}))
        return
    if not stored:
        click.echo("no tenant configured: every request runs as the default tenant, weight 1, no limit")
        return
    for label, t in sorted(stored.items()):
        limits = ", ".join(f"{k}={getattr(t, k)}" for k in LIMITS if getattr(t, k) is not None) or "no limit"
        click.echo(f"{label}: weight {t.weight:g}, {limits}")


@tenants.command("remove")
@connection_options
@click.argument("labels", nargs=-1, required=True)
@one_line_errors
def remove_tenants(redis_url: str, namespace: str, labels: tuple[str, ...]) -> None:
    """Remove tenants (their requests then run with weight 1 and no limit; their usage is kept)."""
    conn = ConnectionConfig(redis_url, namespace)
    with _redis(conn) as r:
        removed = r.hdel(conn.keys.tenants, *labels)
    click.echo(f"removed {removed} of {len(labels)} tenant(s)")


@tenants.command("apply")
@connection_options
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--replace", is_flag=True, help="Remove the tenants the file does not name.")
@one_line_errors
def apply_file(redis_url: str, namespace: str, path: str, replace: bool) -> None:
    """Store the tenants of a file (.yaml, .yml, .json or .toml: {label: {weight, requests_per_minute,
    tokens_per_minute, tokens_per_day}}, optionally under a top-level "tenants" key). All or nothing: one bad
    entry stores none."""
    stored = _checked(lambda: read_tenants_file(path))
    conn = ConnectionConfig(redis_url, namespace)
    check_reachable(conn)
    with _redis(conn) as r:
        write_tenants(r, conn.keys, stored, replace=replace)
    click.echo(f"applied {len(stored)} tenant(s) from {path}" + (" (others removed)" if replace else ""))


@click.command()
@connection_options
@click.option("--day", default=None, metavar="YYYY-MM-DD", help="Whose day the 'today' column shows (UTC; default "
              "today). Days are kept two days.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as one JSON array.")
@one_line_errors
def usage(redis_url: str, namespace: str, day: str | None, as_json: bool) -> None:
    """Requests and tokens (prompt, cached, generated) per tenant since the fleet began, its share of the generated
    tokens, its tokens today, weight and limits: counted by the workers as jobs finish."""
    conn = ConnectionConfig(redis_url, namespace)
    with _redis(conn) as r:
        configured, total, today = read_usage(r, conn.keys, day)
    rows = usage_table(configured, total, today)
    click.echo(json.dumps(rows) if as_json else render_usage(rows) if rows else "no usage counted yet")


def _checked(make: Any, hint: str = "") -> Any:
    """``make()``; a ConfigError is a usage error (one line, exit 2), ``hint`` added."""
    try:
        return make()
    except ConfigError as exc:
        raise click.UsageError(f"{exc}{hint}") from None
