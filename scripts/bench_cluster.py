"""Redis capacity of a sharded fleet (issue 35): the request rate at which the busiest Redis core saturates,
for one plain Redis and for a private Redis Cluster with the fleet on one shard or on one shard per master.

Each layout runs the same closed-loop load (scripts/benchlib/load.py, client inboxes spread evenly over
the shards) against real worker processes over a SIMULATED engine (scripts/simulated_engine.py, as
scripts/bench_scale.py), and reads every master's CPU time (INFO cpu) and command stats before and after,
and its CPU with the fleet idle first. A layout's ceiling is the rate at which its busiest master fills one
core: min over masters of (1 - idle CPU share) / CPU seconds per request. Beside it, the same from command
time alone (INFO commandstats ``usec``: what Redis spends executing commands, without its network I/O).
On a small host the load generators and workers take the cores the masters would use, so the ceilings
are the figures that compare layouts; the throughput reached is printed too. A master that carries a
third of the requests answers them in smaller groups per wakeup, so its CPU per request comes out higher
than at saturation: the CPU ceiling of a sharded layout measured below saturation is a lower bound.

    python scripts/bench_cluster.py --json docs/bench/cluster_capacity.json
    python scripts/bench_cluster.py --layouts plain,3x1,3x3 --seconds 15

Layouts: ``plain`` (one redis-server, the default fleet), ``MxS`` (a cluster of M masters made by
``redis-cli --cluster create``, the fleet on S shards). Writes JSON and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import redis
from bench_scale import Server, start_workers, stop_workers  # scripts/ is on sys.path as the script runs

from benchlib import cpucap, load

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the private cluster the tests start (tests/helpers/cluster.py)


class Masters:
    """The masters of one layout: a plain server, or a private cluster's primaries."""

    def __init__(self, masters: int) -> None:
        self.cluster = None
        if masters == 0:
            self.plain = Server()
            self.url, self.ports = self.plain.url, [self.plain.private.port]
            return
        from tests.helpers.cluster import PrivateCluster

        self.cluster = PrivateCluster(masters=masters).start()
        self.url, self.ports = self.cluster.url, [n.port for n in self.cluster.nodes]

    def pids(self) -> list[int]:
        nodes = self.cluster.nodes if self.cluster is not None else [self.plain.private]
        return [n.proc.pid for n in nodes]

    def cpu_s(self) -> list[float]:
        out = []
        for port in self.ports:
            with redis.Redis(port=port) as r:
                cpu = r.info("cpu")
                out.append(cpu["used_cpu_user"] + cpu["used_cpu_sys"])
        return out

    def commands(self) -> list[dict[str, tuple[int, int]]]:
        """(calls, command microseconds) so far per command, per master."""
        out = []
        for port in self.ports:
            with redis.Redis(port=port) as r:
                out.append({k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
                            for k, v in r.info("commandstats").items() if k != "cmdstat_info"})
        return out

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        else:
            self.plain.stop()


def parse_layout(layout: str) -> tuple[int, int]:
    """(masters, shards) of ``plain`` (0: one plain Redis, 1 shard) or ``MxS``."""
    if layout == "plain":
        return 0, 1
    masters, shards = (int(x) for x in layout.split("x"))
    return masters, shards


def measure(layout: str, workers: int, clients: int, client_procs: int, seconds: float, idle_s: float,
            worker_args: list[str], per_shard_rate: float = 0.0, cpu_share: float = 0.0,
            per_shard_workers: bool = False) -> dict:
    masters, shards = parse_layout(layout)
    workers = workers * shards if per_shard_workers else workers
    group = Masters(masters)
    procs: list[subprocess.Popen] = []
    capped: list[str] = []
    try:
        if cpu_share:  # inside the try: a cap that fails still stops the masters
            capped = [cpucap.cap(pid, cpu_share, core, f"bfbench-{pid}") for core, pid in enumerate(group.pids())]
        ns = f"cap{masters}x{shards}"
        procs = start_workers(group.url, ns, workers, [*worker_args, "--shards", str(shards)])
        time.sleep(1.0)
        idle0, idle_calls0 = group.cpu_s(), group.commands()
        time.sleep(idle_s)  # what the masters spend with the workers idle (cluster bus, polling): not per request
        idle = [(b - a) / idle_s for a, b in zip(idle0, group.cpu_s())]
        idle_calls = sum(n - c0.get(k, (0, 0))[0] for c0, c1 in zip(idle_calls0, group.commands())
                         for k, (n, _) in c1.items()) / idle_s / workers
        before, calls0, t0 = group.cpu_s(), group.commands(), time.monotonic()
        # open loop: the same offered rate per shard in every layout, so each master is measured at one load
        mode = {"rate": per_shard_rate * shards} if per_shard_rate else {"clients": clients}
        run = load.run(load.Load(group.url, ns, seconds, new_tokens=1, prompt_len=16, homes=shards, **mode),
                       client_procs)
        wall = time.monotonic() - t0
        spent = [b - a for a, b in zip(before, group.cpu_s())]
        done = max(run["requests"], 1)
        delta = [{k: (n - c0.get(k, (0, 0))[0], u - c0.get(k, (0, 0))[1]) for k, (n, u) in c1.items()}
                 for c0, c1 in zip(calls0, group.commands())]
        calls = [{k: round(n / done, 2) for k, (n, _) in d.items() if n > 0} for d in delta]
        usec = [sum(u for _, u in d.values()) / done for d in delta]
        per_master = [max(0.0, s - i * wall) / done * 1e6 for s, i in zip(spent, idle)]
        # a master saturates when its idle share plus rate x its CPU per request fill its one core
        ceiling = min((1 - i) / (p / 1e6) for i, p in zip(idle, per_master) if p > 0)
        return {"layout": layout, "masters": max(masters, 1), "shards": shards, "workers": workers,
                "redis_cpu_cap": {"share": cpu_share, "by": capped[0]} if capped else None, **run,
                "redis_cpu_us_per_req_by_master": per_master, "redis_cpu_us_per_req_total": sum(per_master),
                "redis_cpu_share_by_master": [s / wall for s in spent], "idle_cpu_share_by_master": idle,
                "idle_calls_per_worker_s": idle_calls,
                "ceiling_rps": ceiling, "calls_per_req_by_master": calls,
                "command_us_per_req_by_master": usec, "command_ceiling_rps": 1e6 / max(usec) if max(usec) else None}
    finally:
        stop_workers(procs)
        pids = group.pids()
        group.stop()
        for pid in pids if cpu_share else []:  # a group made before a later cap failed goes too
            cpucap.release(f"bfbench-{pid}")


