"""Every Redis key batchfleet uses, derived from one namespace (default ``bf``).

Keeping names in one place lets ACL rules (``~bf:*``) and tenant isolation follow from the namespace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_NAMESPACE = "bf"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def valid_job_id(job_id: object) -> bool:
    return isinstance(job_id, str) and bool(JOB_ID_RE.match(job_id))


@dataclass(frozen=True)
class Keys:
    """Key names under one namespace."""

    namespace: str = DEFAULT_NAMESPACE

    def __post_init__(self) -> None:
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"invalid namespace {self.namespace!r}: use 1-64 chars of [A-Za-z0-9_.-]")

    @property
    def group(self) -> str:
        """Consumer group shared by every worker of the fleet."""
        return "workers"

    def stream(self, bucket: int) -> str:
        """The request stream of one prompt-length bucket."""
        return f"{self.namespace}:stream:{bucket}"

    def reply(self, job_id: str) -> str:
        """List the worker pushes the encoded Result/Error onto (expires after the reply TTL)."""
        return f"{self.namespace}:reply:{job_id}"

    def done(self, job_id: str) -> str:
        """First-writer-wins marker: set once a reply was written, so a re-run cannot answer twice."""
        return f"{self.namespace}:done:{job_id}"

    @property
    def fleet(self) -> str:
        """Fleet description published by workers: tokenizer, buckets, limits."""
        return f"{self.namespace}:fleet"

    def worker(self, name: str) -> str:
        """Heartbeat/status of one worker (expires when the worker stops refreshing it)."""
        return f"{self.namespace}:worker:{name}"

    @property
    def batches(self) -> str:
        """Capped stream of batch records (bucket, ids, size) written by workers, for audit and tests."""
        return f"{self.namespace}:batches"

    @property
    def flush(self) -> str:
        """Counter a load generator bumps to close partial static batches ("static N" ends its load).

        Only static-batching workers act on it: their transport polls it (``Transport.flush_requested``
        in worker/transport.py, at most every 50 ms while a partial batch waits) and a change since the
        last value seen closes the partial batches."""
        return f"{self.namespace}:flush"

    @property
    def dead(self) -> str:
        """Capped dead-letter stream."""
        return f"{self.namespace}:dead"

    @property
    def pattern(self) -> str:
        return f"{self.namespace}:*"
