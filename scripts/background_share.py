"""A batch job and a bulk run side by side on one worker (issue 58 item 5): do both move all the time?

Two runs start together on their own clients, as two processes would: a bulk run (the prompt format of
``batchfleet bulk``) and an OpenAI batch job (the batch format, as gateway/batches/runner.py runs it), both
through the one runner (producer/bulk/runner.py) at background priority with the default window (256).
Each line written is timed; per run: answers in each 10-s window while it has lines left, the windows with
none, the longest gap between two answers (from the start), and the longest streak of one run's answers
while the other still had lines left (timing-free: how far one run got ahead of the other).

"before": each run queues its whole window at once (``Spec.share`` False); "after": each keeps at most the
fleet's next read of its jobs queued unread (producer/bulk/queued.py, the default). Also the bulk run alone,
before and after: what the limit costs a run with the fleet to itself.

    python scripts/background_share.py --json docs/bench/background_share.json

Writes JSON and prints a table. Not a test: run it on a quiet machine (tests/test_background_share.py checks
the property on a small load).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.gateway.batches.format import OpenAIFormat
from batchfleet.gateway.batches.lines import Limits
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk.files import FileSink
from batchfleet.producer.bulk.lines import PromptFormat, numbered
from batchfleet.producer.bulk.runner import run_lines
from batchfleet.producer.bulk.work import LineFormat, Spec, Summary
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

WINDOW_S = 10.0
RUNS = ("bulk", "batch")


def _inputs(tmp: Path, lines: int, max_new_tokens: int, model: str) -> dict[str, Path]:
    bulk, batch = tmp / "bulk.jsonl", tmp / "batch.jsonl"
    bulk.write_text("".join(json.dumps({"prompt": f"Write a short note about item {i}: " + "details " * (i % 9),
                                        "max_new_tokens": max_new_tokens}) + "\n" for i in range(lines)))
    batch.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": max_new_tokens,
                 "messages": [{"role": "user", "content": f"Tell me about order {i}: " + "words " * (i % 7)}]}})
        + "\n" for i in range(lines)))
    return {"bulk": bulk, "batch": batch}


async def _one(url: str, ns: str, name: str, src: Path, tmp: Path, share: bool, t0: float,
               times: list[float]) -> Summary:
    async with AsyncClient(url, ns) as client:
        fleet = await client.fleet()
        prefix = f"{name}{secrets.token_hex(4)}"
        fmt: LineFormat
        if name == "bulk":
            fmt = PromptFormat(prefix, {}, 3600.0)
        else:
            assert fleet.info is not None
            fmt = replace(OpenAIFormat(prefix, Limits(3600.0, 256), endpoint="/v1/chat/completions", strict=True),
                          fleet=fleet, model_names=(fleet.info.model,))
        with open(tmp / f"{name}.out.jsonl", "w") as out, open(src, "rb") as lines:
            return await run_lines(client, numbered(lines), fmt, FileSink(out, out), Spec(share=share),
                                   progress=lambda _s: times.append(time.monotonic() - t0))


async def side_by_side(url: str, ns: str, lines: int, max_new_tokens: int, share: bool,
                       runs: tuple[str, ...] = RUNS) -> dict[str, list[float]]:
    """``runs`` at once (default: both): each run's answer times (s from the start)."""
    async with AsyncClient(url, ns) as client:
        model = (await client.fleet()).info.model  # type: ignore[union-attr]
    times: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        srcs = _inputs(tmp, lines, max_new_tokens, model)
        t0 = time.monotonic()
        done = await asyncio.gather(*(_one(url, ns, n, srcs[n], tmp, share, t0, times[n]) for n in runs))
    for name, summary in zip(runs, done):
        assert summary.written == lines and summary.error is None, (name, summary)
    return times


def order(times: dict[str, list[float]]) -> list[str]:
    """Which run each answer went to, in the order they came."""
    return [name for _, name in sorted((t, name) for name in times for t in times[name])]


def longest_streak(times: dict[str, list[float]]) -> dict[str, int]:
    """Per run: its most answers in a row while every other run still had lines left."""
    both_until = min(ts[-1] for ts in times.values())
    seq = order({n: [t for t in ts if t <= both_until] for n, ts in times.items()})
    best = {name: 0 for name in times}
    run, last = 0, None
    for name in seq:
        run = run + 1 if name == last else 1
        last = name
        best[name] = max(best[name], run)
    return best


def shares(times: dict[str, list[float]], window_s: float = WINDOW_S) -> dict[str, Any]:
    """Per run: answers per ``window_s`` window while it had lines left (windows that end before its last
    answer), the empty ones, the longest gap between answers (the first from the start), its end."""
    out: dict[str, Any] = {}
    streak = longest_streak(times)
    for name, ts in times.items():
        end = ts[-1]
        counts = [sum(1 for t in ts if k * window_s <= t < (k + 1) * window_s)
                  for k in range(int(end // window_s))]  # full windows before its last answer
        gaps = [b - a for a, b in zip([0.0, *ts], ts)]
        out[name] = {"answers": len(ts), "end_s": round(end, 1), "per_window": counts,
                     "empty_windows": sum(1 for c in counts if c == 0), "longest_gap_s": round(max(gaps), 1),
                     "longest_streak": streak[name]}
    return out


@click.command()
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True)
@click.option("--lines", type=int, default=1500, show_default=True, help="Lines of each run.")
@click.option("--max-new-tokens", type=int, default=16, show_default=True)
@click.option("--worker-arg", multiple=True, help="Extra worker CLI argument (repeatable).")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(redis_url: str, lines: int, max_new_tokens: int, worker_arg: tuple[str, ...], json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    out: dict[str, Any] = {"lines": lines, "max_new_tokens": max_new_tokens, "window": Spec().window,
                           "window_s": WINDOW_S, "worker_args": list(worker_arg)}
    ns = f"share-{uuid.uuid4().hex[:6]}"
    worker = spawn_worker(url, ns, list(worker_arg))
    try:
        asyncio.run(side_by_side(url, ns, 20, max_new_tokens, True))  # warm-up
        for label, share in (("before", False), ("after", True)):
            out[label] = shares(asyncio.run(side_by_side(url, ns, lines, max_new_tokens, share)))
            alone = asyncio.run(side_by_side(url, ns, lines, max_new_tokens, share, runs=("bulk",)))["bulk"]
            out[label]["bulk_alone_s"] = round(alone[-1], 1)
    finally:
        worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
    print(f"| {lines} lines each, one worker | run | answers per {WINDOW_S:g} s (min - max) | empty windows | "
          "longest gap | longest streak | done at |\n|---|---|---|---:|---:|---:|---:|")
    for label in ("before", "after"):
        for name in RUNS:
            r = out[label][name]
            per = r["per_window"] or [0]
            print(f"| {label} | {name} | {min(per)} - {max(per)} | {r['empty_windows']} of {len(r['per_window'])} | "
                  f"{r['longest_gap_s']} s | {r['longest_streak']} | {r['end_s']} s |")
    print(f"\nthe bulk run alone: {out['before']['bulk_alone_s']} s before, {out['after']['bulk_alone_s']} s after")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
