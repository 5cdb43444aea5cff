"""Redis crash harness: kill -9 a Redis (AOF, ``appendfsync always``) under load, restart it, count what
was lost or answered twice.

One run: a private redis-server (same dir and port across restarts), a worker subprocess, sync clients
(``Client``, several threads each) and one ``AsyncClient`` (many tasks) sharing one pool of requests.
strace slows Redis' fsync (scripts/benchlib/faults.py) and each kill waits until Redis sits inside such a delayed
fsync (by default: of a write holding a worker's final reply), so it lands after a write is durable and
before anyone was told. Half the calls are ``generate``,
half ``submit(job_id=...)`` + ``result``. What counts:

- every call returns its Result (an exception = lost), whose text equals the warm-up's for that prompt
  (greedy decoding: a reply delivered to the wrong call shows as a mismatch);
- no job id is received twice, and the AOF holds at most one final reply per job id;
- from the AOF: jobs enqueued but never answered, and jobs answered but never received (lost in delivery).

Used by tests/test_redis_crash.py and scripts/bench_redis_crash.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchfleet.common.options import option_args
from batchfleet.producer import AsyncClient, Client
from batchfleet.worker.devtools import PrivateRedis, free_port, spawn_worker

from .faults import SlowFsync, audit_aof, final_replies, wait_for_durable, wait_in_fsync

AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always", "--auto-aof-rewrite-percentage", "0")


@dataclass(frozen=True)
class CrashPlan:
    """What one run does; the defaults are the issue's reproduction (320 requests, 16 sync threads)."""

    requests: int = 320
    cycles: int = 2
    sync_clients: int = 2
    threads_per_client: int = 8
    async_tasks: int = 16
    fsync_delay_ms: int = 200
    down_s: float = 0.3  # how long Redis stays dead before the restart
    timeout_s: float = 60.0  # every call's timeout: long enough to outlive the restarts
    max_new_tokens: int = 8
    prompts: int = 16  # distinct prompts (their greedy texts are learnt in a warm-up round)
    target: str = "reply"  # where kills land: "reply" (the fsync of a final reply), "any" fsync, "mixed"
    claim_idle_ms: int = 2000  # worker: reclaim entries whose reader never got them (kill after XREADGROUP)
    redis_binary: str = "/usr/bin/redis-server"


@dataclass
class Outcome:
    """One call: which prompt, which client, when, and the Result or the exception it raised."""

    index: int
    client: str
    start: float
    end: float
    job_id: str | None = None
    text: str | None = None
    error: str | None = None


@dataclass
class Cycle:
    """One kill -9 + restart."""

    kill_at: float
    target: str  # "reply": the kill waited for the fsync of a final reply; "any": for any delayed fsync
    in_fsync: bool  # the kill landed while Redis was inside such a delayed fsync
    up_at: float  # monotonic time the restarted Redis answered (AOF replayed)
    completed_before: int


