"""The outbox: where every final answer of the worker leaves, for the intake and the dispatcher alike.

A reply is counted (ledger, observer), moved to the request table's OUTBOX stage and written at once through
``transport.settler``; on an outage it waits there, its entry still leased, and the loop retries ``flush``
every tick (writes are idempotent: first writer wins, the settling is repeatable). An entry that cannot be
answered normally is dead-lettered here too (``give_up``).

Hops of a reply (worker/transport/base.py): ``send`` (1) -> ``flush`` (2) -> ``Settler.write_replies`` (3).
"""

from __future__ import annotations

import logging

from batchfleet.common.errors import WORKER_FAILED
from batchfleet.common.wire.protocol import Error
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.metrics import LoopStats
from batchfleet.worker.requests.table import RequestTable
from batchfleet.worker.requests.validate import job_id_of, reply_key_of
from batchfleet.worker.transport.base import Entry, Reply, Transport

log = logging.getLogger("batchfleet.worker.loop")


class Outbox:
    """Sends replies and dead letters through the transport's settler (module docstring)."""

    def __init__(self, transport: Transport, requests: RequestTable, ledger: Ledger, observer: LoopStats) -> None:
        self.transport = transport
        self.requests = requests  # holds the OUTBOX stage: replies not written yet
        self.ledger = ledger
        self.observer = observer  # the loop's observer (WorkerMetrics with --metrics-port)

    def send(self, replies: list[Reply]) -> None:
        """Queue replies and try to write them now; on an outage they wait in the outbox (still leased)."""
        self.ledger.replied(replies)
        self.observer.replied(replies)
        self.requests.answer(replies)
        self.flush()

    def flush(self) -> None:
        """Write every reply in the outbox (raises on an outage: they stay there for the next try)."""
        batch = self.requests.outbox
        if not batch:
            return
        self.transport.settler.write_replies(list(batch))  # idempotent: first writer wins, settling repeatable
        self.requests.written(len(batch))

    def give_up(self, entry: Entry, reason: str) -> None:
        """Dead-letter an entry for good, answering ``worker_failed`` when it names a job."""
        job_id, reply_key = job_id_of(entry), reply_key_of(entry, self.transport.keys)
        reply = None
        if job_id is not None and reply_key is not None:
            reply = Reply.to(entry, job_id, Error(job_id, WORKER_FAILED, reason), reply_key)
        log.warning("giving up on entry %s (job %s): %s", entry.entry_id, job_id, reason,
                    extra={"job": job_id, "bucket": entry.bucket})
        self.ledger.dead_lettered()
        self.transport.settler.give_up(entry, reason, reply)
