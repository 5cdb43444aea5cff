"""The worker's one ledger: every count it reports (heartbeat status, Prometheus, tests), in one owner.

Outcomes are counted where every answer passes, from the typed replies themselves (``replied``): a
``Result`` is ``completed``, an ``Error`` coded ``cancelled`` is ``cancelled``, any other ``Error`` is
one of ``errors`` (a ``Result`` also adds its ``cached_tokens`` and ``preemptions``, from ``extra``, to
its priority's totals); a dead-lettered entry (answered by the transport's dead-letter write, not the outbox)
is counted by ``dead_lettered``. Everything else is an event its part notes by name (``note``). Pure:
no Redis, no torch; only the loop's thread writes it (other threads read whole ints).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from batchfleet.common.errors import CANCELLED, WORKER_FAILED
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.common.wire.protocol import Result
from batchfleet.worker.transport.base import Reply

EVENTS = ("batches", "batched_requests", "reclaimed", "released", "handed_to_peers", "internal_errors",
          "deltas", "duplicates")
OUTCOMES = ("completed", "errors", "cancelled", "dead_lettered")


class Ledger(Mapping[str, int]):
    """Counters by name (a read-only mapping: ``ledger["completed"]``), tokens of answered requests and
    answers by outcome (``ok`` or the error code)."""

    def __init__(self) -> None:
        self._n: dict[str, int] = dict.fromkeys(OUTCOMES + EVENTS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.outcomes: Counter[str] = Counter()
        # per priority (priority) of answered requests: prompt tokens the prefix cache supplied, preemptions
        self.cached_tokens: Counter[str] = Counter(dict.fromkeys(PRIORITIES, 0))
        self.preemptions: Counter[str] = Counter(dict.fromkeys(PRIORITIES, 0))
        # per (tenant, what) of answered requests: requests, prompt, cached and generated tokens (Reply.usage)
        self.usage: Counter[tuple[str, str]] = Counter()

    def note(self, event: str, n: int = 1) -> None:
        """Count ``n`` of an event (one of ``EVENTS``)."""
        assert event in EVENTS, event
        self._n[event] += n

    def replied(self, replies: Iterable[Reply]) -> None:
        """Count final replies as they enter the outbox (results and errors alike)."""
        for rep in replies:
            for what, n in rep.usage.items():
                self.usage[rep.tenant, what] += n
            msg = rep.message
            if isinstance(msg, Result):
                self._n["completed"] += 1
                self.outcomes["ok"] += 1
                self.prompt_tokens += msg.prompt_tokens
                self.generation_tokens += msg.completion_tokens
                self.cached_tokens[rep.priority] += _count(msg.extra.get("cached_tokens"))
                self.preemptions[rep.priority] += _count(msg.extra.get("preemptions"))
            else:
                self._n["cancelled" if msg.code == CANCELLED else "errors"] += 1
                self.outcomes[msg.code] += 1

    def dead_lettered(self) -> None:
        """An entry was dead-lettered (answered ``worker_failed`` when it named a job)."""
        self._n["dead_lettered"] += 1
        self._n["errors"] += 1
        self.outcomes[WORKER_FAILED] += 1

    def __getitem__(self, name: str) -> int:
        return self._n[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._n)

    def __len__(self) -> int:
        return len(self._n)


def _count(value: object) -> int:
    """An engine's count from ``Result.extra`` (0 when absent)."""
    return int(value) if type(value) is int and value > 0 else 0
