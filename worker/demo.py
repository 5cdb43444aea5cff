"""``batchfleet demo``: the main job on embedded defaults, end to end on one machine.

Uses the configured Redis if reachable (else a private one), starts one worker with the default model,
sends 64 prompts from 32 client threads through one Client, prints throughput / TTFT / batch size, and cleans
up every process and key it created. While the worker starts (a minute or more on a loaded machine, the
first time longer: the model and the C kernels are built once) the demo relays what it is doing: each
start-up phase line of the worker's log (common/logs.py ``startup_phase``) and its warnings, then its own
steps, each with the seconds since the demo started.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from batchfleet.common.cli import connection_options
from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.logs import STARTUP_LOGGER
from batchfleet.common.options import build_worker_config, config_options, option_args
from batchfleet.common.redis.url import redact_url
from batchfleet.worker.benchmark.loadgen import percentile
from batchfleet.worker.devtools import delete_namespace, ensure_redis, spawn_worker

WORDS = ("fleet batch token queue redis stream worker bucket cache paged decode prefill latency "
         "throughput accelerator prompt model reply").split()


def make_prompts(n: int, seed: int = 0, max_chars: int = 400) -> list[str]:
    """Prompts of mixed lengths (8 to max_chars bytes) so several buckets are used."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = max_chars
        target = rng.choice([rng.randint(8, m // 4), rng.randint(m // 3, m * 6 // 10), rng.randint(m * 65 // 100, m)])
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:target])
    return out


# a text log line (common/logs.py TEXT_FORMAT): date, time, level, logger, message
TEXT_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<message>.*)$")
RELAYED_LEVELS = ("WARNING", "ERROR", "CRITICAL")  # besides the phase lines: what went wrong while starting


def phase_message(line: str) -> str | None:
    """The message of a worker log line (text or JSON format) worth showing while it starts: a start-up phase
    line, or a warning or error; None for any other line (and for progress bars)."""
    line = line.rsplit("\r", 1)[-1].strip()  # a progress bar redraws itself with \r on one line
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        level, logger, message = record.get("level"), record.get("logger"), record.get("message")
    elif match := TEXT_LINE.match(line):
        level, logger, message = match["level"], match["logger"], match["message"]
    else:
        return None
    return message if logger == STARTUP_LOGGER or level in RELAYED_LEVELS else None


class Progress:
    """Prints the demo's steps with the seconds since it started; ``relay(log)`` also prints the phase lines
    (``phase_message``) a worker writes to ``log`` until the block ends, as they come."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        click.echo(f"[{time.monotonic() - self.t0:6.1f} s] {text}")

    def relay(self, log: Path) -> _Relay:
        return _Relay(self, log)


class _Relay:
    def __init__(self, progress: Progress, log: Path, poll_s: float = 0.2) -> None:
        self.progress, self.log, self.poll_s = progress, log, poll_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="demo-log-relay", daemon=True)

    def __enter__(self) -> _Relay:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.done.set()
        self.thread.join(10)

    def _run(self) -> None:
        offset, pending = 0, b""
        while True:
            finished = self.done.is_set()  # read once more after the block ended: the last lines too
            try:
                with open(self.log, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:  # not created yet
                data = b""
            offset += len(data)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if (message := phase_message(line.decode(errors="replace"))) is not None:
                    self.progress.say(f"worker: {message}")
            if finished:
                return
            self.done.wait(self.poll_s)


@click.command()
@connection_options
@config_options(EngineConfig, DynamicBatchingConfig)  # all passed on to the demo's worker
@click.option("--requests", "n_requests", type=int, default=64, show_default=True, help="Prompts to send.")
@click.option("--clients", type=int, default=32, show_default=True, help="Concurrent client threads.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Tokens to generate per prompt.")
def demo(redis_url: str, namespace: str, n_requests: int, clients: int, max_new_tokens: int, **worker_kw) -> None:
    """Run a worker and --clients client threads against it; print a results table."""
    from batchfleet.producer import Client

    try:
        cfg = build_worker_config(**worker_kw)  # validated here, before any process starts
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    progress = Progress()
    url, private = ensure_redis(redis_url)
    progress.say(f"redis: {redact_url(url)}" + (" (private, started by the demo)" if private else ""))
    ns = f"{namespace}-demo-{uuid.uuid4().hex[:6]}"
    log = Path(tempfile.gettempdir()) / f"batchfleet-{ns}.log"
    worker = None
    try:
        progress.say(f"starting worker (namespace {ns}, log {log}) ...")
        with progress.relay(log):
            try:
                worker = spawn_worker(url, ns, option_args(worker_kw), log_path=str(log))
            except (RuntimeError, TimeoutError) as exc:  # exited or hung before serving: its log says why
                raise click.ClickException(f"{exc}; its log: {log}") from None
        progress.say("worker ready (its heartbeat is in Redis)")
        prompts = make_prompts(n_requests)
        with Client(url, ns) as client:
            progress.say("warm-up request (the first prefill and decode steps) ...")
            client.generate("warm up", max_new_tokens=2)
            progress.say(f"sending {n_requests} prompts from {clients} client threads ...")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda p: client.generate(p, max_new_tokens=max_new_tokens), prompts))
            wall = time.perf_counter() - t0
        progress.say("done")
        tokens = sum(r.completion_tokens for r in results)
        ttft = [r.ttft_ms for r in results]
        rows = [
            ("requests", f"{len(results)} from {clients} client threads"),
            ("engine / mode", f"{cfg.engine.engine} / {cfg.engine.mode}"),
            ("max_wait_ms / max_batch_size", f"{worker_kw['max_wait_ms']:g} / {worker_kw['max_batch_size']}"),
            ("output tokens", str(tokens)),
            ("wall time", f"{wall:.2f} s"),
            ("throughput", f"{tokens / wall:.1f} tok/s"),
            ("TTFT p50 / p99", f"{percentile(ttft, 50):.0f} / {percentile(ttft, 99):.0f} ms"),
            ("mean batch size", f"{statistics.mean(r.batch_size for r in results):.1f}"),
            ("buckets used", ", ".join(sorted({str(r.extra.get('bucket')) for r in results}))),
        ]
        click.echo("\n| metric | value |\n|---|---|")
        for k, v in rows:
            click.echo(f"| {k} | {v} |")
    finally:
        if worker is not None:
            worker.stop()
        delete_namespace(url, ns)
        if private is not None:
            private.stop()
