"""Resumable bulk submission: a JSONL prompt file in, one JSONL answer line per prompt out.

Why it can resume without recomputing: every line's job id is derived from the input (its ``"id"``, else a
hash of the input file's path and line number) and the client's inbox from the output file, so a second
run with the same files asks the fleet the same questions under the same names and reads the same inbox.
A run keeps the lines already in the output, collects replies that arrived in the inbox while no run was
reading it, and enqueues the rest. A reply is deleted from the inbox only after its line is flushed to the
output, so a kill at any instant leaves each answer on disk or still in the inbox, never neither. A job a
killed run left queued or running is enqueued again: its first answer wins the worker's ``done`` marker and
is the only one written to the inbox, so the output gets it once (the fleet may compute it twice).

Lines are written in input order, but submitted prefix-grouped: within each run of ``window`` lines, those
whose prompts start alike (the same first 64 characters, or 16 token ids: about one KV block) go one after
another, so one worker's batch shares its prefix and a worker's prefix cache keeps what the next lines need.

A bad line (not JSON, unknown keys, bad parameters, too long) becomes an error line carrying the protocol's
error code; the run goes on. Fleet-wide failures (no live worker, Redis unreachable) stop it like Ctrl-C does:
the answers already here are written, and a rerun resumes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from batchfleet.common.config import connection_from_env
from batchfleet.common.errors import (
    DEADLINE_EXCEEDED,
    INVALID_REQUEST,
    PROMPT_TOO_LONG,
    FleetUnavailable,
    InvalidRequest,
    PromptTooLong,
    QueueFull,
    RedisUnavailable,
    Timeout,
)
from batchfleet.common.keys import valid_job_id
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.core import Deadline
from batchfleet.producer.prefix_order import submission_order

PARAM_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
LINE_KEYS = frozenset({"prompt", "id", *PARAM_KEYS})
# client-side failures have codes of their own next to the wire codes of common/errors.py
CLIENT_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (PromptTooLong, PROMPT_TOO_LONG), (InvalidRequest, INVALID_REQUEST), (QueueFull, "queue_full"),
    (Timeout, DEADLINE_EXCEEDED), (FleetUnavailable, "no_workers"), (RedisUnavailable, "redis_unavailable"),
    (ValueError, INVALID_REQUEST), (TypeError, INVALID_REQUEST),
)
FATAL = (FleetUnavailable, RedisUnavailable)  # every later line would fail the same way: stop, resume later
QUEUE_FULL_WAIT_S = (0.05, 2.0)


def error_code(exc: BaseException) -> str:
    """The protocol's code for an error (``prompt_too_long``, ``queue_full``, ...), never a class name."""
    code = getattr(exc, "code", None)
    if isinstance(code, str):
        return code
    return next((c for cls, c in CLIENT_CODES if isinstance(exc, cls)), "internal_error")


def _digest(*parts: str, n: int = 32) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def run_names(output_path: str | None, namespace: str) -> tuple[str | None, str]:
    """(inbox token, job id prefix) of a run writing ``output_path``: stable across reruns of the same
    output, so a rerun reads the replies of jobs an earlier run submitted. Stdout: a fresh random run."""
    if output_path is None:
        return None, "b" + os.urandom(6).hex()
    where = os.path.abspath(output_path)
    return _digest("inbox", where, namespace), "b" + _digest("jobs", where, namespace, n=12)


@dataclass
class Line:
    """One non-empty input line: what to ask (``obj``) or why it cannot be asked (``error``)."""

    index: int  # 0-based line number in the input file (blank lines count, and get no answer)
    obj: dict = field(default_factory=dict)
    error: dict | None = None
    job_id: str | None = None

    def answer(self, **body: object) -> dict:
        out: dict = {"index": self.index}
        if "id" in self.obj:
            out["id"] = self.obj["id"]
        out.update(body)
        return out


