"""The one bulk runner: input lines -> jobs at the fleet's background priority -> answer lines on disk, resumable.

``batchfleet bulk`` (both formats, producer/bulk/file_run.py) and the gateway's batches (gateway/batches/runner.py) run
their lines here; a ``LineFormat`` (producer/bulk/work.py) says what a line asks and how its answer reads
(producer/bulk/lines.py: prompts; gateway/batches/format.py: OpenAI batch lines), so this module knows neither.

Lines are read one at a time (never the whole input) and submitted with at most ``window`` lines in flight,
and at most the fleet's next read of jobs queued unread (producer/bulk/queued.py): runs that share the background
class then take turns in its streams instead of one run's window waiting behind another's.
Within each run of ``window`` lines, those whose prompts start alike go one after another
(producer/bulk/prefix_order.py), so one worker's batch shares its prefix and its prefix cache keeps what the next
lines need. Each line's jobs are waited for concurrently; answers are written in submission order
(``LineFormat.ordered``) or as they come. Every job's timeout runs from its own submission, so answers that
never come expire together.

Exactly once across a kill: job ids derive from the run's prefix, the line (its number, or its id and number)
and its fingerprint; a reply is deleted from the run's inbox only after its line is on disk, and ``Spec.done``
(read back from the written files) skips what is written. A rerun collects the replies that came while no run
read the inbox and submits the rest again: a job still queued or running answers once (the worker's ``done``
marker), nothing written is computed again. A job answered whose reply is neither in the inbox nor written
(an output cut short by hand) runs again under a fresh id: the fleet drops a second answer under one id.

Stopping (``stop`` set; a fleet-wide failure, no live worker or Redis unreachable, sets it too): nothing more
is submitted. ``Spec.abandon`` None (Ctrl-C, a shutdown, a lost lease): the answers of the lines in flight are
written as they come for at most ``Spec.drain_s`` (none after a fleet-wide failure), the rest stay for the
next run. ``abandon`` set to (code, message) (cancel, expiry): what is in flight is cancelled, answers that
still come within CANCEL_GRACE_S are written, and every line not answered gets an error line with that code.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Iterable
from typing import Any

from batchfleet.common.errors import FleetUnavailable, QueueFull, RateLimited, RedisRefused, RedisUnavailable, Timeout
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.answers import Answers
from batchfleet.producer.bulk.prefix_order import submission_order
from batchfleet.producer.bulk.queued import POLL_S, Queued
from batchfleet.producer.bulk.work import LineFormat, Sink, Spec, Summary, Work
from batchfleet.producer.core import Deadline

# every later line would fail the same way (Redis full or refusing too): stop, resume later
FATAL = (FleetUnavailable, RedisUnavailable, RedisRefused)
QUEUE_FULL_WAIT_S = (0.05, 2.0)
CANCEL_GRACE_S = 5.0


async def inbox_replies(client: AsyncClient) -> dict[str, str]:
    """job id -> entry id of every reply now in the client's inbox (read without consuming); a ring counts only
    while its answer is stored (producer/answers.py: an answer expires before a ring in a long-lived inbox)."""
    found: dict[str, str] = {}
    last = "0-0"
    await client.learn_layout(Deadline(None))  # a sharded fleet: the inbox is on the client's home shard
    while resp := await client.r.xread({client.reply_key: last}, count=1000):
        entries = [(e.decode(), fields) for e, fields in resp[0][1]]
        last = entries[-1][0]
        answers = await Answers().fetch(client.r, client.reply_key, entries)
        for entry_id, fields in entries:
            if entry_id not in answers or answers[entry_id]:
                found[fields.get(b"id", b"").decode(errors="replace")] = entry_id
    return found


def retagged(job_ids: list[str], tag: str | None = None) -> list[str]:
    """Fresh ids for a line's jobs (one tag for all, random by default): a line that runs again after an answer."""
    tag = tag or secrets.token_hex(4)
    return [f"{j[:118]}.r{tag}" for j in job_ids]


