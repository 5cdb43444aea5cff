"""A tenant's requests-per-minute limit across two gateways (issue 57): does a limit of N admit N +- 2% in every
minute, and does every refused request get a 429 with OpenAI's headers, none enqueued then dropped?

One worker (tiny preset) and two gateways (``batchfleet serve`` processes, the same ``--tenant-key``), real HTTP
through the ``openai`` client. The tenant's limit is ``--limit`` requests a minute; ``--callers`` threads send
requests to the two gateways in turn at ``--rate`` times the limit for ``--seconds``. Each answer's time and status
is kept: the admitted count of every 60-s window that starts at a request (the sliding window the limit keeps), the
429s' headers, and the admitted requests against the answered ones (an admitted request is answered; a refused one
is never queued).

    python scripts/bench_rate_limit.py --json docs/bench/rate_limit.json

Writes JSON and prints a table. Not a test: run it on a quiet machine.
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import click
import httpx
import openai
import redis

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.common.keys import Keys
from batchfleet.common.tenants import Tenant, write_tenants
from batchfleet.worker.devtools import delete_namespace, ensure_redis, free_port, spawn_worker

HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
           "retry-after")
KEY = "sk-bench-acme-" + uuid.uuid4().hex
WINDOW_S = 60.0


def serve(url: str, ns: str) -> tuple[subprocess.Popen, str]:
    """A gateway process on a free port, serving the tenant's key; (process, base URL) once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", "serve", "--redis-url", url, "--namespace",
                             ns, "--port", str(port), "--tenant-key", f"acme:{KEY}", "--model-alias-any"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            if httpx.get(base + "/health", timeout=1).status_code < 500:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited ({proc.returncode})")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the gateway did not answer within 120 s")


def send(bases: list[str], interval_s: float, seconds: float, callers: int) -> list[dict]:
    """Requests every ``interval_s`` (spread over ``callers`` threads, gateways in turn) for ``seconds``."""
    clients = [openai.OpenAI(base_url=b + "/v1", api_key=KEY, max_retries=0, timeout=120) for b in bases]
    out: list[dict] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    n = int(seconds / interval_s)

    def caller(k: int) -> None:
        for i in range(k, n, callers):
            time.sleep(max(0.0, t0 + i * interval_s - time.monotonic()))
            sent = time.monotonic() - t0
            try:
                raw = clients[i % 2].completions.with_raw_response.create(model="x", prompt=f"hello {i}",
                                                                          max_tokens=1)
                row = {"i": i, "sent_s": sent, "status": raw.http_response.status_code}
            except openai.RateLimitError as exc:
                h = exc.response.headers
                row = {"i": i, "sent_s": sent, "status": 429, "headers_ok": all(x in h for x in HEADERS)
                       and h["x-ratelimit-remaining-requests"] == "0" and int(h["retry-after"]) >= 1}
            except openai.APIError as exc:
                row = {"i": i, "sent_s": sent, "status": getattr(exc, "status_code", None) or -1}
            with lock:
                out.append(row)

    threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(out, key=lambda r: r["sent_s"])


def windows(admitted: list[float], until: float) -> tuple[int, int]:
    """(fewest, most) admitted in a 60-s window starting at an admitted request's time, windows that end by ``until``
    and start once the first minute has passed (its burst of N is the window itself; after it admissions follow the
    window's expiries)."""
    counts = [bisect.bisect_left(admitted, t + WINDOW_S) - i for i, t in enumerate(admitted)
              if WINDOW_S <= t and t + WINDOW_S <= until]
    return (min(counts), max(counts)) if counts else (0, 0)


@click.command(help=__doc__)
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True, help="Started privately if unreachable.")
@click.option("--limit", type=int, default=120, show_default=True, help="The tenant's requests per minute.")
@click.option("--rate", type=float, default=2.0, show_default=True, help="Requests sent per second, x limit / 60.")
@click.option("--seconds", type=float, default=180.0, show_default=True, help="How long requests are sent.")
@click.option("--callers", type=int, default=8, show_default=True, help="Threads sending (two gateways in turn).")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(redis_url: str, limit: int, rate: float, seconds: float, callers: int, json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    ns = f"benchrl{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    r = redis.Redis.from_url(url)
    write_tenants(r, keys, [Tenant("acme", requests_per_minute=limit)])
    worker = spawn_worker(url, ns)
    gateways = []
    try:
        gateways = [serve(url, ns) for _ in range(2)]
        rows = send([base for _, base in gateways], 60.0 / (limit * rate), seconds, callers)
        answered = int(r.hget(keys.usage(), "acme|requests") or 0)
    finally:
        for proc, _ in gateways:
            proc.terminate()
            proc.wait(30)
        worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
    admitted = [row["sent_s"] for row in rows if row["status"] == 200]
    refused = [row for row in rows if row["status"] == 429]
    fewest, most = windows(admitted, seconds)
    first = sum(1 for t in admitted if t < WINDOW_S)
    out = {"limit": limit, "rate_x_limit": rate, "seconds": seconds, "sent": len(rows), "admitted": len(admitted),
           "refused": len(refused), "refused_with_headers": sum(1 for row in refused if row["headers_ok"]),
           "other_status": sorted({row["status"] for row in rows} - {200, 429}),
           "first_minute": first, "window_min": fewest, "window_max": most,
           "window_min_ratio": round(fewest / limit, 4), "window_max_ratio": round(most / limit, 4),
           "answered_in_usage": answered, "enqueued_then_dropped": len(admitted) - answered}
    print("| measure | value | target |\n|---|---:|---|")
    print(f"| sent over two gateways ({seconds:g} s at {rate:g}x the limit) | {len(rows)} | - |")
    print(f"| admitted in the first minute | {first} of limit {limit} | N +- 2% |")
    print(f"| admitted per sliding minute after it (fewest / most) | {fewest} / {most} "
          f"({fewest / limit:.1%} / {most / limit:.1%}) | N +- 2% |")
    print(f"| refused with a 429 and the headers | {out['refused_with_headers']} of {len(refused)} | all |")
    print(f"| admitted then not answered | {out['enqueued_then_dropped']} | 0 |")
    if json_path:
        Path(json_path).write_text(json.dumps({**out, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
