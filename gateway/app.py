"""The OpenAI-compatible HTTP app: ``create_app(config)`` -> a FastAPI app over one AsyncClient.

    POST /v1/completions        POST /v1/chat/completions   GET /v1/models   (gateway/openai/chat/routes.py)
    POST /v1/responses, GET/DELETE /v1/responses/{id}, GET .../input_items  the Responses API
    (gateway/openai/responses/routes.py)
    POST /v1/embeddings         embeddings on the same fleet (gateway/openai/embeddings/routes.py)
    /v1/files, /v1/batches      the OpenAI Batch API (gateway/batches/routes.py; run by gateway/batches/runner.py)
    POST /tokenize, /detokenize vLLM's tokenizer routes                       (gateway/openai/chat/tokenize.py)
    GET  /health, /version      GET /dashboard, /dashboard/data, /metrics     (gateway/dashboard.py)

The app holds no model: it validates, hands the job to the fleet through AsyncClient and shapes the
answer. Its Redis connections (gateway/connections.py) are made in the lifespan (startup) and closed at
shutdown, so every request shares their bounded pools. The routes live on module-level routers; they
reach this state through gateway/deps.py, and the API-key check is a dependency of each keyed router.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from batchfleet.gateway import dashboard
from batchfleet.gateway.batches import routes as batch_api
from batchfleet.gateway.batches.runner import BatchRunner
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.connections import ClientFactory, GatewayRedis, producer_client
from batchfleet.gateway.handlers import add_error_handlers, endpoints
from batchfleet.gateway.metrics import HTTPMetrics, MetricsMiddleware
from batchfleet.gateway.openai.chat import routes as inference
from batchfleet.gateway.openai.chat import tokenize
from batchfleet.gateway.openai.embeddings import routes as embeddings
from batchfleet.gateway.openai.responses import routes as responses
from batchfleet.gateway.service import Gateway
from batchfleet.producer.ops.history import HistorySampler

ROUTERS = (inference.router, responses.router, embeddings.router, batch_api.router, tokenize.router,
           dashboard.router)


def create_app(config: GatewayConfig | None = None, client_factory: ClientFactory = producer_client,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The gateway app; ``client_factory(config)`` makes its AsyncClient at startup; its HTTP metrics go
    to ``registry`` (default: a fresh one, ``app.state.metrics.registry``)."""
    app = FastAPI(title="batchfleet gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config or GatewayConfig()
    app.state.client_factory = client_factory
    app.state.metrics = HTTPMetrics(registry)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    add_error_handlers(app)
    app.state.endpoints = endpoints(ROUTERS)  # an unknown route's 404 names them
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the connections, register the fleet's queue gauges (gateway/metrics.py), start the batch runner
    (unless ``--no-batch-runner``) and the dashboard's history sampler (producer/ops/history.py); undo them at
    shutdown."""
    config: GatewayConfig = app.state.config
    metrics: HTTPMetrics = app.state.metrics
    await asyncio.to_thread(metrics.add_queue_gauges, config.connection)  # a cluster client connects: off the loop
    redis = app.state.redis = GatewayRedis(config, app.state.client_factory)
    app.state.gateway = Gateway(config, redis.client)
    runner = BatchRunner(config, redis.files, redis.batches) if config.batch_runner else None
    serving = asyncio.ensure_future(runner.serve()) if runner is not None else None
    sampler = HistorySampler(redis.dashboard(), config.connection.keys).start()
    try:
        yield
    finally:
        await asyncio.to_thread(sampler.close)
        if runner is not None and serving is not None:
            serving.cancel()
            await runner.close()
        await redis.aclose()
        metrics.remove_queue_gauges()
