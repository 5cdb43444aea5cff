"""The two values that cross between the stream consumer and the worker loop (no Redis, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One raw stream entry as read from Redis (fields not yet validated)."""

    bucket: int
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1  # times Redis has delivered it (each XAUTOCLAIM adds one)


@dataclass(frozen=True)
class Reply:
    """A reply to write: payload is an encoded Result or Error."""

    job_id: str
    payload: bytes
    bucket: int  # the stream the answered entry sits in
    entry_id: str  # acked and deleted by the same script that writes the reply
