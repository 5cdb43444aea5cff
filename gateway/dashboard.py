"""The operators' routes: ``GET /health`` and ``GET /dashboard`` (no key needed: the health check of a
load balancer; the static page, which holds no data) and ``GET /dashboard/data`` (the JSON the page polls;
needs the API key when keys are set, like /v1/*).

The data is producer/dashboard.py's (the same as ``batchfleet dashboard``): sync status reads, made on
the dashboard's own small pool (gateway/connections.py) in a worker thread (``run_in_threadpool``),
never on the event loop serving completions.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import HTMLResponse, JSONResponse

from batchfleet.common.errors import RedisUnavailable
from batchfleet.gateway.deps import KEY_CHECKED, Redis, Service
from batchfleet.gateway.errors import APIError
from batchfleet.producer.dashboard import DATA_PATH, PAGE, PAGE_PATH, dashboard_data

NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter()  # open to anyone
keyed = APIRouter(dependencies=KEY_CHECKED)


@router.get("/health")
async def health(gateway: Service) -> Any:
    status, body = await gateway.health()
    return JSONResponse(body, status_code=status)


@router.get(PAGE_PATH)
async def dashboard_page() -> Any:
    return HTMLResponse(PAGE, headers=NO_STORE)


@keyed.get(DATA_PATH)
async def dashboard_json(redis: Redis) -> Any:
    try:
        body = await run_in_threadpool(dashboard_data, redis.dashboard(), redis.config.connection.keys)
    except RedisUnavailable as exc:
        raise APIError(503, str(exc), "service_unavailable", "redis_unavailable") from None
    return JSONResponse(body, headers=NO_STORE)
