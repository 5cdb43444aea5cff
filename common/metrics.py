"""Prometheus plumbing any process can use: a registry per process, the fleet-wide queue gauges read from
Redis at scrape time, and the HTTP server.

The queue gauges come from Redis, not from the process, so any one worker (or the gateway) reports every
bucket's queue of the whole fleet. Wiring a process takes one line::

    serve_metrics(registry_with(queue_collector(conn_config)), port)

Whatever registry ``serve_metrics`` serves also gets the standard collectors of a Python process
(prometheus_client's ``process_*``, ``python_gc_*``, ``python_info``): a private registry has none of them
unless they are registered, and operators' dashboards and alerts expect them of every scraped process.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.fleetstate import fleet_info, layout, live_workers, queue_stats
from batchfleet.common.wire.priority import old_name

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0  # a scrape must answer even when Redis does not: queue gauges are then left out

# Per-priority series carry the priority twice for one release: ``priority`` (interactive / background) and the
# deprecated ``class`` (interactive / batch: its old name), so queries written for ``class`` keep working through
# an upgrade (docs/CONFIGURATION.md, "Deprecated names"). Both labels name one series: nothing is counted twice.
PRIORITY_LABELS = ["priority", "class"]


def priority_labels(priority: str) -> list[str]:
    """The label values of ``PRIORITY_LABELS`` for one priority."""
    return [priority, old_name(priority)]


class QueueCollector(Collector):
    """batchfleet_queue_depth / _pending / _oldest_age_seconds {bucket, priority} and batchfleet_workers_live,
    read from Redis per scrape.

    Has its own small connection pool with a short timeout, so a slow Redis delays a scrape by at most
    SCRAPE_TIMEOUT_S and never blocks the process' own Redis traffic. ``buckets`` None: the buckets the
    fleet publishes (none while no fleet is published).
    """

    def __init__(self, conn: ConnectionConfig, buckets: Iterable[int] | None = None, keys: Keys | None = None) -> None:
        self.keys = keys or conn.keys  # with ``buckets``: the fleet's layout (a worker's ``WorkerConfig.keys``)
        self.buckets = tuple(buckets) if buckets is not None else None
        self.r = sync_client(conn.redis_url, socket_timeout=SCRAPE_TIMEOUT_S,  # a Sentinel URL too
                             socket_connect_timeout=SCRAPE_TIMEOUT_S, max_connections=2,
                             client_name=f"{self.keys.namespace}:metrics")
        self._lock = threading.Lock()  # the HTTP server may scrape from several threads

    def describe(self) -> list[GaugeMetricFamily]:
        """Nothing: a registry then registers it without a first read of Redis (a registry that describes
        collectors by collecting would read Redis, and wait on a Redis that is down, at registration)."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("batchfleet_queue_depth", "Entries in a bucket stream not yet delivered to any "
                                  "worker (consumer-group lag).", labels=["bucket", *PRIORITY_LABELS])
        pending = GaugeMetricFamily("batchfleet_queue_pending", "Entries delivered to a worker and not yet "
                                    "answered (consumer-group pending list).", labels=["bucket", *PRIORITY_LABELS])
        age = GaugeMetricFamily("batchfleet_queue_oldest_age_seconds", "Age of the oldest unanswered entry of a "
                                "bucket stream, on Redis' clock (0 when empty).", labels=["bucket", *PRIORITY_LABELS])
        try:
            with self._lock:
                buckets, keys = self.buckets, self.keys
                if buckets is None:
                    info = fleet_info(self.r, self.keys)
                    buckets = info.buckets if info is not None else ()
                    keys = layout(keys, info)  # a sharded fleet: its queues summed over its shards
                stats = queue_stats(self.r, keys, buckets)
                live = len(live_workers(self.r, self.keys))
        except redis.RedisError as exc:  # Redis down: the scrape still answers, without queue gauges
            log.debug("queue gauges not read: %r", exc)
            return
        for q in stats:
            depth.add_metric([str(q.bucket), *priority_labels(q.priority)], q.depth)
            pending.add_metric([str(q.bucket), *priority_labels(q.priority)], q.pending)
            age.add_metric([str(q.bucket), *priority_labels(q.priority)], q.oldest_age_s)
        yield depth
        yield pending
        yield age
        yield GaugeMetricFamily("batchfleet_workers_live", "Workers with a heartbeat within the live window (the "
                                "set producers check), fleet-wide.", value=live)

    def close(self) -> None:
        self.r.close()


def queue_collector(conn_config: ConnectionConfig, buckets: Iterable[int] | None = None,
                    keys: Keys | None = None) -> QueueCollector:
    """The fleet-wide queue gauges for ``conn_config``'s namespace (register it in a CollectorRegistry)."""
    return QueueCollector(conn_config, buckets, keys)


class MetricsPortInUse(ConfigError):
    """The metrics port cannot be bound (another process holds it, or no permission)."""


def registry_with(*collectors: Collector, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """A fresh registry (never prometheus_client's global one; or ``registry``) holding ``collectors``."""
    registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


class MetricsServer:
    """The running /metrics HTTP server (a daemon thread); ``close`` stops it and frees the port."""

    def __init__(self, server: Any, thread: threading.Thread, registry: CollectorRegistry) -> None:
        self.server = server
        self.thread = thread
        self.registry = registry  # what it serves (collectors may be added while it runs)
        self.port = int(server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


_WITH_PROCESS: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()  # registries given the process collectors


def with_process_metrics(registry: CollectorRegistry) -> CollectorRegistry:
    """``registry`` plus this process' standard metrics (``process_resident_memory_bytes``,
    ``process_cpu_seconds_total``, ``process_open_fds``, ... from /proc; ``python_gc_*``; ``python_info``),
    registered once however often it is called."""
    if registry not in _WITH_PROCESS:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        _WITH_PROCESS.add(registry)
    return registry


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` (with this process' standard metrics: ``with_process_metrics``) on
    http://addr:port/metrics from a thread (port 0: any free port, see .port). The port is bound here
    (MetricsPortInUse when it cannot be): a registry may be filled afterwards."""
    with_process_metrics(registry)
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise MetricsPortInUse(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc} (another worker "
                               "on this host has --metrics-port "
                               f"{port}? give each its own, or 0 for none)") from None
    log.info("metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return MetricsServer(server, thread, registry)


def reserve_metrics(port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Bind ``port`` now and serve an empty registry (``.registry``) that is filled later: a process checks
    its metrics port before its slow start (a worker: before importing torch and loading the model)."""
    return serve_metrics(CollectorRegistry(auto_describe=False), port, addr)
