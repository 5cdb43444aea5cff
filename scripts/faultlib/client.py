"""One client process of the fault test: ``python -m faultlib.client`` (with scripts/ on the path).

``--kind sync`` drives the sync ``Client`` from threads, ``async`` one ``AsyncClient`` from tasks,
``gateway`` the gateway's /v1/completions with the ``openai`` client. Each of ``--callers`` loops draws
operations (workload.CLIENT_OPS for sync and async) until ``--until``, then the process collects every
accepted job whose last outcome was a timeout, with ``--collect-s`` to wait (the fleet is calm by then),
and exits.

The nemesis kills this process with SIGKILL and starts it again with the same arguments: the new
incarnation keeps the inbox token (``--inbox-file``), reads its history and settles what the dead one
left open: an accepted job is waited for again; a job whose enqueue was in flight is submitted again
under the same job id (the retry of a caller who does not know whether its enqueue landed).

Every call of an operation gets what is left of the operation's timeout, so no caller may wait longer
than ``timeout_s`` in all (the checker allows a stated slack)."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from batchfleet.common.errors import ERROR_CODES, BatchfleetError, RedisUnavailable, Timeout

from .history import History, inbox_digest, read_events
from .workload import CLIENT_OPS, Workload

RETRYABLE = (Timeout, RedisUnavailable)  # the enqueue's fate is unknown: retry under the same job id
# the client raises ``Timeout`` both when its caller's wait ends and for a worker's ``deadline_exceeded`` answer
# (producer/core.py parse_reply: "job <id>: <message>"): the second is the job's one answer, a typed error
DEADLINE_ANSWER = re.compile(r"job [A-Za-z0-9_.\-]+: ")
MIN_CALL_S = 0.5  # less than this left of an operation's timeout: it ends as a timeout without another call


class Caller:
    """What every operation of one process shares: the client, the history, the workload, the job ids."""

    def __init__(self, args: argparse.Namespace, history: History, workload: Workload, inbox: str,
                 call: Callable[..., Awaitable[Any]]) -> None:
        self.args = args
        self.history = history
        self.workload = workload
        self.inbox = inbox_digest(inbox) if inbox else None
        self.call = call  # call("submit", ...) -> awaits the client's method (a thread hop for the sync one)
        self.n = 0
        self.answered: list[tuple[str, int, int]] = []  # (job id, prompt, max_new_tokens) answered to this inbox
        self.timed_out: dict[str, tuple[int, int]] = {}  # accepted job id -> (prompt, max_new_tokens)
        self.shared = 0  # how many shared job ids this client used (all incarnations)

    def next_op(self) -> str:
        self.n += 1
        return f"{self.history.client}.{self.history.incarnation}.{self.n}"

    def start(self, kind: str, prompt: int, mnt: int, job_id: str | None, **extra: Any) -> tuple[str, float]:
        op = self.next_op()
        self.history.record("start", op, kind=kind, job_id=job_id, inbox=self.inbox, prompt=prompt,
                            max_new_tokens=mnt, timeout=self.workload.timeout_s, channel=self.args.kind, **extra)
        return op, time.monotonic() + self.workload.timeout_s

    def end_answer(self, op: str, job_id: str | None, prompt: int, mnt: int, tokens: list[int] | None,
                   text: str) -> None:
        self.history.record("end", op, outcome="answer", job_id=job_id, tokens=tokens, text=text)
        if job_id is not None:
            self.answered.append((job_id, prompt, mnt))
            self.timed_out.pop(job_id, None)

    def end_error(self, op: str, job_id: str | None, exc: BaseException, accepted: bool = False,
                  prompt: int = 0, mnt: int = 0) -> None:
        if isinstance(exc, Timeout) and not DEADLINE_ANSWER.match(str(exc)):
            self.history.record("end", op, outcome="timeout", job_id=job_id, error_class="Timeout", typed=True,
                                message=str(exc)[:300])
            if accepted and job_id is not None:
                self.timed_out[job_id] = (prompt, mnt)
            return
        code = "deadline_exceeded" if isinstance(exc, Timeout) else getattr(exc, "code", None)
        self.history.record("end", op, outcome="error", job_id=job_id, error_class=type(exc).__name__,
                            error_code=code, typed=isinstance(exc, BatchfleetError), message=str(exc)[:300])
        if job_id is not None:
            self.timed_out.pop(job_id, None)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


async def submit_and_wait(c: Caller, op: str, deadline: float, job_id: str, prompt: int, mnt: int,
                          before_result: Callable[[], Awaitable[None]] | None = None) -> None:
    """submit (again under the same id while its fate is unknown), then result: one outcome recorded."""
    text = c.workload.prompts[prompt]
    while True:
        if left(deadline) < MIN_CALL_S:
            c.end_error(op, job_id, Timeout("no time left to enqueue"))
            return
        try:
            await c.call("submit", text, timeout=left(deadline), job_id=job_id, max_new_tokens=mnt, temperature=0)
            break
        except RETRYABLE:
            c.history.record("retry", op, job_id=job_id)
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded, the checker judges it
            c.end_error(op, job_id, exc)
            return
    c.history.record("accepted", op, job_id=job_id)
    if before_result is not None:
        await before_result()
    await wait_result(c, op, deadline, job_id, prompt, mnt)


async def wait_result(c: Caller, op: str, deadline: float, job_id: str, prompt: int, mnt: int) -> None:
    try:
        res = await c.call("result", job_id, timeout=max(left(deadline), MIN_CALL_S))
    except BaseException as exc:  # noqa: BLE001
        c.end_error(op, job_id, exc, accepted=True, prompt=prompt, mnt=mnt)
        return
    c.end_answer(op, job_id, prompt, mnt, list(res.token_ids), res.text)


async def op_generate(c: Caller, rng: random.Random) -> None:
    prompt, mnt = c.workload.draw(rng)
    op, deadline = c.start("generate", prompt, mnt, None)
    try:
        res = await c.call("generate", c.workload.prompts[prompt], timeout=c.workload.timeout_s,
                           max_new_tokens=mnt, temperature=0)
    except BaseException as exc:  # noqa: BLE001
        c.end_error(op, None, exc)
        return
    c.end_answer(op, res.id, prompt, mnt, list(res.token_ids), res.text)


def own_id(c: Caller) -> str:
    return f"{c.history.client}-{c.history.incarnation}-{c.n + 1}"


async def op_submit(c: Caller, rng: random.Random) -> None:
    prompt, mnt = c.workload.draw(rng)
    job_id = own_id(c)
    op, deadline = c.start("submit", prompt, mnt, job_id)
    await submit_and_wait(c, op, deadline, job_id, prompt, mnt)


async def op_cancel(c: Caller, rng: random.Random) -> None:
    """Cancel mid-flight: the one outcome is the answer (it finished first) or ``Cancelled``."""
    prompt, mnt = c.workload.draw(rng)
    job_id = own_id(c)
    op, deadline = c.start("cancel", prompt, mnt, job_id)
    pause = rng.uniform(0, 0.3)

    async def cancel() -> None:
        await asyncio.sleep(pause)
        try:
            await c.call("cancel", job_id, timeout=min(5.0, max(left(deadline) - 1, MIN_CALL_S)))
        except Exception as exc:  # noqa: BLE001 - the cancel may not land (Redis down): the job then finishes
            c.history.record("cancel_failed", op, job_id=job_id, error_class=type(exc).__name__,
                             typed=isinstance(exc, BatchfleetError), message=str(exc)[:300])

    await submit_and_wait(c, op, deadline, job_id, prompt, mnt, before_result=cancel)


async def op_reuse(c: Caller, rng: random.Random) -> None:
    """Submit again under an id already answered to this inbox: refused (one answer per id), never a
    second answer."""
    if not c.answered:
        return await op_submit(c, rng)
    job_id, prompt, mnt = rng.choice(c.answered)
    op, deadline = c.start("reuse", prompt, mnt, job_id)
    await submit_and_wait(c, op, deadline, job_id, prompt, mnt)


async def op_shared(c: Caller, rng: random.Random) -> None:
    """A job id every client process uses once (a job id names one job per inbox)."""
    prompt, mnt = c.workload.draw(rng)
    c.shared += 1
    job_id = f"shared-{c.shared}"
    op, deadline = c.start("shared", prompt, mnt, job_id)
    await submit_and_wait(c, op, deadline, job_id, prompt, mnt)


async def op_join(c: Caller, rng: random.Random) -> None:
    """Two concurrent submits of one job id with different prompts: each caller gets its own prompt's answer
    or a typed refusal, never the other's answer."""
    (p1, mnt), (p2, _) = c.workload.draw(rng), c.workload.draw(rng)
    if p1 == p2:
        p2 = (p1 + 1) % len(c.workload.prompts)
    job_id = own_id(c)
    first = c.start("join", p1, mnt, job_id)
    second = c.start("join", p2, mnt, job_id)
    await asyncio.gather(submit_and_wait(c, *first, job_id, p1, mnt), submit_and_wait(c, *second, job_id, p2, mnt))


