"""Redis kill -9 under load, many times: what is lost, what is answered twice, how long recovery takes.

A private Redis 7 (AOF, appendfsync always, fsync slowed by strace) is killed and restarted on its AOF
``--cycles`` times while sync and async clients send ``--requests`` greedy requests through a worker
subprocess (scripts/benchlib/redis_crash.py). ``--target``: where each kill lands: ``reply`` (inside the
fsync of a write holding a final reply), ``any`` (any delayed fsync) or ``mixed`` (alternating). Prints a
markdown table (one row per cycle, then the totals) and writes JSON.

    python scripts/bench_redis_crash.py --json docs/bench/redis_crash.json
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from batchfleet.worker.engine.models import make_preset
from benchlib.redis_crash import CrashPlan, run_crash


@click.command(help=__doc__)
@click.option("--cycles", type=int, default=20, show_default=True, help="kill -9 + restart cycles.")
@click.option("--requests", type=int, default=1260, show_default=True, help="Calls in all (spread over the cycles).")
@click.option("--fsync-delay-ms", type=int, default=200, show_default=True, help="strace delay on every fsync.")
@click.option("--target", type=click.Choice(["reply", "any", "mixed"]), default="mixed", show_default=True)
@click.option("--timeout-s", type=float, default=60.0, show_default=True, help="Every call's timeout.")
@click.option("--claim-idle-ms", type=int, default=CrashPlan.claim_idle_ms, show_default=True,
              help="Worker: reclaim entries pending this long (the worker default is 30000).")
@click.option("--redis-binary", default="/usr/bin/redis-server", show_default=True)
@click.option("--cache-dir", default="~/.cache/batchfleet/models", show_default=True, help="Tiny preset dir.")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(cycles: int, requests: int, fsync_delay_ms: int, target: str, timeout_s: float, claim_idle_ms: int,
         redis_binary: str, cache_dir: str, json_path: str | None) -> None:
    plan = CrashPlan(requests=requests, cycles=cycles, fsync_delay_ms=fsync_delay_ms, target=target,
                     timeout_s=timeout_s, claim_idle_ms=claim_idle_ms, redis_binary=redis_binary)
    model = make_preset("tiny", Path(cache_dir).expanduser())
    with tempfile.TemporaryDirectory(prefix="bench-redis-crash-") as work:
        report = run_crash(plan, model, work)
    doc = report.summary()
    print("| cycle | kill target | in fsync | calls in flight | of them lost | Redis down s | first result s "
          "| in-flight drained s |")
    print("|---|---|---|---|---|---|---|---|")
    for k, c in enumerate(doc["cycles"], 1):
        print(f"| {k} | {c['target']} | {'yes' if c['in_fsync'] else 'no'} | {c['in_flight']} | {c['lost']} | "
              f"{c['down_s']} | {c['first_result_s']} | {c['drained_s']} |")
    print("\n| requests | completed | lost | answered twice | wrong text | AOF: answered, never received | wall s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {doc['requests']} | {doc['completed']} | {doc['lost']} | {doc['duplicated']} | "
          f"{doc['mismatched_text']} | {doc['aof_answered_never_received']} | {doc['wall_s']} |")
    calm = doc["undisturbed_call_s"]
    print(f"\ncalls no kill happened during: {calm['n']}, duration p50 {calm['p50']} s, max {calm['max']} s")
    if doc["errors"]:
        print(f"\nerrors: {doc['errors']}")
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
