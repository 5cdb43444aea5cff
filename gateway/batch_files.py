"""Output and error files of an OpenAI batch run, and ``batchfleet bulk --format openai`` over them.

Both files are appended to, one flushed line per answer; a run reads them back (``written``) to know which
input lines are answered, cutting off a partial last line a kill left.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from batchfleet.gateway.batch_lines import Limits, numbered, written_index
from batchfleet.gateway.batch_run import Outcome, Sink, Spec, run_lines
from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk_input import run_names

BULK_TIMEOUT_S = 24 * 3600.0  # a bulk line's deadline without --timeout: OpenAI's completion window
ERRORS_SUFFIX = ".errors.jsonl"


class FileSink(Sink):
    """Appends output lines to one file and error lines to another (the same file is fine); ``written(ok)``
    after each line."""

    def __init__(self, output: IO[str], errors: IO[str], written: Callable[[bool], None] | None = None) -> None:
        self.output, self.errors, self.written = output, errors, written

    def write(self, line: dict[str, Any], ok: bool) -> None:
        f = self.output if ok else self.errors
        f.write(json.dumps(line) + "\n")
        f.flush()
        if self.written is not None:  # once the line is on disk
            self.written(ok)


def written(path: str | None, prefix: str) -> tuple[set[int], int]:
    """(input line numbers answered in ``path``, how many lines that is); a partial last line is cut off."""
    done: set[int] = set()
    if path is None or not os.path.exists(path):
        return done, 0
    lines = 0
    with open(path, "rb+") as f:
        keep = 0
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            keep += len(raw)
            try:
                index = written_index(json.loads(raw), prefix)
            except ValueError:
                continue
            if index is not None and index not in done:
                done.add(index)
                lines += 1
        f.truncate(keep)
    return done, lines


def input_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """The input's non-blank lines, read one at a time (a 200 MB file is never held whole)."""
    with open(path, "rb") as f:
        yield from numbered(f)


@dataclass
class BulkOutcome:
    """A bulk run over an OpenAI batch file: this run's outcome, and the lines already written before."""

    outcome: Outcome
    kept_ok: int
    kept_failed: int

    @property
    def failed(self) -> int:
        return self.kept_failed + self.outcome.failed


async def bulk_openai(input_path: str, output_path: str | None, errors_path: str | None, *,
                      redis_url: str | None = None, namespace: str | None = None, window: int = 256,
                      timeout: float | None = None, resume: bool | None = None, chat_max_tokens: int = 256,
                      stop: asyncio.Event | None = None, model_names: tuple[str, ...] = (),
                      progress: Callable[[int], None] | None = None) -> BulkOutcome:
    """Answer an OpenAI batch input file into OpenAI batch output lines (``output_path``, None: stdout) and
    error lines (``errors_path``; None: ``<output>.errors.jsonl``, or stdout with the output). Resumes like
    ``bulk_file`` (the run key beside the output). ``progress(lines written so far, kept ones included)``
    after each line."""
    if errors_path is None and output_path is not None:
        errors_path = output_path + ERRORS_SUFFIX
    names, resuming = run_names(output_path, resume is not False)
    prefix = names.prefix
    kept_ok, n_ok = written(output_path, prefix) if resuming else (set(), 0)
    kept_err, n_err = (written(errors_path, prefix) if resuming and errors_path != output_path else (set(), 0))
    mode = "a" if resuming else "w"
    client = AsyncClient(redis_url, namespace, inbox=names.inbox)
    out = open(output_path, mode, encoding="utf-8") if output_path else sys.stdout
    err = out if errors_path in (None, output_path) else open(errors_path, mode, encoding="utf-8")
    try:
        fleet = await client.fleet()
        spec = Spec(prefix=prefix, limits=Limits(timeout or BULK_TIMEOUT_S, chat_max_tokens),
                    model_names=model_names or (fleet.info.model,), window=window)
        lines_written = itertools.count(n_ok + n_err + 1)  # kept lines count towards the progress
        sink = FileSink(out, err, None if progress is None else lambda ok: progress(next(lines_written)))
        outcome = await run_lines(client, input_lines(input_path), kept_ok | kept_err, sink, spec, stop)
    finally:
        for f in {out, err} - {sys.stdout}:
            f.close()
        await client.aclose()
    return BulkOutcome(outcome, n_ok, n_err)