OPS = {"generate": op_generate, "submit": op_submit, "cancel": op_cancel, "reuse": op_reuse, "shared": op_shared,
       "join": op_join}


async def recover(c: Caller, events: list[dict[str, Any]]) -> None:
    """Settle what earlier incarnations left open, and learn their answered ids and timed-out jobs."""
    starts: dict[str, dict[str, Any]] = {}
    accepted: set[str] = set()
    ended: set[str] = set()
    for ev in events:
        if ev["ev"] == "start":
            starts[ev["op"]] = ev
            if ev.get("kind") == "shared":
                c.shared += 1
        elif ev["ev"] == "accepted":
            accepted.add(ev["op"])
        elif ev["ev"] == "end":
            ended.add(ev["op"])
            s = starts.get(ev["op"])
            if s is None or ev.get("job_id") is None:
                continue
            key = (ev["job_id"], s["prompt"], s["max_new_tokens"])
            if ev["outcome"] == "answer":
                c.answered.append(key)
                c.timed_out.pop(ev["job_id"], None)
            elif ev["outcome"] == "timeout" and (ev["op"] in accepted or s.get("of")):
                c.timed_out[ev["job_id"]] = key[1:]
            else:
                c.timed_out.pop(ev["job_id"], None)
    tasks = []
    superseded = {s["of"] for s in starts.values() if s.get("kind") == "recover"}  # a later incarnation took it on
    for op, s in starts.items():
        if op in ended or op in superseded or s.get("job_id") is None:
            continue  # finished, taken on already, or a generate whose id the dead process never learnt (given up)
        prompt, mnt, job_id = s["prompt"], s["max_new_tokens"], s["job_id"]
        new, deadline = c.start("recover", prompt, mnt, job_id, of=op)
        if op in accepted:
            c.history.record("accepted", new, job_id=job_id)
            tasks.append(wait_result(c, new, deadline, job_id, prompt, mnt))
        else:
            tasks.append(submit_and_wait(c, new, deadline, job_id, prompt, mnt))
    await asyncio.gather(*tasks)


