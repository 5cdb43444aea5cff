"""``batchfleet submit``, ``batchfleet bulk`` and ``batchfleet status``: producer-side commands (no torch)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click
import msgpack
import redis

from batchfleet.common.cli import connection_options
from batchfleet.common.config import connection_from_env
from batchfleet.common.errors import BatchfleetError
from batchfleet.common.protocol import FleetInfo
from batchfleet.producer.bulk import read_jsonl, run_bulk
from batchfleet.producer.client import Client


def _params(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
            stop: tuple[str, ...]) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": list(stop) or None}


def generation_options(fn):
    for opt in reversed([
        click.option("--max-new-tokens", type=int, default=64, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True),
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
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def submit(redis_url: str, namespace: str, prompt: str, timeout: float | None, as_json: bool, **gen) -> None:
    """Send one prompt and print its completion."""
    with Client(redis_url, namespace) as client:
        try:
            result = client.generate(prompt, timeout=timeout, **_params(**gen))
        except BatchfleetError as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(asdict(result)))
    else:
        click.echo(result.text)
        click.echo(f"[{result.completion_tokens} tokens, finish={result.finish_reason}, "
                   f"queue {result.queue_ms:.0f} ms, ttft {result.ttft_ms:.0f} ms, total {result.total_ms:.0f} ms, "
                   f"batch {result.batch_size}]", err=True)


@click.command()
@connection_options
@click.argument("prompts", type=click.File("r"))
@click.option("-o", "--output", type=click.File("w"), default="-", show_default=True,
              help="JSONL: one line per prompt, in input order: {index, result} or {index, error}.")
@click.option("--window", type=int, default=256, show_default=True, help="Max jobs in flight.")
@generation_options
def bulk(redis_url: str, namespace: str, prompts, output, window: int, timeout: float | None, **gen) -> None:
    """Submit every line of a JSONL file ({"prompt": ..., optional params}); never aborts on a bad line."""
    from tqdm import tqdm

    if window < 1:
        raise click.UsageError("--window must be >= 1")
    lines = prompts.readlines()
    failed = 0
    with Client(redis_url, namespace) as client:
        try:
            client.fleet()
        except BatchfleetError as exc:
            raise click.ClickException(str(exc)) from exc
        items = read_jsonl(iter(lines))
        bar = tqdm(total=sum(1 for line in lines if line.strip()), unit="prompt", file=sys.stderr)
        for out in run_bulk(client, items, window, _params(**gen), timeout):
            failed += "error" in out
            output.write(json.dumps(out) + "\n")
            bar.update(1)
        bar.close()
    click.echo(f"done: {bar.n} prompts, {failed} failed", err=True)


@click.command()
@connection_options
def status(redis_url: str, namespace: str) -> None:
    """Show live workers and queue lengths of a namespace."""
    conn = connection_from_env(redis_url, namespace)
    keys = conn.keys
    r = redis.Redis.from_url(conn.redis_url, socket_timeout=conn.socket_timeout_s)
    fleet = r.get(keys.fleet)
    if fleet is None:
        click.echo(f"no fleet published under namespace {namespace!r}")
        return
    info = FleetInfo.decode(fleet)
    click.echo(f"model {info.model}  buckets {list(info.buckets)}  max_seq_len {info.max_seq_len}")
    for b in info.buckets:
        click.echo(f"  stream {keys.stream(b)}: {r.xlen(keys.stream(b))} entries")
    for key in r.scan_iter(match=keys.worker("*"), count=100):
        raw = r.get(key)
        if raw:
            click.echo(f"  worker {json.dumps(msgpack.unpackb(raw, raw=False), default=str)}")
    r.close()
