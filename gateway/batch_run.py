"""Run OpenAI batch input lines through the fleet, streamed: the gateway's batch runner and
``batchfleet bulk --format openai`` both call ``run_lines``.

Lines are read one at a time (never the whole file), submitted in the batch class with at most ``window``
lines in flight, each line's jobs waited for concurrently, and each answer written as soon as it comes
(OpenAI's output order is not the input's). Within each window, lines whose prompts start alike go one
after another (producer/prefix_order.py), so one worker's batch shares its prefix cache.

Exactly once across a kill: job ids derive from the run's prefix and the line number; a reply is deleted
from the run's inbox only after its line is on disk, and ``done`` (read back from the written files) skips
what is written. A rerun collects the replies that came while no run read the inbox and submits the rest
again: a job still queued or running answers once (the worker's ``done`` marker), nothing written is
computed again.

Stopping (``stop`` set): nothing more is submitted. ``abandon`` None (a shutdown, a lost lease): the lines in
flight stay for the next run. ``abandon`` set to (code, message) (cancel, expiry): what is in flight is
cancelled, answers that still come within CANCEL_GRACE_S are written, and every line not answered gets an
error line with that code.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from batchfleet.common.errors import FleetUnavailable, PromptTooLong, QueueFull, RedisUnavailable, Timeout
from batchfleet.common.keys import BATCH
from batchfleet.common.protocol import Result
from batchfleet.gateway.batch_lines import (
    BatchLine,
    Limits,
    LineError,
    custom_id_of,
    failure_line,
    parse_line,
    response_line,
)
from batchfleet.gateway.errors import APIError, api_error
from batchfleet.gateway.formats import Shape
from batchfleet.gateway.service import choice_params, job_params, token_texts, too_long, unknown_model
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk import inbox_replies
from batchfleet.producer.core import Deadline
from batchfleet.producer.prefix_order import grouped, prefix_key

log = logging.getLogger(__name__)
FATAL = (FleetUnavailable, RedisUnavailable)  # every later line would fail the same way: stop, run later
QUEUE_FULL_WAIT_S = 0.2
CANCEL_GRACE_S = 5.0


class Sink:
    """Where answers go: ``write(line, ok)`` puts one output (ok) or error line on disk before returning."""

    def write(self, line: dict[str, Any], ok: bool) -> None:
        raise NotImplementedError


@dataclass
class Spec:
    """What a run needs beyond its lines: names, the gateway's limits and models, its window."""

    prefix: str  # job ids <prefix>.<line>[-<choice>], output ids batch_req_<prefix>_<line>
    limits: Limits
    model_names: tuple[str, ...]
    window: int = 256
    endpoint: str | None = None  # the batch's url (None: each line names its own)
    abandon: tuple[str, str] | None = None  # set when stopping: (error code, message) for unanswered lines


@dataclass
class Outcome:
    """What a run did: lines written (ok / error) and whether it stopped before the end."""

    ok: int = 0
    failed: int = 0
    stopped: bool = False
    error: BaseException | None = None  # NoWorkers / RedisUnavailable: what stopped it