async def collect(c: Caller) -> None:
    """Once no fault is injected any more: wait once more for every accepted job that timed out. An answer
    or error owed and still not there after ``collect_s`` of a calm fleet is lost."""
    async def one(job_id: str, prompt: int, mnt: int) -> None:
        op = c.next_op()
        c.history.record("start", op, kind="collect", job_id=job_id, inbox=c.inbox, prompt=prompt,
                         max_new_tokens=mnt, timeout=c.args.collect_s, channel=c.args.kind, of=job_id)
        c.history.record("accepted", op, job_id=job_id)
        await wait_result(c, op, time.monotonic() + c.args.collect_s, job_id, prompt, mnt)

    await asyncio.gather(*(one(j, p, m) for j, (p, m) in list(c.timed_out.items())))


async def caller_loop(c: Caller, seed: str, until: float) -> None:
    rng = random.Random(seed)
    kinds, weights = list(CLIENT_OPS), list(CLIENT_OPS.values())
    while time.time() < until:
        kind = rng.choices(kinds, weights)[0]
        try:
            await OPS[kind](c, rng)
        except Exception as exc:  # noqa: BLE001 - a bug of this harness: noted (the checker counts it), loop on
            c.history.record("harness_error", None, kind=kind, error=repr(exc)[:300])
        await asyncio.sleep(rng.uniform(0, 0.2))


