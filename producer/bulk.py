"""Resumable bulk submission: a JSONL prompt file in, one JSONL answer line per prompt out, in the batch class.

Lines are named from a random run key kept beside the output (producer/bulk_input.py), so a second run on
the same output asks the fleet the same questions under the same names and reads the same inbox. A run
keeps the lines already in the output, collects replies that arrived in the inbox while no run was
reading it, and enqueues the rest. A reply is deleted from the inbox only after its line is flushed to
the output, so a kill at any instant leaves each answer on disk or still in the inbox, never neither. A
job a killed run left queued or running is enqueued again: its first answer wins the worker's ``done``
marker and is the only one written to the inbox, so the output gets it once (the fleet may compute it
twice).

Every job's timeout runs from its own submission, so answers that never come expire together, not one
after the other. A bad line (not JSON, unknown keys, bad parameters, too long) becomes an error line
carrying the protocol's error code; the run goes on. Fleet-wide failures (no live worker, Redis
unreachable) stop it like Ctrl-C does: the answers already here are written, and a rerun resumes.

Lines are submitted prefix-grouped: within each run of ``window`` lines, those whose prompts start alike
(the same first 64 characters, or 16 token ids: about one KV block; producer/prefix_order.py) go one after
another, so one worker's batch shares its prefix and its prefix cache keeps what the next lines need.
Answers are written in submission order; each line carries its input line number (``index``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from batchfleet.common.errors import FleetUnavailable, InvalidRequest, QueueFull, RedisUnavailable, Timeout
from batchfleet.common.keys import BATCH
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk_input import PARAM_KEYS, Line, Written, error_code, parse_lines, read_output, run_names
from batchfleet.producer.core import Deadline
from batchfleet.producer.prefix_order import submission_order

FATAL = (FleetUnavailable, RedisUnavailable)  # every later line would fail the same way: stop, resume later
QUEUE_FULL_WAIT_S = (0.05, 2.0)


@dataclass
class Summary:
    """What a run did; ``interrupted`` runs leave ``in_flight`` jobs for the next run to collect."""

    total: int = 0  # answer lines the input asks for
    kept: int = 0  # already in the output when the run started
    kept_failed: int = 0  # error lines among them
    written: int = 0  # written by this run
    failed: int = 0  # error lines written by this run
    submitted: int = 0  # jobs this run enqueued
    collected: int = 0  # replies to jobs an earlier run enqueued
    in_flight: int = 0
    interrupted: bool = False  # stopped (Ctrl-C) or ended by ``error`` before every line was answered
    error: BaseException | None = None  # NoWorkers / RedisUnavailable mid-run: what ended it

    @property
    def done(self) -> int:
        return self.kept + self.written

    @property
    def failed_lines(self) -> int:
        """Error lines in the whole output (this run's and the kept ones)."""
        return self.failed + self.kept_failed


@dataclass
class _Pending:
    line: Line
    error: BaseException | dict | None = None
    deadline: Deadline | None = None  # from the job's submission: missing answers expire together


class _Run:
    """One pass over the lines: submit within the window, write answers in submission order."""

    def __init__(self, client: AsyncClient, out, defaults: dict, timeout: float | None, stop: asyncio.Event,
                 summary: Summary, progress: Callable[[Summary], None] | None) -> None:
        self.client, self.out, self.defaults, self.timeout = client, out, defaults, timeout
        self.stop, self.summary, self.progress = stop, summary, progress
        self.stopper = asyncio.ensure_future(stop.wait())
        self.wait_s = QUEUE_FULL_WAIT_S[0]

    def write(self, item: _Pending, body: dict, entry_id: str | None = None) -> None:
        self.out.write(json.dumps(item.line.answer(**body)) + "\n")
        self.out.flush()
        if entry_id is not None:
            self.client.inbox.consumed(entry_id)  # only now: the answer is on disk
        self.summary.written += 1
        self.summary.failed += "error" in body
        if self.progress is not None:
            self.progress(self.summary)

    @staticmethod
    def failure(exc: BaseException | dict) -> dict:
        return {"error": exc if isinstance(exc, dict) else {"code": error_code(exc), "message": str(exc)}}

    async def submit(self, item: _Pending, has_inflight: bool) -> bool | None:
        """Enqueue the item's job. True: submitted (or it failed on its own: an error line); False: the queue
        is full and answers in flight make room (take the head first); None: stop (fatal, or stopped)."""
        line = item.line
        params = {"priority": BATCH, **self.defaults, **{k: line.obj[k] for k in PARAM_KEYS if k in line.obj}}
        while not self.stop.is_set():
            try:
                item.deadline = Deadline(self.timeout)
                await self.client.submit(line.obj["prompt"], timeout=self.timeout, job_id=line.job_id, **params)
            except QueueFull:
                if has_inflight:
                    return False
                await asyncio.wait({self.stopper}, timeout=self.wait_s)
                self.wait_s = min(2 * self.wait_s, QUEUE_FULL_WAIT_S[1])
                continue
            except FATAL as exc:
                self.summary.error = exc  # the next line would fail the same way: stop here
                self.stop.set()
                return None
            except (InvalidRequest, ValueError, TypeError) as exc:
                item.error = exc
                return True
            self.summary.submitted += 1
            self.wait_s = QUEUE_FULL_WAIT_S[0]
            return True
        return None

    async def finish(self, item: _Pending, wait: bool) -> bool:
        """Write the head's answer; False when it is not here (``wait``: stop came first)."""
        if item.error is not None:
            self.write(item, self.failure(item.error))
            return True
        assert item.line.job_id is not None
        left = (item.deadline or Deadline(self.timeout)).left() if wait else 0
        take = asyncio.ensure_future(self.client.inbox.take(item.line.job_id, Deadline(left)))
        if wait:
            await asyncio.wait({take, self.stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not take.done():
                take.cancel()  # the inbox keeps waiting for the reply: the next run collects it
                return False
        try:
            entry_id, outcome = await take
        except Timeout:
            if not wait:
                return False
            self.write(item, self.failure(Timeout(f"no answer for job {item.line.job_id} within "
                                                  f"{self.timeout:g} s of its submission")))
            return True
        body = self.failure(outcome) if isinstance(outcome, BaseException) else {"result": asdict(outcome)}
        self.write(item, body, entry_id)
        return True


async def run_bulk(client: AsyncClient, lines: list[Line], out, *, window: int, defaults: dict,
                   timeout: float | None, kept: Written | None = None, stop: asyncio.Event | None = None,
                   progress: Callable[[Summary], None] | None = None) -> Summary:
    """Answer every line not in ``kept.done``, writing to ``out`` in submission order with at most ``window`` jobs
    in flight (batch class unless ``defaults`` says otherwise). ``stop`` set: submit nothing more, write the
    answers already here, return. NoWorkers / RedisUnavailable while submitting stop it the same way."""
    kept = kept or Written()
    stop = stop or asyncio.Event()
    summary = Summary(total=len(lines), kept=sum(1 for ln in lines if ln.index in kept.done),
                      kept_failed=kept.failed)
    present = await inbox_replies(client)
    stale = [present.pop(ln.job_id) for ln in lines if ln.job_id in present and ln.index in kept.done]
    for i in range(0, len(stale), 1000):  # answered and written: a run killed before it deleted them
        await client.r.xdel(client.reply_key, *stale[i:i + 1000])
    todo = deque(_Pending(ln, ln.error) for ln in submission_order([ln for ln in lines if ln.index not in kept.done],
                                                                  window))
    inflight: deque[_Pending] = deque()
    run = _Run(client, out, defaults, timeout, stop, summary, progress)
    try:
        while (todo or inflight) and not stop.is_set():
            while todo and len(inflight) < window and not stop.is_set():
                item = todo[0]
                if item.error is None and item.line.job_id in present:
                    summary.collected += 1
                elif item.error is None:
                    ok = await run.submit(item, bool(inflight))
                    if not ok:
                        break  # queue full with answers due (False), or stopped (None)
                inflight.append(todo.popleft())
            if inflight and await run.finish(inflight[0], wait=True):
                inflight.popleft()
        while inflight and await run.finish(inflight[0], wait=False):  # stopped: keep what already came
            inflight.popleft()
    finally:
        run.stopper.cancel()
        summary.in_flight = sum(1 for p in inflight if p.error is None)
        summary.interrupted = bool(todo or inflight)
    return summary


async def inbox_replies(client: AsyncClient) -> dict[str, str]:
    """job id -> entry id of every reply now in the client's inbox (read without consuming)."""
    found: dict[str, str] = {}
    last = "0-0"
    while True:
        resp = await client.r.xread({client.reply_key: last}, count=1000)
        if not resp:
            return found
        for entry_id, fields in resp[0][1]:
            last = entry_id.decode()
            found[fields.get(b"id", b"").decode(errors="replace")] = last


async def bulk_file(input_path: str | None, output_path: str | None, *, redis_url: str | None = None,
                    namespace: str | None = None, window: int = 256, defaults: dict | None = None,
                    timeout: float | None = None, resume: bool | None = None, stop: asyncio.Event | None = None,
                    progress: Callable[[Summary], None] | None = None, text: str | None = None,
                    out=None) -> Summary:
    """Run a prompt file (``text`` instead of reading ``input_path``) into ``output_path`` (None: ``out``).

    ``resume`` None: resume when the output and its run key exist; False: start the output over (a new run
    key). Raises NoWorkers / RedisUnavailable when the run cannot start; once started it stops instead
    (``Summary.error``): what is written stays, and a rerun resumes."""
    if window < 1:
        raise InvalidRequest("window must be >= 1")
    if text is None:
        assert input_path is not None
        with open(input_path, encoding="utf-8") as f:
            text = f.read()
    client = AsyncClient(redis_url, namespace, inbox=None)
    try:
        await client.fleet()  # reachable, and a fleet to ask: before any file is touched
    finally:
        await client.aclose()
    names, resuming = run_names(output_path, resume is not False)
    lines = parse_lines(text.splitlines(), names.prefix)
    kept = read_output(output_path) if resuming else Written()  # type: ignore[arg-type]
    client = AsyncClient(redis_url, namespace, inbox=names.inbox)
    try:
        if output_path is not None:
            out = open(output_path, "a" if resuming else "w", encoding="utf-8")
        try:
            return await run_bulk(client, lines, out, window=window, defaults=defaults or {}, timeout=timeout,
                                  kept=kept, stop=stop, progress=progress)
        finally:
            if output_path is not None:
                out.close()
    finally:
        await client.aclose()


def throttled(fn: Callable[[Summary], None], every_s: float) -> Callable[[Summary], None]:
    """``fn`` at most every ``every_s`` seconds, and for the last line."""
    last = [0.0]

    def call(s: Summary) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or s.done >= s.total:
            last[0] = now
            fn(s)
    return call
