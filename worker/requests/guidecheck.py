"""The guide-check thread: judges structured-output guides off the loop's thread.

Checking a guide nobody sent before (``Guide.check``: compile it, walk its first steps) and compiling it
for the engine (``Compiler.warm``: the served tokenizer, its first mask) take up to about a second for a
pathological one, and llguidance releases the GIL meanwhile. On the loop's thread that second would
stall every running request's decode, so a request whose guide's verdict is not cached waits in the
request table (stage VALIDATING: leased, cancellable, expirable, handed back on shutdown) while this
thread judges it (so does one whose verdict is cached but which the engine has not compiled); the loop
drains the verdicts at the top of each tick (worker/requests/intake.py ``verdicts``).

Invariants: this thread only reads the guide it is handed and writes the verdict queue (and the verdict
and compiled-matcher caches, each behind its own lock); every request submitted gets exactly one verdict
unless the checker is stopped first (then its request is handed back by the loop, never answered here).
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol

from batchfleet.common.wire.guided import Guide, GuideError
from batchfleet.worker.requests.validate import Accepted

log = logging.getLogger("batchfleet.worker.loop")

# one thread: a burst of expensive guides then costs one core, never the loop's; they queue behind each
# other (their requests wait VALIDATING), as the read-ahead bound lets through (worker/requests/intake.py room)
CHECK_THREADS = 1


class Compiler(Protocol):
    """The engine's guide compiler (worker/engine/guided.py ``GuideCompiler``), as the check thread uses it."""

    def warm(self, guide: Guide) -> None:
        """Compile ``guide`` for the served tokenizer now, so that admission only copies it (any thread)."""

    def warmed(self, guide: Guide) -> bool:
        """Whether admission would only copy a compiled ``guide`` (cheap)."""


class Verdict(NamedTuple):
    """A judged request: ``error`` '' when its guide passed, else why not (answered INVALID_REQUEST);
    ``fault`` set when the check itself broke (a bug: the entry is given up, as an internal error)."""

    acc: Accepted
    error: str
    fault: str = ""


class GuideChecks:
    """Runs ``Guide.check`` (and the engine's ``prepare``, for guides that pass) on its own thread; the
    verdicts come back through a queue only the loop's thread drains."""

    def __init__(self, compiler: Compiler | None = None) -> None:
        self.compiler = compiler  # None: the engine compiles at admission (an engine without guides)
        self._pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="guide-check")  # its thread starts
        self._done: queue.SimpleQueue[Verdict] = queue.SimpleQueue()  # at the first submit

    def ready(self, guide: Guide) -> bool:
        """Whether a guide whose verdict is known to be good may run without a trip to the check thread:
        the engine has it compiled (else compiling it is this thread's job too)."""
        return self.compiler is None or self.compiler.warmed(guide)

    def submit(self, acc: Accepted) -> None:
        """Judge ``acc.unchecked`` off this thread; its verdict comes back from ``done``."""
        assert acc.unchecked is not None
        self._pool.submit(self._judge, acc)

    def done(self) -> list[Verdict]:
        """The verdicts that came back since the last call, in the order they were reached."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        """Drop the checks not started and do not wait for the running one (its verdict is ignored: the
        loop hands back what is still VALIDATING)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _judge(self, acc: Accepted) -> None:
        guide = acc.unchecked
        assert guide is not None
        try:
            guide.check()
            error = ""
        except GuideError as exc:
            error = str(exc)
        except Exception as exc:  # a bug in the check: this request is given up, the others go on
            log.exception("guide check failed unexpectedly", extra={"job": acc.gen.id})
            self._done.put(Verdict(acc, "", f"internal error while checking its guide: {exc!r}"[:500]))
            return
        if not error and self.compiler is not None:
            try:
                self.compiler.warm(guide)
            except Exception:  # the engine compiles it again at admission, and answers what fails there
                log.exception("compiling a guide ahead of admission failed", extra={"job": acc.gen.id})
        self._done.put(Verdict(acc, error))