class _Run:
    def __init__(self, client: AsyncClient, sink: Sink, spec: Spec, stop: asyncio.Event, outcome: Outcome,
                 shape: Callable[[BatchLine, str], Shape]) -> None:
        self.client, self.sink, self.spec, self.stop, self.outcome = client, sink, spec, stop, outcome
        self.shape = shape
        self.inflight: dict[asyncio.Task, tuple[BatchLine, list[str]]] = {}
        self.present: dict[str, str] = {}

    def write(self, line: dict[str, Any], ok: bool) -> None:
        self.sink.write(line, ok)
        if ok:
            self.outcome.ok += 1
        else:
            self.outcome.failed += 1

    def refuse(self, line: BatchLine, error: APIError) -> None:
        self.write(response_line(self.spec.prefix, line, self.job_stem(line), error.status, error.body()), False)

    def job_stem(self, line: BatchLine) -> str:
        return f"{self.spec.prefix}.{line.index}"

    async def job_ids(self, line: BatchLine) -> list[str]:
        """The line's job ids. Its own stem, unless that was answered and the answer is neither in the inbox
        nor written (an output file cut short by hand): the fleet drops a second answer under one id, so
        the line then runs under a fresh one."""
        n = line.job.n if line.job is not None else 1

        def named(stem: str) -> list[str]:
            return [stem] if n == 1 else [f"{stem}-{i}" for i in range(n)]
        ids = named(self.job_stem(line))
        lost = [j for j in ids if j not in self.present]
        if lost and await self.client.r.exists(*(self.client.keys.done(j) for j in lost)):
            ids = named(f"{self.job_stem(line)}.r{secrets.token_hex(4)}")
        return ids

    async def params(self, line: BatchLine) -> dict[str, Any]:
        job = line.job
        assert job is not None
        error = unknown_model(job.model, self.spec.model_names)
        if error is not None:
            raise error
        return {**await job_params(job), "priority": BATCH}  # the batch class, whatever the body says

    async def submit(self, line: BatchLine) -> bool:
        """Submit the line's jobs (or write its error line); False: stopped before it was submitted."""
        if line.error is not None:
            self.refuse(line, line.error)
            return True
        ids = await self.job_ids(line)
        try:
            params = await self.params(line)
        except APIError as exc:
            self.refuse(line, exc)
            return True
        assert line.job is not None
        timeout = line.job.timeout
        sent: list[str] = []
        for i, jid in enumerate(ids):
            while jid not in self.present:
                if self.stop.is_set():
                    await self._give_up(sent)
                    return False
                try:
                    await self.client.submit(line.job.prompt, timeout=timeout, job_id=jid, **choice_params(params, i))
                    break
                except QueueFull:  # make room: wait for an answer in flight, else a little
                    if self.inflight:
                        await self.drain(once=True, wait=QUEUE_FULL_WAIT_S)
                    else:
                        await asyncio.sleep(QUEUE_FULL_WAIT_S)
                except FATAL:
                    await self._give_up(sent)
                    raise
                except PromptTooLong as exc:
                    await self._give_up(sent)
                    self.refuse(line, too_long(exc, line.job))
                    return True
                except Exception as exc:  # noqa: BLE001 - the client's checks (InvalidRequest, ValueError...)
                    await self._give_up(sent)
                    self.refuse(line, api_error(exc))
                    return True
            sent.append(jid)
        task = asyncio.ensure_future(self.answers(ids, timeout))
        self.inflight[task] = (line, ids)
        return True

    async def _give_up(self, job_ids: list[str]) -> None:
        for jid in job_ids:
            await self.client.give_up(jid)

    async def answers(self, job_ids: list[str], timeout: float) -> list[tuple[str | None, Any]]:
        async def one(jid: str) -> tuple[str | None, Any]:
            try:
                return await self.client.inbox.take(jid, Deadline(timeout))
            except Timeout:
                return None, Timeout(f"no answer for job {jid} within {timeout:g} s of its submission")
        return list(await asyncio.gather(*(one(j) for j in job_ids)))

    def finish(self, task: asyncio.Task) -> None:
        """Write a finished line's answer, then delete its replies from the inbox (only once on disk)."""
        line, ids = self.inflight.pop(task)
        taken = task.result()
        outcomes = [o for _, o in taken]
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None and self.spec.abandon is not None and getattr(failure, "code", None) == "cancelled":
            self.abandon_line(line.index, line.custom_id)
        elif failure is not None:
            self.refuse(line, api_error(failure))
        else:
            body = self.shape(line, self.job_stem(line)).response([o for o in outcomes if isinstance(o, Result)])
            self.write(response_line(self.spec.prefix, line, self.job_stem(line), 200, body), True)
        for entry_id, _ in taken:
            if entry_id is not None:
                self.client.inbox.consumed(entry_id)

    async def drain(self, once: bool = False, wait: float | None = None) -> None:
        """Write finished lines until none is in flight, or (``once``) at least one is written, or ``wait``
        seconds pass; a stop ends it early."""
        stopper = asyncio.ensure_future(self.stop.wait())
        try:
            while self.inflight and not self.stop.is_set():
                done, _ = await asyncio.wait([*self.inflight, stopper], timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done - {stopper}:
                    self.finish(task)
                if once or not done:
                    return
        finally:
            stopper.cancel()

    async def abandon_inflight(self) -> None:
        """Cancel what is in flight; write the answers that still come within the grace, error lines for
        the rest."""
        for _, ids in self.inflight.values():
            for jid in ids:
                try:
                    await self.client.cancel(jid)
                except Exception as exc:  # noqa: BLE001 - the job's deadline still bounds it
                    log.warning("could not cancel job %s: %r", jid, exc)
        done, pending = (await asyncio.wait(list(self.inflight), timeout=CANCEL_GRACE_S)
                         if self.inflight else (set(), set()))
        for task in done:
            self.finish(task)
        for task in pending:
            line, ids = self.inflight.pop(task)
            task.cancel()
            await self._give_up(ids)
            self.abandon_line(line.index, line.custom_id)

    def abandon_line(self, index: int, custom_id: str | None) -> None:
        assert self.spec.abandon is not None
        code, message = self.spec.abandon
        self.write(failure_line(self.spec.prefix, index, custom_id, code, message), False)


async def run_lines(client: AsyncClient, lines: Iterable[tuple[int, bytes]], done: set[int], sink: Sink,
                    spec: Spec, stop: asyncio.Event | None = None, strict: bool = False) -> Outcome:
    """Answer every (line number, raw line) not in ``done`` into ``sink``. ``strict``: the lines were
    validated already (a malformed one is a bug); else a malformed line is an error line of its own."""
    stop = stop or asyncio.Event()
    outcome = Outcome()
    fleet = await client.fleet()
    texts = token_texts(fleet.tokenizer)
    model = spec.model_names[0]

    def shape(line: BatchLine, stem: str) -> Shape:
        return Shape(chat=line.chat, job_id=stem, model=model, created=int(time.time()),
                     fingerprint=fleet.info.fingerprint or None,
                     token_text=None if line.job is None or line.job.logprobs is None else texts)

    run = _Run(client, sink, spec, stop, outcome, shape)
    run.present = await inbox_replies(client)
    seen: set[str] = set()
    chunk: list[BatchLine] = []
    try:
        for index, raw in lines:
            if index in done:
                continue
            if stop.is_set():
                if spec.abandon is None:
                    break
                run.abandon_line(index, custom_id_of(raw))
                continue
            try:
                chunk.append(parse_line(raw, index, spec.limits, spec.endpoint, seen))
            except LineError as exc:
                if strict:
                    raise
                run.write(failure_line(spec.prefix, index, custom_id_of(raw), exc.code, exc.message), False)
            if len(chunk) >= spec.window:
                await _submit_all(run, chunk)
                chunk = []
        await _submit_all(run, chunk)
        if not stop.is_set():
            await run.drain()
    except FATAL as exc:
        outcome.error = exc
        stop.set()
    finally:
        for task in [t for t in run.inflight if t.done() and not t.cancelled()]:
            run.finish(task)  # answers already here are written in any case
        if stop.is_set() and spec.abandon is not None:
            await run.abandon_inflight()
        else:  # left for the next run, which collects the replies
            for task in run.inflight:
                task.cancel()
        outcome.stopped = stop.is_set()
    return outcome


async def _submit_all(run: _Run, chunk: list[BatchLine]) -> None:
    for line in grouped(chunk, lambda ln: prefix_key(ln.job.prompt) if ln.job is not None else None):
        while len(run.inflight) >= run.spec.window and not run.stop.is_set():
            await run.drain(once=True)
        if (run.stop.is_set() or not await run.submit(line)) and run.spec.abandon is not None:
            run.abandon_line(line.index, line.custom_id)