@click.command()
@click.option("--layouts", default="plain,3x1,3x3", help="plain and/or MxS (M masters, S shards), comma separated.")
@click.option("--workers", type=int, default=4, help="Simulated worker processes (per shard with --per-shard-workers).")
@click.option("--per-shard-workers", is_flag=True, help="--workers x the layout's shards: with --per-shard-rate, "
              "each layout is the one-master fleet times its shards (the same load per master and per worker).")
@click.option("--clients", type=int, default=96, help="Closed-loop clients (1-token requests).")
@click.option("--client-procs", type=int, default=3, help="Client processes (a multiple of the shards spreads "
              "their inboxes evenly).")
@click.option("--per-shard-rate", type=float, default=0.0, help="Open loop instead: Poisson arrivals at this rate "
              "(req/s) times the layout's shards, so every master carries the same load (0: closed loop).")
@click.option("--redis-cpu-share", type=float, default=0.0, help="Cap each master to this share of its own core "
              "(cgroups, root; the masters on cores 0..M-1, the rest elsewhere), so the load saturates every layout "
              "and the throughput reached is its ceiling (0: uncapped).")
@click.option("--seconds", type=float, default=15.0)
@click.option("--idle-seconds", type=float, default=3.0, help="The masters' idle CPU is measured this long first.")
@click.option("--cost", default="1,0.001,2,0.01", help="Simulated step cost (ms): small, so Redis is the work.")
@click.option("--json", "json_path", default=None)
def main(layouts: str, workers: int, per_shard_workers: bool, clients: int, client_procs: int, per_shard_rate: float,
         redis_cpu_share: float, seconds: float, idle_seconds: float, cost: str, json_path: str | None) -> None:
    if redis_cpu_share:  # the workers and clients started from here keep off the masters' cores
        cpucap.keep_off(set(range(max(max(parse_layout(x)[0], 1) for x in layouts.split(",")))))
    worker_args = ["--max-running", "64", "--cost", cost, "--max-wait-ms", "2"]
    rows = []
    for layout in layouts.split(","):
        rows.append(measure(layout, workers, clients, client_procs, seconds, idle_seconds, worker_args,
                            per_shard_rate, redis_cpu_share, per_shard_workers))
        print(f"{layout}: {rows[-1]['rps']:.0f} req/s, ceiling {rows[-1]['ceiling_rps']:,.0f}", file=sys.stderr,
              flush=True)
    base = rows[0]["ceiling_rps"]
    for row in rows:
        row["ceiling_x"] = row["ceiling_rps"] / base if base else None
    out = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
           "settings": {"workers": workers, "per_shard_workers": per_shard_workers, "clients": clients,
                        "per_shard_rate": per_shard_rate,
                        "redis_cpu_share": redis_cpu_share,
                        "client_procs": client_procs, "seconds": seconds, "cost_ms": cost}, "rows": rows}
    print(f"| layout | masters | shards | req/s reached | x {rows[0]['layout']} | Redis CPU share by master "
          "| idle CPU share by master | Redis CPU us/req by master "
          f"| ceiling req/s | x {rows[0]['layout']} | calls/req by master | command us/req by master "
          f"| command-time ceiling | x {rows[0]['layout']} |")
    print("|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---|---:|---:|")
    base_cmd = rows[0]["command_ceiling_rps"]
    for r in rows:
        by = " / ".join(f"{x:.0f}" for x in r["redis_cpu_us_per_req_by_master"])
        idle = " / ".join(f"{x:.3f}" for x in r["idle_cpu_share_by_master"])
        share = " / ".join(f"{x:.2f}" for x in r["redis_cpu_share_by_master"])
        print(f"| {r['layout']} | {r['masters']} | {r['shards']} | {r['rps']:.0f} | {r['rps'] / rows[0]['rps']:.2f} "
              f"| {share} | {idle} | {by} | "
              f"{r['ceiling_rps']:,.0f} | {r['ceiling_x']:.2f} | "
              f"{' / '.join(f'{sum(c.values()):.1f}' for c in r['calls_per_req_by_master'])} | "
              f"{' / '.join(f'{u:.0f}' for u in r['command_us_per_req_by_master'])} | "
              f"{r['command_ceiling_rps']:,.0f} | {r['command_ceiling_rps'] / base_cmd:.2f} |")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
