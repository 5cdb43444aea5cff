"""One run of the fault test: start the fleet and the clients, let the nemesis loose for ``minutes``, heal,
let every client settle what it is owed, run the references on a fresh worker, check, summarise.

Layout of ``out``: workload.json, histories/<client>.jsonl, faults.jsonl, bulk<k>.jsonl and .out.jsonl,
references.json, summary.json, and each process's log (worker<slot>.log, gateway.log, <client>.log)."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .checker import Report, check, wanted_references
from .fleet import Fleet
from .nemesis import INTENSITIES, Nemesis
from .reference import run_references
from .workload import Workload, make_workload


@dataclass(frozen=True)
class Plan:
    seed: int
    minutes: float  # how long the nemesis acts (start-up, settling and references come on top)
    intensity: str = "full"
    sync_clients: int = 2
    async_clients: int = 1
    callers: int = 4  # threads (sync) or tasks (async, gateway threads) of each client process
    gateway: bool = True
    bulk: bool = True
    workers: int = 2
    prompts: int = 16
    timeout_s: float = 30.0  # every call's timeout and job deadline
    collect_s: float = 60.0  # the last wait for a job that timed out, the fleet calm
    slack_s: float = 5.0  # how far past its timeout a caller may get its outcome (a loaded 2-core host)


class Supervisor(threading.Thread):
    """Restarts what ended by itself while the test runs: a bulk run (resume, or the next round), a worker or
    client that exited with an error (noted as a crash: the nemesis only ever kills with SIGKILL)."""

    def __init__(self, fleet: Fleet, until: float) -> None:
        super().__init__(name="supervisor", daemon=True)
        self.fleet = fleet
        self.until = until
        self.crashes: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.5):
            self.fleet.tend_bulk(more=time.time() < self.until)
            for slot, w in enumerate(self.fleet.workers):
                rc = w.popen.poll() if w.popen else None
                if rc not in (None, -9) and not w.done:
                    w.done = True  # noted once; its slot gets a new worker
                    self.crashes.append({"process": w.name, "exit": rc, "log": str(w.log), "tail": log_tail(w.log)})
                    self.fleet.replace_worker(slot)
            for c in self.fleet.clients.values():
                rc = c.popen.poll() if c.popen else None
                if rc == 0:
                    c.done = True
                elif rc not in (None, -9) and not c.done:
                    with c.lock:
                        if c.popen is not None and c.popen.poll() == rc:
                            self.crashes.append({"process": c.name, "exit": rc, "log": str(c.log),
                                                 "tail": log_tail(c.log)})
                            c.start()  # its open operations are settled by the next incarnation


def log_tail(path: Path, size: int = 4000) -> str:
    """The end of a process's log (its last traceback: logs of one slot or client are appended to)."""
    with path.open("rb") as f:
        f.seek(max(f.seek(0, 2) - size, 0))
        return f.read().decode(errors="replace")


def model_dir(cache: Path) -> Path:
    from batchfleet.worker.engine.models import make_preset

    return make_preset("tiny", cache)


