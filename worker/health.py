"""Readiness and liveness checks for containers: exit 0 when a worker of THIS host sent a heartbeat recently.

``python -m batchfleet.worker.health`` is the compose healthcheck and the Kubernetes readiness probe
of a worker: a worker is ready once it serves: its heartbeat is fresh in ``<ns>:workers`` (scored with Redis'
own clock) and its status ``<ns>:worker:<name>`` is there, which only its loop publishes, once the model is
loaded, the kernels chosen, the fleet joined and its read-ahead thread reading the streams (joining alone makes
a worker live, not ready). Dependants never race the first model build with a sleep. Reads
BATCHFLEET_REDIS_URL / BATCHFLEET_NAMESPACE / BATCHFLEET_WORKER_NAME like the worker; imports no torch.

``--live`` is the liveness probe: it fails only when Redis answers and this worker's heartbeat is older than
LIVE_MS (its process is wedged, or its loop stalled past --stall-timeout-s and stopped beating). A Redis that
does not answer is not this pod's fault: restarting every worker during a Redis outage would only add model
loads to it, so the check passes (and says why) then.
"""

from __future__ import annotations

import os
import socket
import sys

import redis

from batchfleet.common.config import connection_from_env
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.fleetstate import live_workers

FRESH_MS = 10_000  # heartbeats come every 2-5 s (5 s idle); 10 s without one is not ready (the live window is 30 s)
LIVE_MS = 60_000  # the lease keeper beats every 2.5 s even during a long engine step: a minute without is wedged


def ready(r: redis.Redis, keys: Keys, name: str | None = None, host: str | None = None,
          within_ms: int = FRESH_MS, serving: bool = True) -> bool:
    """Whether the worker ``name`` (or, without a name, any worker named ``<host>-...``, the default
    consumer name) has a fresh heartbeat and (``serving``) has published its status: its loop runs."""
    prefix = f"{host or socket.gethostname()}-"
    live = live_workers(r, keys, within_ms)
    names = [w for w in live if (w == name if name else w.startswith(prefix))]
    return any(not serving or r.exists(keys.worker(w)) for w in names)


def main(argv: list[str] | None = None) -> int:
    live = "--live" in (sys.argv[1:] if argv is None else argv)
    conn = connection_from_env()
    try:
        r = sync_client(conn.redis_url, socket_timeout=5, socket_connect_timeout=5)
        ok = ready(r, conn.keys, os.environ.get("BATCHFLEET_WORKER_NAME") or None,
                   within_ms=LIVE_MS if live else FRESH_MS, serving=not live)
    except (redis.RedisError, OSError) as exc:
        if live:
            print(f"live (not judged: Redis did not answer: {exc})", file=sys.stderr)
            return 0
        print(f"not ready: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"not {'live' if live else 'ready'}: no fresh heartbeat{'' if live else ' and status'} from this "
              "host's worker", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
