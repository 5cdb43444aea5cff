"""Autoscaling simulation (issue 56): a day of traffic on 1-200 simulated workers, scaled by KEDA's arithmetic,
against an oracle that knows the day in advance.

Real parts: a private Redis, the real producer (AsyncClient for interactive requests, ``bulk_file`` for the bulk
job, which registers its remaining lines), the real worker loop and transport over the simulated engine
(scripts/simulated_engine.py), many worker threads per host process (scripts/benchlib/simhost.py). Simulated:
time (everything runs ``--speed`` times faster than the day: engine steps, the trace, start delays, KEDA's
and the HPA's clocks), the engine (a step sleeps), KEDA and the HPA (scripts/benchlib/keda.py, fed by the demand
figure of scripts/benchlib/simdemand.py) and Kubernetes' pods (start delay; SIGTERM's path on scale-down; hosts
SIGKILLed every ``--kill-every-h`` so their workers' entries are reclaimed by the others).

The trace (scripts/benchlib/daytrace.py): interactive arrivals on a diurnal curve with bursts, a bulk job at
night. A simulated request is a scale model of real work: ``--tokens`` steps of ``--step-s`` simulated seconds.

Policies: ``keda`` (the ScaledObject from the options, scaling on deploy/k8s/keda.yaml's formula with the
interactive utilization the manifests ship, ``--interactive-utilization`` to try another) and ``oracle`` (the
fewest workers per interval that start every interactive request on arrival, started one start delay ahead; the
bulk job on ``--background-cap`` workers). Each runs the same trace on a fresh Redis. Reported per policy:
workers over time, interactive queue time (enqueue -> its batch started: TTFT less one step) p50/p99, the bulk
job's finish, worker-seconds, and exactly-once counts (sent, answered, lost; bulk lines answered twice).

    nice -n 19 python scripts/autoscale_sim.py --json docs/bench/autoscale_day.json --plot docs/bench/autoscale_day.png
    python scripts/autoscale_sim.py --hours 1 --speed 60 --peak-rps 0.3 --bulk-lines 100   # a quick look
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import redis

from batchfleet.common.keys import Keys
from batchfleet.worker.devtools import PrivateRedis, free_port
from benchlib.daytrace import DayShape, Plan, Trace, make_trace, oracle_schedule
from benchlib.keda import Autoscaler, ScaledObject
from benchlib.shipped import shipped
from benchlib.simdemand import read_demand, worker_equivalents
from benchlib.simhost import BUCKETS, HostSpec, host_main
from benchlib.simload import LoadSpec, load_main

DEFAULT_SERVER = "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else "redis-server"
CTX = mp.get_context("spawn")  # clean interpreters: no inherited Redis connections or threads


@dataclass(frozen=True)
class Setup:
    speed: float
    max_running: int
    step_s: float
    tokens: int
    bulk_tokens: int
    start_delay_s: float
    background_cap: int
    hosts: int
    kill_every_h: float
    tick_s: float
    claim_idle_s: float
    interactive_utilization: float = 1.0  # keda.yaml's formula: interactive / u

    @property
    def service_s(self) -> float:
        return self.tokens * self.step_s

    @property
    def bulk_service_s(self) -> float:
        return self.bulk_tokens * self.step_s


@dataclass
class Pod:
    name: str
    host: int
    started: float  # simulated seconds: asked for
    ready: float | None = None
    stopping: float | None = None
    gone: float | None = None


@dataclass
class Fleet:
    """The pods (Kubernetes' view) over host processes; times in simulated seconds."""

    setup: Setup
    spec: HostSpec
    hosts: list[tuple[mp.Process, mp.Queue, mp.Queue]] = field(default_factory=list)
    pods: dict[str, Pod] = field(default_factory=dict)
    count: int = 0
    kills: int = 0

    def start_hosts(self) -> None:
        for _ in range(self.setup.hosts):
            self.hosts.append(self._host())

    def _host(self) -> tuple[mp.Process, mp.Queue, mp.Queue]:
        commands, events = CTX.Queue(), CTX.Queue()
        proc = CTX.Process(target=host_main, args=(self.spec, commands, events), daemon=True)
        proc.start()
        return proc, commands, events

    def live(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.gone is None and p.stopping is None]

    def scale(self, now: float, replicas: int) -> None:
        live = self.live()
        for _ in range(replicas - len(live)):
            per_host = [sum(1 for p in live if p.host == h) for h in range(len(self.hosts))]
            host = per_host.index(min(per_host))
            self.count += 1
            pod = Pod(f"pod{self.count}", host, now)
            self.pods[pod.name] = pod
            live.append(pod)
            self.hosts[host][1].put(("start", pod.name, self.setup.start_delay_s / self.setup.speed))
        # a ReplicaSet removes pods not ready first, then the newest
        for pod in sorted(live, key=lambda p: (p.ready is not None, -p.started))[:max(0, len(live) - replicas)]:
            pod.stopping = now
            self.hosts[pod.host][1].put(("stop", pod.name))

    def drain_events(self, t0: float) -> None:
        """Apply the hosts' events; their wall times become simulated seconds since ``t0``."""
        for _, _, events in self.hosts:
            while True:
                try:
                    kind, name, wall = events.get_nowait()
                except queue.Empty:
                    break
                pod = self.pods.get(name)
                if pod is None or pod.gone is not None:
                    continue
                at = (wall - t0) * self.setup.speed
                if kind == "ready":
                    pod.ready = at
                else:
                    pod.gone = at

    def kill_busiest_host(self, now: float) -> None:
        """SIGKILL the host with the most ready pods (a node lost): its pods' entries stay pending until live
        workers reclaim them; a fresh host process takes its place."""
        ready = [sum(1 for p in self.live() if p.host == h and p.ready is not None) for h in range(len(self.hosts))]
        h = ready.index(max(ready))
        proc, _, _ = self.hosts[h]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self.kills += 1
        for pod in self.pods.values():
            if pod.host == h and pod.gone is None:
                pod.gone = now
        self.hosts[h] = self._host()

    def stop_all(self) -> None:
        for _, commands, _ in self.hosts:
            commands.put(("exit",))
        for proc, _, _ in self.hosts:
            proc.join(120)
            if proc.is_alive():
                proc.kill()

    def worker_seconds(self, end: float) -> float:
        return sum((p.gone if p.gone is not None else end) - p.started for p in self.pods.values())


def pct(xs: list[float], q: float) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def run_policy(policy: str, trace: Trace, plan: Plan, setup: Setup, so: ScaledObject, server_binary: str) -> dict:
    private = PrivateRedis(port=free_port(), extra_args=("--appendonly", "no", "--maxclients", "20000"),
                           binary=server_binary).start()
    r = redis.Redis.from_url(private.url)
    ns, S = "sim", setup.speed
    keys = Keys(ns)
    spec = HostSpec(private.url, ns, setup.max_running, setup.step_s * 1000 / S,
                    max(100, int(setup.claim_idle_s * 1000 / S)), max_wait_ms=20.0)
    fleet = Fleet(setup, spec)
    fleet.start_hosts()
    try:
        # one pod writes the fleet description (kept: scale to zero), then goes: not part of the day
        fleet.scale(0.0, 1)
        boot = time.time() + 120
        while not any(p.ready is not None for p in fleet.pods.values()) and time.time() < boot:
            fleet.drain_events(0.0)
            time.sleep(0.05)
        fleet.scale(0.0, 0)
        while any(p.gone is None for p in fleet.pods.values()) and time.time() < boot:
            fleet.drain_events(0.0)
            time.sleep(0.05)
        fleet.pods.clear()
        workdir = tempfile.mkdtemp(prefix="autoscale-")
        t0 = time.time() + 3.0
        load = LoadSpec(private.url, ns, [a / S for a in trace.arrivals],
                        trace.bulk_at_s / S if trace.shape.bulk_lines else None, trace.shape.bulk_lines,
                        setup.tokens, setup.bulk_tokens, timeout_s=trace.end_s / S * 3 + 600, workdir=workdir)
        out: mp.Queue = CTX.Queue()
        producer = CTX.Process(target=load_main, args=(load, t0, out), daemon=True)
        producer.start()
        scaler = Autoscaler(so)
        timeline: list[tuple[float, float, int, int, int]] = []  # (t, metric, replicas, ready, paid)
        next_kill = setup.kill_every_h * 3600 if setup.kill_every_h else float("inf")
        result, load_before = None, os.getloadavg()
        progress_every = max(1, int(trace.end_s / setup.tick_s / 24))
        time.sleep(max(0.0, t0 - time.time()))
        while result is None:
            now = (time.time() - t0) * S
            fleet.drain_events(t0)
            metric = worker_equivalents(r, keys, BUCKETS, setup.max_running, setup.background_cap,
                                        setup.interactive_utilization if policy == "keda" else 1.0)
            if policy == "keda":
                replicas = scaler.advance(now, metric)
            else:
                d = read_demand(r, keys, BUCKETS)
                bulk_left = now < trace.bulk_at_s + 600 or d.background + d.unsent > 0  # 600 s: the run registers
                replicas = plan.replicas_at(now, bulk_left)
                if now > trace.end_s and metric > 0:
                    replicas = max(replicas, 1)  # past the plan's last interval: never strand a request
            if now >= next_kill and now < trace.end_s and any(p.ready is not None for p in fleet.live()):
                fleet.kill_busiest_host(now)
                next_kill += setup.kill_every_h * 3600
            fleet.scale(now, replicas)
            live = fleet.live()
            timeline.append((round(now, 1), round(metric, 2), replicas, sum(1 for p in live if p.ready is not None),
                             sum(1 for p in fleet.pods.values() if p.gone is None)))
            if len(timeline) % progress_every == 0:
                print(f"{policy} {hhmm(now)}: demand {metric:.1f}, replicas {replicas}, ready {timeline[-1][3]}",
                      file=sys.stderr, flush=True)
            try:
                result = out.get(timeout=setup.tick_s / S)
            except queue.Empty:
                if not producer.is_alive():
                    raise RuntimeError(f"the producer process died (exit code {producer.exitcode})") from None
        end = (time.time() - t0) * S
        producer.join(30)
        # what the streams still hold once every request was answered: should be nothing
        leftover = {name: r.xlen(name) for name, _, _ in keys.streams(BUCKETS) if r.xlen(name)}
        if leftover:
            name = next(iter(leftover))
            print("left in", name, r.xrange(name, count=3), r.xpending(name, keys.group), file=sys.stderr)
        load_after = os.getloadavg()
    finally:
        fleet.stop_all()
        r.close()
        private.stop()
    inter = result["interactive"]
    queue_s = [q / 1000 * S for _, q, _ in inter["samples"]]
    service_s = [(total - q) / 1000 * S for _, q, total in inter["samples"]]
    bulk = result["bulk"]
    summary = {
        "policy": policy, "end_s": end, "worker_seconds": fleet.worker_seconds(end), "pods_started": fleet.count,
        "host_kills": fleet.kills, "left_in_streams": leftover, "peak_ready": max((t[3] for t in timeline), default=0),
        "interactive": {"sent": inter["sent"], "answered": len(inter["samples"]), "lost": len(inter["errors"]),
                        "errors": inter["errors"][:5], "queue_p50_s": pct(queue_s, 50),
                        "queue_p99_s": pct(queue_s, 99), "queue_max_s": max(queue_s, default=0.0),
                        "service_p50_s": pct(service_s, 50)},
        "ticks": len(timeline), "mean_tick_s": end / max(len(timeline), 1),
        "bulk": None if bulk is None else {
            **bulk, "arrived_s": trace.bulk_at_s, "started_s": bulk["started_wall"] * S,
            "finished_s": bulk["finished_wall"] * S, "took_s": (bulk["finished_wall"] - bulk["started_wall"]) * S},
        "load_avg_before": load_before, "load_avg_after": load_after,
        "timeline": timeline[::max(1, int(60 / setup.tick_s))],  # one a simulated minute
    }
    return summary


def hhmm(seconds: float) -> str:
    return f"{int(seconds // 3600):02d}:{int(seconds % 3600 // 60):02d}"


def plot(path: str, trace: Trace, runs: dict, plan: Plan) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, low) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = [i * plan.interval_s / 3600 for i in range(len(plan.interactive))]
    top.step(xs, [plan.workers(i) for i in range(len(xs))], where="post", color="black", lw=1, ls="--",
             label="oracle plan (workers needed)")
    colors = {"keda": "tab:blue", "oracle": "tab:green"}
    for name, run in runs.items():
        tl = run["timeline"]
        top.plot([t[0] / 3600 for t in tl], [t[4] for t in tl], color=colors.get(name), lw=1.2,
                 label=f"{name}: workers (paid)")
        if name == "keda":
            top.plot([t[0] / 3600 for t in tl], [t[1] for t in tl], color="tab:orange", lw=0.8, alpha=0.8,
                     label="KEDA's metric: demand, interactive / utilization (worker-equivalents)")
    top.set_ylabel("workers")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"A simulated day: {len(trace.arrivals):,} interactive requests, a {trace.shape.bulk_lines:,}-line "
                  f"bulk job at {hhmm(trace.bulk_at_s)}")
    hours = int(trace.end_s // 3600) or 1
    width = trace.end_s / hours
    rate = [sum(1 for a in trace.arrivals if i * width <= a < (i + 1) * width) / width for i in range(hours)]
    low.bar([(i + 0.5) * width / 3600 for i in range(hours)], rate, width=width / 3600 * 0.9, color="lightgray",
            label="interactive arrivals / s")
    low.set_ylabel("requests / s")
    low.set_xlabel("hour of the day (simulated)")
    low.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--hours", type=float, default=24.0, show_default=True,
              help="Simulated hours (the day's shape squeezed in).")
