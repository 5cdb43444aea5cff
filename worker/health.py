"""Readiness check for containers: exit 0 when a worker of THIS host sent a heartbeat recently.

``python -m batchfleet.worker.health`` is the compose healthcheck and the Kubernetes readiness probe
of a worker: a worker is ready once its model is loaded and its heartbeat is in ``<ns>:workers``
(scored with Redis' own clock), so dependants never race the first model build with a sleep. Reads
BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE / BATCHFLEET_WORKER_NAME like the worker; imports no torch.
"""

from __future__ import annotations

import os
import socket
import sys

import redis

from batchfleet.common.config import connection_from_env
from batchfleet.common.fleetstate import live_workers
from batchfleet.common.keys import Keys
from batchfleet.common.redis_conn import sync_client

FRESH_MS = 10_000  # heartbeats come every 2-5 s (5 s idle); 10 s without one is not ready (the live window is 30 s)


def ready(r: redis.Redis, keys: Keys, name: str | None = None, host: str | None = None,
          within_ms: int = FRESH_MS) -> bool:
    """Whether the worker ``name`` (or, without a name, any worker named ``<host>-...``, the default
    consumer name) has a fresh heartbeat."""
    prefix = f"{host or socket.gethostname()}-"
    live = live_workers(r, keys, within_ms)
    return (name in live) if name else any(w.startswith(prefix) for w in live)


def main() -> int:
    conn = connection_from_env()
    try:
        r = sync_client(conn.redis_url, socket_timeout=5, socket_connect_timeout=5)
        ok = ready(r, conn.keys, os.environ.get("BATCHFLEET_WORKER_NAME") or None)
    except (redis.RedisError, OSError) as exc:
        print(f"not ready: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("not ready: no fresh heartbeat from this host's worker", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
