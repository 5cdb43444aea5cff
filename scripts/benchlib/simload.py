"""The producer side of the autoscaling simulation (scripts/autoscale_sim.py), in its own process: the real
AsyncClient sends each interactive request of the trace at its (compressed) arrival time, and the real bulk run
(producer/bulk/file_run.py ``bulk_file``, which registers itself in the bulk-run registry) sends the bulk job's
lines when it arrives. Times come back in wall seconds; the controller turns them into simulated ones.

Exactly once is checked here: every interactive request gets one result (an error counts as lost), and the
bulk output holds every input line's index exactly once.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from pathlib import Path

from batchfleet.producer import AsyncClient
from batchfleet.producer.bulk.file_run import bulk_file


@dataclass(frozen=True)
class LoadSpec:
    url: str
    namespace: str
    arrivals_wall: list[float]  # seconds after t0
    bulk_at_wall: float | None
    bulk_lines: int
    tokens: int
    bulk_tokens: int
    timeout_s: float  # wall: generous, a request is never given up by the simulation itself
    workdir: str


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(rng.randrange(8, 48))]


async def _interactive(spec: LoadSpec, t0: float) -> dict:
    rng = random.Random(7)
    samples: list[tuple[float, float, float]] = []  # (sent wall - t0, queue_ms, total_ms: wall)
    errors: list[str] = []
    async with AsyncClient(spec.url, spec.namespace, max_connections=32) as client:
        async def one(at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.time()))
            try:
                res = await client.generate(_prompt(rng), max_new_tokens=spec.tokens, timeout=spec.timeout_s)
            except Exception as exc:  # lost: counted, never retried (a retry would hide a loss)
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            samples.append((at, res.queue_ms, res.total_ms))

        await asyncio.gather(*(one(at) for at in spec.arrivals_wall))
    return {"sent": len(spec.arrivals_wall), "samples": samples, "errors": errors}


async def _bulk(spec: LoadSpec, t0: float) -> dict | None:
    if spec.bulk_at_wall is None or not spec.bulk_lines:
        return None
    rng = random.Random(11)
    src, out = Path(spec.workdir) / "bulk.txt", Path(spec.workdir) / "bulk.out.jsonl"
    src.write_text("".join(" ".join(f"t{rng.randrange(1, 500)}" for _ in range(rng.randrange(8, 48))) + "\n"
                           for _ in range(spec.bulk_lines)))
    await asyncio.sleep(max(0.0, t0 + spec.bulk_at_wall - time.time()))
    started = time.time() - t0
    summary = await bulk_file(str(src), str(out), redis_url=spec.url, namespace=spec.namespace, plain=True,
                              defaults={"max_new_tokens": spec.bulk_tokens}, timeout=spec.timeout_s, resume=False)
    finished = time.time() - t0
    indexes = [json.loads(line)["index"] for line in out.read_text().splitlines() if line.strip()]
    failed = sum(1 for line in out.read_text().splitlines() if line.strip() and "error" in json.loads(line))
    return {"lines": spec.bulk_lines, "started_wall": started, "finished_wall": finished,
            "answered": len(set(indexes)), "duplicates": len(indexes) - len(set(indexes)), "failed": failed,
            "summary_done": summary.done}


async def _run(spec: LoadSpec, t0: float) -> dict:
    interactive, bulk = await asyncio.gather(_interactive(spec, t0), _bulk(spec, t0))
    return {"interactive": interactive, "bulk": bulk}


def load_main(spec: LoadSpec, t0: float, out: mp.Queue) -> None:
    out.put(asyncio.run(_run(spec, t0)))
