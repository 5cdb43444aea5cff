"""Resumable bulk runs over files: a JSONL input in, one JSONL answer line per input line out.

``run_file`` is the one file-level run of ``batchfleet bulk`` (both formats) and the RQ ``bulk`` job: it names
the run from the key kept beside the output (producer/bulk/files.py), reads back the lines already written,
and runs the rest (producer/bulk/runner.py says why every line then appears exactly once). ``bulk_file`` runs
the prompt format (producer/bulk/lines.py); the OpenAI batch format comes from the gateway
(gateway/batches/format.py), which passes its ``LineFormat`` in: the producer imports nothing of the gateway.
"""

from __future__ import annotations

import asyncio
import io
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import IO, Any

from batchfleet.common.errors import InvalidRequest
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk.files import KEY_SUFFIX, FileSink, Written, read_back, run_record
from batchfleet.producer.bulk.lines import PromptFormat, numbered, prompt_params
from batchfleet.producer.bulk.lock import OutputLock
from batchfleet.producer.bulk.registry import RunReporter, run_priority
from batchfleet.producer.bulk.runner import run_lines
from batchfleet.producer.bulk.work import LineFormat, Spec, Summary

__all__ = ["Summary", "bulk_file", "run_file", "throttled"]


class Fingerprints:
    """Every input line's fingerprint (the format's ``sha``: what the line asks), 8 bytes a line: what a rerun
    checks written lines against (10 million lines: 80 MB)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.total = 0  # non-blank lines

    def add(self, index: int, sha: str) -> None:
        self.data.extend(bytes(8 * index + 8 - len(self.data)))
        self.data[8 * index:8 * index + 8] = bytes.fromhex(sha)
        self.total += 1

    def get(self, index: int) -> str | None:
        chunk = self.data[8 * index:8 * index + 8]
        return chunk.hex() if len(chunk) == 8 and any(chunk) else None


def verdict(prints: Fingerprints, retry_errors: bool) -> Callable[[int, str | None, bool], str | None]:
    """Why a written line is dropped on resume: its input line changed (or is gone), or it is an error line
    to retry."""
    def why(index: int, sha: str | None, failed: bool) -> str | None:
        if sha is None or prints.get(index) != sha:
            return "changed"
        return "retry" if retry_errors and failed else None
    return why


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
                   text: str | None = None, out: IO[str] | None = None, params: dict[str, Any] | None = None,
                   retry_errors: bool = False, drain_s: float = 0.0, tenant: str = "") -> Summary:
    """Run ``input_path`` (``text`` instead of reading it) into ``output_path`` (None: ``out``), error lines
    into ``errors_path`` (None: the output). ``make_format(job id prefix, fleet view)`` gives the lines' format.

    One run per output at a time: another run writing ``output_path`` now raises OutputBusy before anything is
    read or written (producer/bulk/lock.py). ``resume`` None: resume when the output and its run record exist;
    False: start the output over (a new run key). ``params``: the run's parameters (JSON values), kept in the
    record: a resumed run with others raises RunChanged. A resumed run keeps only the answers whose input line
    is unchanged (``retry_errors``: and drops the error lines), and runs the others again. Raises NoWorkers /
    RedisUnavailable when the run cannot start; once started it stops instead (``Summary.error``): what is
    written stays, a rerun resumes. ``stop`` set: ``Spec.drain_s`` (``drain_s``) bounds the wait for the
    answers of the lines in flight. ``tenant``: on whose account every line runs (its limits: a line over one
    waits until it fits, never fails for it). The run reports its progress to the fleet's bulk-run registry
    (producer/bulk/registry.py) as it goes."""
    if window < 1:
        raise InvalidRequest("window must be >= 1")
    if drain_s < 0:
        raise InvalidRequest("drain_s must be >= 0")
    client = AsyncClient(redis_url, namespace, inbox=None, tenant=tenant)
    try:
        fleet = await client.fleet()  # reachable, and a fleet to ask: before any file is touched
    finally:
        await client.aclose()
    with ExitStack() as held:
        if output_path is not None:  # before the run record is read or written: the other run's it may be
            held.enter_context(OutputLock(output_path))
        return await _locked_run(input_path, output_path, errors_path, make_format, fleet, redis_url=redis_url,
                                 namespace=namespace, window=window, resume=resume, stop=stop, progress=progress,
                                 text=text, out=out, params=params, retry_errors=retry_errors, drain_s=drain_s,
                                 tenant=tenant)


async def _locked_run(input_path: str | None, output_path: str | None, errors_path: str | None,
                      make_format: Callable[[str, Any], LineFormat], fleet: Any, *, redis_url: str | None,
                      namespace: str | None, window: int, resume: bool | None, stop: asyncio.Event | None,
                      progress: Callable[[Summary], None] | None, text: str | None, out: IO[str] | None,
                      params: dict[str, Any] | None, retry_errors: bool, drain_s: float, tenant: str = "") -> Summary:
    """``run_file`` once the output is this run's alone."""
    record, resuming = run_record(output_path, resume is not False, params)
    names = record.names
    fmt = make_format(names.prefix, fleet)
    prints = Fingerprints()
    with _input(input_path, text) as f:
        for index, raw in numbered(f):  # the progress bar's length and the lines' fingerprints: one pass
            prints.add(index, fmt.sha(raw))
    separate = errors_path not in (None, output_path)
    kept = Written()
    if resuming:
        check = verdict(prints, retry_errors)
        read_back(output_path, fmt, kept, check)
        if separate:
            read_back(errors_path, fmt, kept, check)
        if kept.dropped:  # the dropped lines run again under tags of their own, kept before any is submitted
            record.fresh.update({i: secrets.token_hex(4) for i in kept.dropped})
            assert output_path is not None
            record.save(output_path + KEY_SUFFIX)
    summary = Summary(total=prints.total, kept=kept.lines, kept_failed=kept.failed, codes=kept.codes,
                      changed=sum(w == "changed" for w in kept.dropped.values()),
                      retried=sum(w == "retry" for w in kept.dropped.values()))
    mode = "a" if resuming else "w"
    opened: list[IO[str]] = []
    client = AsyncClient(redis_url, namespace, inbox=names.inbox, tenant=tenant)
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
        reporter = RunReporter(client.r, client.keys, names.prefix, input_path, output_path, summary,
                               run_priority(params))
        finished = asyncio.Event()
        reporting = asyncio.ensure_future(reporter.every(finished))
        try:
            with _input(input_path, text) as f:
                spec = Spec(window, kept.done, fresh={i: t for i, t in record.fresh.items() if i not in kept.done},
                            drain_s=drain_s)
                return await run_lines(client, numbered(f), fmt, FileSink(out, err), spec, stop, summary, progress)
        finally:
            finished.set()
            await asyncio.wait([reporting])  # its last write ends; wait raises nothing
            await reporter.report(reporter.final_state())
    finally:
        for opened_file in opened:
            opened_file.close()
        await client.aclose()


