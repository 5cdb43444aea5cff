"""The live dashboard on the gateway: ``GET /dashboard`` (the static page, no data: served to anyone) and
``GET /dashboard/data`` (the JSON it polls; needs the API key when keys are set, like /v1/*).

The data is producer/dashboard.py's (the same as ``batchfleet dashboard``): the status reads, made by a
small sync pool of their own in a worker thread (``run_in_threadpool``), never on the event loop serving
completions; every other Redis call of the gateway stays the AsyncClient's.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from batchfleet.common.errors import RedisUnavailable
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.errors import APIError
from batchfleet.producer.dashboard import DATA_PATH, PAGE, PAGE_PATH, dashboard_client, dashboard_data

NO_STORE = {"Cache-Control": "no-store"}


def add_dashboard(app: FastAPI, config: GatewayConfig) -> None:
    """Add the two routes; the Redis pool is made at the first data request and closed with ``close``."""

    @app.get(PAGE_PATH)
    async def dashboard_page() -> Any:
        return HTMLResponse(PAGE, headers=NO_STORE)

    @app.get(DATA_PATH)
    async def dashboard_json(request: Request) -> Any:
        request.app.state.gateway.authorize(request)
        r = getattr(app.state, "dashboard_redis", None)
        if r is None:
            r = app.state.dashboard_redis = dashboard_client(config.connection)
        try:
            body = await run_in_threadpool(dashboard_data, r, config.connection.keys)
        except RedisUnavailable as exc:
            raise APIError(503, str(exc), "service_unavailable", "redis_unavailable") from None
        return JSONResponse(body, headers=NO_STORE)


def close(app: FastAPI) -> None:
    """Close the dashboard's Redis pool, if one was made."""
    r = getattr(app.state, "dashboard_redis", None)
    if r is not None:
        r.close()
        app.state.dashboard_redis = None
