"""Tenants sharing one worker (issue 57): does tenant B notice tenant A's flood, and do two saturating tenants
get their weights' share of the tokens? One worker at user defaults (native engine, continuous mode, tiny preset),
one run, four phases, each with tenants of its own (labels ``<phase>-a`` / ``<phase>-b``):

1. idle: B sends ``--b-requests`` requests at ``--b-rate`` per second (16 new tokens): B's TTFT p50 on an idle fleet;
   then ``--newcomers`` tenants new to the fleet send one request each: their first request's TTFT;
2. flood: A submits ``--flood`` interactive requests at once (16 new tokens), then keeps its queue full (submitting
   again as it is served) while B sends the same requests at the same rate: how many of B's were refused (target 0;
   A, whose queue fills at the worker's queue limit, gets the ``QueueFull``), B's TTFT p50 / idle (target <= 1.3),
   over B's requests sent while A had work waiting (a fast worker drains a flood of the limit alone within B's
   phase: those after it would measure an idle fleet);
3. even: A and B each keep ``--backlog`` requests (32 new tokens, EOS ignored) queued, weights 1:1: each tenant's
   share of the tokens generated while both still had work (read from ``Keys.usage``; target 50/50 +- 10%);
4. weighted: the same with A's weight 3 (``Keys.tenants``): target 75/25 +- 10%.

    python scripts/bench_tenants.py --json docs/bench/tenants.json

Writes JSON and prints a table. Not a test: run it on a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import click
import redis

from batchfleet.common.config import DEFAULT_REDIS_URL
from batchfleet.common.errors import QueueFull
from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import fleet_info
from batchfleet.producer import Client
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

PROMPT = "Summarize in one line: the queue is full of work"
SETTLE_S = 1.5  # a worker takes the tenants' weights within a second


def tenant_client(url: str, ns: str, tenant: str) -> Client:
    client = Client(url, ns)
    client._async.tenant = tenant  # the client's own tenant parameter is the edge's (issue 57); the core takes it
    return client


def paced(client: Client, n: int, rate: float, tag: str, busy: Callable[[], bool] | None = None) -> dict:
    """``n`` requests at ``rate`` per second, each awaited in a thread of its own; TTFTs (ms) and refusals.
    ``busy``: asked as each is sent (whether another tenant has work waiting); the TTFTs of those sent while it
    had are also given apart."""
    ttfts: list[float] = []
    during: list[float] = []
    each: list[tuple[int, float | None]] = []  # (request number, TTFT ms or None when refused), as answered
    refused = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        flooded = busy is not None and busy()
        try:
            res = client.generate(f"{PROMPT} ({tag} {i})", max_new_tokens=16, timeout=300)
        except QueueFull:
            with lock:
                refused[0] += 1
                each.append((i, None))
            return
        with lock:
            ttfts.append(res.ttft_ms)
            each.append((i, round(res.ttft_ms, 1)))
            if flooded:
                during.append(res.ttft_ms)

    threads = []
    t0 = time.monotonic()
    for i in range(n):
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    out = {"requests": n, "answered": len(ttfts), "refused": refused[0],
           "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
           "ttft_max_ms": round(max(ttfts), 1) if ttfts else None, "ttfts_ms": [t for _, t in sorted(each)]}
    if busy is not None:
        out["sent_while_busy"] = len(during)
        out["ttft_p50_while_busy_ms"] = round(statistics.median(during), 1) if during else None
    return out


def newcomers(client: Client, n: int, rate: float) -> dict:
    """``n`` tenants new to the fleet send one request each at ``rate`` per second, on the idle fleet: their
    TTFTs (ms). A worker hears a new tenant when its enqueue rings the tenant bell (``Keys.tenant_bell``), not at
    its next look at the tenants' set (once a second)."""
    ttfts: list[float] = []
    for i in range(n):
        time.sleep(1 / rate)
        client._async.tenant = f"newcomer-{i}"
        ttfts.append(round(client.generate(f"{PROMPT} (newcomer {i})", max_new_tokens=16, timeout=300).ttft_ms, 1))
    client._async.tenant = "idle-b"
    return {"requests": n, "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
            "ttft_max_ms": max(ttfts) if ttfts else None, "ttfts_ms": ttfts}


