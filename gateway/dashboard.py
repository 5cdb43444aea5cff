"""The operators' routes: ``GET /health``, ``GET /dashboard`` and ``GET /favicon.ico`` (no key needed: the
health check of a load balancer; the static page, which holds no data; its icon) and ``GET /dashboard/data`` (the
JSON the page polls
and ``batchfleet status --gateway`` reads; needs a read-only operator key when ``--operator-key`` is set,
else an API key when keys are set: producer/ops/dashboard.py ``access``).

The data is producer/ops/dashboard.py's (the same as ``batchfleet dashboard``): sync status reads, made on
the dashboard's own small pool (gateway/connections.py) in a worker thread (``run_in_threadpool``),
never on the event loop serving completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from batchfleet.common.errors import RedisUnavailable
from batchfleet.gateway.deps import Redis, Service
from batchfleet.gateway.errors import APIError, invalid
from batchfleet.producer.ops.dashboard import (
    ACCESS_ERRORS,
    DATA_PATH,
    FAVICON,
    FAVICON_HEADERS,
    FAVICON_PATH,
    FAVICON_TYPE,
    PAGE,
    PAGE_PATH,
    access,
    dashboard_data,
    history_after,
)

NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter()  # open to anyone: /dashboard/data checks its own keys (operator keys, not the API's)


@router.get("/health")
async def health(gateway: Service) -> Any:
    status, body = await gateway.health()
    return JSONResponse(body, status_code=status)


@router.get(PAGE_PATH)
async def dashboard_page() -> Any:
    return HTMLResponse(PAGE, headers=NO_STORE)


@router.get(FAVICON_PATH, include_in_schema=False)
async def favicon() -> Any:
    return Response(FAVICON, media_type=FAVICON_TYPE, headers=FAVICON_HEADERS)


@router.get(DATA_PATH)
async def dashboard_json(request: Request, redis: Redis) -> Any:
    status = access(request.headers.get("authorization"), redis.config.api_keys, redis.config.operator_keys)
    if status != 200:
        message, code = ACCESS_ERRORS[status]
        raise APIError(status, message, "invalid_request_error" if status == 401 else "permission_error", code,
                       headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
    try:
        after = history_after(request.query_params.get("history_after"))
    except ValueError as exc:
        raise invalid(str(exc), "history_after") from None
    try:
        body = await run_in_threadpool(dashboard_data, redis.dashboard(), redis.config.connection.keys, after)
    except RedisUnavailable as exc:
        raise APIError(503, str(exc), "service_unavailable", "redis_unavailable") from None
    return JSONResponse(body, headers=NO_STORE)
