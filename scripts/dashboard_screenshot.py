"""docs/dashboard.png: the live dashboard of a real fleet at work, rendered by headless Chromium.

    python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--workers 2] [--history-s 120] [--status-out F]

Starts a private namespace on the Redis at $BATCHFLEET_REDIS_URL (else 127.0.0.1:6379, else a private
redis-server), N workers (tiny model, native engine), a gateway (`batchfleet serve`, with a read-only operator
key: the page is opened with it), then the work: an OpenAI batch job of 8,000 requests (/v1/batches), a
`batchfleet bulk` run of 8,000 prompts, interactive requests in waves, and one dead letter. After
--history-s seconds (the charts get a sample every 10 s) it takes the screenshot (times in UTC) and cleans up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import redis

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.worker.devtools import delete_namespace, ensure_redis, free_port, spawn_worker

KEY, OPERATOR = "sk-screenshot-model-key", "op-screenshot-readonly"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchfleet.common.cli", *args]


def start_gateway(url: str, ns: str, port: int, files: str) -> subprocess.Popen:
    proc = subprocess.Popen(cli("serve", "--redis-url", url, "--namespace", ns, "--port", str(port), "--api-key", KEY,
                                "--operator-key", OPERATOR, "--files-dir", files, "--served-model-name", "tiny",
                                "--batch-window", "8"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code < 500:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the gateway did not start")


def create_batch_job(base: str, lines: int) -> str:
    def line(i: int) -> str:
        question = f"question {i} " + "w " * (i % 60)
        body = {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": question}]}
        return json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
    text = "".join(line(i) for i in range(lines))
    auth = {"Authorization": f"Bearer {KEY}"}
    up = httpx.post(f"{base}/v1/files", headers=auth, data={"purpose": "batch"},
                    files={"file": ("questions.jsonl", text.encode())}, timeout=60).json()
    job = httpx.post(f"{base}/v1/batches", headers=auth, timeout=60, json={
        "input_file_id": up["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    return job["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--history-s", type=float, default=120.0)
    ap.add_argument("--lines", type=int, default=8000, help="requests of the batch job, prompts of the bulk run")
    ap.add_argument("--status-out", default=None, help="also write `batchfleet status` at that moment here")
    args = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("needs headless Chromium: apt-get install -y chromium")
    url, private = ensure_redis(os.environ.get("BATCHFLEET_REDIS_URL", DEFAULT_REDIS_URL))
    ns = f"demo-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    procs: list[subprocess.Popen] = []
    workers = []
    tmp = tempfile.mkdtemp(prefix="bf-shot-")
    try:
        for _ in range(args.workers):
            workers.append(spawn_worker(url, ns, ["--threads", "1", "--max-wait-ms", "50"]))
        port = free_port()
        procs.append(start_gateway(url, ns, port, os.path.join(tmp, "files")))
        base = f"http://127.0.0.1:{port}"
        create_batch_job(base, args.lines)
        prompts = os.path.join(tmp, "prompts.txt")
        with open(prompts, "w") as f:
            f.writelines(f"summarize item {i}: " + "text " * (i % 90) + "\n" for i in range(args.lines))
        procs.append(subprocess.Popen(cli("bulk", prompts, "-o", os.path.join(tmp, "answers.jsonl"), "--format", "text",
                                          "--window", "8", "--max-new-tokens", "24", "--redis-url", url,
                                          "--namespace", ns), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        r = redis.Redis.from_url(url)
        r.xadd(keys.stream(128), {"id": "bad-entry-1", "r": "not-an-inbox", "p": b"\xc1"})  # one dead letter
        with Client(url, ns, max_connections=8) as client:
            t0, wave = time.monotonic(), 0
            while time.monotonic() - t0 < args.history_s:  # interactive waves: the queue chart moves
                for i in range(40 if wave % 3 == 0 else 8):
                    client.submit(f"chat {wave}.{i} " + "word " * (5 + (i * 37) % 120), max_new_tokens=16)
                wave += 1
                time.sleep(5)
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            "--hide-scrollbars", "--window-size=1280,1750", "--virtual-time-budget=4000",
                            f"--screenshot={os.path.abspath(args.out)}",
                            f"{base}/dashboard?tz=utc&span=15#key={OPERATOR}"], check=True, capture_output=True,
                           timeout=120)
            if args.status_out:
                with open(args.status_out, "w") as f:
                    subprocess.run(cli("status", "--redis-url", url, "--namespace", ns), stdout=f, check=True,
                                   timeout=60)
        print(f"wrote {args.out} (namespace {ns}, {args.workers} workers, {args.history_s:.0f} s of history)")
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for w in workers:
            w.kill()
        delete_namespace(url, keys.namespace)
        shutil.rmtree(tmp, ignore_errors=True)
        if private is not None:
            private.stop()


if __name__ == "__main__":
    main()
