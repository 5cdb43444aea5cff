"""Fleet scale (issue 29): N real worker processes on one Redis, over a SIMULATED engine (scripts/simulated_engine.py).

Each worker is the real worker (transport, intake, batcher, loop, reply writes) around an engine that
sleeps for a measured step-cost model instead of running a model, so N = 64 fits on a small host and what
is measured is the fleet's own cost. A private redis-server (no persistence) serves each run. Per N:

- closed loop: ``--per-worker`` x max_running x N clients send back to back (each request ``--new-tokens``
  tokens), spread over ``--client-procs`` processes (scripts/benchlib/load.py), throughput counted over a
  steady window past the start-up wave: against N x the one-worker throughput (scaling efficiency), the queue wait the
  fleet adds (enqueue -> the step that started the request, p50/p99), Redis calls and Redis CPU per request;
- idle: the same N workers with no traffic: Redis calls per second per idle worker.

Then the Redis work of one request (one worker, 1-token requests from 64 concurrent clients, as issue
29 measured it: calls and command time per request from INFO commandstats), and the request rate at which
one Redis core saturates (1 / Redis CPU seconds per request, measured under load).

    python scripts/bench_scale.py --json docs/bench/scale.json                 # N = 1 2 4 8 16 32 64
    python scripts/bench_scale.py --workers 1,2,4 --seconds 10                 # a quick look

Writes JSON and prints a table. Not a test: run it on a quiet machine; say which machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
import redis

from batchfleet.producer import AsyncClient
from batchfleet.worker.devtools import PrivateRedis, free_port
from benchlib import load  # scripts/ is on sys.path when run as python scripts/bench_scale.py

HERE = Path(__file__).resolve().parent
DEFAULT_SERVER = "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else "redis-server"


class Server:
    """A private redis-server without persistence (worker/devtools.py PrivateRedis), for one measurement."""

    binary = DEFAULT_SERVER  # --redis-server sets it

    def __init__(self) -> None:
        self.private = PrivateRedis(port=free_port(), extra_args=("--appendonly", "no", "--maxclients", "20000"),
                                    binary=self.binary).start()
        self.url = self.private.url
        self.r = redis.Redis.from_url(self.url)

    def counters(self) -> dict[str, float]:
        """Redis calls and command microseconds so far (INFO commandstats, less the INFO calls), CPU seconds."""
        cpu = self.r.info("cpu")
        per = self.by_command().values()
        return {"calls": sum(c for c, _ in per), "usec": sum(u for _, u in per),
                "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"]}

    def by_command(self) -> dict[str, tuple[int, int]]:
        return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
                for k, v in self.r.info("commandstats").items() if k != "cmdstat_info"}

    def stop(self) -> None:
        self.r.close()
        self.private.stop()


def start_workers(url: str, ns: str, n: int, worker_args: list[str]) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, str(HERE / "simulated_engine.py"), "--redis-url", url,
                               "--namespace", ns, "--name", f"sim{i}", *worker_args],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(n)]
    for p in procs:
        line = p.stdout.readline() if p.stdout else ""
        if "ready" not in line:
            raise RuntimeError(f"a simulated worker did not start: {line!r}")
    return procs


def cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """User + system CPU seconds the processes used so far (/proc/<pid>/stat, Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in procs:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of the whole line)
    return total


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of every CPU since boot (/proc/stat): busy share = their deltas' ratio."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # less idle and iowait


