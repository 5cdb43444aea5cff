"""Randomized fault test with a seed (scripts/faultlib): many clients (sync ``Client``, ``AsyncClient``, the
gateway over HTTP with ``openai``, ``batchfleet bulk``) submit, retry, cancel and reuse job ids with greedy
decoding while a seeded nemesis kills and restarts workers, clients and a private Redis (AOF, appendfsync
always), pauses processes and fills Redis' memory. A checker then reads every history: each accepted request
got exactly one answer or one typed error, every answer is its own prompt's (compared with the prompt run
alone on an undisturbed worker), nothing answered twice, no caller waited past its timeout (+ slack).

    python scripts/fault_test.py --seed 1 --minutes 5 --out /tmp/fault-1

Exit status: 0 no violation, 1 violations (the summary names them; examples in OUT/summary.json).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import click

from faultlib.nemesis import INTENSITIES
from faultlib.run import Plan, model_dir, run_once


@click.command(help=__doc__)
@click.option("--seed", type=int, required=True, help="Seeds the workload, the clients and the nemesis.")
@click.option("--minutes", type=float, required=True, help="How long the nemesis acts (per run).")
@click.option("--runs", type=int, default=1, show_default=True, help="Runs, with seeds SEED, SEED+1, ...")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Run directory (default: a temp dir).")
@click.option("--intensity", type=click.Choice(sorted(INTENSITIES)), default="full", show_default=True)
@click.option("--no-gateway", is_flag=True, help="Leave the gateway and its HTTP client out.")
@click.option("--no-bulk", is_flag=True, help="Leave the bulk runs out.")
@click.option("--cache-dir", default="~/.cache/batchfleet/models", show_default=True, help="Tiny preset dir.")
def main(seed: int, minutes: float, runs: int, out: str | None, intensity: str, no_gateway: bool, no_bulk: bool,
         cache_dir: str) -> None:
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="fault-test-"))
    model = model_dir(Path(cache_dir).expanduser())
    summaries = []
    for k in range(runs):
        plan = Plan(seed=seed + k, minutes=minutes, intensity=intensity, gateway=not no_gateway, bulk=not no_bulk)
        summary = run_once(plan, root / f"seed{seed + k}", model, log=lambda m: print(m, flush=True))
        summaries.append(summary)
        print(f"seed {plan.seed}: {summary['operations']} operations, {summary['faults']} faults "
              f"{summary['faults_by_kind']}, {summary['violations']} violations {summary['violations_by_kind']}",
              flush=True)
    total = {
        "runs": len(summaries), "seeds": [s["plan"]["seed"] for s in summaries], "minutes_each": minutes,
        "operations": sum(s["operations"] for s in summaries), "faults": sum(s["faults"] for s in summaries),
        "violations": sum(s["violations"] for s in summaries),
        "violations_by_kind": _add(s["violations_by_kind"] for s in summaries),
        "faults_by_kind": _add(s["faults_by_kind"] for s in summaries),
    }
    (root / "summary.json").write_text(json.dumps({"total": total, "runs": summaries}, indent=1) + "\n")
    print(json.dumps(total, indent=1))
    print(f"details: {root}/summary.json")
    sys.exit(1 if total["violations"] else 0)


def _add(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


if __name__ == "__main__":
    main()
