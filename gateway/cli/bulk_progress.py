"""How ``batchfleet bulk`` shows a run and stops it: a progress bar on a terminal, plain progress lines
elsewhere (nohup, CI, a Kubernetes Job: a log file shows the count, rate and ETA every ``--progress-every``
seconds; the rate and ETA only once the run's recent pace is measured, producer/bulk/rate.py), and Ctrl-C or
SIGTERM (what ``timeout``, Kubernetes and systemd send) as a clean stop: nothing
more is submitted, the answers of the lines in flight are written as they come for at most
``--drain-timeout`` seconds, and the lines still in flight then are left to the next run.

The exit is bounded whatever the run is waiting on (a fleet gone, Redis hanging, a task that ignores its
cancellation): a watchdog thread ends the process CLOSE_S after the drain's bound, and a second signal ends it
at once. Ending it so is safe: every answer line is flushed whole before its reply leaves the inbox, the lock
on the output goes with the process, and a rerun resumes as after a kill -9 (producer/bulk/runner.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import click

from batchfleet.producer.bulk.rate import RecentRate
from batchfleet.producer.bulk.work import Summary

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal's number, as a shell reports it
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
DRAIN_S = 20.0  # --drain-timeout's default: with CLOSE_S, within Kubernetes' default 30 s grace period
CLOSE_S = 10.0  # after the drain: the run closes (writes, cancels, its last report) within this, or is ended


def duration(seconds: float) -> str:
    """``1h02m``, ``4m10s``, ``7s``."""
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(noun: str, s: Summary, elapsed: float, rate: float | None) -> str:
    """One progress line, ``rate``: this run's recent lines/s (None: not measured yet, so no ETA either):

    ``prompts: 1200/10000 (12%), 35.2/s, ETA 4m10s`` while measured; ``prompts: 3/10000 (0%), measuring the
    rate`` before; at the end, ``prompts: 10000/10000 (100%) in 4m44s, 35.2/s`` (``elapsed``: since the run
    started; the rate there is its average over the whole run)."""
    pct = 100 * s.done // s.total if s.total else 100
    head = f"{noun}: {s.done}/{s.total} ({pct}%)"
    if s.done >= s.total:
        return f"{head} in {duration(elapsed)}, {s.written / elapsed if elapsed > 0 else 0.0:.1f}/s"
    return f"{head}, {_pace(s, rate)}"


def _pace(s: Summary, rate: float | None) -> str:
    if rate is None:
        return "measuring the rate"
    return f"{rate:.1f}/s, ETA {duration((s.total - s.done) / rate) if rate > 0 else '-'}"


class Progress:
    """The ``progress`` callback of a run: from the first answer on (an error before it stays the only line),
    a bar when ``stream`` is a terminal, else a plain line every ``every_s`` seconds and at the end; both say
    the rate and ETA once measured (RecentRate)."""

    def __init__(self, noun: str, every_s: float, stream: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.noun, self.every_s, self.stream, self.clock = noun, every_s, stream or sys.stderr, clock
        self.bar: Any = None
        self.start = clock()
        self.shown: float | None = None  # when the last plain line was written
        self.tty = self.stream.isatty()
        self.pace = RecentRate()

    def __call__(self, s: Summary) -> None:
        now = self.clock()
        self.pace.add(now, s.written)
        if self.tty:
            if self.bar is None:  # click's own ETA would count the start-up time: ours is shown instead
                self.bar = click.progressbar(length=s.total, label=self.noun, show_pos=True, show_eta=False,
                                             item_show_func=lambda text: text, file=self.stream)
                self.bar.__enter__()
            self.bar.update(s.done - self.bar.pos, _pace(s, self.pace.rate()) if s.done < s.total else None)
            return
        if self.shown is None or now - self.shown >= self.every_s or s.done >= s.total:
            self.shown = now
            self.stream.write(progress_line(self.noun, s, now - self.start, self.pace.rate()) + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


class Stopper:
    """While a bulk run runs: the first Ctrl-C or SIGTERM sets ``stop`` (a clean stop, also right after the
    run ended: then it changes nothing), is remembered (``exit_code``) and arms the watchdog: the process
    ends ``drain_s`` + CLOSE_S later if it has not by then; a second one ends it at once. The handlers stay
    installed until ``restore()``, so a signal racing an interrupted run's exit never becomes a traceback."""

    def __init__(self, stop: asyncio.Event, drain_s: float = DRAIN_S) -> None:
        self.stop, self.drain_s, self.loop, self.presses = stop, drain_s, None, 0
        self.signum: int = signal.SIGINT
        self.watchdog: threading.Timer | None = None
        self.main = threading.current_thread() is threading.main_thread()  # signal handlers: main thread only
        self.previous = {sig: signal.signal(sig, self._pressed) for sig in EXIT_CODES} if self.main else {}

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.signum]

    def _pressed(self, signum: int, frame: object) -> None:
        self.presses += 1
        if self.presses > 1:
            self.end_now(f"{NAMES.get(signum, 'a signal')} again")
        self.signum = signum
        self.watchdog = threading.Timer(self.drain_s + CLOSE_S, self.end_now,
                                        (f"the run did not end within {self.drain_s + CLOSE_S:g} s",))
        self.watchdog.daemon = True
        self.watchdog.start()
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stopping)
        else:  # the run has not started its loop yet: it sees the event set as it starts
            self.stop.set()

    def _stopping(self) -> None:
        """On the loop: set ``stop`` and say what happens now (never from the handler itself, which may
        interrupt a write to stderr)."""
        self.stop.set()
        name = NAMES.get(self.signum, "signal")
        click.echo(f"\n{name}: stopping: nothing more is submitted, answers of the lines in flight are written for "
                   f"up to {self.drain_s:g} s (--drain-timeout), the rest is left to the next run ({name} again: "
                   "exit at once)", err=True)

    def end_now(self, why: str) -> None:
        """End the process now (a second signal, or the watchdog): safe at any instant (the module doc)."""
        os.write(2, f"\nstopped at once ({why}): the lines written stay; run the same command again to "
                    "resume\n".encode())
        os._exit(self.exit_code)

    async def run(self, coro: Any) -> Any:
        self.loop = asyncio.get_running_loop()
        return await coro

    def restore(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run_stoppable(make_run: Callable[[asyncio.Event, Callable[[Summary], None]], Any], noun: str,
                  every_s: float, drain_s: float = DRAIN_S) -> Summary:
    """Run ``make_run(stop, progress)`` with progress shown and Ctrl-C / SIGTERM as a clean stop (the run
    drains for ``drain_s``: see the module doc); an interrupted run exits here: 130 (Ctrl-C), 143 (SIGTERM),
    1 (the fleet stopped it), after one line that says how far it got and how to resume."""
    stop = asyncio.Event()
    progress = Progress(noun, every_s)
    stopper = Stopper(stop, drain_s)
    try:
        s = asyncio.run(stopper.run(make_run(stop, progress)))
    finally:
        progress.close()
    if s.interrupted:  # our handlers stay: a signal racing this exit must not turn it into a traceback
        why = ("interrupted" if stopper.signum == signal.SIGINT else "stopped by SIGTERM") if s.error is None \
            else f"stopped ({' '.join(str(s.error).split())})"
        click.echo(f"{why}: {s.done} of {s.total} lines written, {s.total - s.done} unanswered ({s.in_flight} of "
                   "them in flight); run the same command again to resume", err=True)
        sys.exit(stopper.exit_code if s.error is None else 1)
    stopper.restore()
    return s
