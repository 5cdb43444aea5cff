"""Resumable bulk runs over files: a JSONL input in, one JSONL answer line per input line out.

``run_file`` is the one file-level run of ``batchfleet bulk`` (both formats) and the RQ ``bulk`` job: it names
the run from the key kept beside the output (producer/bulk_files.py), reads back the lines already written,
and runs the rest (producer/bulk_jobs.py says why every line then appears exactly once). ``bulk_file`` runs
the prompt format (producer/bulk_lines.py); the OpenAI batch format comes from the gateway
(gateway/batch_format.py), which passes its ``LineFormat`` in: the producer imports nothing of the gateway.
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from batchfleet.common.errors import InvalidRequest
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk_files import FileSink, Written, read_back, run_names
from batchfleet.producer.bulk_jobs import run_lines
from batchfleet.producer.bulk_lines import PromptFormat, numbered
from batchfleet.producer.bulk_types import LineFormat, Spec, Summary

__all__ = ["Summary", "bulk_file", "run_file", "throttled"]


@contextmanager
def _input(path: str | None, text: str | None) -> Iterator[IO[bytes]]:
    if text is not None:
        yield io.BytesIO(text.encode())
        return
    assert path is not None
    with open(path, "rb") as f:
        yield f


async def run_file(input_path: str | None, output_path: str | None, errors_path: str | None,
                   make_format: Callable[[str, Any], LineFormat], *, redis_url: str | None = None,
                   namespace: str | None = None, window: int = 256, resume: bool | None = None,
                   stop: asyncio.Event | None = None, progress: Callable[[Summary], None] | None = None,
                   text: str | None = None, out: IO[str] | None = None) -> Summary:
    """Run ``input_path`` (``text`` instead of reading it) into ``output_path`` (None: ``out``), error lines
    into ``errors_path`` (None: the output). ``make_format(job id prefix, fleet view)`` gives the lines' format.

    ``resume`` None: resume when the output and its run key exist; False: start the output over (a new run
    key). Raises NoWorkers / RedisUnavailable when the run cannot start; once started it stops instead
    (``Summary.error``): what is written stays, and a rerun resumes."""
    if window < 1:
        raise InvalidRequest("window must be >= 1")
    client = AsyncClient(redis_url, namespace, inbox=None)
    try:
        fleet = await client.fleet()  # reachable, and a fleet to ask: before any file is touched
    finally:
        await client.aclose()
    names, resuming = run_names(output_path, resume is not False)
    fmt = make_format(names.prefix, fleet)
    separate = errors_path not in (None, output_path)
    kept = Written()
    if resuming:
        read_back(output_path, fmt, kept)
        if separate:
            read_back(errors_path, fmt, kept)
    with _input(input_path, text) as f:
        total = sum(1 for _ in numbered(f))  # the progress bar's length: one streaming pass
    summary = Summary(total=total, kept=kept.lines, kept_failed=kept.failed)
    mode = "a" if resuming else "w"
    opened: list[IO[str]] = []
    client = AsyncClient(redis_url, namespace, inbox=names.inbox)
    try:
        if output_path is not None:
            out = open(output_path, mode, encoding="utf-8")
            opened.append(out)
        assert out is not None
        err = out
        if separate:
            assert errors_path is not None
            err = open(errors_path, mode, encoding="utf-8")
            opened.append(err)
        with _input(input_path, text) as f:
            return await run_lines(client, numbered(f), fmt, FileSink(out, err), Spec(window, kept.done), stop,
                                   summary, progress)
    finally:
        for opened_file in opened:
            opened_file.close()
        await client.aclose()


async def bulk_file(input_path: str | None, output_path: str | None, *, redis_url: str | None = None,
                    namespace: str | None = None, window: int = 256, defaults: dict | None = None,
                    timeout: float | None = None, resume: bool | None = None, stop: asyncio.Event | None = None,
                    progress: Callable[[Summary], None] | None = None, text: str | None = None,
                    out: IO[str] | None = None) -> Summary:
    """Run a prompt file into ``output_path`` (``run_file``): answers in submission order, at most ``window``
    jobs in flight, in the batch class unless ``defaults`` says otherwise."""
    return await run_file(input_path, output_path, None,
                          lambda prefix, _fleet: PromptFormat(prefix, dict(defaults or {}), timeout),
                          redis_url=redis_url, namespace=namespace, window=window, resume=resume, stop=stop,
                          progress=progress, text=text, out=out)


def throttled(fn: Callable[[Summary], None], every_s: float) -> Callable[[Summary], None]:
    """``fn`` at most every ``every_s`` seconds, and for the last line."""
    last = [0.0]

    def call(s: Summary) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or s.done >= s.total:
            last[0] = now
            fn(s)
    return call
