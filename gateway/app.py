"""The OpenAI-compatible HTTP app: ``create_app(config)`` -> a FastAPI app over one AsyncClient.

    POST /v1/completions        POST /v1/chat/completions   (``stream: true``: server-sent events)
    GET  /v1/models             GET  /health (no key needed: Redis reachable + live workers)
    /v1/files, /v1/batches      the OpenAI Batch API (gateway/batch_api.py; run by gateway/batch_runner.py)
    GET  /dashboard             GET  /dashboard/data (the live dashboard, gateway/dashboard.py)

The app holds no model: it validates, hands the job to the fleet through AsyncClient and shapes the
answer. One AsyncClient per app, made in the lifespan (startup) and closed at shutdown, so every request
shares its bounded Redis connections.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from batchfleet.common.errors import BatchfleetError
from batchfleet.common.protocol import FleetInfo
from batchfleet.gateway.batch_api import add_batch_routes
from batchfleet.gateway.batch_runner import BatchRunner
from batchfleet.gateway.batch_store import BatchStore, FileStore
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.dashboard import add_dashboard
from batchfleet.gateway.dashboard import close as close_dashboard
from batchfleet.gateway.errors import APIError, api_error
from batchfleet.gateway.metrics import HTTPMetrics, MetricsMiddleware
from batchfleet.gateway.schemas import request_job
from batchfleet.gateway.service import CLIENT_CLOSED, Gateway
from batchfleet.gateway.strict import read_json
from batchfleet.producer import AsyncClient

log = logging.getLogger(__name__)


def default_client(config: GatewayConfig) -> AsyncClient:
    return AsyncClient(config.connection.redis_url, config.connection.namespace)


def create_app(config: GatewayConfig | None = None,
               client_factory: Callable[[GatewayConfig], AsyncClient] = default_client,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The gateway app; ``client_factory(config)`` makes its AsyncClient at startup; its HTTP metrics go
    to ``registry`` (default: a fresh one, ``app.state.metrics.registry``)."""
    config = config or GatewayConfig()
    metrics = HTTPMetrics(registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = client_factory(config)
        app.state.gateway = Gateway(config, client)
        app.state.files = FileStore(client.r, client.keys, config.files_dir, config.max_file_mb << 20)
        app.state.batches = BatchStore(client.r, client.keys)
        runner = BatchRunner(config, app.state.files, app.state.batches) if config.batch_runner else None
        serving = asyncio.ensure_future(runner.serve()) if runner is not None else None
        try:
            yield
        finally:
            if runner is not None and serving is not None:
                serving.cancel()
                await runner.close()
            await client.aclose()
            close_dashboard(app)

    app = FastAPI(title="batchfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    for exc_type in (APIError, BatchfleetError, ValueError, Exception):
        app.add_exception_handler(exc_type, _error_response)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _error_response)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        gateway = _gateway(request)
        gateway.authorize(request)
        job = request_job(False, await read_json(request), config.request_timeout_s, config.chat_max_tokens)
        return await gateway.complete(request, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        gateway = _gateway(request)
        gateway.authorize(request)
        job = request_job(True, await read_json(request), config.request_timeout_s, config.chat_max_tokens)
        return await gateway.complete(request, job, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        gateway = _gateway(request)
        gateway.authorize(request)
        info = (await gateway.client.fleet()).info
        return {"object": "list", "data": [_model(name, info) for name in await gateway.model_names()]}

    @app.get("/v1/models/{model_id:path}")  # :path: ids like "org/model" hold a slash
    async def model(request: Request, model_id: str) -> Any:
        gateway = _gateway(request)
        gateway.authorize(request)
        await gateway.check_model(model_id, param=None)
        return _model(model_id, (await gateway.client.fleet()).info)

    @app.get("/health")
    async def health(request: Request) -> Any:
        status, body = await _gateway(request).health()
        return JSONResponse(body, status_code=status)

    add_batch_routes(app)
    add_dashboard(app, config)

    return app


def _model(name: str, info: FleetInfo) -> dict[str, Any]:
    """A model object in OpenAI's shape (plus vLLM's max_model_len and the largest prompt bucket)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchfleet",
            "max_model_len": info.max_seq_len, "max_prompt_tokens": info.buckets[-1]}


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


async def _error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientDisconnect):  # gone before its body was read: nobody to answer, nothing wrong
        log.debug("%s %s: client disconnected before sending its body", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)
    err = api_error(exc)
    if err.status == 500:
        log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (404 unknown path, 405 wrong method) with an OpenAI error body."""
    assert isinstance(exc, HTTPException)
    err = APIError(exc.status_code, str(exc.detail), "invalid_request_error", None)
    return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}))
