"""One request ready to enqueue (pure: no I/O): the stream it goes to, the enqueue function's arguments and
what its answer means, and the fingerprint that tells one request from another under the same job id."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from batchfleet.common.errors import FleetUnavailable, InvalidRequest, NoWorkers, QueueFull
from batchfleet.common.wire.priority import INTERACTIVE
from batchfleet.common.wire.protocol import MAX_PAYLOAD_BYTES, Request

ADDED_PAST_LIMIT = 2  # an enqueue answer of the client's own: a plain add found the queue past its limit


@dataclass(frozen=True)
class Outgoing:
    """One request ready to enqueue: the stream it goes to and the enqueue function's arguments."""

    bucket: int
    stream: str
    request: Request
    max_queue_len: int
    priority: str = INTERACTIVE

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def fingerprint(self) -> bytes:
        """What makes this request the one it is: its prompt, every parameter, ``stream``, its kind, bucket and
        priority; not its timeout (a retry has less time left) nor its shard (picked per enqueue). Two submits of
        one job id in one client are one job only when their fingerprints are equal."""
        what = replace(self.request, timeout_ms=None).encode() + f"\0{self.bucket}\0{self.priority}".encode()
        return hashlib.blake2b(what, digest_size=16).digest()

    @property
    def tenant(self) -> str:
        """Who sent it ("" the default tenant): a named tenant's stream is its own (common/keys.py ``stream``)."""
        return self.request.tenant

    def args(self, require_workers: bool, live_ms: int, group: str = "") -> list:
        """ARGV of the enqueue function (KEYS: stream, live-worker set[, queued tenants]); a named tenant's add
        also names the tenant and the workers' ``group`` (the function makes the stream)."""
        args = [self.max_queue_len, self.request.id, self.request.reply_key, self.request.encode(),
                MAX_PAYLOAD_BYTES, "1" if require_workers else "0", live_ms]
        return [*args, self.tenant, group] if self.tenant else args

    def fields(self) -> dict[str, Any]:
        """The stream entry the enqueue function writes (docs/PROTOCOL.md), for a plain ``XADD``."""
        return {"id": self.request.id, "r": self.request.reply_key, "p": self.request.encode()}

    def appended(self, length: int) -> int:
        """The answer for a plain ``XADD`` that left its stream ``length`` entries long: 1, or ADDED_PAST_LIMIT
        (queue full; the entry is withdrawn, ``RedisCalls.enqueue``). The function checks before it adds; a plain
        add can only check after, so concurrent adds at the limit may all be refused where the function would
        have taken one of them."""
        return ADDED_PAST_LIMIT if self.max_queue_len and length > self.max_queue_len else 1

    def accepted(self, code: int, namespace: str, *, in_batch: bool = False) -> str:
        """The job id when the function enqueued it; else the matching error."""
        if code == 1:
            return self.id
        earlier = "; earlier prompts of this call were enqueued" if in_batch else ""
        if code in (0, ADDED_PAST_LIMIT):
            whose = f" of tenant {self.tenant}" if self.tenant else ""
            raise QueueFull(f"bucket {self.bucket} ({self.priority}){whose} holds {self.max_queue_len} entries; "
                            f"retry later{earlier}")
        if code == -1:
            raise NoWorkers(f"no live worker serves namespace {namespace!r} (none sent a heartbeat recently); "
                            f"start one, or make the client with require_workers=False to enqueue anyway{earlier}")
        if code == -2:
            raise InvalidRequest(f"request of {len(self.request.encode())} bytes exceeds {MAX_PAYLOAD_BYTES}")
        raise FleetUnavailable(f"unexpected enqueue answer {code!r}")
