"""The adaptive batching window against fixed windows, open loop (issue 34): JSON, a table and a plot.

One worker per row (the real Redis path, ``batchfleet bench``'s runner), continuous mode: ``fixed10``,
``fixed50``, ``fixed200`` (a fixed window of that many ms) and ``continuous`` (the default: the adaptive
window, bounded by 50 ms). Poisson arrivals at three rates, set from the capacity measured first in the
same run (a closed loop of 32 clients on the default): ``--low`` x, ``--mid`` x and ``--high`` x it (past
saturation). Each (rate, strategy) runs ``--runs`` times; the table shows medians. Per rate it checks the
issue's targets: the adaptive TTFT p50 and p99 within 10% of the best fixed column's, its throughput within
5% of the best fixed column's. Then two more checks: a lone request on an idle worker (its queue time,
sequential requests 0.2 s apart) and a burst of 32 clients against static batch 1.

    python scripts/bench_window.py --json docs/bench/window.json --plot docs/bench/window.png
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

from batchfleet.common.options import build_worker_config
from batchfleet.worker.benchmark.loadgen import make_workload
from batchfleet.worker.benchmark.report import machine, write_json
from batchfleet.worker.benchmark.runner import LoadSpec, latency_probe, run_load, serving_redis
from batchfleet.worker.benchmark.strategies import parse_strategy
from batchfleet.worker.compose import resolve_model_path
from batchfleet.worker.devtools import ensure_redis

FIXED = ("fixed10", "fixed50", "fixed200")
ADAPTIVE = "continuous"
METRICS = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "queue_p50_ms", "mean_batch_size")


def median_row(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in METRICS} | {
        "errors": sum(r["errors"] for r in rows), "runs": len(rows)}


def verdict(by_strategy: dict[str, dict]) -> dict:
    """The issue's targets at one rate: adaptive against the best fixed column, per metric."""
    a = by_strategy[ADAPTIVE]
    fixed = [by_strategy[s] for s in FIXED if s in by_strategy]
    best_p50 = min(f["ttft_p50_ms"] for f in fixed)
    best_p99 = min(f["ttft_p99_ms"] for f in fixed)
    best_tput = max(f["throughput_tok_s"] for f in fixed)
    out = {"ttft_p50_vs_best_fixed": round(a["ttft_p50_ms"] / best_p50, 3),
           "ttft_p99_vs_best_fixed": round(a["ttft_p99_ms"] / best_p99, 3),
           "throughput_vs_best_fixed": round(a["throughput_tok_s"] / best_tput, 3)}
    out["met"] = (out["ttft_p50_vs_best_fixed"] <= 1.10 and out["ttft_p99_vs_best_fixed"] <= 1.10
                  and out["throughput_vs_best_fixed"] >= 0.95)
    return out