async def bulk_file(input_path: str | None, output_path: str | None, *, redis_url: str | None = None,
                    namespace: str | None = None, window: int = 256, defaults: dict | None = None,
                    timeout: float | None = None, resume: bool | None = None, stop: asyncio.Event | None = None,
                    progress: Callable[[Summary], None] | None = None, text: str | None = None,
                    out: IO[str] | None = None, plain: bool = False, retry_errors: bool = False,
                    tenant: str = "") -> Summary:
    """Run a prompt file into ``output_path`` (``run_file``): answers in submission order, at most ``window``
    jobs in flight, at background priority unless ``defaults`` says otherwise; ``plain``: a plain-text file, one
    prompt per line; ``tenant``: on whose account."""
    return await run_file(input_path, output_path, None,
                          lambda prefix, _fleet: PromptFormat(prefix, dict(defaults or {}), timeout, plain),
                          redis_url=redis_url, namespace=namespace, window=window, resume=resume, stop=stop,
                          progress=progress, text=text, out=out, retry_errors=retry_errors,
                          params=prompt_params(defaults, timeout, plain), tenant=tenant)



def throttled(fn: Callable[[Summary], None], every_s: float) -> Callable[[Summary], None]:
    """``fn`` at most every ``every_s`` seconds, and for the last line."""
    last = [0.0]

    def call(s: Summary) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or s.done >= s.total:
            last[0] = now
            fn(s)
    return call
