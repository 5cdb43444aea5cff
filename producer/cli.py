"""``batchfleet submit``, ``batchfleet bulk`` and ``batchfleet status``: producer-side commands (no torch).

What goes wrong at a terminal (Redis unreachable, no workers, a timeout, a prompt too long, a full
queue, a failed job) prints one line and exits 1, never a traceback: see ``one_line_errors``.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

import click
import redis

from batchfleet.common.cli import connection_options
from batchfleet.common.config import ConnectionConfig, DashboardConfig
from batchfleet.common.errors import BatchfleetError, RedisUnavailable
from batchfleet.common.options import config_options, config_values, fatal
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.url import redact_url
from batchfleet.common.wire.priority import DEPRECATED, INTERACTIVE, PRIORITIES, priority_of
from batchfleet.producer.client import Client

F = TypeVar("F", bound=Callable[..., Any])


def error_line(exc: BaseException, redis_url: str) -> str | None:
    """The one line a person reads for ``exc``; None for an exception that is a bug (its traceback stays).

    The Redis URL is shown without its password.
    """
    where = f"Redis at {redact_url(redis_url)}"
    if isinstance(exc, redis.AuthenticationError):
        text = f"{where} refused the credentials: {exc}"
    elif isinstance(exc, (RedisUnavailable, redis.ConnectionError, redis.TimeoutError)):
        text = f"{where} is unreachable: {exc or type(exc).__name__}"
    elif isinstance(exc, redis.RedisError):
        text = f"{where} answered with an error: {exc}"
    elif isinstance(exc, BatchfleetError):
        # NoWorkers, FleetUnavailable, Timeout, PromptTooLong, InvalidRequest, QueueFull, JobFailed, ConfigError:
        # the public name (common/errors.py), not a module's own subclass (common/wire/params.py ParamError)
        name = next(c.__name__ for c in type(exc).__mro__ if c.__module__ == BatchfleetError.__module__)
        text = f"{name}: {exc}"
    else:
        return None
    return " ".join(text.split())  # one line, whatever the message held


def one_line_errors(command: F) -> F:
    """Decorator for a command taking ``redis_url``: expected failures become ``click.ClickException``
    (``Error: <one line>`` on stderr, exit code 1)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (BatchfleetError, redis.RedisError) as exc:
            line = error_line(exc, kwargs.get("redis_url") or "")
            if line is None:
                raise
            raise fatal(line) from None

    return run  # type: ignore[return-value]


def _redis(conn: ConnectionConfig) -> redis.Redis:
    return sync_client(conn.redis_url, socket_timeout=conn.socket_timeout_s,
                       socket_connect_timeout=conn.socket_timeout_s)


def check_reachable(conn: ConnectionConfig) -> None:
    """Open one connection (the same handshake the client makes: AUTH, SELECT, ...) and close it, so an
    unreachable Redis or wrong credentials fail at once with one line instead of after the client's
    ``retry_s`` of backoff; the client keeps its retries for outages in the middle of a run."""
    r = _redis(conn)  # a cluster client connects here already: it asks a seed node for the slot map
    if getattr(r, "connection_pool", None) is None:
        r.close()
        return
    connection = r.connection_pool.make_connection()
    try:
        connection.connect()
    finally:
        connection.disconnect()
        r.close()


def _params(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
            stop: tuple[str, ...], priority: str) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": list(stop) or None, "priority": priority}


def priority_option(default: str):
    """``--priority``: the priority (common/wire/priority.py); ``submit`` defaults to interactive, ``bulk`` to
    background. ``batch``, background's deprecated name, is still accepted (and means background)."""
    return click.option("--priority", type=click.Choice((*PRIORITIES, *DEPRECATED)), default=default,
                        show_default=True, callback=lambda ctx, param, value: priority_of(value),
                        help="Priority: interactive work is read, batched and run first; background work uses "
                             "the spare capacity (docs/OPERATIONS.md). batch: deprecated name of background.")


def generation_options(fn):
    for opt in reversed([
        click.option("--max-new-tokens", type=int, default=64, show_default=True,
                     help="Most tokens to generate (fewer when a stop string or the end-of-text token comes first)."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Nucleus sampling: only the most likely tokens whose probabilities add up to this "
                          "(1.0 = off)."),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--seed", type=int, default=None, help="Makes a sampled answer reproducible."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--timeout", type=float, default=None, help="Seconds to wait; also the request deadline."),
    ]):
        fn = opt(fn)
    return fn