@click.option("--speed", type=float, default=144.0, show_default=True, help="Simulated seconds per wall second.")
@click.option("--peak-rps", type=float, default=0.3, show_default=True, help="Interactive requests/s at the peak.")
@click.option("--night-rps", type=float, default=0.03, show_default=True)
@click.option("--bulk-lines", type=int, default=2000, show_default=True)
@click.option("--bulk-at-h", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=1)
@click.option("--max-running", type=int, default=4, show_default=True, help="Slots of one worker.")
@click.option("--step-s", type=float, default=20.0, show_default=True, help="Simulated seconds of one engine step.")
@click.option("--tokens", type=int, default=6, show_default=True, help="Steps of an interactive request.")
@click.option("--bulk-tokens", type=int, default=24, show_default=True, help="Steps of a bulk line.")
@click.option("--start-delay-s", type=float, default=60.0, show_default=True, help="A new worker's start delay.")
@click.option("--background-cap", type=int, default=100, show_default=True,
              help="Workers background work alone may claim (worker-equivalents).")
@click.option("--polling-interval-s", type=float, default=None, help="[default: keda.yaml's pollingInterval]")
@click.option("--cooldown-s", type=float, default=None, help="[default: keda.yaml's cooldownPeriod]")
@click.option("--down-window-s", type=float, default=None,
              help="HPA scale-down stabilization [default: keda.yaml's behavior, else Kubernetes' 300 s].")
