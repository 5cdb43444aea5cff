"""``batchfleet bulk``: a JSONL file of prompts, or of OpenAI Batch API requests, answered line by line by the
producer's bulk runner (producer/bulk.py ``run_file``); resumable, stopped cleanly by Ctrl-C.

It lives in the gateway because the OpenAI format validates lines as the gateway does (pydantic,
gateway/batch_format.py); that is imported only for that format, so a client-only install
(``pip install batchfleet``) runs the prompt format.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import ConnectionConfig
from batchfleet.common.lanes import BATCH
from batchfleet.producer.bulk_lines import PromptFormat, looks_like_batch, numbered
from batchfleet.producer.cli import _params, check_reachable, generation_options, one_line_errors, priority_option

ERRORS_SUFFIX = ".errors.jsonl"


@click.command()
@connection_options
@click.argument("prompts", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", default="-", show_default=True,
              help="JSONL: one line per prompt: {index, id?, result} or {index, id?, error: {code, message}}.")
@click.option("--window", type=int, default=256, show_default=True, help="Max jobs in flight.")
@click.option("--resume/--no-resume", default=None,
              help="Keep the lines already in OUTPUT and collect the answers of jobs an interrupted run left in "
                   "flight (the default when OUTPUT and its run key OUTPUT.run exist); --no-resume starts OUTPUT "
                   "over under a new run key.")
@click.option("--format", "fmt", type=click.Choice(["auto", "prompts", "openai"]), default="auto",
              show_default=True, help="prompts: {prompt, id?, params?} lines; openai: OpenAI Batch API lines "
              "({custom_id, method, url, body}), answered with OpenAI batch output lines; auto: from the "
              "file's first line.")
@click.option("--errors", "errors_path", default=None,
              help="--format openai: where error lines go (default: OUTPUT.errors.jsonl; with OUTPUT '-', "
                   "standard output).")
@click.option("--served-model-name", "model_names", default="",
              help="--format openai: model names the lines may ask for, comma-separated, as the gateway's option "
                   "(default: the fleet's model name); a line asking for another gets a 404 error line.")
@generation_options
@priority_option(BATCH)
@one_line_errors
def bulk(redis_url: str, namespace: str, prompts: str, output: str, window: int, resume: bool | None,
         timeout: float | None, fmt: str, errors_path: str | None, model_names: str, **gen) -> None:
    """Answer every line of a JSONL file ({"prompt": ..., "id"?: ..., params?}, or OpenAI Batch API request
    lines); never aborts on a bad line.

    Ctrl-C stops submitting, writes what has arrived and leaves the jobs in flight to the next run of the
    same command, which resumes. Exit status: 0 every line answered with a result; 3 every line answered,
    some with an error line; 1 the run could not start or stopped (no live worker, Redis unreachable;
    rerun to resume); 130 interrupted (rerun to resume); 2 a usage error."""
    if window < 1:
        raise click.UsageError("--window must be >= 1")
    out_path = None if output == "-" else output
    with _input_file(prompts) as path:
        if fmt == "auto":
            fmt = "openai" if looks_like_batch(_first_line(path)) else "prompts"
        check_reachable(ConnectionConfig(redis_url, namespace))
        if fmt == "openai":
            make = _openai_format(timeout, tuple(n.strip() for n in model_names.split(",") if n.strip()))
            if errors_path is None and out_path is not None:
                errors_path = out_path + ERRORS_SUFFIX
        else:
            defaults = _params(**gen)
            make, errors_path = (lambda prefix, _fleet: PromptFormat(prefix, defaults, timeout)), None
        s = _run(path, out_path, errors_path, make, "requests" if fmt == "openai" else "prompts", redis_url,
                 namespace, window, resume)
    if fmt == "openai":
        click.echo(f"done: {s.done} requests ({s.kept} kept from an earlier run), {s.failed_lines} in the error "
                   "file", err=True)
    else:
        earlier = f" ({s.kept_failed} of them kept from an earlier run)" if s.kept_failed else ""
        click.echo(f"done: {s.total} prompts ({s.kept} kept from an earlier run, {s.collected} collected, "
                   f"{s.submitted} submitted), {s.failed_lines} failed{earlier}", err=True)
    if s.failed_lines:
        sys.exit(3)


@contextmanager
def _input_file(prompts: str) -> Iterator[str]:
    """The input as a file path: standard input ("-") is copied to a temporary file in chunks first, so
    it is read like any file, one line at a time (and counted first, for the progress bar)."""
    if prompts != "-":
        yield prompts
        return
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl") as tmp:
        shutil.copyfileobj(sys.stdin.buffer, tmp)
        tmp.flush()
        yield tmp.name


def _first_line(path: str) -> bytes:
    """The first non-blank line (enough to tell the format), read with bounded memory."""
    with open(path, "rb") as f:
        return next(numbered(f), (0, b""))[1]


def _openai_format(timeout: float | None, model_names: tuple[str, ...]) -> Any:
    try:
        from batchfleet.gateway.batch_format import bulk_format
    except ImportError as exc:  # pydantic: the gateway's validation, installed with the serve extra
        raise click.ClickException(f"--format openai validates lines as the gateway does: pip install "
                                   f"'batchfleet[serve]' ({exc})") from None
    return bulk_format(timeout, model_names)


def _run(path: str, out_path: str | None, errors_path: str | None, make_format: Any, noun: str, redis_url: str,
         namespace: str, window: int, resume: bool | None) -> Any:
    """Run the file with a progress bar (from the first answer on: an error before it stays the only line) and
    Ctrl-C as a clean stop; an interrupted run exits here (130, or 1 when the fleet stopped it)."""
    import asyncio

    from batchfleet.producer.bulk import Summary, run_file

    stop = asyncio.Event()
    bars: list = []

    def progress(s: Summary) -> None:
        if not bars:
            bars.append(click.progressbar(length=s.total, label=noun, show_pos=True, file=sys.stderr))
            bars[0].__enter__()
        bars[0].update(s.done - bars[0].pos)

    ctrl_c = _CtrlC(stop)
    try:
        s = asyncio.run(ctrl_c.run(run_file(path, out_path, errors_path, make_format, redis_url=redis_url,
                                            namespace=namespace, window=window, resume=resume, stop=stop,
                                            progress=progress, out=sys.stdout)))
    finally:
        if bars:
            bars[0].__exit__(None, None, None)
    if s.interrupted:  # our handler stays: a Ctrl-C racing this exit must not turn it into a traceback
        why = "interrupted" if s.error is None else f"stopped ({' '.join(str(s.error).split())})"
        click.echo(f"{why}: {s.done} of {s.total} lines written, {s.in_flight} jobs left in flight; run the "
                   "same command again to resume", err=True)
        sys.exit(130 if s.error is None else 1)
    ctrl_c.restore()
    return s


class _CtrlC:
    """While a bulk run runs: the first Ctrl-C sets ``stop`` (a clean stop, also right after the run ended:
    then it changes nothing); a second one ends the process at once. The handler stays installed until
    ``restore()``, so a Ctrl-C racing an interrupted run's exit never becomes a traceback."""

    def __init__(self, stop: Any) -> None:
        import signal
        import threading

        self.stop, self.loop, self.presses = stop, None, 0
        self.main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
        self.previous = signal.signal(signal.SIGINT, self._pressed) if self.main else None

    def _pressed(self, signum: int, frame: object) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stop.set)

    async def run(self, coro: Any) -> Any:
        import asyncio

        self.loop = asyncio.get_running_loop()
        return await coro

    def restore(self) -> None:
        import signal

        if self.main:
            signal.signal(signal.SIGINT, self.previous)