async def run_fleet_client(args: argparse.Namespace, history: History, workload: Workload,
                           events: list[dict[str, Any]]) -> None:
    from batchfleet.producer import AsyncClient, Client

    inbox = Path(args.inbox_file).read_text().strip()
    loop = asyncio.get_running_loop()
    # the sync client's calls block a thread each: room for every caller, a join's pair, and the recoveries and
    # collections of a process restarted many times (a queue here would count as the product's delay)
    loop.set_default_executor(ThreadPoolExecutor(64))
    if args.kind == "sync":
        sync = Client(args.redis_url, args.namespace, inbox=inbox, max_connections=8)

        async def call(method: str, *a: Any, **kw: Any) -> Any:
            return await asyncio.to_thread(getattr(sync, method), *a, **kw)

        close: Callable[[], Awaitable[Any]] = lambda: asyncio.to_thread(sync.close)  # noqa: E731
    else:
        aclient = AsyncClient(args.redis_url, args.namespace, inbox=inbox, max_connections=8)

        async def call(method: str, *a: Any, **kw: Any) -> Any:
            return await getattr(aclient, method)(*a, **kw)

        close = aclient.aclose
    c = Caller(args, history, workload, inbox, call)
    try:
        await recover(c, events)
        await asyncio.gather(*(caller_loop(c, f"{args.seed}-{args.name}-{history.incarnation}-{i}", args.until)
                               for i in range(args.callers)))
        await collect(c)
    finally:
        await close()


def run_gateway_client(args: argparse.Namespace, history: History, workload: Workload) -> None:
    """Callers in threads, each with its own ``openai`` client (no retries: every outcome is seen)."""
    import threading

    import openai

    def loop(i: int) -> None:
        rng = random.Random(f"{args.seed}-{args.name}-{history.incarnation}-{i}")
        client = openai.OpenAI(base_url=args.gateway_url + "/v1", api_key="unused", max_retries=0,
                               timeout=workload.timeout_s)
        n = 0
        while time.time() < args.until:
            n += 1
            op = f"{args.name}.{history.incarnation}.{i}.{n}"
            prompt, mnt = workload.draw(rng)
            history.record("start", op, kind="completion", job_id=None, inbox=None, prompt=prompt,
                           max_new_tokens=mnt, timeout=workload.timeout_s, channel="gateway")
            try:
                out = client.completions.create(model="fleet", prompt=workload.prompts[prompt], max_tokens=mnt,
                                                temperature=0)
            except openai.APITimeoutError:
                history.record("end", op, outcome="timeout", error_class="APITimeoutError", typed=True)
            except openai.APIStatusError as exc:
                # a typed error is a status the API documents for it with an OpenAI error body; a 500 is typed
                # only with one of the fleet's error codes (a job whose workers died with it max_deliveries
                # times: worker_failed, as JobFailed for the Python clients), never internal_error
                body = exc.body if isinstance(exc.body, dict) else {}
                error = body.get("error", body)
                code = error.get("code") if isinstance(error, dict) else None
                typed = isinstance(error, dict) and (exc.status_code != 500 or code in ERROR_CODES)
                history.record("end", op, outcome="error", error_class=f"HTTP {exc.status_code}", typed=typed,
                               error_code=code if typed else None,
                               message=str(exc)[:300])
            except Exception as exc:  # noqa: BLE001 - a dropped connection to a live gateway is no typed error
                history.record("end", op, outcome="error", error_class=type(exc).__name__, typed=False,
                               message=str(exc)[:300])
            else:
                history.record("end", op, outcome="answer", text=out.choices[0].text)
            time.sleep(rng.uniform(0, 0.2))
        client.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--kind", choices=("sync", "async", "gateway"), required=True)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--gateway-url")
    ap.add_argument("--workload", required=True, help="the workload JSON (workload.Workload.save)")
    ap.add_argument("--history", required=True)
    ap.add_argument("--inbox-file", help="this client's inbox token (kept across incarnations)")
    ap.add_argument("--seed", required=True)
    ap.add_argument("--until", type=float, required=True, help="time.time() after which no operation starts")
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--collect-s", type=float, default=60.0)
    args = ap.parse_args()
    path = Path(args.history)
    events = list(read_events(path))
    history = History(path, args.name, 1 + sum(ev["ev"] == "boot" for ev in events))
    history.record("boot", pid=os.getpid())
    workload = Workload.load(Path(args.workload))
    if args.kind == "gateway":
        run_gateway_client(args, history, workload)
    else:
        asyncio.run(run_fleet_client(args, history, workload, events))
    history.record("exit")
    history.close()


if __name__ == "__main__":
    main()