def parse_lines(text_lines: list[str], input_path: str | None, prefix: str) -> list[Line]:
    """Parse and name every non-empty line; ids: ``<prefix>.<line id>``, else a hash of path + line number."""
    where = os.path.abspath(input_path) if input_path else "<stdin>"
    seen: dict[str, int] = {}
    out: list[Line] = []
    for index, raw in enumerate(text_lines):
        if not raw.strip():
            continue
        line = Line(index)
        out.append(line)
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            line.error = {"code": INVALID_REQUEST, "message": f"not JSON: {exc}"}
            continue
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if not isinstance(obj, dict) or "prompt" not in obj:
            line.error = {"code": INVALID_REQUEST,
                          "message": 'each line must be a JSON object with a "prompt" (or a JSON string)'}
            continue
        line.obj = obj
        unknown = sorted(set(obj) - LINE_KEYS)
        user_id = obj.get("id")
        if unknown:
            line.error = {"code": INVALID_REQUEST, "message": f"unknown key(s) {', '.join(unknown)}; a line "
                          f"holds {', '.join(sorted(LINE_KEYS))}"}
        elif "id" in obj and (isinstance(user_id, bool) or not isinstance(user_id, (str, int))):
            line.error = {"code": INVALID_REQUEST, "message": '"id" must be a string or an integer'}
        elif "id" in obj and str(user_id) in seen:
            line.error = {"code": INVALID_REQUEST,
                          "message": f"duplicate id {user_id!r} (line {seen[str(user_id)]} has it)"}
        else:
            if "id" in obj:
                seen[str(user_id)] = index
                key = str(user_id)
                if not valid_job_id(f"{prefix}.{key}"):  # odd characters or too long: its hash names it
                    key = "h" + _digest(key)
            else:
                key = "l" + _digest(where, str(index))
            line.job_id = f"{prefix}.{key}"
    return out