class _Run:
    def __init__(self, client: AsyncClient, fmt: LineFormat, sink: Sink, spec: Spec, stop: asyncio.Event,
                 summary: Summary, progress: Callable[[Summary], None] | None) -> None:
        self.client, self.fmt, self.sink, self.spec, self.stop = client, fmt, sink, spec, stop
        self.summary, self.progress = summary, progress
        self.inflight: dict[asyncio.Future, Work] = {}  # in submission order
        self.present: dict[str, str] = {}
        self.stopper = asyncio.ensure_future(stop.wait())
        self.wait_s = QUEUE_FULL_WAIT_S[0]
        self.left = False  # a line was left unanswered for the next run
        self.queued = Queued(client, spec.share)

    def write(self, line: dict, ok: bool) -> None:
        self.sink.write(line, ok)
        self.summary.written += 1
        self.summary.failed += not ok
        if not ok:
            self.summary.codes[self.fmt.code_of(line)] += 1
        if self.progress is not None:
            self.progress(self.summary)

    def abandon(self, index: int, line: Any) -> None:
        assert self.spec.abandon is not None
        self.write(self.fmt.abandoned(index, line, *self.spec.abandon), False)

    def queue_error(self, work: Work, error: dict) -> None:
        """An error line takes its place in flight, so an ordered output keeps submission order."""
        work.error = error
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        done.set_result([])
        self.inflight[done] = work

    async def job_ids(self, work: Work) -> list[str]:
        """The work's own ids, unless one was answered and its reply is neither in the inbox nor written (an
        output cut short by hand): the line then runs under fresh ones."""
        if work.index in self.spec.fresh:  # its earlier answer was dropped: the fleet answered these ids
            return retagged(work.job_ids, self.spec.fresh[work.index])
        lost = [j for j in work.job_ids if j not in self.present] if self.fmt.check_answered else []
        done_keys = [self.client.home.done(j, self.client.reply_key) for j in lost]
        if not lost or not await self.client.calls.io(lambda: self.client.r.exists(*done_keys), Deadline(None),
                                                      "bulk: job ids"):
            return work.job_ids
        self.present.update(await inbox_replies(self.client))  # answered since the run began: collected
        if not any(j not in self.present for j in lost):
            return work.job_ids
        return retagged(work.job_ids)

    async def submit(self, work: Work) -> bool:
        """Submit the work's jobs (or queue its error line); False: stopped before it was submitted."""
        if work.error is not None:
            self.queue_error(work, work.error)
            return True
        work.job_ids = await self.job_ids(work)
        try:
            asks = await self.fmt.asks(work)
        except self.fmt.refused as exc:
            self.queue_error(work, self.fmt.failure(work, exc))
            return True
        sent: list[str] = []
        deadlines: list[Deadline] = []
        prompts = work.prompts or [work.prompt] * len(work.job_ids)
        for jid, ask, prompt in zip(work.job_ids, asks, prompts):
            deadlines.append(Deadline(work.timeout))  # from the job's submission: missing answers expire together
            while jid not in self.present:
                if self.stop.is_set():
                    await self.give_up(sent)
                    return False
                try:
                    deadlines[-1] = Deadline(work.timeout)
                    await self.client.submit(prompt, timeout=work.timeout, job_id=jid, ask=ask,
                                             placed=self.queued.placed)
                except QueueFull:  # make room: wait for an answer in flight, else a little, longer each time
                    if self.inflight:
                        await self.drain(once=True, wait=self.wait_s)
                    else:
                        await asyncio.wait({self.stopper}, timeout=self.wait_s)
                    self.wait_s = min(2 * self.wait_s, QUEUE_FULL_WAIT_S[1])
                    continue
                except RateLimited as exc:  # the tenant's limit: wait until it fits (writing answers meanwhile)
                    wait = max(QUEUE_FULL_WAIT_S[0], exc.retry_after_s)
                    if self.inflight:
                        await self.drain(once=True, wait=wait)
                    else:
                        await asyncio.wait({self.stopper}, timeout=wait)
                    continue
                except FATAL:
                    await self.give_up(sent)
                    raise
                except self.fmt.refused as exc:
                    await self.give_up(sent)
                    self.queue_error(work, self.fmt.failure(work, exc))
                    return True
                self.summary.submitted += 1
                self.wait_s = QUEUE_FULL_WAIT_S[0]
                sent.append(jid)
                break
        self.summary.collected += not sent
        self.inflight[asyncio.ensure_future(self.answers(work, deadlines))] = work
        return True

    async def give_up(self, job_ids: list[str]) -> None:
        self.queued.settled(job_ids)
        for jid in job_ids:
            await self.client.give_up(jid)

    async def answers(self, work: Work, deadlines: list[Deadline]) -> list[tuple[str | None, Any]]:
        async def one(jid: str, deadline: Deadline) -> tuple[str | None, Any]:
            try:
                return await self.client.inbox.take(jid, deadline)
            except Timeout:
                return None, Timeout(f"no answer for job {jid} within {work.timeout:g} s of its submission")
        return list(await asyncio.gather(*(one(j, d) for j, d in zip(work.job_ids, deadlines))))

    def settle(self, future: asyncio.Future) -> None:
        """Write a finished line's answer, then delete its replies from the inbox (only once on disk)."""
        work = self.inflight.pop(future)
        self.queued.settled(work.job_ids)
        if work.error is not None:
            self.write(work.error, False)
            return
        taken = future.result()
        failure = next((o for _, o in taken if isinstance(o, BaseException)), None)
        if failure is not None and self.spec.abandon is not None and getattr(failure, "code", None) == "cancelled":
            self.abandon(work.index, work.line)
        elif failure is not None:
            self.write(self.fmt.failure(work, failure), False)
        else:
            self.write(self.fmt.answer(work, [o for _, o in taken]), True)
        for entry_id, _ in taken:
            if entry_id is not None:
                self.client.inbox.consumed(entry_id)

    def settle_done(self) -> None:
        """Write every finished line that may go now (ordered: from the head, while finished)."""
        for future in list(self.inflight):
            if future.done() and not future.cancelled():
                self.settle(future)
            elif self.fmt.ordered:
                return

    async def drain(self, once: bool = False, wait: float | None = None) -> None:
        """Write finished lines until none is in flight, or (``once``) at least one is written, or ``wait``
        seconds pass; a stop ends it early."""
        while self.inflight and not self.stop.is_set():
            heads = [next(iter(self.inflight))] if self.fmt.ordered else list(self.inflight)
            done, _ = await asyncio.wait([*heads, self.stopper], timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            self.settle_done()
            if once or not done:
                return

    async def drain_stopped(self, deadline: Deadline) -> None:
        """After a stop: write the answers of the lines in flight as they come until ``deadline``."""
        while self.inflight and (left := deadline.left()):
            heads = [next(iter(self.inflight))] if self.fmt.ordered else list(self.inflight)
            await asyncio.wait(heads, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            self.settle_done()

    async def room(self) -> None:
        """Wait while this run's jobs queued unread are what the fleet reads next (producer/bulk/queued.py),
        writing the answers that come meanwhile; a stop ends it."""
        while not self.stop.is_set() and await self.queued.full():
            running = [f for f in self.inflight if not f.done()]
            await asyncio.wait([*running, self.stopper], timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
            self.settle_done()

    async def submit_all(self, chunk: list[Work]) -> None:
        for work in submission_order(chunk, self.spec.window):
            while len(self.inflight) >= self.spec.window and not self.stop.is_set():
                await self.drain(once=True)
            if work.error is None:  # an error line sends nothing
                await self.room()
            if not self.stop.is_set() and await self.submit(work):
                continue
            if self.spec.abandon is not None:
                self.abandon(work.index, work.line)
            else:
                self.left = True

    async def abandon_inflight(self) -> None:
        """Cancel what is in flight; write the answers that still come within the grace, error lines for
        the rest."""
        waiting = [f for f, w in self.inflight.items() if w.error is None and not f.done()]
        for future in waiting:
            for jid in self.inflight[future].job_ids:
                with contextlib.suppress(Exception):  # the job's deadline still bounds it
                    await self.client.cancel(jid)
        if waiting:
            await asyncio.wait(waiting, timeout=CANCEL_GRACE_S)
        for future, work in list(self.inflight.items()):
            if future.done():
                self.settle(future)
                continue
            del self.inflight[future]
            future.cancel()
            await self.give_up(work.job_ids)
            self.abandon(work.index, work.line)

    async def close(self) -> None:
        """The run ends: write what is here; abandon or leave (for the next run) what is not."""
        self.stopper.cancel()
        await asyncio.sleep(0)  # answers already in the inbox reach their waiters
        self.settle_done()
        if self.stop.is_set() and self.spec.abandon is not None:
            await self.abandon_inflight()
        for future in self.inflight:
            future.cancel()  # the inbox keeps the reply: the next run collects it
        self.summary.in_flight = sum(1 for w in self.inflight.values() if w.error is None)
        self.summary.interrupted = self.left or bool(self.inflight)
        if not self.summary.interrupted and self.present:  # every line written: earlier runs' replies are stale
            stale = list(self.present.values())
            with contextlib.suppress(Exception):  # best effort: the inbox's TTL cleans up
                for i in range(0, len(stale), 1000):
                    await self.client.r.xdel(self.client.reply_key, *stale[i:i + 1000])


async def run_lines(client: AsyncClient, lines: Iterable[tuple[int, bytes]], fmt: LineFormat, sink: Sink,
                    spec: Spec, stop: asyncio.Event | None = None, summary: Summary | None = None,
                    progress: Callable[[Summary], None] | None = None) -> Summary:
    """Answer every (line number, raw line) not in ``spec.done`` into ``sink``; ``progress(summary)`` after
    each line written. A line ``fmt.parse`` raises for ends the run with that error (nothing is left half
    written)."""
    stop = stop or asyncio.Event()
    summary = summary or Summary()
    run = _Run(client, fmt, sink, spec, stop, summary, progress)
    try:
        run.present = await inbox_replies(client)
        chunk: list[Work] = []
        for index, raw in lines:
            if index in spec.done:
                continue
            if stop.is_set():
                if spec.abandon is None:
                    run.left = True
                    break
                run.abandon(index, raw)
                continue
            chunk.append(fmt.parse(index, raw))
            if len(chunk) >= spec.window:
                await run.submit_all(chunk)
                chunk = []
        await run.submit_all(chunk)
        if not stop.is_set():
            await run.drain()
        if stop.is_set() and spec.abandon is None:
            await run.drain_stopped(Deadline(spec.drain_s))
    except FATAL as exc:
        summary.error = exc
        run.left = True
        stop.set()
    finally:
        await run.close()
    return summary
