"""Streamed generation on the client side: the text deltas of one job, then its Result.

``AsyncTokenStream`` submits lazily (on ``await``, ``async with``, ``start()`` or the first iteration),
yields ``Delta`` objects whose texts concatenate exactly to ``result.text``, and cancels the job when it
is closed before the end. A job re-run after a worker failure streams again from its start: deltas are
placed by their ``offset``, so text already yielded is never yielded twice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from batchfleet.common.errors import Timeout
from batchfleet.common.wire.protocol import Delta, Result
from batchfleet.producer.ask import Ask
from batchfleet.producer.core import Deadline, Prompt
from batchfleet.producer.inbox import Inbox
from batchfleet.producer.outgoing import Outgoing

log = logging.getLogger("producer")


class _Submitter(Protocol):
    """What a stream needs of its client (AsyncClient): submitting, its inbox, cancelling."""

    inbox: Inbox

    async def _submit(self, prompt: Prompt, deadline: Deadline, job_id: str | None, stream: bool,
                      ask: Ask) -> Outgoing: ...

    async def cancel(self, job_id: str, timeout: float | None = 5.0) -> None: ...


class AsyncTokenStream:
    """``async for delta in client.stream(prompt)``; ``.result`` once exhausted; ``aclose()`` cancels."""

    def __init__(self, client: _Submitter, prompt: Prompt, timeout: float | None, job_id: str | None,
                 ask: Ask) -> None:
        self._client = client
        self._prompt = prompt
        self._ask = ask
        self._deadline = Deadline(timeout)
        self.job_id: str | None = job_id
        self.result: Result | None = None
        self.text = ""  # yielded so far
        self._tokens = 0
        self._started = False
        self._closed = False

    async def start(self) -> AsyncTokenStream:
        """Submit the job (once); raises what ``submit`` raises (PromptTooLong, QueueFull, NoWorkers...)."""
        if not self._started:
            self._started = True
            job = await self._client._submit(self._prompt, self._deadline, self.job_id, True, self._ask)
            self.job_id = job.id
        return self

    def __await__(self):
        return self.start().__await__()

    async def __aenter__(self) -> AsyncTokenStream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> Delta:
        await self.start()
        assert self.job_id is not None
        if self._closed:
            raise StopAsyncIteration
        waiter = self._client.inbox.waiter(self.job_id)
        assert waiter.deltas is not None
        while True:
            try:
                item = await _within(waiter.deltas.get(), self._deadline)
            except Timeout:
                raise Timeout(f"job {self.job_id} did not finish within {self._deadline.timeout} s") from None
            if item is None:  # the final reply has come
                self._closed = True  # answered: nothing to cancel any more, whatever it says
                last = self._finish(await self._client.inbox.final(self.job_id, self._deadline))
                if not last.text and not last.token_ids:
                    raise StopAsyncIteration
                return last
            fresh = self._fresh(item)
            if fresh is not None:
                return fresh

    def _fresh(self, d: Delta) -> Delta | None:
        """The part of ``d`` not yielded yet (None when there is none: a repeat, or a gap)."""
        if d.offset > len(self.text) or d.offset + len(d.text) <= len(self.text):
            return None
        text = d.text[len(self.text) - d.offset:]
        self.text += text
        self._tokens += len(d.token_ids)
        return Delta(d.id, d.seq, d.offset + len(d.text) - len(text), text, list(d.token_ids), d.logprobs)

    def _finish(self, result: Result) -> Delta:
        """Keep the Result; the rest of its text is the last delta (or the iteration ends)."""
        self.result = result
        if not result.text.startswith(self.text):  # a re-run that sampled differently (unseeded)
            log.warning("job %s: streamed text is not a prefix of the final text", result.id)
            return Delta(result.id, -1, len(self.text), "", [])
        rest = result.text[len(self.text):]
        logprobs = None if result.logprobs is None else result.logprobs[self._tokens:]
        delta = Delta(result.id, -1, len(self.text), rest, list(result.token_ids[self._tokens:]), logprobs)
        self.text = result.text
        return delta

    async def aclose(self) -> None:
        """Stop: a job not finished yet is cancelled (its reply is dropped when it comes)."""
        if self._closed:
            return
        self._closed = True
        if self.job_id is not None and self.result is None and self._started:
            self._client.inbox.abandon(self.job_id)
            try:
                await self._client.cancel(self.job_id)
            except Exception as exc:  # best effort: the job then runs to its end and its reply expires
                log.warning("could not cancel job %s: %r", self.job_id, exc)


async def _within(aw, deadline: Deadline):
    """``await aw`` within the deadline. Not ``asyncio.wait_for``: before Python 3.12 it returns the
    result and swallows a cancellation that arrives as ``aw`` completes, so a stream whose client left
    at that instant went on to the end of its job instead of cancelling it."""
    try:
        async with asyncio.timeout(deadline.left()):
            return await aw
    except TimeoutError:
        raise Timeout("deadline passed") from None