def answered_lines(output_path: str) -> set[int]:
    """Indexes already in an output file; a partial last line (a kill mid-write) is cut off."""
    with open(output_path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
    done: set[int] = set()
    for raw in data[:keep].splitlines():
        try:
            done.add(int(json.loads(raw)["index"]))
        except (ValueError, KeyError, TypeError):
            continue  # not one of ours: left as it is
    return done


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


@dataclass
class Summary:
    """What a run did; ``interrupted`` runs leave ``in_flight`` jobs for the next run to collect."""

    total: int = 0  # answer lines the input asks for
    kept: int = 0  # already in the output when the run started
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


@dataclass
class _Pending:
    line: Line
    error: BaseException | dict | None = None


async def run_bulk(client: AsyncClient, lines: list[Line], out, *, window: int, defaults: dict,
                   timeout: float | None, skip: set[int] = frozenset(),  # type: ignore[assignment]
                   fresh: bool = False, stop: asyncio.Event | None = None,
                   progress: Callable[[Summary], None] | None = None) -> Summary:
    """Answer every line whose index is not in ``skip``, writing to ``out`` in input order with at most
    ``window`` jobs in flight. ``stop`` set: submit nothing more, write the answers already here, return.
    ``fresh``: the output was started over, so answers an earlier run left in the inbox are dropped.
    NoWorkers / RedisUnavailable while submitting stop the run the same way (``Summary.error``)."""
    stop = stop or asyncio.Event()
    summary = Summary(total=len(lines), kept=sum(1 for ln in lines if ln.index in skip))
    present = await inbox_replies(client)
    # answered and written (a run killed before it deleted them), or of a run whose output is started over
    stale = [present.pop(ln.job_id) for ln in lines if ln.job_id in present and (fresh or ln.index in skip)]
    for i in range(0, len(stale), 1000):
        await client.r.xdel(client.reply_key, *stale[i:i + 1000])
    order = deque(ln for ln in lines if ln.index not in skip)  # input order: the line written next first
    todo = deque(submission_order(list(order), window))  # prefix-grouped within each window of lines
    inflight: dict[int, _Pending] = {}  # line index -> submitted (or failed) and not yet written
    stopper = asyncio.ensure_future(stop.wait())
    wait_s = QUEUE_FULL_WAIT_S[0]

    def write(item: _Pending, body: dict, entry_id: str | None = None) -> None:
        out.write(json.dumps(item.line.answer(**body)) + "\n")
        out.flush()
        if entry_id is not None:
            client.inbox.consumed(entry_id)  # only now: the answer is on disk
        summary.written += 1
        summary.failed += "error" in body
        if progress is not None:
            progress(summary)

    def failure(exc: BaseException | dict) -> dict:
        return {"error": exc if isinstance(exc, dict) else {"code": error_code(exc), "message": str(exc)}}

    async def finish(item: _Pending, wait: bool) -> bool:
        """Write the head's answer; False when it is not here (``wait``: stop came first)."""
        if item.error is not None:
            write(item, failure(item.error))
            return True
        job_id = item.line.job_id
        assert job_id is not None
        take = asyncio.ensure_future(client.inbox.take(job_id, Deadline(timeout if wait else 0)))
        if wait:
            await asyncio.wait({take, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not take.done():
                take.cancel()  # the inbox keeps waiting for the reply: the next run collects it
                return False
        try:
            entry_id, outcome = await take
        except Timeout as exc:
            if not wait:
                return False
            write(item, failure(exc))
            return True
        body = failure(outcome) if isinstance(outcome, BaseException) else {"result": asdict(outcome)}
        write(item, body, entry_id)
        return True

    try:
        while (todo or inflight) and not stop.is_set():
            while todo and len(inflight) < window and not stop.is_set():
                line = todo[0]
                item = _Pending(line, line.error)
                if item.error is None and line.job_id in present:
                    summary.collected += 1
                elif item.error is None:
                    params = {**defaults, **{k: line.obj[k] for k in PARAM_KEYS if k in line.obj}}
                    try:
                        await client.submit(line.obj["prompt"], timeout=timeout, job_id=line.job_id, **params)
                        summary.submitted += 1
                        wait_s = QUEUE_FULL_WAIT_S[0]
                    except QueueFull:
                        if order[0].index in inflight:
                            break  # answers make room: take the head first
                        await asyncio.wait({stopper}, timeout=wait_s)
                        wait_s = min(2 * wait_s, QUEUE_FULL_WAIT_S[1])
                        continue
                    except FATAL as exc:
                        summary.error = exc  # the next line would fail the same way: stop here
                        stop.set()
                        break
                    except (InvalidRequest, ValueError, TypeError) as exc:
                        item.error = exc
                todo.popleft()
                inflight[line.index] = item
            # the head is submitted here unless stopped: grouping never reaches past the window
            if order and order[0].index in inflight and await finish(inflight[order[0].index], wait=True):
                del inflight[order.popleft().index]
        while order and order[0].index in inflight and await finish(inflight[order[0].index], wait=False):
            del inflight[order.popleft().index]  # stopped: keep what already came, in order
    finally:
        stopper.cancel()
        summary.in_flight = sum(1 for p in inflight.values() if p.error is None)
        summary.interrupted = bool(todo or inflight)
    return summary


async def bulk_file(input_path: str | None, output_path: str | None, *, redis_url: str | None = None,
                    namespace: str | None = None, window: int = 256, defaults: dict | None = None,
                    timeout: float | None = None, resume: bool | None = None, stop: asyncio.Event | None = None,
                    progress: Callable[[Summary], None] | None = None, text: str | None = None,
                    out=None) -> Summary:
    """Run a prompt file (``text`` instead of reading ``input_path``) into ``output_path`` (None: ``out``).

    ``resume`` None: resume when the output exists; False: start the output over. Raises NoWorkers /
    RedisUnavailable when the run cannot start; once started it stops instead (``Summary.error``): what is
    written stays, and a rerun resumes."""
    if window < 1:
        raise InvalidRequest("window must be >= 1")
    if text is None:
        assert input_path is not None
        with open(input_path, encoding="utf-8") as f:
            text = f.read()
    inbox, prefix = run_names(output_path, connection_from_env(redis_url, namespace).keys.namespace)
    lines = parse_lines(text.splitlines(), input_path, prefix)
    resuming = output_path is not None and resume is not False and os.path.exists(output_path)
    skip = answered_lines(output_path) if resuming else set()  # type: ignore[arg-type]
    client = AsyncClient(redis_url, namespace, inbox=inbox)
    try:
        await client.fleet()
        if output_path is not None:
            out = open(output_path, "a" if resuming else "w", encoding="utf-8")
        try:
            return await run_bulk(client, lines, out, window=window, defaults=defaults or {}, timeout=timeout,
                                  skip=skip, fresh=not resuming, stop=stop, progress=progress)
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
