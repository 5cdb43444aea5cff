"""``batchfleet serve``: the OpenAI-compatible gateway on uvicorn (needs ``pip install batchfleet[serve]``)."""

from __future__ import annotations

import logging

import click

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.options import config_options, config_values, fatal, log_options
from batchfleet.gateway.config import GatewayConfig

GRACEFUL_SHUTDOWN_S = 10  # open streams get this long to finish on Ctrl-C / SIGTERM, then are cancelled


def build_gateway_config(**values) -> GatewayConfig:
    """A GatewayConfig from parsed option values (connection options included)."""
    return GatewayConfig(connection=ConnectionConfig(**config_values(ConnectionConfig, values)),
                         **config_values(GatewayConfig, values))


@click.command()
@config_options(ConnectionConfig, GatewayConfig)
@log_options
def serve(**values) -> None:
    """Serve the fleet over an OpenAI-compatible HTTP API. Holds no model: run workers with
    `batchfleet worker`. Every route it serves:

    \b
    completions, chat:  POST /v1/completions, POST /v1/chat/completions
    models:             GET /v1/models, GET /v1/models/{model_id}
    Responses API:      POST /v1/responses, GET|DELETE /v1/responses/{response_id},
                        GET /v1/responses/{response_id}/input_items
    embeddings:         POST /v1/embeddings
    Batch API, files:   POST|GET /v1/files, GET|DELETE /v1/files/{file_id},
                        GET /v1/files/{file_id}/content
    Batch API, batches: POST|GET /v1/batches, GET /v1/batches/{batch_id},
                        POST /v1/batches/{batch_id}/cancel
    vLLM's:             POST /tokenize, POST /detokenize, GET /version, GET /metrics
    operators:          GET /health, GET /dashboard, GET /dashboard/data
    """
    # imported here: `batchfleet --help` lists this command on a client-only install (common/cli.py says
    # which extra to install before this runs)
    import uvicorn

    from batchfleet.gateway.app import create_app

    try:
        config = build_gateway_config(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    app = create_app(config)
    if config.metrics_port:  # the fleet's queue gauges and this gateway's HTTP metrics, one endpoint
        from batchfleet.common.metrics import MetricsPortInUse
        from batchfleet.gateway.metrics import serve_gateway_metrics

        try:
            serve_gateway_metrics(app.state.metrics, config.metrics_port, config.metrics_host)
        except MetricsPortInUse as exc:
            raise fatal(str(exc)) from None
    auth = f"{len(config.api_keys)} API key(s)" if config.api_keys else "no API key (anyone may call it)"
    if config.operator_keys:
        auth += f", {len(config.operator_keys)} read-only operator key(s) for /dashboard"
    logging.getLogger(__name__).info("batchfleet gateway on http://%s:%d/v1 for namespace %r, %s", config.host,
                                     config.port, config.connection.namespace, auth)
    # log_config=None: uvicorn's loggers follow the logging `batchfleet --log-level` set up
    uvicorn.run(app, host=config.host, port=config.port, log_config=None,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


HTTP_ONLY = ("host", "port", "api_keys", "operator_keys", "metrics_port", "metrics_host", "batch_runner",
             "request_timeout_s", "max_file_mb")


@click.command()
@config_options(ConnectionConfig, GatewayConfig, exclude=HTTP_ONLY)
@log_options
def batches(**values) -> None:
    """Run OpenAI batches (/v1/batches) without serving HTTP: start as many as you like beside gateways run
    with --no-batch-runner; a lease in Redis lets exactly one process run each batch. Use the gateways'
    --files-dir (a shared volume) and --served-model-name."""
    import asyncio

    from batchfleet.gateway.batches.runner import BatchRunner
    from batchfleet.gateway.connections import GatewayRedis

    try:
        config = build_gateway_config(**values)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc

    async def run() -> None:
        redis = GatewayRedis(config)
        runner = BatchRunner(config, redis.files, redis.batches)
        logging.getLogger(__name__).info("batch runner for namespace %r, files in %s", config.connection.namespace,
                                         config.files_dir)
        try:
            await runner.serve()
        finally:
            await runner.close()
            await redis.aclose()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
