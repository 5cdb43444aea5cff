"""Helpers shared by the gateway tests (no tests here): the gateway on uvicorn in a thread, reading
server-sent events, a stats read that tolerates the worker thread changing the engine meanwhile."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from batchfleet.common.config import ConnectionConfig
from batchfleet.gateway.app import create_app
from batchfleet.gateway.config import GatewayConfig


class GatewayThread:
    """``create_app`` served by uvicorn on a free port, in a thread with its own event loop (``run``
    executes a coroutine on that loop, e.g. to measure how long the loop stalls)."""

    def __init__(self, redis_url: str, namespace: str, port: int = 0, **config: Any) -> None:
        self.config = GatewayConfig(connection=ConnectionConfig(redis_url=redis_url, namespace=namespace), **config)
        self.app = create_app(self.config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # 0: the kernel picks the port, no race with other tests
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=5))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve([sock]),),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.01)

    @property
    def gateway(self):
        return self.app.state.gateway

    def run(self, coro, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "gateway thread did not stop"
        self.loop.close()


@contextmanager
def gateways(redis_url: str, namespace: str) -> Iterator:
    """``start(**GatewayConfig fields) -> GatewayThread`` on the test namespace; all stopped at the end."""
    started: list[GatewayThread] = []

    def start(**config: Any) -> GatewayThread:
        started.append(GatewayThread(redis_url, namespace, **config))
        return started[-1]

    try:
        yield start
    finally:
        for g in started:
            g.stop()


def parse_events(lines: list[str]) -> list[Any]:
    """The ``data:`` payloads of an event stream: decoded JSON, or the string ``[DONE]``."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def stream_events(http: httpx.AsyncClient, path: str, body: dict, **kw: Any) -> list[Any]:
    """POST a streamed request and read its whole event stream."""
    async with http.stream("POST", path, json={**body, "stream": True}, **kw) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return parse_events([line async for line in resp.aiter_lines()])


def joined_text(events: list[Any]) -> str:
    """The text of a completion's stream (completions: ``text``; chat: ``delta.content``)."""
    parts = []
    for ev in events:
        if isinstance(ev, dict) and ev.get("choices"):
            choice = ev["choices"][0]
            parts.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return "".join(parts)


def engine_stats(worker) -> dict[str, Any]:
    """engine.stats() of a worker running in another thread (a set it iterates may change meanwhile)."""
    for _ in range(100):
        try:
            return worker.loop.engine.stats()
        except RuntimeError:  # "changed size during iteration": read again
            time.sleep(0.001)
    raise AssertionError("engine stats never readable")


async def loop_lag(stop: threading.Event, every_s: float = 0.005) -> float:
    """Run on the gateway's loop: the longest a ``sleep(every_s)`` overslept until ``stop`` (a blocked loop
    shows up here directly, without the network or Redis in between)."""
    worst = 0.0
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.sleep(every_s)
        worst = max(worst, time.monotonic() - t0 - every_s)
    return worst
