"""The gateway's Redis, all of it: this module builds every Redis connection a gateway process holds and
hands them out; no other gateway module makes a client (each is built by common/redis/clients.py).

* The AsyncClient (producer/aclient.py): jobs, the fleet description, health, and, on the same bounded
  pool, the files and batches stores and the batch leases (gateway/batches/store.py; the leases through
  the function library of common/redis/functions.py, shared with the client's enqueue and cancel), and the
  stored Responses API responses (gateway/openai/responses/store.py).
* One AsyncClient per batch turn (``producer_client(config, inbox)``): each batch keeps its own inbox
  across turns and processes, so a runner that takes a batch over finds the answers still on their way.
* The dashboard's small sync pool, made at the first ``/dashboard/data``: its reads are the ones
  ``batchfleet dashboard`` and ``batchfleet status`` make (sync redis-py, common/redis/fleetstate.py and
  producer/ops/status.py), so the gateway runs them in a worker thread, never on the event loop.
* With ``--metrics-port``, the work gauges' small sync pool (``metrics_client``, gateway/work_metrics.py): read
  from the metrics server's thread at scrape time, with the short timeout of the queue gauges' own pool
  (common/metrics.py), so a slow Redis delays a scrape, never a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchfleet.common.config import ConnectionConfig
from batchfleet.common.metrics import SCRAPE_TIMEOUT_S
from batchfleet.common.redis.clients import sync_client
from batchfleet.gateway.batches.store import BatchStore, FileStore
from batchfleet.gateway.config import GatewayConfig
from batchfleet.gateway.openai.responses.store import ResponseStore
from batchfleet.producer import AsyncClient
from batchfleet.producer.ops.dashboard import dashboard_client

ClientFactory = Callable[[GatewayConfig], AsyncClient]


def metrics_client(conn: ConnectionConfig) -> Any:
    """The work gauges' sync pool (two connections, SCRAPE_TIMEOUT_S timeouts)."""
    return sync_client(conn.redis_url, socket_timeout=SCRAPE_TIMEOUT_S, socket_connect_timeout=SCRAPE_TIMEOUT_S,
                       max_connections=2, client_name=f"{conn.namespace}:metrics-work")


def producer_client(config: GatewayConfig, inbox: str | None = None, tenant: str = "") -> AsyncClient:
    """An AsyncClient on the gateway's fleet (``inbox``: a batch's own; default: a fresh one; ``tenant``: a batch's,
    whose limits its lines wait out)."""
    return AsyncClient(config.connection.redis_url, config.connection.namespace, inbox=inbox, tenant=tenant)


class GatewayRedis:
    """The connections of one gateway (or ``batchfleet batches``) process: open at startup, ``aclose`` at
    shutdown."""

    def __init__(self, config: GatewayConfig, client_factory: ClientFactory = producer_client) -> None:
        self.config = config
        self.client = client_factory(config)
        self.files = FileStore(self.client.r, self.client.keys, config.files_dir, config.max_file_mb << 20)
        self.batches = BatchStore(self.client.r, self.client.keys, self.client.functions)
        self.responses = ResponseStore(self.client.r, self.client.keys, config.response_ttl_s)
        self._dashboard: Any = None  # a sync redis-py client (this package imports no sync redis: Any)

    def dashboard(self) -> Any:
        """The dashboard's sync pool (producer/ops/dashboard.py ``dashboard_client``), made on first use."""
        if self._dashboard is None:
            self._dashboard = dashboard_client(self.config.connection)
        return self._dashboard

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._dashboard is not None:
            self._dashboard.close()  # sync, but only drops its sockets
            self._dashboard = None
