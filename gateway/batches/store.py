"""Where the files and batches API keeps things: file bytes in a directory, metadata in Redis.

Files: ``<files_dir>/<file id>``, written to a temporary name and renamed, so a file id that exists names
complete bytes; its metadata (OpenAI's file object plus its owner) under ``keys.file``. Batches: one hash
per batch (``keys.openai_batch``) whose ``doc`` field is the OpenAI batch object. The API writes ``doc``
once, at creation; after that only the process holding the batch's lease writes it (gateway/batches/runner.py),
and the API asks for a cancel through the ``cancel`` field, never by editing ``doc``. An owner is a digest
of the API key, so a key sees only its own files and batches. The lease (``keys.batch_lease``) is a random
token set with a TTL; only its holder renews or drops it (the ``lease_*`` functions of common/redis/functions.py).

Both stores get their client from gateway/connections.py (the AsyncClient's pool): they make none.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import time
from typing import IO, Any

import redis.asyncio

from batchfleet.common.keys import Keys
from batchfleet.common.redis.functions import Functions
from batchfleet.gateway.errors import APIError, invalid

FILE_ID_RE = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID_RE = re.compile(r"batch_[0-9a-f]{24}")
COPY_CHUNK = 1 << 20
TERMINAL = ("completed", "failed", "expired", "cancelled")
LIST_MAX = 100
FILE_PURPOSES = ("batch", "batch_output")  # what a client may upload: batch (batch_output is ours)
FINISHED_KEPT = 20  # the dashboard lists the last finished batches from this capped index (any owner)


def safe_name(name: str) -> str:
    """An uploaded file's name as stored and sent back (``Content-Disposition``): its last path component,
    characters other than letters, digits, ``._-`` and spaces as ``_``, at most 255 (``../../etc/x``:
    ``x``; nothing left: ``upload.jsonl``)."""
    base = re.split(r"[/\\]", name)[-1]
    cleaned = re.sub(r"[^A-Za-z0-9._\- ]", "_", base).strip(" .")[:255]
    return cleaned or "upload.jsonl"


def not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"no {what} with id {ident[:100]!r}", "invalid_request_error", "not_found", "id")


def public(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the API shows it (internal fields start with '_')."""
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def page(objs: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object over ``limit + 1`` fetched objects."""
    shown = objs[:limit]
    return {"object": "list", "data": [public(o) for o in shown], "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(objs) > limit}


class FileStore:
    """The files API's storage: bytes on disk, metadata in Redis."""

    def __init__(self, r: redis.asyncio.Redis, keys: Keys, directory: str, max_bytes: int) -> None:
        self.r, self.keys, self.dir, self.max_bytes = r, keys, directory, max_bytes

    def path(self, file_id: str) -> str:
        if not FILE_ID_RE.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return os.path.join(self.dir, file_id)

    @staticmethod
    def new_id() -> str:
        return "file-" + secrets.token_hex(12)

    async def upload(self, owner: str, filename: str, purpose: str, src: IO[bytes],
                     expires_s: int | None = None) -> dict[str, Any]:
        """Copy an upload into the directory (413 past max_bytes) and record it."""
        if purpose != "batch":
            raise invalid(f"purpose must be 'batch' (this gateway's files serve batches), got {purpose[:50]!r}",
                          "purpose")
        file_id = self.new_id()
        size = await asyncio.to_thread(self._copy, src, self.path(file_id))
        return await self.register(owner, file_id, filename, purpose, size, expires_s)

    def _copy(self, src: IO[bytes], path: str) -> int:
        os.makedirs(self.dir, exist_ok=True)  # made by the first upload, not by every gateway start
        tmp = f"{path}.part"
        size = 0
        try:
            with open(tmp, "wb") as dst:
                while chunk := src.read(COPY_CHUNK):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise APIError(413, f"file over {self.max_bytes >> 20} MiB", "invalid_request_error",
                                       "file_too_large", "file")
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size

    async def register(self, owner: str, file_id: str, filename: str, purpose: str, size: int | None = None,
                       expires_s: int | None = None) -> dict[str, Any]:
        """Record a file whose bytes are at ``path(file_id)``; ``expires_s`` after now it is swept
        (gateway/batches/expiry.py)."""
        if size is None:
            size = os.path.getsize(self.path(file_id))
        now = int(time.time())
        expires_at = None if expires_s is None else now + expires_s
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": now, "expires_at": expires_at,
                "filename": safe_name(filename), "purpose": purpose, "status": "processed", "status_details": None,
                "_owner": owner}
        async with self.r.pipeline(transaction=True) as p:
            p.set(self.keys.file(file_id), json.dumps(meta))
            p.zadd(self.keys.files(owner), {file_id: now})
            if expires_at is not None:
                p.zadd(self.keys.expiring, {f"file:{file_id}": expires_at})
            await p.execute()
        return meta

    async def get(self, owner: str, file_id: str) -> dict[str, Any]:
        """The file's metadata; 404 when it does not exist or is another key's."""
        raw = await self.r.get(self.keys.file(file_id)) if FILE_ID_RE.fullmatch(file_id) else None
        meta = json.loads(raw) if raw else None
        if meta is None or meta.get("_owner") != owner:
            raise not_found("file", file_id)
        return meta

    async def list(self, owner: str, purpose: str | None, after: str | None, limit: int) -> dict[str, Any]:
        ids = [i.decode() for i in await self.r.zrevrange(self.keys.files(owner), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[dict[str, Any]] = []
        for i in range(0, len(ids), LIST_MAX):  # one MGET per hundred, until the page is full
            for raw in await self.r.mget([self.keys.file(f) for f in ids[i:i + LIST_MAX]]):
                meta = json.loads(raw) if raw else None
                if meta is not None and (purpose is None or meta["purpose"] == purpose):
                    out.append(meta)
            if len(out) > limit:
                break
        return page(out[:limit + 1], limit)

    async def delete(self, owner: str, file_id: str) -> dict[str, Any]:
        await self.get(owner, file_id)
        async with self.r.pipeline(transaction=True) as p:
            p.delete(self.keys.file(file_id))
            p.zrem(self.keys.files(owner), file_id)
            await p.execute()
        try:
            os.unlink(self.path(file_id))
        except FileNotFoundError:
            pass
        return {"id": file_id, "object": "file", "deleted": True}


class BatchStore:
    """The batches API's records in Redis."""

    def __init__(self, r: redis.asyncio.Redis, keys: Keys, functions: Functions | None = None) -> None:
        self.r, self.keys = r, keys
        self.functions = functions or Functions(r)

    async def create(self, owner: str, doc: dict[str, Any], run: dict[str, Any]) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.keys.openai_batch(doc["id"]), mapping={"doc": json.dumps({**doc, "_owner": owner}),
                                                               "run": json.dumps(run)})
            p.zadd(self.keys.openai_batches(owner), {doc["id"]: doc["created_at"]})
            p.zadd(self.keys.openai_batches_due, {doc["id"]: doc["created_at"]})
            await p.execute()

    async def load(self, batch_id: str) -> tuple[dict[str, Any], dict[str, Any], int | None] | None:
        """(doc, run, when a cancel was asked) of a batch; None when it does not exist."""
        fields = await self.r.hgetall(self.keys.openai_batch(batch_id)) if BATCH_ID_RE.fullmatch(batch_id) else {}
        if not fields or b"doc" not in fields:
            return None
        cancel = fields.get(b"cancel")
        return json.loads(fields[b"doc"]), json.loads(fields.get(b"run", b"{}")), int(cancel) if cancel else None

    async def get(self, owner: str, batch_id: str) -> dict[str, Any]:
        """The batch object as the API shows it (``cancelling`` once a cancel is asked and until it is done)."""
        loaded = await self.load(batch_id)
        if loaded is None or loaded[0].get("_owner") != owner:
            raise not_found("batch", batch_id)
        doc, _, cancel = loaded
        if cancel is not None and doc["status"] not in TERMINAL:
            doc = {**doc, "status": "cancelling", "cancelling_at": cancel}
        return doc

    async def list(self, owner: str, after: str | None, limit: int) -> dict[str, Any]:
        ids = [i.decode() for i in await self.r.zrevrange(self.keys.openai_batches(owner), 0, -1)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out = [await self.get(owner, i) for i in ids[:limit + 1]]
        return page(out, limit)

    async def cancel(self, owner: str, batch_id: str) -> dict[str, Any]:
        doc = await self.get(owner, batch_id)
        if doc["status"] in TERMINAL:
            raise APIError(409, f"batch {batch_id} is already {doc['status']}", "invalid_request_error",
                           "batch_not_cancellable")
        await self.r.hsetnx(self.keys.openai_batch(batch_id), "cancel", int(time.time()))
        return await self.get(owner, batch_id)

    async def save(self, doc: dict[str, Any]) -> None:
        """The runner's write (only while it holds the lease); a finished batch leaves the due set, and
        expires with its output files when they do (``_expires_at``); the last FINISHED_KEPT finished ones stay
        indexed for the dashboard (producer/ops/batch_jobs.py)."""
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.keys.openai_batch(doc["id"]), "doc", json.dumps(doc))
            if doc["status"] in TERMINAL:
                p.zrem(self.keys.openai_batches_due, doc["id"])
                p.zadd(self.keys.openai_batches_finished, {doc["id"]: time.time()})
                p.zremrangebyrank(self.keys.openai_batches_finished, 0, -FINISHED_KEPT - 1)
                if doc.get("_expires_at"):
                    p.zadd(self.keys.expiring, {f"batch:{doc['id']}": doc["_expires_at"]})
            await p.execute()

    async def due(self) -> list[str]:
        return [i.decode() for i in await self.r.zrange(self.keys.openai_batches_due, 0, -1)]

    async def take_lease(self, batch_id: str, token: str, ttl_ms: int) -> bool:
        """Take the batch's lease when nobody holds it."""
        return bool(await self.r.set(self.keys.batch_lease(batch_id), token, nx=True, px=ttl_ms))

    async def renew_lease(self, batch_id: str, token: str, ttl_ms: int) -> bool:
        """Extend the lease ``token`` holds; False: it is not held any more (expired, or taken over)."""
        return bool(await self.functions.call("lease_renew", [self.keys.batch_lease(batch_id)], [token, ttl_ms]))

    async def release_lease(self, batch_id: str, token: str) -> None:
        """Drop the lease if ``token`` still holds it."""
        await self.functions.call("lease_release", [self.keys.batch_lease(batch_id)], [token])
