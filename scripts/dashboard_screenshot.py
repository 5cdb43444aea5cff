"""docs/dashboard.png: the live dashboard (``batchfleet dashboard``) of a real fleet under load, rendered
by headless Chromium.

    python scripts/dashboard_screenshot.py [--out docs/dashboard.png] [--workers 2]

Starts a private namespace on the Redis at $BATCHFLEET_REDIS_URL (else 127.0.0.1:6379, else a private
redis-server), N workers (default tiny model, native engine), submits 800 prompts of mixed lengths at once
plus one dead letter, waits until the queues and workers are busy, takes the screenshot, cleans up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
import uuid

import redis

from batchfleet.common.config import DEFAULT_REDIS_URL, ConnectionConfig, DashboardConfig
from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from batchfleet.producer.dashboard import DashboardServer
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=800)
    args = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("needs headless Chromium: apt-get install -y chromium")
    url, private = ensure_redis(os.environ.get("BATCHFLEET_REDIS_URL", DEFAULT_REDIS_URL))
    ns = f"demo-{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    workers, server = [], None
    try:
        for _ in range(args.workers):
            workers.append(spawn_worker(url, ns, ["--threads", "1", "--max-wait-ms", "50"]))
        server = DashboardServer(DashboardConfig(port=0), ConnectionConfig(url, ns)).start()
        r = redis.Redis.from_url(url)
        r.xadd(keys.stream(128), {"id": "bad-entry-1", "r": "not-an-inbox", "p": b"\xc1"})  # one dead letter
        with Client(url, ns, max_connections=8) as client:
            for i in range(args.requests):
                client.submit(f"prompt {i} " + "word " * (5 + (i * 37) % 180), max_new_tokens=32 + i % 64)
            time.sleep(6)  # two heartbeats into the load: tok/s, batches and KV use are non-zero
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            "--hide-scrollbars", "--window-size=1280,1300", "--virtual-time-budget=4000",
                            f"--screenshot={os.path.abspath(args.out)}",
                            f"http://127.0.0.1:{server.port}/dashboard"], check=True, capture_output=True,
                           timeout=120)
        print(f"wrote {args.out} (namespace {ns}, {args.workers} workers, {args.requests} prompts)")
    finally:
        if server is not None:
            server.close()
        for w in workers:
            w.kill()
        delete_namespace(url, keys)
        if private is not None:
            private.stop()


if __name__ == "__main__":
    main()
