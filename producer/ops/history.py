"""The fleet's recent history for the dashboard's charts: one sample every SAMPLE_S (queue depth and running
requests per priority, generated tokens/s, mean time to first token overall and per priority, results/min,
live workers), the last KEPT_S of them in a capped Redis stream (``keys.history``).

TTFT is charted per priority: during a background backlog the background mean is minutes by design while
interactive requests are still served at once, and a mean of the two would read as trouble.

Who samples: every gateway and ``batchfleet dashboard`` process runs a ``HistorySampler`` thread. A sample's
stream id is its slot (Redis' clock rounded down to SAMPLE_S), and Redis refuses an id not above the last,
so however many processes sample, each slot is written once; each first asks for the last id (one read), so
only one process per slot makes the status reads. The history lives in Redis: it survives a gateway restart
and every gateway shows the same. Redis cost: MAXLEN entries of about 150 bytes (about 50 KiB), one short
read per sampler every SAMPLE_S / 2 and one ``batchfleet status`` read per slot.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from batchfleet.common.keys import Keys
from batchfleet.common.redis.fleetstate import fleet_info, layout, queue_stats, redis_now_ms, worker_stats
from batchfleet.common.wire.priority import PRIORITIES

log = logging.getLogger(__name__)

SAMPLE_S = 10
KEPT_S = 3600  # the page charts the last 15, 30 or 60 minutes
MAXLEN = KEPT_S // SAMPLE_S
FIELDS = ("live", "tok_s", "ttft_ms", "results_1m") + tuple(f"{k}_{priority}" for priority in PRIORITIES
                                                               for k in ("queued", "running", "ttft_ms",
                                                                         "results_1m"))


def take_sample(r: redis.Redis, keys: Keys) -> dict[str, float]:
    """The fleet now, as one history sample (the reads of ``batchfleet status``): per priority, requests queued
    (depth) and delivered but unanswered (running) summed over buckets; over live workers, tokens/s and the
    results of the last minute with their mean TTFT (weighted by results), overall (``ttft_ms``,
    ``results_1m``) and per priority (``ttft_ms_<priority>``, ``results_1m_<priority>``; absent from the
    heartbeat of a worker older than the per-priority fields)."""
    every = worker_stats(r, keys)
    info = fleet_info(r, keys)  # no fleet key (no live worker): the queues of the buckets gone workers served
    buckets = list(info.buckets) if info else sorted({int(b) for w in every for b in w.get("buckets", ())})
    workers = [w for w in every if w["alive"]]
    sample: dict[str, float] = {"live": len(workers),
                                "tok_s": round(sum(w.get("tokens_per_s") or 0 for w in workers), 2)}
    results = sum(int(w.get("results_1m") or 0) for w in workers)
    weighted = sum((w.get("ttft_mean_ms_1m") or 0) * int(w.get("results_1m") or 0) for w in workers)
    sample["results_1m"] = results
    if results:
        sample["ttft_ms"] = round(weighted / results, 1)
    for priority in PRIORITIES:
        sample[f"queued_{priority}"] = sample[f"running_{priority}"] = 0
        means = [((w.get("ttft_mean_ms_1m_by_priority") or {}).get(priority) or 0,
                  int((w.get("results_1m_by_priority") or {}).get(priority) or 0)) for w in workers]
        n = sum(c for _, c in means)
        sample[f"results_1m_{priority}"] = n
        if n:
            sample[f"ttft_ms_{priority}"] = round(sum(m * c for m, c in means) / n, 1)
    for q in queue_stats(r, layout(keys, info), buckets) if buckets else []:
        sample[f"queued_{q.priority}"] += q.depth
        sample[f"running_{q.priority}"] += q.pending
    return sample


def record_sample(r: redis.Redis, keys: Keys) -> bool:
    """Add the sample of the current slot unless a sampler already did; True when this call added it."""
    slot = redis_now_ms(r) // (SAMPLE_S * 1000) * SAMPLE_S * 1000
    last = r.xrevrange(keys.history, count=1)
    if last and int(_text(last[0][0]).split("-")[0]) >= slot:
        return False
    try:
        r.xadd(keys.history, take_sample(r, keys), id=f"{slot}-0", maxlen=MAXLEN, approximate=False)
    except redis.ResponseError as exc:  # another sampler wrote this slot in between: its sample stands
        if "equal or smaller" not in str(exc):
            raise
        return False
    return True


def history(r: redis.Redis, keys: Keys, after_ms: int | None = None) -> list[dict[str, Any]]:
    """The samples after ``after_ms`` (all kept ones when None), oldest first: ``t`` (s) plus FIELDS (a
    field absent: nothing to say, e.g. no TTFT without results)."""
    start = "-" if after_ms is None else f"({int(after_ms)}-0"
    out = []
    for entry_id, fields in r.xrange(keys.history, start, "+"):
        row: dict[str, Any] = {"t": int(_text(entry_id).split("-")[0]) / 1000}
        for k, v in fields.items():
            if _text(k) in FIELDS:
                row[_text(k)] = float(v)
        out.append(row)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class HistorySampler:
    """A daemon thread calling ``record_sample`` every SAMPLE_S / 2 until ``close``; Redis errors are
    logged (once per outage) and retried at the next tick."""

    def __init__(self, r: redis.Redis, keys: Keys, every_s: float = SAMPLE_S / 2) -> None:
        self.r, self.keys, self.every_s = r, keys, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchfleet-history", daemon=True)

    def start(self) -> HistorySampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                record_sample(self.r, self.keys)
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("dashboard history: no sample (%s); retrying every %.0f s", exc, self.every_s)
                failing = True
            self._stop.wait(self.every_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