def keep_full(client: Client, tag: str, stop: threading.Event, jobs: list[str], **params) -> None:
    """Submit until ``stop``, waiting a little whenever the queue is full: the tenant's queue stays at its limit."""
    i = 0
    while not stop.is_set():
        try:
            jobs.append(client.submit(f"{PROMPT} ({tag} more {i})", **params))
            i += 1
        except QueueFull:
            stop.wait(0.05)


def flood(client: Client, n: int, tag: str, **params) -> tuple[list[str], int]:
    """Submit ``n`` requests as fast as the client goes; the job ids accepted and how many were refused."""
    jobs, refused = [], 0
    for i in range(n):
        try:
            jobs.append(client.submit(f"{PROMPT} ({tag} {i})", **params))
        except QueueFull:
            refused += 1
    return jobs, refused


def usage(r: redis.Redis, keys: Keys, tenant: str, what: str) -> int:
    return int(r.hget(keys.usage(), f"{tenant}|{what}") or 0)


def share_phase(url: str, ns: str, r: redis.Redis, keys: Keys, phase: str, weight_a: float, backlog: int) -> dict:
    """A and B keep ``backlog`` requests each; the tokens each got while both still had work."""
    a, b = f"{phase}-a", f"{phase}-b"
    r.hset(keys.tenants, a, json.dumps({"weight": weight_a}))
    r.hset(keys.tenants, b, json.dumps({"weight": 1}))
    time.sleep(SETTLE_S)
    params = dict(max_new_tokens=32, ignore_eos=True)
    with tenant_client(url, ns, a) as ca, tenant_client(url, ns, b) as cb:
        got: dict[str, tuple[list[str], int]] = {}
        subs = [threading.Thread(target=lambda c=c, t=t: got.__setitem__(t, flood(c, backlog, t, **params)))
                for c, t in ((ca, a), (cb, b))]
        for t in subs:
            t.start()
        for t in subs:
            t.join()
        # the window: from once both are answered at a steady pace until either has < 20% of its backlog left
        def answered(t: str) -> int:
            return usage(r, keys, t, "requests")

        while min(answered(a), answered(b)) < backlog // 10:
            time.sleep(0.1)
        start = {t: usage(r, keys, t, "generated_tokens") for t in (a, b)}
        t0 = time.monotonic()
        while max(answered(a), answered(b)) < backlog * 0.8:
            time.sleep(0.1)
        end = {t: usage(r, keys, t, "generated_tokens") for t in (a, b)}
        seconds = time.monotonic() - t0
        for c, t in ((ca, a), (cb, b)):  # the rest answered (none refused: the backlog is below the limit)
            for j in got[t][0]:
                c.result(j, timeout=600)
    tokens = {t: end[t] - start[t] for t in (a, b)}
    total = sum(tokens.values()) or 1
    return {"weights": [weight_a, 1], "backlog": backlog, "refused": got[a][1] + got[b][1],
            "tokens_a": tokens[a], "tokens_b": tokens[b], "share_a": round(tokens[a] / total, 3),
            "share_b": round(tokens[b] / total, 3), "window_s": round(seconds, 1),
            "tok_s": round(total / seconds, 1) if seconds else None}


@click.command(help=__doc__)
@click.option("--redis-url", default=DEFAULT_REDIS_URL, show_default=True, help="Started privately if unreachable.")
@click.option("--flood", "flood_n", type=int, default=3000, show_default=True, help="A's requests in the flood.")
@click.option("--queue-limit", type=int, default=1000, show_default=True,
              help="The worker's --max-queue-len (per bucket and tenant): A's flood fills it.")
@click.option("--b-requests", type=int, default=20, show_default=True, help="B's requests per paced phase.")
@click.option("--b-rate", type=float, default=1.0, show_default=True, help="B's requests per second.")
@click.option("--newcomers", "newcomer_n", type=int, default=10, show_default=True,
              help="Tenants new to the fleet sending one request each on the idle fleet.")