@click.command()
@connection_options
@click.argument("prompt")
@generation_options
@priority_option(INTERACTIVE)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
@one_line_errors
def submit(redis_url: str, namespace: str, prompt: str, timeout: float | None, as_json: bool, **gen) -> None:
    """Send one prompt and print its completion."""
    check_reachable(ConnectionConfig(redis_url, namespace))
    client = Client(redis_url, namespace)
    try:
        result = client.generate(prompt, timeout=timeout, **_params(**gen))
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(asdict(result)))
    else:
        click.echo(result.text)
        click.echo(f"[{result.completion_tokens} tokens, finish={result.finish_reason}, "
                   f"queue {result.queue_ms:.0f} ms, ttft {result.ttft_ms:.0f} ms, total {result.total_ms:.0f} ms, "
                   f"batch {result.batch_size}]", err=True)


@click.command()
@connection_options
@one_line_errors
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (per refresh with --watch).")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS until Ctrl-C.")
@click.option("--gateway", default=None, metavar="URL", help="Read the status through this gateway (or "
              "`batchfleet dashboard`) with --operator-key instead of from Redis.")
@click.option("--operator-key", envvar="BATCHFLEET_OPERATOR_KEY", show_envvar=True, default=None,
              help="--gateway: the read-only operator key (or an API key where the gateway sets no operator key).")
def status(redis_url: str, namespace: str, as_json: bool, watch: float | None, gateway: str | None,
           operator_key: str | None) -> None:
    """Queues per bucket and priority, workers (alive or gone, load, KV use, tok/s), dead letters, batch jobs
    (/v1/batches) and bulk runs (`batchfleet bulk`) of a namespace, read from Redis (no worker needed) or
    through a gateway (--gateway). The web view of the same: `batchfleet dashboard`, or /dashboard."""
    import time

    from batchfleet.producer.ops.status import render, snapshot, work
    from batchfleet.producer.ops.status_remote import StatusUnavailable, fetch_status

    if watch is not None and watch <= 0:
        raise click.UsageError("--watch must be > 0")
    conn = ConnectionConfig(redis_url, namespace)
    with _redis(conn) as r:
        try:
            while True:
                try:
                    snap = fetch_status(gateway, operator_key) if gateway else {**snapshot(r, conn.keys),
                                                                                **work(r, conn.keys)}
                except StatusUnavailable as exc:
                    if watch is None:
                        raise click.ClickException(str(exc)) from None
                    click.echo(f"Error: {exc}", err=True)
                except redis.RedisError as exc:
                    if watch is None:
                        raise
                    click.echo(f"Error: {error_line(exc, redis_url)}", err=True)  # a live view rides out outages
                else:
                    if as_json:
                        click.echo(json.dumps(snap))
                    else:
                        if watch is not None:
                            click.clear()
                        click.echo(render(snap))
                if watch is None:
                    return
                time.sleep(watch)
        except KeyboardInterrupt:  # the way out of --watch
            return


@click.command()
@connection_options
@config_options(DashboardConfig)
def dashboard(redis_url: str, namespace: str, **values: Any) -> None:
    """Serve the live web dashboard (queues, workers, recent batches, dead letters) on
    http://HOST:PORT/dashboard until Ctrl-C. The gateway (`batchfleet serve`) serves the same page at
    /dashboard. With --operator-key the data needs one of those read-only keys (else, with --api-key, an
    API key); the page asks for it, or open /dashboard#key=KEY."""
    from batchfleet.producer.ops.dashboard import DashboardServer

    try:
        config = DashboardConfig(**config_values(DashboardConfig, values))
        conn = ConnectionConfig(redis_url, namespace)
    except BatchfleetError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        server = DashboardServer(config, conn)
    except OSError as exc:  # the port is taken: one line
        raise fatal(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    auth = (f"{len(config.operator_keys)} operator key(s)" if config.operator_keys else
            f"{len(config.api_keys)} API key(s)" if config.api_keys else "no key")
    logging.getLogger(__name__).info("batchfleet dashboard on http://%s:%d/dashboard for namespace %r, %s",
                                     config.host, server.port, namespace, auth)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
