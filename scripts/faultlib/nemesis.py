"""The nemesis: faults drawn from a seeded RNG, applied to the fleet (fleet.py) until the fault phase ends.

Kinds: ``kill_worker`` (SIGKILL, a new worker after a delay), ``pause_worker`` (SIGSTOP, SIGCONT after a
while: longer than the claim time, so another worker takes its entries over and the paused one wakes to find
them gone), ``kill_redis`` (SIGKILL, restarted on its AOF), ``pause_redis``, ``fill_redis`` (``maxmemory`` below
what Redis holds with ``noeviction``: every write is refused, then the limit is lifted), ``kill_client`` (a
client process or the bulk run: SIGKILL, then the same command again). Each fault is healed before its
thread draws the next one; ``full`` runs two such threads, so faults overlap (one Redis fault at a time).

The same seed draws the same faults in the same order; when they land depends on the machine, as with any
test of real processes: the seed reproduces the plan, not the interleaving.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fleet import Fleet


@dataclass(frozen=True)
class Intensity:
    name: str
    threads: int
    gap_s: tuple[float, float]  # between two faults of one thread
    pause_s: tuple[float, float]  # SIGSTOP -> SIGCONT
    redis_down_s: tuple[float, float]  # SIGKILL -> restart
    fill_s: tuple[float, float]  # full -> lifted
    restart_s: tuple[float, float]  # a killed worker or client -> its restart
    keep_a_worker: bool  # never kill the last live worker
    weights: dict[str, int] = field(default_factory=dict)


WEIGHTS = {"kill_worker": 3, "pause_worker": 2, "kill_redis": 2, "pause_redis": 2, "fill_redis": 2, "kill_client": 3}
MILD = Intensity("mild", 1, (3.0, 6.0), (0.5, 3.0), (0.2, 1.0), (1.0, 3.0), (0.5, 2.0), True, WEIGHTS)
FULL = Intensity("full", 2, (1.0, 4.0), (1.0, 5.0), (0.2, 3.0), (1.0, 6.0), (0.0, 3.0), False, WEIGHTS)
INTENSITIES = {i.name: i for i in (MILD, FULL)}


class Nemesis:
    def __init__(self, fleet: Fleet, seed: int, intensity: Intensity, log: Path) -> None:
        self.fleet = fleet
        self.seed = seed
        self.intensity = intensity
        self._log = log.open("a", buffering=1)
        self._log_lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def record(self, kind: str, **fields: Any) -> None:
        with self._log_lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self._log.write(json.dumps({"t": time.time(), "kind": kind, **fields}) + "\n")

    def run(self, until: float) -> None:
        threads = [threading.Thread(target=self._loop, args=(random.Random(f"nemesis-{self.seed}-{i}"), until),
                                    name=f"nemesis-{i}") for i in range(self.intensity.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._log.close()

    def _loop(self, rng: random.Random, until: float) -> None:
        kinds, weights = list(self.intensity.weights), list(self.intensity.weights.values())
        while True:
            time.sleep(rng.uniform(*self.intensity.gap_s))
            if time.time() >= until:
                return
            kind = rng.choices(kinds, weights)[0]
            try:
                getattr(self, kind)(rng)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is noted, not fatal
                self.record("nemesis_error", fault=kind, error=repr(exc)[:300])

    # ---- the faults ----------------------------------------------------------------------------------
    def kill_worker(self, rng: random.Random) -> None:
        slot = rng.randrange(len(self.fleet.workers))
        proc = self.fleet.workers[slot]
        others = sum(w.alive for i, w in enumerate(self.fleet.workers) if i != slot)
        if self.intensity.keep_a_worker and not others:
            return
        with proc.lock:
            if not proc.kill():
                return
        self.record("kill_worker", target=proc.name)
        time.sleep(rng.uniform(*self.intensity.restart_s))
        self.fleet.replace_worker(slot)

    def pause_worker(self, rng: random.Random) -> None:
        proc = rng.choice(self.fleet.workers)
        if not proc.signal(signal.SIGSTOP):
            return
        seconds = rng.uniform(*self.intensity.pause_s)
        self.record("pause_worker", target=proc.name, seconds=round(seconds, 2))
        time.sleep(seconds)
        proc.signal(signal.SIGCONT)

    def kill_redis(self, rng: random.Random) -> None:
        with self.fleet.redis_lock:
            self.fleet.redis.kill()
            seconds = rng.uniform(*self.intensity.redis_down_s)
            self.record("kill_redis", seconds=round(seconds, 2))
            time.sleep(seconds)
            self.fleet.start_redis()

    def pause_redis(self, rng: random.Random) -> None:
        with self.fleet.redis_lock:
            seconds = rng.uniform(*self.intensity.pause_s)
            self.fleet.redis.freeze()
            self.record("pause_redis", seconds=round(seconds, 2))
            time.sleep(seconds)
            self.fleet.redis.thaw()

    def fill_redis(self, rng: random.Random) -> None:
        with self.fleet.redis_lock:
            r = self.fleet.redis_client()
            try:
                used = int(r.info("memory")["used_memory"])
                r.config_set("maxmemory-policy", "noeviction")
                seconds = rng.uniform(*self.intensity.fill_s)
                self.record("fill_redis", seconds=round(seconds, 2), used_memory=used)  # before: errors may follow
                r.config_set("maxmemory", str(max(used * 9 // 10, 1)))
                time.sleep(seconds)
            finally:
                r.close()
                self.lift_memory()

    def lift_memory(self) -> None:
        """``maxmemory 0`` again, however long Redis takes to answer (a full Redis left behind would fail
        every later write and be blamed on the product)."""
        while True:
            try:
                r = self.fleet.redis_client()
                try:
                    r.config_set("maxmemory", "0")
                    return
                finally:
                    r.close()
            except Exception:  # noqa: BLE001
                time.sleep(0.2)

    def kill_client(self, rng: random.Random) -> None:
        procs = [p for p in self.fleet.clients.values() if p.alive]
        if self.fleet.bulk is not None and self.fleet.bulk.alive:
            procs.append(self.fleet.bulk)
        if not procs:
            return
        proc = rng.choice(procs)
        if proc is self.fleet.bulk:  # the supervisor starts it again on the same output (it resumes)
            if proc.kill():
                self.record("kill_bulk", target=proc.name)
            return
        with proc.lock:
            if not proc.kill():
                return
            self.record("kill_client", target=proc.name)
            time.sleep(rng.uniform(*self.intensity.restart_s))
            proc.start()
