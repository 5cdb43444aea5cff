"""``batchfleet bulk``: a file of prompts (JSON lines or plain text), or of OpenAI Batch API requests, answered
line by line by the producer's bulk runner (producer/bulk/file_run.py ``run_file``); resumable, checked against its
input on resume, stopped cleanly by Ctrl-C or SIGTERM (gateway/cli/bulk_progress.py).

It lives in the gateway because the OpenAI format validates lines as the gateway does (pydantic,
gateway/batches/format.py); that is imported only for that format, so a client-only install
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
from batchfleet.common.keys import TENANT_MAX_CHARS, valid_tenant
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.gateway.cli.bulk_progress import CLOSE_S, DRAIN_S, run_stoppable
from batchfleet.producer.bulk.lines import PromptFormat, looks_like_batch, numbered, prompt_params
from batchfleet.producer.bulk.report import why_failed
from batchfleet.producer.cli import _params, check_reachable, generation_options, one_line_errors, priority_option

ERRORS_SUFFIX = ".errors.jsonl"
NOUNS = {"openai": "requests", "prompts": "prompts", "text": "prompts"}


@click.command()
@connection_options
@click.argument("prompts", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("-o", "--output", default="-", show_default=True,
              help="JSONL: one line per prompt: {index, id?, input_sha256, result} or {index, id?, input_sha256, "
                   "error: {code, message}}.")
@click.option("--window", type=int, default=256, show_default=True, help="Max jobs in flight.")
@click.option("--resume/--no-resume", default=None,
              help="Keep the answers already in OUTPUT whose input line is unchanged and collect the answers of "
                   "jobs an interrupted run left in flight (the default when OUTPUT and its run record "
                   "OUTPUT.run exist); --no-resume starts OUTPUT over under a new run key.")
@click.option("--retry-errors", is_flag=True, help="On resume, run the error lines of OUTPUT (and of --errors) "
              "again.")
@click.option("--format", "fmt", type=click.Choice(["auto", "prompts", "text", "openai"]), default="auto",
              show_default=True, help="prompts: {prompt, id?, params?} JSON lines; text: plain text, one prompt "
              "per line; openai: OpenAI Batch API lines ({custom_id, method, url, body}), answered with OpenAI "
              "batch output lines; auto: from the file's first line (not JSON: text, with a note).")
@click.option("--errors", "errors_path", default=None,
              help="--format openai: where error lines go (default: OUTPUT.errors.jsonl; with OUTPUT '-', "
                   "standard output).")
@click.option("--served-model-name", "model_names", default="",
              help="--format openai: model names the lines may ask for, comma-separated, as the gateway's option "
                   "(default: the fleet's model name); a line asking for another gets a 404 error line.")
@click.option("--model-alias-any", is_flag=True, help="--format openai: answer a line whatever model it names, "
              "with the served model (scripts written for OpenAI's models).")
@click.option("--progress-every", type=float, default=10.0, show_default=True,
              help="Seconds between progress lines when standard error is not a terminal (a terminal gets a bar).")
@click.option("--drain-timeout", "drain_s", type=click.FloatRange(min=0), default=DRAIN_S, show_default=True,
              help="After Ctrl-C or SIGTERM: seconds the answers of the lines in flight are still written as they "
                   "come (nothing more is submitted); the rest is left to the next run. The process ends at most "
                   f"{CLOSE_S:g} s later whatever it waits on; a second signal ends it at once.")
@click.option("--tenant", default="", envvar="BATCHFLEET_TENANT", show_envvar=True,
              help="Run every line on this tenant's account (docs/TENANTS.md): its weight and limits; a line over "
                   "a limit waits until it fits. Default: the default tenant.")
@generation_options
@priority_option(BACKGROUND)
@one_line_errors
def bulk(redis_url: str, namespace: str, prompts: str, output: str, window: int, resume: bool | None,
         retry_errors: bool, timeout: float | None, fmt: str, errors_path: str | None, model_names: str,
         model_alias_any: bool, progress_every: float, drain_s: float, tenant: str, **gen) -> None:
    """Answer every line of a prompts file (JSON lines {"prompt": ..., "id"?: ..., params?}, plain text, or
    OpenAI Batch API request lines); never aborts on a bad line.

    A rerun on the same OUTPUT resumes: answers whose input line is unchanged are kept, changed lines are
    answered again; other run parameters are refused (--no-resume starts over). One run per OUTPUT at a
    time: a second one is refused (OUTPUT.lock). Ctrl-C or SIGTERM stops submitting, writes the answers of
    the lines in flight that come within --drain-timeout and leaves the rest to the next run of the same
    command. Exit status: 0 every line answered with a result; 3 every line answered, some with an error
    line; 1 the run could not start (another run writes OUTPUT, no live worker, Redis unreachable) or
    stopped (rerun to resume); 130 interrupted by Ctrl-C, 143 by SIGTERM (rerun to resume); 2 a usage error
    (also: the run's parameters changed)."""
    from batchfleet.producer.bulk.files import RunChanged
    from batchfleet.producer.bulk.lock import OutputBusy

    if window < 1:
        raise click.UsageError("--window must be >= 1")
    if tenant and not valid_tenant(tenant):
        raise click.UsageError(f"--tenant must be 1-{TENANT_MAX_CHARS} chars of [a-z0-9_-]")
    out_path = None if output == "-" else output
    with _input_file(prompts) as path:
        if fmt == "auto":
            fmt = detect(_first_line(path))
            if fmt == "text":
                click.echo(f"note: {prompts}: the first line is not JSON, so each line is read as one prompt "
                           "(plain text; --format text says so, --format prompts refuses non-JSON lines)", err=True)
        check_reachable(ConnectionConfig(redis_url, namespace))
        if fmt == "openai":
            names = tuple(n.strip() for n in model_names.split(",") if n.strip())
            make = _openai_format(timeout, names, model_alias_any)
            params = {"format": fmt, "timeout": timeout, "served_model_names": list(names),
                      "model_alias_any": model_alias_any}
            if errors_path is None and out_path is not None:
                errors_path = out_path + ERRORS_SUFFIX
        else:
            defaults, text = _params(**gen), fmt == "text"
            make, errors_path = (lambda prefix, _fleet: PromptFormat(prefix, defaults, timeout, text)), None
            params = prompt_params(defaults, timeout, text)
        try:
            s = _run(path, out_path, errors_path, make, NOUNS[fmt], redis_url, namespace, window, resume, params,
                     retry_errors, progress_every, drain_s, tenant)
        except RunChanged as exc:
            raise click.UsageError(str(exc)) from None
        except OutputBusy as exc:
            raise click.ClickException(str(exc)) from None
    if s.changed or s.retried:
        click.echo(f"resumed: {s.kept} answers kept, {s.changed} dropped (their input line changed) and "
                   f"{s.retried} error lines retried", err=True)
    why = why_failed(s.codes)
    if why is not None:
        click.echo(why, err=True)
    if fmt == "openai":
        click.echo(f"done: {s.done} requests ({s.kept} kept from an earlier run), {s.failed_lines} in the error "
                   "file", err=True)
    else:
        earlier = f" ({s.kept_failed} of them kept from an earlier run)" if s.kept_failed else ""
        click.echo(f"done: {s.total} prompts ({s.kept} kept from an earlier run, {s.collected} collected, "
                   f"{s.submitted} submitted), {s.failed_lines} failed{earlier}", err=True)
    if s.failed_lines:
        sys.exit(3)


def detect(first_line: bytes) -> str:
    """``auto``'s format: openai (a batch request), prompts (a line meant as JSON: an object or a string,
    broken ones too, which then get error lines), else text (plain prompts)."""
    if looks_like_batch(first_line):
        return "openai"
    return "prompts" if first_line.lstrip()[:1] in (b"{", b'"') else "text"


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


def _openai_format(timeout: float | None, model_names: tuple[str, ...], alias_any: bool) -> Any:
    try:
        from batchfleet.gateway.batches.format import bulk_format
    except ImportError as exc:  # pydantic: the gateway's validation, installed with the serve extra
        raise click.ClickException(f"--format openai validates lines as the gateway does: pip install "
                                   f"'batchfleet[serve]' ({exc})") from None
    return bulk_format(timeout, model_names, alias_any)


def _run(path: str, out_path: str | None, errors_path: str | None, make_format: Any, noun: str, redis_url: str,
         namespace: str, window: int, resume: bool | None, params: dict, retry_errors: bool,
         progress_every: float, drain_s: float, tenant: str = "") -> Any:
    """Run the file, shown and stoppable (gateway/cli/bulk_progress.py: an interrupted run exits there)."""
    from batchfleet.producer.bulk.file_run import run_file

    return run_stoppable(lambda stop, progress: run_file(
        path, out_path, errors_path, make_format, redis_url=redis_url, namespace=namespace, window=window,
        resume=resume, stop=stop, progress=progress, out=sys.stdout, params=params, retry_errors=retry_errors,
        drain_s=drain_s, tenant=tenant), noun, progress_every, drain_s)
