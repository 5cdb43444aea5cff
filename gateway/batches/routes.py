"""The OpenAI files and batches API on the gateway (``router``, every route behind the API key):

    POST /v1/files (multipart: file, purpose=batch)     GET /v1/files    GET /v1/files/{id}
    GET  /v1/files/{id}/content                         DELETE /v1/files/{id}
    POST /v1/batches    GET /v1/batches    GET /v1/batches/{id}    POST /v1/batches/{id}/cancel

Same API keys as the rest of the gateway; each key sees only its own files and batches. Batches are run by
gateway/batches/runner.py (in this process unless ``--no-batch-runner``).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, StrictStr
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse

from batchfleet.gateway.batches.expiry import expiry_seconds, form_expiry
from batchfleet.gateway.batches.lines import ENDPOINTS
from batchfleet.gateway.batches.store import LIST_MAX, public, safe_name
from batchfleet.gateway.deps import KEY_CHECKED, Owner, Redis
from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.openai.chat.request import STRICT, parse
from batchfleet.gateway.service import tenant_of
from batchfleet.gateway.strict import query_limit, read_json

WINDOW_RE = re.compile(r"([1-9][0-9]{0,5})([smh])")  # OpenAI accepts "24h"; shorter windows are ours
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600
FILES_LIST_MAX = 10_000


class CreateBatch(BaseModel):
    model_config = STRICT
    input_file_id: StrictStr
    endpoint: StrictStr
    completion_window: StrictStr = "24h"
    metadata: dict[StrictStr, StrictStr] | None = Field(default=None, max_length=16)
    output_expires_after: dict[StrictStr, Any] | None = None  # gateway/batches/expiry.py


def window_seconds(window: str) -> int:
    m = WINDOW_RE.fullmatch(window)
    seconds = int(m.group(1)) * WINDOW_UNITS[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise invalid(f"completion_window must be like '24h' (at most 7 days), got {window[:50]!r}",
                      "completion_window")
    return seconds


router = APIRouter(dependencies=KEY_CHECKED)


@router.post("/v1/files")
async def upload_file(request: Request, owner: Owner, redis: Redis) -> Any:
    files = redis.files
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > files.max_bytes + (1 << 20):
        raise APIError(413, f"file over {files.max_bytes >> 20} MiB", "invalid_request_error",
                       "file_too_large", "file")
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # noqa: BLE001 - any multipart the parser refuses is the client's
        raise invalid(f"the body must be multipart/form-data with 'file' and 'purpose': {exc}"[:300]) from None
    try:  # the parts are spooled to temporary files: closed (deleted) whatever happens
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise invalid("missing 'file' (multipart/form-data)", "file")
        if not isinstance(purpose, str):
            raise invalid("missing 'purpose' (use 'batch')", "purpose")
        expires_s = form_expiry({k: v for k, v in form.items() if isinstance(v, str)})
        return public(await files.upload(owner, upload.filename or "upload.jsonl", purpose, upload.file, expires_s))
    finally:
        await form.close()


@router.get("/v1/files")
async def list_files(request: Request, owner: Owner, redis: Redis) -> Any:
    return await redis.files.list(owner, request.query_params.get("purpose"), request.query_params.get("after"),
                                  query_limit(request, FILES_LIST_MAX, FILES_LIST_MAX))


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, owner: Owner, redis: Redis) -> Any:
    return public(await redis.files.get(owner, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, owner: Owner, redis: Redis) -> Any:
    files = redis.files
    meta = await files.get(owner, file_id)
    path = files.path(meta["id"])
    if not os.path.exists(path):  # recorded in Redis, but not in this gateway's directory
        raise APIError(500, f"file {file_id} is not in this gateway's --files-dir: every gateway of a fleet "
                       "must mount the same files volume", "server_error", "file_unavailable")
    return FileResponse(path, media_type="application/jsonl", filename=safe_name(meta["filename"]))


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, owner: Owner, redis: Redis) -> Any:
    return await redis.files.delete(owner, file_id)


@router.post("/v1/batches")
async def create_batch(request: Request, owner: Owner, redis: Redis) -> Any:
    files, batches = redis.files, redis.batches
    body = parse(CreateBatch, await read_json(request, redis.config.max_body_bytes))
    if body.endpoint not in ENDPOINTS:
        raise invalid(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.metadata and any(len(k) > 64 or len(v) > 512 for k, v in body.metadata.items()):
        raise invalid("metadata keys are at most 64 characters, values at most 512", "metadata")
    seconds = window_seconds(body.completion_window)
    output_expires_s = expiry_seconds(body.output_expires_after, "output_expires_after")
    try:
        source = await files.get(owner, body.input_file_id)
    except APIError:
        raise APIError(404, f"no file with id {body.input_file_id[:100]!r}", "invalid_request_error",
                       "not_found", "input_file_id") from None
    if source["purpose"] != "batch":
        raise invalid("input_file_id must name a file uploaded with purpose 'batch'", "input_file_id")
    now = int(time.time())
    doc = {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": body.endpoint, "errors": None,
           "input_file_id": body.input_file_id, "completion_window": body.completion_window,
           "status": "validating", "output_file_id": None, "error_file_id": None, "created_at": now,
           "in_progress_at": None, "expires_at": now + seconds, "finalizing_at": None, "completed_at": None,
           "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
           "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata,
           "model": None, "usage": None}
    run = {"output": files.new_id(), "errors": files.new_id(), "prefix": "q" + secrets.token_hex(8),
           "inbox": secrets.token_urlsafe(24), "output_expires_s": output_expires_s, "tenant": tenant_of(request)}
    await batches.create(owner, doc, run)
    return public(doc)


@router.get("/v1/batches")
async def list_batches(request: Request, owner: Owner, redis: Redis) -> Any:
    return await redis.batches.list(owner, request.query_params.get("after"), query_limit(request, 20, LIST_MAX))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, owner: Owner, redis: Redis) -> Any:
    return public(await redis.batches.get(owner, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, owner: Owner, redis: Redis) -> Any:
    return public(await redis.batches.cancel(owner, batch_id))