@click.option("--min-replicas", type=int, default=0, show_default=True)
@click.option("--target", type=float, default=1.0, show_default=True,
              help="Worker-equivalents per replica (AverageValue); below 1 keeps headroom.")
@click.option("--interactive-utilization", type=float, default=None,
              help="KEDA's formula: interactive demand over this (headroom for bursts) "
                   "[default: deploy/k8s/config.yaml's INTERACTIVE_UTILIZATION, what ships].")
@click.option("--max-replicas", type=int, default=200, show_default=True)
@click.option("--hosts", type=int, default=4, show_default=True, help="Processes hosting the worker threads.")
@click.option("--kill-every-h", type=float, default=6.0, show_default=True,
              help="SIGKILL the busiest host every so many simulated hours (0: never).")
@click.option("--claim-idle-s", type=float, default=300.0, show_default=True,
              help="Simulated claim_idle: a killed worker's entries wait this long before others reclaim them.")
@click.option("--policies", default="keda,oracle", show_default=True)
@click.option("--oracle-from", default=None, help="Take the oracle's run from this earlier JSON (same trace).")
@click.option("--json", "json_path", default=None)
@click.option("--plot", "plot_path", default=None)
@click.option("--redis-server", default=DEFAULT_SERVER, show_default=True)
def main(hours: float, speed: float, peak_rps: float, night_rps: float, bulk_lines: int, bulk_at_h: float, seed: int,
         max_running: int, step_s: float, tokens: int, bulk_tokens: int, start_delay_s: float, background_cap: int,
         polling_interval_s: float | None, cooldown_s: float | None, down_window_s: float | None,
         min_replicas: int, target: float,
         interactive_utilization: float | None, max_replicas: int, hosts: int, kill_every_h: float,
         claim_idle_s: float, policies: str, oracle_from: str | None, json_path: str | None,
         plot_path: str | None, redis_server: str) -> None:
    ships = shipped()  # what deploy/k8s ships, for every KEDA setting not given
    polling_interval_s = ships.polling_interval_s if polling_interval_s is None else polling_interval_s
    cooldown_s = ships.cooldown_period_s if cooldown_s is None else cooldown_s
    down_window_s = ships.down_window_s if down_window_s is None else down_window_s
    if interactive_utilization is None:
        interactive_utilization = ships.interactive_utilization
    setup = Setup(speed, max_running, step_s, tokens, bulk_tokens, start_delay_s, background_cap, hosts, kill_every_h,
                  tick_s=polling_interval_s, claim_idle_s=claim_idle_s,
                  interactive_utilization=interactive_utilization)
    so = ScaledObject(polling_interval_s=polling_interval_s, cooldown_period_s=cooldown_s, min_replicas=min_replicas,
                      max_replicas=max_replicas, down_window_s=down_window_s, target=target)
    trace = make_trace(DayShape(hours=hours, peak_rps=peak_rps, night_rps=night_rps, bulk_lines=bulk_lines,
                                bulk_at_h=bulk_at_h, seed=seed))
    plan = oracle_schedule(trace, setup.service_s, setup.bulk_service_s, max_running, 60.0, start_delay_s,
                           background_cap)
    slowdown = 1.0
    print(f"{len(trace.arrivals)} interactive requests, {bulk_lines} bulk lines over {hours:g} h at {speed:g}x "
          f"(~{hours * 3600 / speed / 60:.1f} min wall per policy)", file=sys.stderr, flush=True)
    runs = {}
    for policy in policies.split(","):
        if policy == "oracle" and runs:
            # the fleet's steps run slower than the engine's sleep (the loop's own work on a shared CPU): the oracle
            # plans with the service time the runs before it measured, or it would plan too few workers
            slowdown = max(1.0, statistics.median(run["interactive"]["service_p50_s"] for run in runs.values())
                           / setup.service_s)
            plan = oracle_schedule(trace, setup.service_s * slowdown, setup.bulk_service_s * slowdown, max_running,
                                   60.0, start_delay_s, background_cap)
        runs[policy] = run_policy(policy, trace, plan, setup, so, redis_server)
        if json_path:  # each run as it ends: a later one that fails leaves the earlier ones
            Path(json_path).write_text(json.dumps({"runs": runs}) + "\n")
        print(f"{policy}: done, load average {runs[policy]['load_avg_after']}", file=sys.stderr, flush=True)
    if oracle_from and "oracle" not in runs:
        runs["oracle"] = json.loads(Path(oracle_from).read_text())["runs"]["oracle"]
    oracle_ws = runs["oracle"]["worker_seconds"] if "oracle" in runs else plan.worker_seconds
    oracle_p99 = runs["oracle"]["interactive"]["queue_p99_s"] if "oracle" in runs else None
    print(f"\noracle plan: {plan.worker_seconds / 3600:.1f} worker-hours, bulk done at {hhmm(plan.bulk_done_s)}, "
          f"service times x {slowdown:.2f} as measured; "
          f"one step = {step_s:g} s, an interactive request {setup.service_s:g} s, "
          f"a bulk line {setup.bulk_service_s:g} s, "
          f"start delay {start_delay_s:g} s\n")
    print("| policy | worker-hours (x oracle) | peak workers | interactive queue p50 / p99 s (p99 x oracle) "
          "| bulk finished (took) | sent / answered / lost | bulk answered / twice | host kills |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        it, bk = run["interactive"], run["bulk"]
        run["worker_seconds_x_oracle"] = run["worker_seconds"] / oracle_ws if oracle_ws else None
        run["queue_p99_x_oracle"] = it["queue_p99_s"] / oracle_p99 if oracle_p99 else None
        xo = f"{run['queue_p99_x_oracle']:.2f}" if run["queue_p99_x_oracle"] is not None else "-"
        bulk_cell = "-" if bk is None else f"{hhmm(bk['finished_s'])} ({bk['took_s'] / 3600:.2f} h)"
        bulk_count = "-" if bk is None else f"{bk['answered']} / {bk['duplicates']}"
        print(f"| {name} | {run['worker_seconds'] / 3600:.1f} ({run['worker_seconds_x_oracle']:.2f}) "
              f"| {run['peak_ready']} | {it['queue_p50_s']:.1f} / {it['queue_p99_s']:.1f} ({xo}) | {bulk_cell} "
              f"| {it['sent']} / {it['answered']} / {it['lost']} | {bulk_count} | {run['host_kills']} |")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "settings": {**asdict(setup), "scaled_object": asdict(so), "hours": hours, "peak_rps": peak_rps,
                         "night_rps": night_rps, "bulk_lines": bulk_lines, "bulk_at_h": bulk_at_h, "seed": seed},
            "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "oracle_plan": {"worker_seconds": plan.worker_seconds, "bulk_done_s": plan.bulk_done_s,
                            "service_slowdown": slowdown},
            "runs": runs}) + "\n")
    if plot_path:
        plot(plot_path, trace, runs, plan)


if __name__ == "__main__":
    main()