def lone_probe(url: str, worker_kw: dict, name: str, n: int = 30) -> dict:
    """Queue time (enqueue -> prefill start, the worker's own figure) of sequential lone requests."""
    probe = latency_probe(serving_redis(url, parse_strategy(name), worker_kw), ["a lone request " * 4], n,
                          new_tokens=2, gap_s=0.2)
    return {"strategy": name, "queue_p50_ms": probe.queue_p50_ms, "queue_max_ms": probe.queue_max_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--requests", type=int, default=48, help="per open-loop row")
    ap.add_argument("--prompt-len", default="32-512")
    ap.add_argument("--max-new-tokens", default="16-64")
    ap.add_argument("--low", type=float, default=0.25)
    ap.add_argument("--mid", type=float, default=0.7)
    ap.add_argument("--high", type=float, default=1.4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rates", default="low,mid,high", help="which of the three rates to run (comma separated)")
    ap.add_argument("--capacity", type=float, help="req/s the rates are fractions of (default: measured first, "
                    "closed loop); give an earlier run's to rerun one of its rates")
    ap.add_argument("--skip-burst", action="store_true", help="leave out the 32-client burst against static1")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    args = ap.parse_args()
    chosen = args.rates.split(",")
    if not chosen or any(label not in ("low", "mid", "high") for label in chosen):
        ap.error(f"--rates takes low, mid and/or high, comma separated; got {args.rates!r}")
    lo, hi = (int(x) for x in args.prompt_len.split("-"))
    nlo, nhi = (int(x) for x in args.max_new_tokens.split("-"))
    worker_kw = {"preset": args.preset}
    resolve_model_path(build_worker_config(**worker_kw))  # the preset is built once, before any worker
    url, private = ensure_redis(args.redis_url)
    doc: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["python", *sys.argv]), "machine": machine(), "preset": args.preset}
    try:
        capacity = args.capacity
        if capacity is None:
            workload = make_workload(args.requests, (lo, hi), (nlo, nhi), seed=0)
            cap_row = run_load(serving_redis(url, parse_strategy(ADAPTIVE), worker_kw), parse_strategy(ADAPTIVE),
                               LoadSpec(workload, clients=32), "redis")
            capacity = cap_row["requests"] / cap_row["wall_s"]
        doc["capacity_req_s"] = round(capacity, 3)
        how = "given" if args.capacity is not None else "closed loop, 32 clients"
        print(f"capacity ({how}): {capacity:.2f} req/s", file=sys.stderr)
        fractions = {"low": args.low, "mid": args.mid, "high": args.high}
        rates = {label: fractions[label] * capacity for label in chosen}
        results: dict = {}
        for label, rate in rates.items():
            runs: dict[str, list[dict]] = {s: [] for s in (*FIXED, ADAPTIVE)}
            for run in range(args.runs):
                for name in runs:  # interleaved, so a drift of the machine hits every strategy alike
                    strategy = parse_strategy(name)
                    spec = LoadSpec(make_workload(args.requests, (lo, hi), (nlo, nhi), seed=run), rate=rate, seed=run)
                    runs[name].append(run_load(serving_redis(url, strategy, worker_kw), strategy, spec, "redis"))
                    r = runs[name][-1]
                    print(f"{label} {rate:.2f}/s run {run} {name}: {r['throughput_tok_s']} tok/s, TTFT p50 "
                          f"{r['ttft_p50_ms']} p99 {r['ttft_p99_ms']} ms", file=sys.stderr)
            med = {name: median_row(rows) for name, rows in runs.items()}
            results[label] = {"rate_req_s": round(rate, 3), "median": med, "verdict": verdict(med), "runs": runs}
        doc["open_loop"] = results
        doc["lone"] = [lone_probe(url, worker_kw, name) for name in (ADAPTIVE, "fixed50")]
        if not args.skip_burst:
            burst = make_workload(32, (64, 128), (128, 128), seed=0)
            doc["burst"] = [run_load(serving_redis(url, parse_strategy(n), worker_kw), parse_strategy(n),
                                     LoadSpec(burst, clients=32), "redis") for n in ("static1", ADAPTIVE)]
    finally:
        if private is not None:
            private.stop()
    print(table(doc))
    if args.json_path:
        write_json(args.json_path, doc)
    if args.plot_path:
        plot(doc, args.plot_path)


def table(doc: dict) -> str:
    lines = ["| rate | req/s | strategy | output tok/s | TTFT p50 ms | TTFT p99 ms | queue p50 ms | mean batch |",
             "|---|---|---|---|---|---|---|---|"]
    for label, res in doc["open_loop"].items():
        for name, m in res["median"].items():
            lines.append(f"| {label} | {res['rate_req_s']:.2f} | {name} | {m['throughput_tok_s']:.1f} | "
                         f"{m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | {m['queue_p50_ms']:.1f} | "
                         f"{m['mean_batch_size']:.1f} |")
    lines.append("")
    for label, res in doc["open_loop"].items():
        v = res["verdict"]
        lines.append(f"{label}: adaptive / best fixed: TTFT p50 {v['ttft_p50_vs_best_fixed']:.2f}, p99 "
                     f"{v['ttft_p99_vs_best_fixed']:.2f}, throughput {v['throughput_vs_best_fixed']:.2f} "
                     f"-> {'met' if v['met'] else 'NOT met'}")
    for p in doc["lone"]:
        lines.append(f"lone request, {p['strategy']}: queue p50 {p['queue_p50_ms']} ms, max {p['queue_max_ms']} ms")
    if doc.get("burst"):
        s1, a = doc["burst"]
        ratio = a["throughput_tok_s"] / s1["throughput_tok_s"]
        lines.append(f"burst of 32 (64-128 in, 128 out): {ADAPTIVE} {a['throughput_tok_s']} tok/s = "
                     f"{ratio:.1f}x static1, mean batch {a['mean_batch_size']}")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    labels = list(doc["open_loop"])
    rates = [doc["open_loop"][lb]["rate_req_s"] for lb in labels]
    for name in (*FIXED, ADAPTIVE):
        for ax, key in zip(axes, ("ttft_p50_ms", "ttft_p99_ms", "throughput_tok_s")):
            ys = [doc["open_loop"][lb]["median"][name][key] for lb in labels]
            ax.plot(rates, ys, "o-", label="adaptive (default)" if name == ADAPTIVE else name,
                    linewidth=2.5 if name == ADAPTIVE else 1.2)
    for ax, title in zip(axes, ("TTFT p50 (ms)", "TTFT p99 (ms)", "output tokens / s")):
        ax.set_xlabel("offered load (requests / s)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"open loop, Poisson, median of {doc['open_loop'][labels[0]]['median'][ADAPTIVE]['runs']} runs "
                 f"({doc['machine'].get('cpu_model', '')})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
