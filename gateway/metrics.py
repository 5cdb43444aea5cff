"""The gateway's own Prometheus metrics: HTTP requests by route and status, and their latency.

    batchfleet_gateway_requests_total{route, status}          counter
    batchfleet_gateway_request_duration_seconds{route}         histogram (until the last byte, streams too)

Measured by a plain ASGI middleware (``HttpMetrics``) around the whole app, so error responses and
streamed answers count like any other. ``route`` is the route's path template (``/v1/completions``), or
``other`` for paths no route matched: the label set stays bounded whatever clients send. Served on the
gateway's ``--metrics-port`` with the fleet's queue gauges (gateway/cli.py).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.metrics import MetricsServer, queue_collector, registry_with, serve_metrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """The counters and histogram, in a registry of their own (never prometheus_client's global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.requests = Counter("batchfleet_gateway_requests", "HTTP requests answered, by route and status code.",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("batchfleet_gateway_request_duration_seconds", "From request to the last byte of "
                                 "the response (a stream: its end), by route.", ["route"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)


class HttpMetrics:
    """ASGI middleware: one observation per HTTP request, when its response ends (or the client left)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = {"code": 500}  # an exception that escapes every handler is a 500 to the client

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            self.metrics.observe(path, status["code"], time.monotonic() - start)


def serve_gateway_metrics(metrics: GatewayMetrics, conn: ConnectionConfig, port: int,
                          host: str = "0.0.0.0") -> MetricsServer:
    """Serve ``metrics`` and the fleet's queue gauges (and live-worker count) on http://host:port/metrics
    (port 0: any free one). MetricsPortInUse when the port is taken."""
    return serve_metrics(registry_with(queue_collector(conn), registry=metrics.registry), port, host)
