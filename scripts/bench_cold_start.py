"""A worker's cold start: seconds from process start to ready (the readiness probe's answer) and to its first
answer, and the start's phases (its log), per model and cache state.

    python scripts/bench_cold_start.py --json docs/bench/cold_start_<kind>.json

For each ``--presets`` model (``tiny``; ``llama1b``: TinyLlama-1.1B's shape, random weights built locally once,
not timed), worker processes start one after another, each answering one 2-token request once ready:

- ``cold``: an empty cache dir and a namespace with nothing kept: the C kernels compiled, the kernel choices
  measured (a new pod of a CPU kind the fleet never ran on);
- ``new pod``: another empty cache dir, the namespace of the cold run: the kernels compiled again, the kernel
  choices found in Redis (a pod of Kubernetes, which keeps no disk);
- ``restart``: the cold run's cache dir and namespace: nothing compiled, nothing measured.

``--worker-python`` / ``--worker-pythonpath`` start another checkout's worker (the same readiness: the
status its loop publishes), e.g. before this change. Prints a table, writes ``--json``; reports the load
average before each start (the machine is rarely idle).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import click
import redis

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.benchmark.report import git_commit, machine, write_json
from batchfleet.worker.devtools import delete_namespace
from batchfleet.worker.engine.models import make_preset
from batchfleet.worker.health import ready

MODES = ("cold", "new pod", "restart")
PHASE_RE = re.compile(r"start phase (\S+)\s+([0-9.]+) s")
MEASURED_RE = re.compile(r"(\d+) found cached, (\d+) measured")


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds ``pid`` and its waited-for children (the C compiler) used so far (Linux): on a loaded machine
    closer than the wall clock to what an idle one would take, for the serial part of a start."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round(sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK"), 2)  # utime stime cutime cstime


def start_once(redis_url: str, ns: str, model: Path, cache: Path, python: str, pythonpath: str | None,
               extra: list[str], timeout_s: float) -> dict:
    """One worker process: seconds to ready and to its first answer, its phases, then stopped."""
    name = f"cold-{uuid.uuid4().hex[:6]}"
    log = cache.parent / f"{name}.log"
    env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
    load = round(os.getloadavg()[0], 2)
    args = [python, "-m", "batchfleet.worker", "--redis-url", redis_url, "--namespace", ns, "--name", name,
            "--model", str(model), "--cache-dir", str(cache), "--log-format", "json", *extra]
    r = redis.Redis.from_url(redis_url)
    keys = Keys(ns)
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while not ready(r, keys, name):
            if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise click.ClickException(f"worker {name} did not get ready: {log.read_text()[-2000:]}")
            time.sleep(0.02)
        t_ready = time.monotonic() - t0
        cpu = cpu_seconds(proc.pid)
        with Client(redis_url, ns) as client:
            client.generate([5, 6, 7, 8], max_new_tokens=2, timeout=timeout_s)
        t_answer = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(120)
        r.close()
    phases: dict[str, float] = {}
    kernels = {}
    for line in log.read_text(errors="replace").splitlines():
        try:
            message = json.loads(line).get("message", "")
        except ValueError:
            continue
        if m := PHASE_RE.search(message):
            phases[m.group(1)] = float(m.group(2))
        if m := MEASURED_RE.search(message):
            kernels = {"kernel_choices_found": int(m.group(1)), "kernel_choices_measured": int(m.group(2))}
    return {"ready_s": round(t_ready, 2), "first_answer_s": round(t_answer, 2), "cpu_s_to_ready": cpu,
            "load_avg_1m": load,
            "phases": phases, **kernels}


@click.command(help=__doc__)
@click.option("--presets", default="tiny,llama1b", show_default=True, help="Models, comma-separated.")
@click.option("--runs", type=int, default=1, show_default=True, help="Rounds of the three starts per model.")
@click.option("--redis-url", default="redis://127.0.0.1:6379", show_default=True)
@click.option("--models-dir", default="~/.cache/batchfleet/models", show_default=True,
              help="Where the presets are built (once, not timed).")
@click.option("--worker-python", default=sys.executable, show_default=True)
@click.option("--worker-pythonpath", default=None, help="PYTHONPATH of the workers only (another checkout).")
@click.option("--label", default="HEAD", show_default=True, help="What the rows measure (e.g. before / after).")
@click.option("--timeout-s", type=float, default=600, show_default=True)
@click.option("--json", "json_path", default=None, help="Write the results here.")
def main(presets: str, runs: int, redis_url: str, models_dir: str, worker_python: str,
         worker_pythonpath: str | None, label: str, timeout_s: float, json_path: str | None) -> None:
    rows = []
    work = Path(tempfile.mkdtemp(prefix="bench-cold-start-"))
    try:
        for preset in presets.split(","):
            model = make_preset(preset, Path(models_dir).expanduser(), max_seq_len=4096)
            extra = ["--max-seq-len", "1024", "--buckets", "128,1024", "--kv-cache-gb", "0.5"]
            for run in range(runs):
                ns = f"bench-cold-{uuid.uuid4().hex[:6]}"
                first_cache = work / f"{preset}-{run}-cold" / "cache"
                caches = {"cold": first_cache, "new pod": work / f"{preset}-{run}-pod" / "cache",
                          "restart": first_cache}
                try:
                    for mode in MODES:
                        caches[mode].parent.mkdir(parents=True, exist_ok=True)
                        row = {"label": label, "preset": preset, "mode": mode, "run": run,
                               **start_once(redis_url, ns, model, caches[mode], worker_python, worker_pythonpath,
                                            extra, timeout_s)}
                        rows.append(row)
                        click.echo(f"{preset} {mode}: ready {row['ready_s']} s, first answer {row['first_answer_s']} s "
                                   f"(load {row['load_avg_1m']})", err=True)
                finally:
                    delete_namespace(redis_url, ns)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    names = [p for p in ("imports", "preset", "model", "cache", "compile", "kernels", "engine", "redis", "join",
                         "loop", "other") if any(p in r["phases"] for r in rows)]
    click.echo("| label | model | start | load 1m | ready (s) | first answer (s) | CPU s to ready |"
               + "".join(f" {p} |" for p in names))
    click.echo("|---|---|---|---:|---:|---:|---:|" + "---:|" * len(names))
    for r in rows:
        cells = "".join(f" {r['phases'][p]:.2f} |" if p in r["phases"] else " |" for p in names)
        click.echo(f"| {r['label']} | {r['preset']} | {r['mode']} | {r['load_avg_1m']} | {r['ready_s']} | "
                   f"{r['first_answer_s']} | {r['cpu_s_to_ready']} |{cells}")
    if json_path:
        write_json(json_path, {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "scripts/bench_cold_start.py", *sys.argv[1:]]), "commit": git_commit(),
            "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
