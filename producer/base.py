"""What the sync and async clients both hold, set up once: the connection config, key names, one
redis-py client (sync or asyncio), the enqueue script, the cached fleet view and the shared backoff."""

from __future__ import annotations

from typing import Any

from batchfleet.common.config import connection_from_env
from batchfleet.producer.core import ENQUEUE_SCRIPT, FleetView, connection_kwargs
from batchfleet.producer.plan import client_backoff


class ClientBase:
    """State shared by Client and AsyncClient; they add the I/O (blocking or awaited) around it."""

    def __init__(self, redis_cls: Any, lock: Any, redis_url: str | None, namespace: str | None,
                 retry_s: float) -> None:
        self.conn = connection_from_env(redis_url, namespace)
        self.keys = self.conn.keys
        # redis-py's pool hands each thread (or task) its own connection, so blocking waits do not serialize.
        self.r = redis_cls.from_url(self.conn.redis_url, **connection_kwargs(self.conn))
        self._enqueue = self.r.register_script(ENQUEUE_SCRIPT)
        self._fleet = FleetView()
        self._lock = lock  # guards the fleet refresh (threading.Lock or asyncio.Lock)
        self.retry_s = retry_s
        self._backoff = client_backoff()
