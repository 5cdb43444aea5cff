"""Issue 29's own measurement of what one request costs Redis, runnable against any version of batchfleet: one real
worker (the tiny preset, the version's own defaults) on a private redis-server, ``--requests`` non-streamed
1-token requests from ``--threads`` threads of one sync ``Client``; INFO commandstats deltas (calls and command
time per request; a script's inner commands are counted again, as the issue counted them), Redis CPU, and the
worker's and this client process's CPU per request. Prints one JSON line (``--json`` appends it to a file).

It imports only what every version since the issue has (``batchfleet.producer.Client`` and ``python -m
batchfleet.worker``), so an older checkout is measured by mapping its folders to ``batchfleet.*`` first on
``PYTHONPATH`` (docs/BENCHMARKS_HISTORY.md section 11 shows how):

    python scripts/bench_request_cost.py --label HEAD --json /tmp/cost.jsonl
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import click
import redis

from batchfleet.producer import Client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@click.command()
@click.option("--requests", "n", type=int, default=1500, show_default=True)
@click.option("--threads", type=int, default=64, show_default=True)
@click.option("--label", default="", help="What is measured (a commit), copied into the JSON.")
@click.option("--redis-server", "binary", default="/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server")
              else "redis-server", show_default=True)
@click.option("--cache-dir", default=os.path.join(tempfile.gettempdir(), "bf-request-cost"), show_default=True,
              help="Where the worker builds the tiny preset.")
@click.option("--json", "json_path", default=None, help="Append the JSON line to this file.")
def main(n: int, threads: int, label: str, binary: str, cache_dir: str, json_path: str | None) -> None:
    port, data = free_port(), tempfile.mkdtemp()
    server = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", data],
                              stdout=subprocess.DEVNULL)
    url, ns = f"redis://127.0.0.1:{port}/0", "cost"
    r = redis.Redis.from_url(url)
    worker = None
    try:
        for _ in range(200):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        worker = subprocess.Popen([sys.executable, "-m", "batchfleet.worker", "--redis-url", url, "--namespace", ns,
                                   "--cache-dir", cache_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not r.exists(f"{ns}:fleet"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not publish its fleet")
            time.sleep(0.1)
        row = measure(r, url, ns, n, threads, worker.pid)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(60)
        server.terminate()
        server.wait(10)
    line = json.dumps({"label": label, "requests": n, "threads": threads, **row})
    print(line)
    if json_path:
        with open(json_path, "a") as f:
            f.write(line + "\n")


def measure(r: redis.Redis, url: str, ns: str, n: int, threads: int, worker: int) -> dict:
    def stats() -> dict[str, tuple[int, int]]:
        return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
                for k, v in r.info("commandstats").items() if k != "cmdstat_info"}

    def redis_cpu() -> float:
        c = r.info("cpu")
        return c["used_cpu_user"] + c["used_cpu_sys"]

    me = os.getpid()
    with Client(url, ns) as client:
        client.generate([1, 2, 3], max_new_tokens=1, timeout=120)  # the fleet read, scripts or functions loaded
        left, lock = list(range(n)), threading.Lock()

        def one() -> None:
            while True:
                with lock:
                    if not left:
                        return
                    left.pop()
                client.generate([1, 2, 3, 4], max_new_tokens=1, timeout=120)

        log = f"{ns}:batches"  # the worker's batch audit log (every version has it): what it batched
        mark = (r.xrevrange(log, count=1) or [(b"0-0", None)])[0][0]
        before, rc0, wc0, mc0, t0 = stats(), redis_cpu(), cpu_s(worker), cpu_s(me), time.monotonic()
        pool = [threading.Thread(target=one) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall, rc1, wc1, mc1, after = time.monotonic() - t0, redis_cpu(), cpu_s(worker), cpu_s(me), stats()
    sizes = [len(f[b"ids"].split(b",")) for _, f in r.xrange(log, b"(" + mark)]
    per = {k: ((c - before.get(k, (0, 0))[0]) / n, (u - before.get(k, (0, 0))[1]) / n) for k, (c, u) in after.items()}
    per = {k: v for k, v in per.items() if v[0] > 0}
    return {"calls_per_req": round(sum(c for c, _ in per.values()), 2),
            "usec_per_req": round(sum(u for _, u in per.values()), 1),
            "redis_cpu_us_per_req": round((rc1 - rc0) / n * 1e6, 1),
            "worker_cpu_us_per_req": round((wc1 - wc0) / n * 1e6),
            "client_cpu_us_per_req": round((mc1 - mc0) / n * 1e6), "wall_s": round(wall, 2),
            "batches": len(sizes), "mean_batch": round(sum(sizes) / max(len(sizes), 1), 1),
            "by_command": {k: [round(c, 2), round(u, 1)] for k, (c, u) in sorted(per.items())}}


if __name__ == "__main__":
    main()
