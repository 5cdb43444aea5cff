"""A Prometheus collector whose gauges are read from Redis at each scrape (the demand, work and tenant gauges):
its own small pool with short timeouts (gateway/connections.py ``metrics_client``), one read at a time (the HTTP
server may scrape from several threads), and a scrape that still answers, without these gauges, when Redis does not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.errors import RedisUnavailable
from batchfleet.gateway.connections import metrics_client

log = logging.getLogger(__name__)


class ScrapedCollector(Collector):
    """Subclasses say what they read (``read``, under the lock) and which errors mean "Redis did not answer"."""

    what = "gauges"  # for the log line of a scrape without them
    unavailable: tuple[type[BaseException], ...] = (RedisUnavailable,)

    def __init__(self, conn: ConnectionConfig) -> None:
        self.keys = conn.keys
        self.r = metrics_client(conn)
        self._lock = threading.Lock()

    def read(self) -> Iterable[GaugeMetricFamily]:
        raise NotImplementedError

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            with self._lock:
                families = list(self.read())
        except self.unavailable as exc:
            log.debug("%s not read: %s", self.what, exc)
            return
        yield from families

    def close(self) -> None:
        self.r.close()
