"""Interactive and bulk on one worker (issue #17): does a web client notice a bulk job, and does the bulk
job notice the web client? One worker at user defaults (native engine, continuous mode, tiny preset), one
run, four phases:

1. idle: a client sends ``--interactive`` short requests one after the other (16 new tokens): p50 idle;
2. bulk alone: ``batchfleet bulk`` semantics (``bulk_file``, default window, background priority) over ``--prompts``
   prompts (64 new tokens): its throughput alone;
3. both: the same bulk again while the client (a process of its own, as a web backend) sends its requests
   one after the other: interactive p50 under bulk / idle p50 (target <= 1.5) and bulk throughput / the
   mean of the bulk alone before and after this phase (target >= 0.85); every line answered;
4. flood: a background backlog while ``--flood`` x max_running interactive clients send back to back (a flood at
   80% of the engine's capacity): background's share of decode slots (target >= --background-min-share).

    python scripts/bench_priority.py --json docs/bench/priority.json

Writes JSON and prints a table. Not a test: run it on a quiet machine.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import click

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.producer.bulk.file_run import bulk_file
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

SHORT = "Summarize in one line: the queue is full of work."


def interactive_run(client: Client, n: int, stop: threading.Event | None = None) -> list[float]:
    """``n`` requests one after the other (or until ``stop``); latency of each in ms."""
    out = []
    for i in range(n):
        if stop is not None and stop.is_set():
            break
        t0 = time.perf_counter()
        client.generate(f"{SHORT} ({i})", max_new_tokens=16, timeout=120)
        out.append((time.perf_counter() - t0) * 1000)
    return out


class _Web:
    """``interactive_run`` in a process of its own (started now, after ``delay`` s); ``get()`` its latencies."""

    def __init__(self, url: str, ns: str, n: int, delay: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.queue = ctx.Queue()
        self.proc = ctx.Process(target=_web_main, args=(url, ns, n, delay, self.queue), daemon=True)
        self.proc.start()

    def get(self) -> list[float]:
        got = self.queue.get(timeout=600)
        self.proc.join(30)
        return got


def _web_main(url: str, ns: str, n: int, delay: float, queue) -> None:
    time.sleep(delay)
    with Client(url, ns) as client:
        queue.put(interactive_run(client, n))


web_client = _Web


def run_bulk(url: str, ns: str, prompts: int, tmp: Path, tag: str) -> dict:
    src, dst = tmp / f"{tag}.jsonl", tmp / f"{tag}.out.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Write a short note about item {i}: " + "details " * (i % 9)})
                           + "\n" for i in range(prompts)))
    t0 = time.perf_counter()
    s = asyncio.run(bulk_file(str(src), str(dst), redis_url=url, namespace=ns, defaults={"max_new_tokens": 64},
                              timeout=3600))
    took = time.perf_counter() - t0
    lines = [json.loads(x) for x in dst.read_text().splitlines()]
    tokens = sum(x["result"]["completion_tokens"] for x in lines if "result" in x)
    return {"seconds": round(took, 2), "lines": len(lines), "failed": s.failed_lines, "tokens": tokens,
            "tok_s": round(tokens / took, 1), "all_answered": sorted(x["index"] for x in lines) == list(range(prompts))}


def flood(url: str, ns: str, concurrency: int, seconds: float, backlog: int) -> dict:
    """A background backlog, then ``concurrency`` interactive clients sending back to back for ``seconds``: the
    decode slots each priority got meanwhile (the engine's counters, read from the worker's heartbeat)."""
    with Client(url, ns) as client:
        jobs = [client.submit(f"backlog item {i}", max_new_tokens=64, priority="background") for i in range(backlog)]
        time.sleep(3.0)  # background work fills the engine first
        before = _engine_stats(url, ns)
        stop = threading.Event()
        counts = [0] * concurrency

        def one(k: int) -> None:
            while not stop.is_set():
                client.generate(f"{SHORT} [{k}]", max_new_tokens=16, timeout=300)
                counts[k] += 1
        threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(concurrency)]
        for th in threads:
            th.start()
        time.sleep(seconds)
        after = _engine_stats(url, ns)
        stop.set()
        for th in threads:
            th.join(300)
        for j in jobs:
            client.cancel(j)
    slots = {c: after[f"engine_decode_slots_{c}"] - before[f"engine_decode_slots_{c}"]
             for c in ("interactive", "background")}
    return {"window_s": seconds, "concurrency": concurrency, "interactive_requests": sum(counts),
            "decode_slots": slots, "background_share": round(slots["background"] / max(1, sum(slots.values())), 3)}


@click.command(help=__doc__)
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True, help="Started privately if unreachable.")
@click.option("--prompts", type=int, default=3000, show_default=True, help="Bulk prompts per bulk phase.")
@click.option("--interactive", type=int, default=20, show_default=True, help="Interactive requests per phase.")
@click.option("--flood", "flood_x", type=float, default=0.8, show_default=True,
              help="Interactive clients in the flood phase, as a fraction of the engine's --max-running slots.")
@click.option("--flood-s", type=float, default=30.0, show_default=True, help="Length of the flood phase.")
@click.option("--worker-arg", multiple=True, help="Extra worker CLI argument (repeatable).")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(redis_url: str, prompts: int, interactive: int, flood_x: float, flood_s: float, worker_arg: tuple[str, ...],
         json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    ns = f"priorities-{uuid.uuid4().hex[:6]}"
    worker = spawn_worker(url, ns, list(worker_arg))
    out: dict = {"prompts": prompts, "interactive": interactive, "worker_args": list(worker_arg)}
    try:
        with tempfile.TemporaryDirectory() as d, Client(url, ns) as client:
            tmp = Path(d)
            interactive_run(client, 3)  # warm-up
            idle = web_client(url, ns, interactive, 0.0).get()
            alone = run_bulk(url, ns, prompts, tmp, "alone")
            before = _engine_stats(url, ns)
            # the web client is a process of its own, as a web backend is: in this one it would compete with
            # the bulk run's event loop for the GIL and slow the bulk down, not the worker
            web = web_client(url, ns, interactive, 3.0)  # after 3 s: the bulk has filled the engine
            both = run_bulk(url, ns, prompts, tmp, "both")
            got = web.get()
            after = _engine_stats(url, ns)
            again = run_bulk(url, ns, prompts, tmp, "again")  # alone once more: what drifts between runs
            max_running = after["engine_running_limit"]
            # a backlog background work cannot finish within the window, whatever share it gets
            fl = flood(url, ns, max(1, round(flood_x * max_running)), flood_s, backlog=3000)
        p50_idle, p50_bulk = statistics.median(idle), statistics.median(got) if got else float("nan")
        out.update({
            "idle_p50_ms": round(p50_idle, 1), "under_bulk_p50_ms": round(p50_bulk, 1),
            "under_bulk_requests": len(got), "interactive_ratio": round(p50_bulk / p50_idle, 2),
            "bulk_alone": alone, "bulk_with_interactive": both, "bulk_alone_again": again,
            "bulk_ratio": round(both["tok_s"] / statistics.mean([alone["tok_s"], again["tok_s"]]), 3),
            "priority_preemptions_during_both": after.get("engine_priority_preemptions", 0)
            - before.get("engine_priority_preemptions", 0),
            "flood": fl,
        })
    finally:
        worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
    print("| measure | value | target |\n|---|---:|---|")
    print(f"| interactive p50 idle | {out['idle_p50_ms']} ms | - |")
    print(f"| interactive p50 during bulk ({out['under_bulk_requests']} requests) | {out['under_bulk_p50_ms']} ms "
          f"({out['interactive_ratio']}x idle) | <= 1.5x |")
    print(f"| bulk alone, before / after | {alone['tok_s']} / {again['tok_s']} tok/s ({alone['seconds']} / "
          f"{again['seconds']} s, {alone['lines']} lines) | - |")
    print(f"| bulk with interactive | {both['tok_s']} tok/s ({out['bulk_ratio']}x the mean alone; all answered: "
          f"{both['all_answered']}; {out['priority_preemptions_during_both']} priority preemptions) | >= 0.85x |")
    print(f"| flood ({fl['concurrency']} interactive clients): background share of decode slots | "
          f"{fl['background_share']} | >= background_min_share |")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


def _engine_stats(url: str, ns: str) -> dict:
    """The worker's latest heartbeat status (one worker: this benchmark's)."""
    from batchfleet.common.redis.clients import sync_client
    from batchfleet.common.redis.fleetstate import worker_stats

    time.sleep(2.2)  # one heartbeat period: the figures are fresh
    r = sync_client(url)
    try:
        return next(w for w in worker_stats(r, Keys(ns)) if w["alive"])
    finally:
        r.close()


if __name__ == "__main__":
    main()
