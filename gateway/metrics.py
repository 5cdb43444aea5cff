"""The gateway's own HTTP metrics (Prometheus), beside the fleet's queue gauges and the work it runs
(gateway/work_metrics.py), its demand, what KEDA scales the workers on (gateway/demand_metrics.py), and its usage
per tenant (gateway/tenant_metrics.py; all registered at the app's startup) and this process' standard metrics,
served on the API port's ``/metrics`` (gateway/dashboard.py) and on ``--metrics-port``:

    batchfleet_gateway_requests_total{route, method, status}       requests answered
    batchfleet_gateway_request_duration_seconds{route, method}     latency histogram (a stream: until its last byte)
    batchfleet_gateway_requests_in_progress                        requests being served now

``route`` is the matched route's template (``/v1/models/{model_id}``), ``unmatched`` for any other path, so
a scanner cannot grow the label set. A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: that one
buffers nothing but reads ``receive`` itself, which would hide a client's disconnect from the streams.
A client gone before any answer counts as status 499.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.metrics import (
    MetricsServer,
    QueueCollector,
    queue_collector,
    serve_metrics,
    with_process_metrics,
)
from batchfleet.gateway.demand_metrics import DemandCollector
from batchfleet.gateway.tenant_metrics import TenantCollector, refusals_counter
from batchfleet.gateway.work_metrics import WorkCollector

CLIENT_CLOSED = 499
# from a cached /v1/models (ms) to a long generation (minutes)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class HTTPMetrics:
    """The metric families, registered in ``registry`` (a fresh one per app: never the global registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter("batchfleet_gateway_requests", "HTTP requests answered by the gateway.",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("batchfleet_gateway_request_duration_seconds", "Time from a request's arrival "
                                 "to its answer's last byte.", ["route", "method"], buckets=BUCKETS,
                                 registry=self.registry)
        self.in_progress = Gauge("batchfleet_gateway_requests_in_progress", "Requests being served.",
                                 registry=self.registry)
        self.rate_limited = refusals_counter(self.registry)
        with_process_metrics(self.registry)  # process_*, python_gc_*, python_info: on both ports
        self.queues: QueueCollector | None = None
        self.work: WorkCollector | None = None
        self.demand: DemandCollector | None = None
        self.tenants: TenantCollector | None = None

    def add_queue_gauges(self, conn: ConnectionConfig) -> None:
        """Register the fleet's queue gauges and live-worker count (common/metrics.py) and the work it runs
        (batch jobs and bulk runs: gateway/work_metrics.py), read from Redis at each scrape. Blocking: a Redis
        Cluster client connects as it is made."""
        self.queues = queue_collector(conn)
        self.registry.register(self.queues)
        self.work = WorkCollector(conn)
        self.registry.register(self.work)
        self.demand = DemandCollector(conn)  # what KEDA scales the workers on (gateway/demand_metrics.py)
        self.registry.register(self.demand)
        self.tenants = TenantCollector(conn)
        self.registry.register(self.tenants)

    def remove_queue_gauges(self) -> None:
        for collector in (self.queues, self.work, self.demand, self.tenants):
            if collector is not None:
                self.registry.unregister(collector)
                collector.close()
        self.queues = self.work = self.demand = self.tenants = None


class MetricsMiddleware:
    """ASGI middleware counting every HTTP request of ``app`` in ``metrics``."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = CLIENT_CLOSED

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_progress.inc()
        try:
            await self.app(scope, receive, sending)
        except Exception:
            if status == CLIENT_CLOSED:  # nothing sent yet: the server answers 500
                status = 500
            raise
        finally:
            self.metrics.in_progress.dec()
            route = getattr(scope.get("route"), "path", None) or "unmatched"  # set by the router once matched
            method = scope.get("method", "")
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route, method).observe(time.monotonic() - start)


def serve_gateway_metrics(metrics: HTTPMetrics, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``metrics`` (with the fleet's queue gauges once the app started) on http://host:port/metrics
    (port 0: any free one), without a key: ``host`` decides who reaches it. MetricsPortInUse when the port
    is taken."""
    return serve_metrics(metrics.registry, port, host)
