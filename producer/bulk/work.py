"""What a bulk run is made of: a line's ``Work``, the ``LineFormat`` that parses and answers lines, the
``Sink`` answers go to, the ``Spec`` of a run and its ``Summary``. The runner (producer/bulk/runner.py) works
on these alone; a format is passed in from above (producer/bulk/lines.py, gateway/batches/format.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchfleet.common.wire.protocol import Result
from batchfleet.producer.ask import Ask


@dataclass
class Work:
    """One parsed input line: its jobs, or ``error``, the answer line it gets without running."""

    index: int  # 0-based line number in the input
    line: Any  # the format's own parsed line
    job_ids: list[str] = field(default_factory=list)
    prompt: Any = None  # every job's prompt, unless ``prompts`` gives one per job
    key: str | None = None  # prefix key (producer/bulk/prefix_order.py): lines alike are submitted together
    timeout: float | None = None
    error: dict | None = None
    prompts: list | None = None  # one prompt per job (an embeddings line with several inputs)


class LineFormat(Protocol):
    """One kind of input line: what it asks, how its answer and its errors read, how written lines read back."""

    ordered: bool  # answers in submission order (else as they come)
    # ask whether a line's jobs were answered already when their replies are gone (EXISTS on the ``done`` markers,
    # which the producer's ACL user lacks, docs/SECURITY.md): the prompt format needs not (a new output, a new key)
    check_answered: bool
    refused: tuple[type[BaseException], ...]  # submission errors that are the line's own (an error line)

    def parse(self, index: int, raw: bytes) -> Work: ...
    def sha(self, raw: bytes) -> str: ...  # an input line's fingerprint: exactly what it asks (its ``Work``'s)
    async def asks(self, work: Work) -> list[Ask]: ...  # what each job asks; ``refused`` errors: an error line
    def answer(self, work: Work, results: list[Result]) -> dict: ...
    def failure(self, work: Work, exc: BaseException) -> dict: ...
    def abandoned(self, index: int, line: Any, code: str, message: str) -> dict: ...  # line: raw or parsed
    def index_of(self, obj: Any) -> int | None: ...  # a written line's input line number
    def sha_of(self, obj: dict) -> str | None: ...  # a written line's fingerprint of its input line
    def failed(self, obj: dict) -> bool: ...  # a written line is an error line
    def code_of(self, obj: dict) -> str: ...  # an error line's error code


class Sink(Protocol):
    def write(self, line: dict, ok: bool) -> None: ...  # on disk before it returns


@dataclass
class Spec:
    """How to run: at most ``window`` lines in flight, skipping ``done``; ``abandon``: see the module doc.
    ``fresh``: line -> tag of the lines whose earlier answer was dropped (changed since, or an error
    retried): their jobs run under ids with that tag, as the fleet answers one id once (the tags are kept in
    the run record, so a run interrupted again collects them). ``drain_s``: how long a stopped run (``abandon``
    None) still writes the answers of the lines in flight before it leaves the rest to the next run.
    ``share``: keep at most the fleet's next read of jobs queued unread (producer/bulk/queued.py), so runs
    beside this one keep getting answers; False (benchmarks' before) queues the whole window at once."""

    window: int = 256
    done: set[int] = field(default_factory=set)
    abandon: tuple[str, str] | None = None
    fresh: dict[int, str] = field(default_factory=dict)
    drain_s: float = 0.0
    share: bool = True


@dataclass
class Summary:
    """What a run did; ``interrupted`` runs leave ``in_flight`` jobs for the next run to collect."""

    total: int = 0  # answer lines the input asks for
    kept: int = 0  # already in the output when the run started
    kept_failed: int = 0  # error lines among them
    written: int = 0  # written by this run
    failed: int = 0  # error lines written by this run
    submitted: int = 0  # jobs this run enqueued
    collected: int = 0  # lines answered by jobs an earlier run enqueued
    in_flight: int = 0
    changed: int = 0  # answers of an earlier run dropped: their line changed since (recomputed)
    retried: int = 0  # error lines of an earlier run dropped to run again (--retry-errors)
    codes: Counter = field(default_factory=Counter)  # error code -> error lines in the whole output
    interrupted: bool = False  # stopped (Ctrl-C) or ended by ``error`` before every line was answered
    error: BaseException | None = None  # NoWorkers / RedisUnavailable mid-run: what ended it

    @property
    def done(self) -> int:
        return self.kept + self.written

    @property
    def failed_lines(self) -> int:
        """Error lines in the whole output (this run's and the kept ones)."""
        return self.failed + self.kept_failed
