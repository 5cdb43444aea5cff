"""Files and batches that expire, as OpenAI's: ``expires_after`` on an upload, ``output_expires_after`` on a
batch (its output and error files, and the batch record with them), and the sweeper that deletes them.

``expires_after`` is ``{"anchor": "created_at", "seconds": n}`` (JSON on a batch; on an upload the form
fields ``expires_after[anchor]`` and ``expires_after[seconds]``, as OpenAI's client sends them), with
OpenAI's bounds: 1 hour to 30 days. What expires is recorded in one sorted set (``keys.expiring``, score:
the time); every batch runner sweeps it (``sweep``) about once a minute: the file's bytes and metadata, or
the batch's record, are deleted, and the API answers 404 from then on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from batchfleet.gateway.batches.store import BatchStore, FileStore
from batchfleet.gateway.errors import invalid

log = logging.getLogger(__name__)
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 24 * 3600
SWEEP_S = 60.0
SWEEP_MAX = 1000  # deleted per sweep at most (the rest: next sweep)


def expiry_seconds(value: Any, field: str) -> int | None:
    """The seconds of an ``expires_after`` object (None: not given); a 400 naming ``field`` otherwise."""
    if value is None:
        return None
    seconds = value.get("seconds") if isinstance(value, Mapping) else None
    if isinstance(seconds, str) and seconds.isdigit():
        seconds = int(seconds)  # a form field
    if (not isinstance(value, Mapping) or value.get("anchor") != "created_at" or type(seconds) is not int
            or not MIN_EXPIRY_S <= seconds <= MAX_EXPIRY_S):
        raise invalid(f"{field} must be {{\"anchor\": \"created_at\", \"seconds\": <{MIN_EXPIRY_S}-{MAX_EXPIRY_S}>}}",
                      field)
    return seconds


def form_expiry(form: Mapping[str, Any]) -> int | None:
    """``expires_after`` of an upload form: OpenAI's client sends ``expires_after[anchor]`` and
    ``expires_after[seconds]``; a JSON ``expires_after`` field is read too."""
    if "expires_after" in form:
        try:
            value = json.loads(form["expires_after"])
        except (TypeError, ValueError):
            value = "?"
        return expiry_seconds(value, "expires_after")
    parts = {k[len("expires_after["):-1]: v for k, v in form.items() if k.startswith("expires_after[")}
    return expiry_seconds(parts, "expires_after") if parts else None


async def sweep(files: FileStore, batches: BatchStore, now: float | None = None) -> int:
    """Delete what expired by ``now``; returns how many were deleted."""
    now = time.time() if now is None else now
    due = [m.decode() for m in await files.r.zrange(files.keys.expiring, "-inf", now, byscore=True, offset=0,
                                                     num=SWEEP_MAX)]
    for member in due:
        kind, _, ident = member.partition(":")
        if kind == "file":
            await _drop_file(files, ident)
        elif kind == "batch":
            await _drop_batch(batches, ident)
        await files.r.zrem(files.keys.expiring, member)
        log.info("expired: %s %s deleted", kind, ident)
    return len(due)


async def _drop_file(files: FileStore, file_id: str) -> None:
    raw = await files.r.get(files.keys.file(file_id))
    owner = json.loads(raw).get("_owner") if raw else None
    async with files.r.pipeline(transaction=True) as p:
        p.delete(files.keys.file(file_id))
        if owner is not None:
            p.zrem(files.keys.files(owner), file_id)
        await p.execute()
    try:
        os.unlink(files.path(file_id))
    except (FileNotFoundError, ValueError):
        pass


async def _drop_batch(batches: BatchStore, batch_id: str) -> None:
    loaded = await batches.load(batch_id)
    async with batches.r.pipeline(transaction=True) as p:
        p.delete(batches.keys.openai_batch(batch_id))
        if loaded is not None:
            p.zrem(batches.keys.openai_batches(loaded[0]["_owner"]), batch_id)
        p.zrem(batches.keys.openai_batches_due, batch_id)
        await p.execute()