@dataclass
class CrashReport:
    plan: CrashPlan
    outcomes: list[Outcome]
    cycles: list[Cycle]
    expected: dict[int, str]  # prompt number -> greedy text
    enqueued: set[str]  # job ids the AOF shows enqueued
    replies: Counter  # job id -> final replies (result/error) the AOF shows written
    warmup_ids: set[str]
    wall_s: float
    worker_log: str = ""

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]

    @property
    def duplicated(self) -> list[str]:
        """Job ids received by more than one call, or with more than one final reply in the AOF."""
        seen = Counter(o.job_id for o in self.outcomes if o.job_id)
        return sorted({j for j, n in seen.items() if n > 1} | {j for j, n in self.replies.items() if n > 1})

    @property
    def mismatched(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.text is not None and o.text != self.expected[o.index % self.plan.prompts]]

    @property
    def received(self) -> set[str]:
        return {o.job_id for o in self.outcomes if o.job_id} | self.warmup_ids

    def cycle_figures(self) -> list[dict]:
        """Per cycle: calls in flight at the kill, the calls this kill lost (failed calls count at the first
        kill after they started), Redis down time (kill -> AOF replayed and answering), first result after
        the restart, and when the last call in flight at the kill got its result."""
        out = []
        for k, c in enumerate(self.cycles):
            after = [o.end - c.up_at for o in self.outcomes if o.end > c.up_at and o.error is None]
            hit = [o for o in self.outcomes if o.start < c.kill_at < o.end]
            drained = [o.end - c.up_at for o in hit if o.error is None]
            since = self.cycles[k - 1].kill_at if k else float("-inf")
            out.append({"target": c.target, "in_fsync": c.in_fsync, "in_flight": len(hit),
                        "lost": sum(o.error is not None and o.start > since for o in hit),
                        "down_s": round(c.up_at - c.kill_at, 3),
                        "first_result_s": round(min(after), 3) if after else None,
                        "drained_s": round(max(drained), 3) if drained else None})
        return out

    def undisturbed_s(self) -> list[float]:
        """Durations of the calls no kill happened during (the yardstick for ``drained_s``: with every
        client busy, a call waits for the queue ahead of it even without a crash)."""
        return sorted(o.end - o.start for o in self.outcomes
                      if o.error is None and not any(o.start < c.kill_at < o.end for c in self.cycles))

    def summary(self) -> dict:
        errors = Counter((o.error or "").split(":")[0] for o in self.lost)
        calm = self.undisturbed_s()
        return {
            "requests": len(self.outcomes), "completed": len(self.outcomes) - len(self.lost),
            "lost": len(self.lost), "errors": dict(errors), "duplicated": len(self.duplicated),
            "mismatched_text": len(self.mismatched),
            "aof_enqueued_never_answered": len(self.enqueued - set(self.replies)),
            "aof_answered_never_received": len(set(self.replies) - self.received),
            "undisturbed_call_s": {"n": len(calm), "p50": round(calm[len(calm) // 2], 3) if calm else None,
                                   "max": round(calm[-1], 3) if calm else None},
            "cycles": self.cycle_figures(), "wall_s": round(self.wall_s, 1), "plan": asdict(self.plan),
        }


def prompt_of(i: int, prompts: int) -> list[int]:
    """Token ids of request ``i`` (one of ``prompts`` distinct prompts; ids valid for every preset)."""
    j = i % prompts
    return [10 + j, 100 + 3 * j, 200 + j, 50, 60 + j]


class _Load:
    """The shared pool of request numbers and the outcomes of the calls made from it."""

    def __init__(self, plan: CrashPlan, run: str) -> None:
        self.plan = plan
        self.run = run
        self.next = 0
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self.params = {"max_new_tokens": plan.max_new_tokens, "timeout": plan.timeout_s}

    def take(self) -> int | None:
        with self.lock:
            if self.next >= self.plan.requests:
                return None
            self.next += 1
            return self.next - 1

    def job_id(self, i: int) -> str | None:
        """Odd calls name their job (submit + result), even ones let ``generate`` do it."""
        return f"{self.run}-{i:05d}" if i % 2 else None

    def record(self, i: int, kind: str, start: float, call: Callable[[], object]) -> None:
        try:
            res = call()
            out = Outcome(i, kind, start, time.monotonic(), res.id, res.text)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 (every failure is a lost request: recorded, not raised)
            out = Outcome(i, kind, start, time.monotonic(), error=f"{type(exc).__name__}: {exc}"[:300])
        self.outcomes.append(out)

    def sync_thread(self, client: Client) -> None:
        plan = self.plan
        while (i := self.take()) is not None:
            prompt, job = prompt_of(i, plan.prompts), self.job_id(i)
            if job is None:
                self.record(i, "sync", time.monotonic(), lambda p=prompt: client.generate(p, **self.params))
            else:
                self.record(i, "sync", time.monotonic(), lambda p=prompt, j=job: client.result(
                    client.submit(p, job_id=j, **self.params), plan.timeout_s))

    async def async_task(self, client: AsyncClient) -> None:
        plan = self.plan
        while (i := self.take()) is not None:
            prompt, job, start = prompt_of(i, plan.prompts), self.job_id(i), time.monotonic()
            try:
                if job is None:
                    res = await client.generate(prompt, **self.params)
                else:
                    res = await client.result(await client.submit(prompt, job_id=job, **self.params), plan.timeout_s)
                self.outcomes.append(Outcome(i, "async", start, time.monotonic(), res.id, res.text))
            except Exception as exc:  # noqa: BLE001 (as in record)
                self.outcomes.append(Outcome(i, "async", start, time.monotonic(),
                                             error=f"{type(exc).__name__}: {exc}"[:300]))

    def async_thread(self, url: str, namespace: str) -> None:
        async def main() -> None:
            client = AsyncClient(url, namespace)
            try:
                await asyncio.gather(*(self.async_task(client) for _ in range(self.plan.async_tasks)))
            finally:
                await client.aclose()

        asyncio.run(main())


@dataclass
class _Run:
    plan: CrashPlan
    server: PrivateRedis
    namespace: str = field(default_factory=lambda: f"crash-{uuid.uuid4().hex[:8]}")


def _kill_and_restart(run: _Run, slow: SlowFsync, completed: int, target: str) -> tuple[Cycle, SlowFsync]:
    """Wait (up to 5 s) until Redis sits in a delayed fsync (``target`` "reply": of a write holding a final
    reply), kill -9 it, restart it on its AOF, slow it again."""
    min_stop_ms = min(20, run.plan.fsync_delay_ms / 4)
    if target == "reply":
        in_fsync = wait_for_durable(run.server.pid, run.server.dir, lambda a: bool(final_replies(a, run.namespace)),
                                    min_stop_ms, timeout_s=5)
    else:
        in_fsync = wait_in_fsync(run.server.pid, min_stop_ms, timeout_s=5)
    kill_at = time.monotonic()
    run.server.kill()
    slow.stop()
    time.sleep(run.plan.down_s)
    run.server.start(timeout_s=60)
    up_at = time.monotonic()
    return Cycle(kill_at, target, in_fsync, up_at, completed), SlowFsync(run.server.pid, run.plan.fsync_delay_ms)


def run_crash(plan: CrashPlan, model_dir: str | Path, work_dir: str | Path) -> CrashReport:
    """One run (see the module docstring); ``work_dir`` receives the worker log."""
    t0 = time.monotonic()
    run = _Run(plan, PrivateRedis(port=free_port(), extra_args=AOF_ARGS, binary=plan.redis_binary).start())
    log_path = Path(work_dir) / f"worker-{run.namespace}.log"
    worker = None
    try:
        worker = spawn_worker(run.server.url, run.namespace, option_args({
            "model": str(model_dir), "engine": "hf", "mode": "dynamic", "dtype": "float32", "max_seq_len": 512,
            "buckets": (32, 64), "max_wait_ms": 20, "max_batch_size": 16, "claim_idle_ms": plan.claim_idle_ms,
        }), log_path=str(log_path))
        prompts = [prompt_of(j, plan.prompts) for j in range(plan.prompts)]
        with Client(run.server.url, run.namespace) as warm:
            first = warm.generate_many(prompts, max_new_tokens=plan.max_new_tokens, timeout=plan.timeout_s)
        expected = {j: r.text for j, r in enumerate(first)}
        load = _Load(plan, run.namespace)
        clients = [Client(run.server.url, run.namespace) for _ in range(plan.sync_clients)]
        threads = [threading.Thread(target=load.sync_thread, args=(c,), daemon=True)
                   for c in clients for _ in range(plan.threads_per_client)]
        threads.append(threading.Thread(target=load.async_thread, args=(run.server.url, run.namespace), daemon=True))
        slow = SlowFsync(run.server.pid, plan.fsync_delay_ms)
        cycles: list[Cycle] = []
        for t in threads:
            t.start()
        try:
            for k in range(plan.cycles):
                due = (k + 1) * plan.requests // (plan.cycles + 1)
                while len(load.outcomes) < due and any(t.is_alive() for t in threads):
                    time.sleep(0.02)
                target = plan.target if plan.target != "mixed" else ("reply", "any")[k % 2]
                cycle, slow = _kill_and_restart(run, slow, len(load.outcomes), target)
                cycles.append(cycle)
            for t in threads:
                t.join(plan.timeout_s * 3)
        finally:
            slow.stop()
            for c in clients:
                c.close()
        enqueued, replies = audit_aof(run.server.dir, run.namespace)
        return CrashReport(plan, sorted(load.outcomes, key=lambda o: o.index), cycles, expected, enqueued, replies,
                           {r.id for r in first}, time.monotonic() - t0,
                           log_path.read_text(errors="replace")[-4000:] if log_path.exists() else "")
    finally:
        if worker is not None:
            worker.stop(10)
        run.server.stop()
