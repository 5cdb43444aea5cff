"""Bounded memory on a large OpenAI batch file (issue 18): one worker (user defaults, tiny preset) answers a
``--mb`` MB / ``--lines``-line batch input through ``batchfleet bulk --format openai`` (the same streamed
runner, producer/bulk/runner.py, as the gateway's /v1/batches) and the batch validation the gateway runs
first (gateway/batches/runner.py ``validate``); reports each one's peak RSS against the file's size.

    python scripts/bench_batch_memory.py --json docs/bench/batch_memory.json

Every line carries the same long system prompt (what makes the file large; the prefix cache computes it
once) and asks for one token, so the run measures the runner's memory, not the model's speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import click

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

VALIDATE = """
import resource, sys, time
from batchfleet.gateway.batches.lines import Limits
from batchfleet.gateway.batches.runner import validate
t = time.perf_counter()
total, errors = validate(sys.argv[1], "/v1/chat/completions", Limits(600.0, 256))
print(total, len(errors), time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def write_input(path: Path, mb: int, lines: int) -> int:
    system = "You answer in one word. " * (mb * 1_000_000 // lines // 24)
    with open(path, "w") as f:
        for i in range(lines):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"item {i}"}],
                "max_tokens": 1, "temperature": 0}}) + "\n")
    return path.stat().st_size


def max_rss_mb(stderr: str) -> float:
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr).group(1)) / 1024


@click.command(help=__doc__)
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True, help="Started privately if unreachable.")
@click.option("--mb", type=int, default=200, show_default=True)
@click.option("--lines", type=int, default=50_000, show_default=True)
@click.option("--json", "json_path", default=None)
def main(redis_url: str, mb: int, lines: int, json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    ns = f"bmem-{uuid.uuid4().hex[:6]}"
    worker = spawn_worker(url, ns, ["--buckets", "128,512,2048,8192", "--max-seq-len", "8192"])
    try:
        with tempfile.TemporaryDirectory() as d:
            src, dst = Path(d) / "in.jsonl", Path(d) / "out.jsonl"
            size = write_input(src, mb, lines)
            v = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", VALIDATE, str(src)],
                               capture_output=True, text=True, check=True)
            total, errors, v_s, _ = v.stdout.split()
            t0 = time.perf_counter()
            b = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src),
                                "-o", str(dst), "--redis-url", url, "--namespace", ns], capture_output=True, text=True)
            took = time.perf_counter() - t0
            out_lines = sum(1 for _ in open(dst))
            errs = Path(str(dst) + ".errors.jsonl")
            err_lines = sum(1 for _ in open(errs)) if errs.exists() else 0
        res = {"input_mb": round(size / 1e6, 1), "lines": lines, "validate": {
            "requests": int(total), "malformed": int(errors), "seconds": round(float(v_s), 1),
            "peak_rss_mb": round(max_rss_mb(v.stderr), 1)}, "bulk": {
            "exit": b.returncode, "seconds": round(took, 1), "output_lines": out_lines, "error_lines": err_lines,
            "peak_rss_mb": round(max_rss_mb(b.stderr), 1)}}
    finally:
        worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
    print("| step | input | peak RSS | time | result |\n|---|---:|---:|---:|---|")
    print(f"| validate (gateway's batch check) | {res['input_mb']} MB, {lines} lines | "
          f"{res['validate']['peak_rss_mb']} MB | {res['validate']['seconds']} s | {res['validate']['requests']} "
          f"requests, {res['validate']['malformed']} malformed |")
    print(f"| bulk --format openai (the batch runner) | same | {res['bulk']['peak_rss_mb']} MB | "
          f"{res['bulk']['seconds']} s | {res['bulk']['output_lines']} output + {res['bulk']['error_lines']} error "
          f"lines, exit {res['bulk']['exit']} |")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
