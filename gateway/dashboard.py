"""The operators' routes: ``GET /health`` and ``GET /version`` (no key needed: a load balancer's health check;
vLLM's ``{"version"}``, here batchfleet's), ``GET /dashboard`` and ``GET /favicon.ico`` (the static page, which
holds no data, and its icon), and
the fleet's state: ``GET /dashboard/data`` (the JSON the page polls and ``batchfleet status --gateway``
reads) and ``GET /metrics`` (Prometheus text, as vLLM serves it on its API port: what ``--metrics-port``
serves too). Those two need a read-only operator key when ``--operator-key`` is set, else an API key when
keys are set (gateway/deps.py ``operator``).

Both read Redis with sync clients (the dashboard's data is producer/ops/dashboard.py's, the same as
``batchfleet dashboard``, on the dashboard's own small pool, gateway/connections.py; the queue gauges on the
metrics' own, common/metrics.py), so they run in a worker thread (``run_in_threadpool``), never on the event
loop serving completions.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from batchfleet.common.errors import RedisUnavailable
from batchfleet.gateway.deps import OPERATOR_CHECKED, Redis, Service
from batchfleet.gateway.errors import APIError, invalid
from batchfleet.producer.ops.dashboard import (
    DATA_PATH,
    FAVICON,
    FAVICON_HEADERS,
    FAVICON_PATH,
    FAVICON_TYPE,
    PAGE,
    PAGE_PATH,
    dashboard_data,
    history_after,
)

NO_STORE = {"Cache-Control": "no-store"}

router = APIRouter()  # open to anyone: the fleet's state checks its own keys (operator keys, not the API's)


@router.get("/health")
async def health(gateway: Service) -> Any:
    status, body = await gateway.health()
    return JSONResponse(body, status_code=status)


@router.get("/version")
async def server_version() -> Any:
    try:
        return {"version": version("batchfleet")}
    except PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}


@router.get(PAGE_PATH)
async def dashboard_page() -> Any:
    return HTMLResponse(PAGE, headers=NO_STORE)


@router.get(FAVICON_PATH, include_in_schema=False)
async def favicon() -> Any:
    return Response(FAVICON, media_type=FAVICON_TYPE, headers=FAVICON_HEADERS)


@router.get(DATA_PATH, dependencies=OPERATOR_CHECKED)
async def dashboard_json(request: Request, redis: Redis) -> Any:
    try:
        after = history_after(request.query_params.get("history_after"))
    except ValueError as exc:
        raise invalid(str(exc), "history_after") from None
    try:
        body = await run_in_threadpool(dashboard_data, redis.dashboard(), redis.config.connection.keys, after)
    except RedisUnavailable as exc:
        raise APIError(503, str(exc), "service_unavailable", "redis_unavailable") from None
    return JSONResponse(body, headers=NO_STORE)


@router.get("/metrics", dependencies=OPERATOR_CHECKED)
async def metrics(request: Request) -> Any:
    """The gateway's registry (gateway/metrics.py: its HTTP metrics and the fleet's queue gauges, read from
    Redis at each scrape, at most common/metrics.py's SCRAPE_TIMEOUT_S)."""
    body = await run_in_threadpool(generate_latest, request.app.state.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)