def stop_workers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def measure_n(n: int, seconds: float, idle_s: float, per_worker: float, new_tokens: int, prompt_len: int,
              max_running: int, worker_args: list[str], open_rate: float | None, client_procs: int) -> dict:
    server = Server()
    procs: list[subprocess.Popen] = []
    try:
        ns = f"scale{n}"
        procs = start_workers(server.url, ns, n, worker_args)
        time.sleep(1.0)  # heartbeats and the first reclaim pass settle
        before = server.counters()
        time.sleep(idle_s)
        after = server.counters()
        idle_calls = (after["calls"] - before["calls"]) / idle_s / n
        idle_cpu = (after["cpu_s"] - before["cpu_s"]) / idle_s
        clients = max(1, round(per_worker * max_running * n))
        before = server.counters()
        shape = {"url": server.url, "namespace": ns, "seconds": seconds, "new_tokens": new_tokens,
                 "prompt_len": prompt_len}
        t0, cpu0, host0 = time.monotonic(), cpu_seconds(procs), host_busy()
        run = load.run(load.Load(**shape, clients=clients), client_procs)
        after, wall, worker_cpu = server.counters(), time.monotonic() - t0, cpu_seconds(procs) - cpu0
        host = host_busy()
        done = max(run["requests"], 1)
        poisson = None if open_rate is None else load.run(load.Load(**shape, rate=open_rate * n), client_procs)
        return {"workers": n, "clients": clients, **run, "open_loop": poisson,
                "redis_calls_per_req": (after["calls"] - before["calls"]) / done,
                "redis_usec_per_req": (after["usec"] - before["usec"]) / done,
                "redis_cpu_us_per_req": (after["cpu_s"] - before["cpu_s"]) / done * 1e6,
                "redis_cpu_share": (after["cpu_s"] - before["cpu_s"]) / wall,
                "worker_cpu_us_per_req": worker_cpu / done * 1e6, "worker_cpu_share": worker_cpu / wall,
                "host_cpu_busy": (host[0] - host0[0]) / max(host[1] - host0[1], 1e-9),
                "idle_calls_per_worker_s": idle_calls, "idle_redis_cpu_share": idle_cpu}
    finally:
        stop_workers(procs)
        server.stop()


def request_cost(n_requests: int, concurrency: int, worker_args: list[str]) -> dict:
    """Issue 29's measurement: one worker, 1-token non-streamed requests from ``concurrency`` tasks."""
    server = Server()
    procs: list[subprocess.Popen] = []
    try:
        procs = start_workers(server.url, "cost", 1, worker_args)

        async def drive() -> tuple[float, dict[str, tuple[int, int]]]:
            async with AsyncClient(server.url, "cost", max_connections=16) as client:
                await client.fleet(timeout=30)
                await client.generate([1, 2, 3], max_new_tokens=1, timeout=60)  # scripts loaded, inbox read
                left = list(range(n_requests))
                before = server.by_command()
                t0 = time.monotonic()

                async def one() -> None:
                    while left:
                        left.pop()
                        await client.generate([1, 2, 3, 4], max_new_tokens=1, timeout=60)

                await asyncio.gather(*(one() for _ in range(concurrency)))
                return time.monotonic() - t0, before

        cpu0 = server.counters()["cpu_s"]
        wall, before = asyncio.run(drive())
        cpu1 = server.counters()["cpu_s"]
        after = server.by_command()
        per = {cmd: ((c - before.get(cmd, (0, 0))[0]) / n_requests, (u - before.get(cmd, (0, 0))[1]) / n_requests)
               for cmd, (c, u) in after.items()}
        per = {k: v for k, v in per.items() if v[0] > 0}
        return {"requests": n_requests, "concurrency": concurrency, "wall_s": wall,
                "calls_per_req": sum(c for c, _ in per.values()), "usec_per_req": sum(u for _, u in per.values()),
                "redis_cpu_us_per_req": (cpu1 - cpu0) / n_requests * 1e6,
                "by_command": {k: {"calls": round(c, 2), "usec": round(u, 1)} for k, (c, u) in sorted(per.items())}}
    finally:
        stop_workers(procs)
        server.stop()


def idle_workers_per_core(rows: list[dict]) -> float | None:
    """Idle workers one Redis core carries: 1 / the Redis CPU each idle worker adds (the slope between the
    smallest and the largest fleet, so Redis' own cron is not charged to the workers)."""
    lo, hi = rows[0], rows[-1]
    slope = (hi["idle_redis_cpu_share"] - lo["idle_redis_cpu_share"]) / max(hi["workers"] - lo["workers"], 1)
    return 1 / slope if slope > 0 else None


@click.command()
@click.option("--workers", default="1,2,4,8,16,32,64", help="Fleet sizes, comma separated.")
@click.option("--seconds", type=float, default=20.0, help="Closed-loop seconds per fleet size.")
@click.option("--idle-seconds", type=float, default=5.0)
@click.option("--per-worker", type=float, default=1.5, help="Closed-loop clients per worker, x max_running.")
@click.option("--new-tokens", type=int, default=32)
@click.option("--prompt-len", type=int, default=64)
@click.option("--max-running", type=int, default=32)
@click.option("--cost", default="8,0.02,30,0.3", help="Simulated step cost: prefill_a,prefill_b,decode_c,decode_d ms.")
@click.option("--cost-requests", type=int, default=1500, help="Requests of the per-request Redis cost run.")
@click.option("--client-procs", type=int, default=4, show_default=True,
              help="Client processes the load is spread over (one process cannot feed 64 workers).")
