"""Server-sent events: an ASGI response that stops (and runs its cleanup) as soon as the client goes
away, and the events of one streamed job.

Why not Starlette's StreamingResponse: whether and when it notices a disconnect depends on the server's
ASGI version (2.4 servers are only noticed at the next write, and a queued job writes nothing for a
while). Here a watcher waits on ``receive()`` for ``http.disconnect`` whatever the server, so a closed
browser tab cancels its job at once, not at its next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.responses import Response

from batchfleet.gateway.errors import api_error
from batchfleet.gateway.openai.chat.format import FINISH_REASONS, Shape
from batchfleet.gateway.openai.tools.calling import ToolStream

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]  # proxies (nginx) must not buffer a stream


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the client has gone (the request body was already read, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """ASGI response sending ``events`` as they come; a client that disconnects stops the iteration
    (the generator's ``finally`` then releases what it holds, e.g. cancels the job)."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        # no super().__init__: it would render a body; these are the fields frameworks read
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = HEADERS + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.gone = False  # the client disconnected: the pump stops at its next event whatever happens

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            self.gone = watch.done()
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if self.background is not None:
            await self.background()

    async def _pump(self, send: Callable) -> None:
        try:
            async for chunk in self.events:
                if self.gone:  # a cancellation lost in a race (see _within in producer/stream.py) ends here
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.events.aclose()  # a generator cancelled at a yield still runs its cleanup


async def job_events(streams: Sequence[Any], shape: Shape) -> AsyncIterator[bytes]:
    """The events of one streamed request: its choices' streams (AsyncTokenStreams, one per choice),
    chunks as deltas arrive (each choice's in order, choices interleaved), each choice's finish chunk, the
    usage chunk when asked, ``[DONE]``. A job that fails once the stream has started sends an error event,
    then ``[DONE]``. However the iteration ends (finished, failed, client gone), every stream is closed,
    which cancels the jobs still running."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: Any) -> None:
        try:
            async for delta in stream:
                await arrivals.put((index, delta, None))
            await arrivals.put((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which answers with an error event
            await arrivals.put((index, None, exc))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        try:
            if shape.chat:
                for i in range(len(streams)):
                    yield event(shape.chunk("", index=i, first=True))
            elif shape.echo:  # as vLLM's: the prompt's text first
                for i in range(len(streams)):
                    yield event(shape.chunk(shape.echo, index=i))
            sent = [0] * len(streams)  # characters of each choice sent so far
            readers = [shape.tool_stream() for _ in streams]  # tool calls read from each choice's text
            left = len(streams)
            while left:
                i, delta, exc = await arrivals.get()
                if exc is not None:
                    raise exc
                if delta is None:
                    left -= 1
                    for chunk in _last_chunks(shape, i, streams[i].result, readers[i]):
                        yield event(chunk)
                    continue
                logprobs = shape.logprobs(delta.token_ids, delta.logprobs, sent[i])
                text = delta.text if readers[i] is None else readers[i].feed(delta.text)
                if text or (logprobs is not None and delta.token_ids):
                    yield event(shape.chunk(text, index=i, logprobs=logprobs))
                sent[i] += len(delta.text)
            if shape.include_usage:
                yield event(shape.usage_chunk([s.result for s in streams]))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the error event OpenAI clients raise
            err = api_error(exc, shape.guide_param)
            if err.status >= 500 and err.code not in ("timeout", "deadline_exceeded"):
                log.warning("stream %s failed: %s", shape.id, exc)
            yield event(err.body())
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        # shielded: when the client went away this task is being cancelled, and the cancels must still go out
        await asyncio.shield(_close(pumps, streams))


def _last_chunks(shape: Shape, index: int, result: Any, reader: ToolStream | None) -> list[dict[str, Any]]:
    """A finished choice's last chunks: what its tool-call reader held (content or tool-call deltas), then
    the chunk with the finish reason."""
    if reader is None:
        return [shape.chunk("", index=index, result=result)]
    reason = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
    text, calls = reader.finish(cut=reason == "length")
    out = [shape.chunk(text, index=index)] if text else []
    out += [shape.chunk("", index=index, tool_calls=[call]) for call in calls]
    finish = shape.tools.finish(reason, bool(calls))
    return out + [shape.chunk("", index=index, result=result, finish=finish)]


async def _close(pumps: list[asyncio.Future], streams: Sequence[Any]) -> None:
    """Wait for the cancelled pumps, then close every stream (cancelling the jobs still running)."""
    await asyncio.gather(*pumps, return_exceptions=True)
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
