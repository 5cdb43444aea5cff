"""Pipelined bulk submission: a bounded in-flight window, results written in input order.

A failed prompt (bad line, too long, worker error) becomes one error line; the run never aborts.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import IO

from batchfleet.common.errors import BatchfleetError
from batchfleet.producer.client import Client

PARAM_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def read_jsonl(stream: IO[str]) -> Iterator[tuple[int, dict | Exception]]:
    """(index, object) per non-empty line; a line that is not a JSON object yields its error instead."""
    index = 0
    for line in stream:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError('each line must be a JSON object with a "prompt" (or a JSON string)')
            yield index, obj
        except ValueError as exc:
            yield index, exc
        index += 1


def run_bulk(client: Client, items: Iterable[tuple[int, dict | Exception]], window: int,
             defaults: dict, timeout: float | None) -> Iterator[dict]:
    """Yield one output object per input item, in input order, keeping <= window jobs in flight."""
    inflight: deque[tuple[int, dict, str | BaseException]] = deque()

    def finish(index: int, obj: dict, job: str | BaseException) -> dict:
        out: dict = {"index": index}
        if "id" in obj:
            out["id"] = obj["id"]
        if isinstance(job, BaseException):
            out["error"] = {"code": getattr(job, "code", type(job).__name__), "message": str(job)}
            return out
        try:
            out["result"] = asdict(client.result(job, timeout=timeout))
        except BatchfleetError as exc:
            out["error"] = {"code": getattr(exc, "code", type(exc).__name__), "message": str(exc)}
        return out

    for index, obj in items:
        if isinstance(obj, Exception):
            inflight.append((index, {}, obj))
        else:
            params = {**defaults, **{k: obj[k] for k in PARAM_KEYS if k in obj}}
            try:
                job: str | BaseException = client.submit(obj["prompt"], timeout=timeout, **params)
            except (BatchfleetError, ValueError, TypeError) as exc:
                job = exc
            inflight.append((index, obj, job))
        while len(inflight) >= window:
            yield finish(*inflight.popleft())
    while inflight:
        yield finish(*inflight.popleft())