@click.option("--load", "load_x", type=float, default=0.7,
              help="Open-loop Poisson rate, x the one-worker closed-loop rate x N.")
@click.option("--json", "json_path", default=None)
@click.option("--redis-server", "redis_server", default=DEFAULT_SERVER, show_default=True,
              help="The redis-server binary of the private servers (/usr/bin/redis-server when it exists).")
def main(workers: str, seconds: float, idle_seconds: float, per_worker: float, new_tokens: int, prompt_len: int,
         max_running: int, cost: str, cost_requests: int, client_procs: int, load_x: float,
         json_path: str | None, redis_server: str) -> None:
    Server.binary = redis_server
    version = subprocess.run([redis_server, "--version"], capture_output=True, text=True).stdout.strip()
    print(version, file=sys.stderr, flush=True)
    worker_args = ["--max-running", str(max_running), "--cost", cost]
    cost_run = request_cost(cost_requests, 64, worker_args)
    rows = []
    per_worker_rps = None  # the open-loop rate per worker: --load x what one worker carried closed-loop
    for n in (int(x) for x in workers.split(",")):
        rows.append(measure_n(n, seconds, idle_seconds, per_worker, new_tokens, prompt_len, max_running, worker_args,
                              None if per_worker_rps is None else load_x * per_worker_rps, client_procs))
        if per_worker_rps is None:
            per_worker_rps = rows[0]["rps"] / n
            rows[0]["open_loop"] = measure_n(n, seconds, 0.1, per_worker, new_tokens, prompt_len, max_running,
                                             worker_args, load_x * per_worker_rps, client_procs)["open_loop"]
        print(f"N={n}: {rows[-1]['rps']:.1f} req/s", file=sys.stderr, flush=True)
    base = rows[0]["rps"] / rows[0]["workers"]
    for row in rows:
        row["efficiency"] = row["rps"] / (base * row["workers"])
    saturation = 1e6 / cost_run["redis_cpu_us_per_req"] if cost_run["redis_cpu_us_per_req"] else None
    out = {"host": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "redis": version},
           "settings": {"seconds": seconds, "client_procs": client_procs, "per_worker": per_worker,
                        "new_tokens": new_tokens, "prompt_len": prompt_len, "max_running": max_running,
                        "cost_ms": cost},
           "request_cost": cost_run, "rows": rows, "redis_saturation_rps": saturation,
           "idle_workers_per_redis": idle_workers_per_core(rows)}
    print("by command (calls, usec per request):", json.dumps(cost_run["by_command"]))
    print(f"\nper request (1 worker, 1 token, 64 clients): {cost_run['calls_per_req']:.1f} Redis calls, "
          f"{cost_run['usec_per_req']:.0f} us command time, {cost_run['redis_cpu_us_per_req']:.0f} us Redis CPU")
    print(f"one Redis core saturates near {saturation:,.0f} requests/s (1 / Redis CPU per request)\n")
    print(f"closed loop: {per_worker:g} x max_running clients per worker; open loop: Poisson at {load_x:g} x N x "
          "the one-worker closed-loop rate; queue = enqueue -> the step that started the request\n")
    print("| workers | closed req/s | efficiency | open req/s (offered) | open queue p50 / p99 ms | calls/req "
          "| CPU us/req: Redis / workers / clients | host CPU busy | idle calls/s/worker |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        o = r["open_loop"]
        print(f"| {r['workers']} | {r['rps']:.1f} | {r['efficiency']:.2f} | {o['rps']:.1f} ({o['offered_rps']:.1f}) "
              f"| {o['queue_p50_ms']:.1f} / {o['queue_p99_ms']:.1f} | {r['redis_calls_per_req']:.1f} "
              f"| {r['redis_cpu_us_per_req']:.0f} / {r['worker_cpu_us_per_req']:.0f} / "
              f"{r['client_cpu_us_per_req']:.0f} "
              f"| {r['host_cpu_busy']:.2f} | {r['idle_calls_per_worker_s']:.0f} |")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