@click.option("--backlog", type=int, default=400, show_default=True, help="Requests per tenant in the share phases.")
@click.option("--worker-arg", multiple=True, help="Extra worker CLI argument (repeatable).")
@click.option("--json", "json_path", default=None, help="Write the result as JSON here.")
def main(redis_url: str, flood_n: int, queue_limit: int, b_requests: int, b_rate: float, newcomer_n: int, backlog: int,
         worker_arg: tuple[str, ...], json_path: str | None) -> None:
    url, private = ensure_redis(redis_url)
    ns = f"benchten{uuid.uuid4().hex[:6]}"
    keys = Keys(ns)
    r = redis.Redis.from_url(url)
    worker = spawn_worker(url, ns, ["--max-queue-len", str(queue_limit), *worker_arg])
    out: dict = {"flood": flood_n, "queue_limit": queue_limit, "b_rate": b_rate}
    try:
        with tenant_client(url, ns, "idle-b") as b:
            paced(b, 3, b_rate, "warm")
            out["idle"] = paced(b, b_requests, b_rate, "idle")
            out["newcomers"] = newcomers(b, newcomer_n, b_rate)
        with tenant_client(url, ns, "flood-a") as a, tenant_client(url, ns, "flood-b") as b:
            t0 = time.monotonic()
            jobs, a_refused = flood(a, flood_n, "flood", max_new_tokens=16)
            submit_s = time.monotonic() - t0
            out["flood_phase"] = {"a_accepted": len(jobs), "a_refused": a_refused, "a_submit_s": round(submit_s, 1),
                                  "a_waiting_when_b_began": _waiting(r, keys, "flood-a")}
            stop, more = threading.Event(), []
            filler = threading.Thread(target=keep_full, args=(a, "flood", stop, more), kwargs={"max_new_tokens": 16},
                                      daemon=True)
            filler.start()
            try:
                out["flood_phase"]["b"] = paced(b, b_requests, b_rate, "flood",
                                                busy=lambda: _waiting(r, keys, "flood-a") > 0)
            finally:
                stop.set()
                filler.join()
            out["flood_phase"]["a_waiting_when_b_ended"] = _waiting(r, keys, "flood-a")
            out["flood_phase"]["a_added_during_b"] = len(more)
            jobs += more
            for j in jobs:
                a.result(j, timeout=900)
        idle, during = out["idle"]["ttft_p50_ms"], out["flood_phase"]["b"]["ttft_p50_while_busy_ms"]
        out["b_ttft_ratio"] = round(during / idle, 2) if idle and during else None
        out["even"] = share_phase(url, ns, r, keys, "even", 1, backlog)
        out["weighted"] = share_phase(url, ns, r, keys, "weighted", 3, backlog)
    finally:
        worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
    fl, ev, wt = out["flood_phase"], out["even"], out["weighted"]
    print("| measure | value | target |\n|---|---:|---|")
    print(f"| B's TTFT p50, idle fleet ({out['idle']['answered']} requests at {b_rate}/s) | "
          f"{out['idle']['ttft_p50_ms']} ms | - |")
    nc = out["newcomers"]
    print(f"| TTFT p50 of {nc['requests']} tenants' first requests, idle fleet | {nc['ttft_p50_ms']} ms (max "
          f"{nc['ttft_max_ms']} ms) | about B's idle |")
    print(f"| B's TTFT p50 during A's flood of {flood_n} ({fl['a_waiting_when_b_began']} of A's waiting when B "
          f"began, kept full: {fl['a_added_during_b']} more; {fl['b']['sent_while_busy']} of B's sent while A "
          f"waited) | {fl['b']['ttft_p50_while_busy_ms']} ms ({out['b_ttft_ratio']}x idle; max "
          f"{fl['b']['ttft_max_ms']} ms) | <= 1.3x |")
    print(f"| B's requests refused during the flood | {fl['b']['refused']} of {fl['b']['requests']} | 0 |")
    print(f"| A's requests refused (queue limit {queue_limit}) | {fl['a_refused']} of {flood_n} | the filler |")
    print(f"| tokens A/B, weights 1:1 (both saturating, {ev['window_s']} s) | {ev['share_a']:.1%} / "
          f"{ev['share_b']:.1%} | 50/50 +- 10% |")
    print(f"| tokens A/B, weights 3:1 (both saturating, {wt['window_s']} s) | {wt['share_a']:.1%} / "
          f"{wt['share_b']:.1%} | 75/25 +- 10% |")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")


def _waiting(r: redis.Redis, keys: Keys, tenant: str) -> int:
    """A tenant's entries not yet answered (its streams' lengths; answered entries are deleted)."""
    info = fleet_info(r, keys)
    buckets = info.buckets if info is not None else ()
    return sum(r.xlen(s) for s, _, _ in keys.streams(buckets, [tenant]) if s.endswith(f":t:{tenant}"))


if __name__ == "__main__":
    main()