def run_once(plan: Plan, out: Path, model: Path, log=print) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    workload = make_workload(plan.seed, plan.prompts, plan.timeout_s)
    workload.save(out / "workload.json")
    fleet = Fleet(out, model, f"fault-{uuid.uuid4().hex[:8]}", workload, plan.seed, plan.workers)
    nemesis = Nemesis(fleet, plan.seed, INTENSITIES[plan.intensity], out / "faults.jsonl")
    try:
        fleet.start_redis()
        fleet.start_workers()
        if plan.gateway:
            fleet.start_gateway()
        log(f"seed {plan.seed}: fleet up after {time.time() - t0:.1f} s (redis {fleet.url}, {plan.workers} workers)")
        until = time.time() + plan.minutes * 60
        for i in range(plan.sync_clients):
            fleet.add_client(f"sync{i}", "sync", until, plan.callers, plan.collect_s)
        for i in range(plan.async_clients):
            fleet.add_client(f"async{i}", "async", until, plan.callers, plan.collect_s)
        if plan.gateway:
            fleet.add_client("gateway0", "gateway", until, plan.callers, plan.collect_s)
        if plan.bulk:
            fleet.new_bulk_round()
        supervisor = Supervisor(fleet, until)
        supervisor.start()
        nemesis.run(until)
        log(f"seed {plan.seed}: nemesis done ({sum(nemesis.counts.values())} faults); settling")
        heal(fleet, nemesis)
        stuck = settle(fleet, plan)
        supervisor.halt.set()
        supervisor.join()
        supervisor.crashes += [{"process": name, "exit": None, "log": str(out / f"{name}.log"),
                                "tail": "did not finish in time"} for name in stuck]
        reference_phase(fleet, workload, out)
        (out / "run.json").write_text(json.dumps({"bulk_rounds": fleet.bulk_rounds, "crashes": supervisor.crashes,
                                                  "slack_s": plan.slack_s}, indent=1) + "\n")
        report = recheck(out)
    finally:
        fleet.stop_all()
    summary = {
        "plan": asdict(plan), "runs": 1, "wall_s": round(time.time() - t0, 1),
        "operations": sum(report.operations.values()), "operations_by_kind": dict(sorted(report.operations.items())),
        "outcomes": dict(sorted(report.outcomes.items())),
        "faults": sum(v for k, v in nemesis.counts.items() if k != "nemesis_error"),
        "faults_by_kind": dict(sorted(nemesis.counts.items())),
        "violations": sum(report.violations.values()), "violations_by_kind": dict(sorted(report.violations.items())),
        "violations_by_issue_item": report.by_item, "unexplained": len(report.unexplained),
        "examples": dict(report.examples),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def recheck(out: Path) -> Report:
    """The checker over a finished run's directory (what ``run_once`` does last; also for a look afterwards)."""
    run = json.loads((out / "run.json").read_text())
    references = json.loads((out / "references.json").read_text())
    faults = [json.loads(line) for line in (out / "faults.jsonl").read_text().splitlines()]
    fills = [(f["t"], f["t"] + f["seconds"]) for f in faults if f["kind"] == "fill_redis"]
    report = check(out / "histories", references, run["bulk_rounds"], Workload.load(out / "workload.json").prompts,
                   run["crashes"], run["slack_s"], fills)
    (out / "violations.jsonl").write_text("".join(json.dumps(v) + "\n" for v in report.every))
    return report


def heal(fleet: Fleet, nemesis: Nemesis) -> None:
    """Undo whatever fault is still on: Redis up and roomy, every process running, every worker slot filled."""
    with fleet.redis_lock:
        if fleet.redis.proc is None or fleet.redis.proc.poll() is not None:
            fleet.start_redis()
        fleet.redis.thaw()
        nemesis.lift_memory()
    for proc in [*fleet.workers, *fleet.clients.values()]:
        proc.signal(signal.SIGCONT)
    for slot, w in enumerate(fleet.workers):
        if not w.alive:
            fleet.replace_worker(slot)
    for c in fleet.clients.values():
        with c.lock:
            if not c.alive and not c.done and c.popen is not None and c.popen.returncode != 0:
                c.start()


def settle(fleet: Fleet, plan: Plan) -> list[str]:
    """Wait for every client process to exit (it collects what it is owed first) and the last bulk round;
    the names of the clients still running when the wait ends (the checker counts them as crashed)."""
    deadline = time.monotonic() + plan.timeout_s + plan.collect_s + 120
    while True:
        fleet.tend_bulk(more=False)
        stuck = [c.name for c in fleet.clients.values() if c.popen is None or c.popen.poll() != 0]
        bulk_done = fleet.bulk is None or fleet.bulk_rounds[-1]["finished"]  # else: bulk_unfinished
        if (not stuck and bulk_done) or time.monotonic() > deadline:
            return stuck
        time.sleep(0.5)


def reference_phase(fleet: Fleet, workload: Workload, out: Path) -> dict[str, dict]:
    """Every worker stopped; one fresh worker answers each request alone."""
    for w in fleet.workers:
        w.stop(30)
    fleet.worker_slots = 1
    fleet.workers = [fleet.worker_proc(0, 99)]
    fleet.workers[0].start()
    fleet.wait_heartbeats(1, 180)
    wanted = wanted_references(fleet.history_dir, fleet.bulk_rounds, workload.prompts)
    references = run_references(fleet.url, fleet.namespace, fleet.gateway_url, workload, wanted)
    (out / "references.json").write_text(json.dumps(references, indent=0) + "\n")
    return references
