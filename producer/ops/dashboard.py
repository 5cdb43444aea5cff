"""The live web dashboard: its data (one JSON object polled by the page), its key check, and the
stand-alone server of ``batchfleet dashboard``. The gateway serves the same page and data at
``/dashboard`` and ``/dashboard/data`` (gateway/dashboard.py).

The page (producer/ops/dashboard.html) is one static HTML file with its script inline (no front-end build
step, no external assets: its icon, producer/ops/favicon.svg, is inlined as a data URL) and no data in it, so it
is served to anyone;
the data needs ``Authorization: Bearer <key>`` when keys are configured (the page asks for the key once,
or takes it from the URL fragment ``#key=...``, which browsers never send to the server): an operator key
(read-only, ``--operator-key``) when any is set, else an API key (``access``).

Everything comes from Redis through common/redis/fleetstate.py and producer/ops/status.py (the same reads as
``batchfleet status``), producer/ops/batch_jobs.py (OpenAI batch jobs), producer/bulk/registry.py (bulk runs)
and producer/ops/history.py (the charts' samples, which this server's ``HistorySampler`` also takes): no torch,
no FastAPI, plain redis-py.
"""

from __future__ import annotations

import hmac
import importlib.resources
import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote

import redis

from batchfleet.common.config import ConnectionConfig, DashboardConfig
from batchfleet.common.errors import RedisUnavailable
from batchfleet.common.keys import Keys
from batchfleet.common.redis.clients import sync_client
from batchfleet.common.redis.fleetstate import dead_letter_entries, recent_batches
from batchfleet.common.tenants import read_table
from batchfleet.producer.ops.history import HistorySampler, history
from batchfleet.producer.ops.status import snapshot, work

log = logging.getLogger(__name__)

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
SHOWN = 10  # recent batches and dead letters listed
READ_TIMEOUT_S = 2.0  # a slow Redis makes one poll fail (the page says so), never hangs the server
# polls DATA_PATH every ?refresh= s (default 2) and redraws; values go in with textContent (dead letters hold
# hostile input); queue columns follow the rows' keys, so a `priority` column shows once fleetstate has it
_FILES = importlib.resources.files("batchfleet.producer.ops")
# the icon: inlined in the page (no request at all), and served at FAVICON_PATH for what asks there by default
# (a browser showing /health or the data's JSON): a page load counts no 404 in the gateway's metrics
FAVICON = _FILES.joinpath("favicon.svg").read_bytes()
FAVICON_PATH = "/favicon.ico"
FAVICON_TYPE = "image/svg+xml"
FAVICON_HEADERS = {"Cache-Control": "public, max-age=86400"}
PAGE = _FILES.joinpath("dashboard.html").read_text(encoding="utf-8").replace(
    "ICON_DATA_URL", "data:image/svg+xml," + quote(FAVICON.strip().decode()))


def dashboard_client(conn: ConnectionConfig) -> redis.Redis:
    """The dashboard's own small pool (sync; the gateway calls it from a thread)."""
    return sync_client(conn.redis_url, socket_timeout=READ_TIMEOUT_S, socket_connect_timeout=READ_TIMEOUT_S,
                       max_connections=4, client_name=f"{conn.namespace}:dashboard")


def dashboard_data(r: redis.Redis, keys: Keys, history_after_ms: int | None = None) -> dict[str, Any]:
    """What the page shows: ``batchfleet status --json``'s snapshot (fleet, queues, workers, dead_letters,
    batch_jobs, bulk_runs) plus ``batches`` (prefill batches), ``dead_letter_entries`` (newest first), ``tenants``
    (usage, share, weight and limits per tenant: common/tenants.py ``read_table``),
    ``history`` (the samples after ``history_after_ms``, all kept ones when None) and ``time`` (this
    server's clock, s). Redis errors raise RedisUnavailable (callers need not import redis)."""
    try:
        return _read(r, keys, history_after_ms)
    except redis.RedisError as exc:
        raise RedisUnavailable(f"Redis: {exc}"[:300]) from None


def _read(r: redis.Redis, keys: Keys, history_after_ms: int | None) -> dict[str, Any]:
    snap = snapshot(r, keys)
    snap.update(work(r, keys))
    snap["batches"] = recent_batches(r, keys, SHOWN)
    shards = snap["fleet"]["shards"] if snap["fleet"] else 1  # a sharded fleet: every shard's dead letters
    snap["dead_letter_entries"] = dead_letter_entries(r, keys.with_shards(shards), SHOWN)
    snap["history"] = history(r, keys, history_after_ms)
    snap["tenants"] = read_table(r, keys)
    snap["time"] = time.time()
    return snap


def history_after(raw: str | None) -> int | None:
    """The ``history_after`` query parameter (ms: the newest sample the page holds); ValueError unless it is
    absent or a whole number."""
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 16:
        raise ValueError(f"history_after must be a whole number of milliseconds, got {raw[:40]!r}")
    return int(raw)


def access(header: str | None, api_keys: tuple[str, ...], operator_keys: tuple[str, ...]) -> int:
    """The HTTP status the dashboard's data answers a request with this ``Authorization`` header: 200, 401
    (no key, an unknown one) or 403 (an API key where operator keys are set: they alone see the fleet)."""
    if operator_keys:
        if authorized(header, operator_keys):
            return 200
        return 403 if api_keys and authorized(header, api_keys) else 401
    return 200 if authorized(header, api_keys) else 401


ACCESS_ERRORS = {401: ("missing or wrong key: an operator key (or an API key when no operator key is set)",
                       "invalid_api_key"),
                 403: ("an API key cannot see the fleet's state (the dashboard's data, the gateway's /metrics) "
                       "where operator keys are set: use an operator key",
                       "operator_key_required")}


def authorized(header: str | None, api_keys: tuple[str, ...]) -> bool:
    """Whether an ``Authorization`` header carries one of ``api_keys`` (always, when there are none).
    Compares with every key whatever matches, so the time taken says nothing about the keys."""
    if not api_keys:
        return True
    scheme, _, key = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return False
    given = key.strip().encode()
    return bool(sum(hmac.compare_digest(given, k.encode()) for k in api_keys))


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path, _, query = self.path.partition("?")
        if path in ("/", ""):
            self._send(HTTPStatus.FOUND, b"", "text/plain", {"Location": PAGE_PATH})
        elif path == PAGE_PATH:
            self._send(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8")
        elif path == FAVICON_PATH:
            self._send(HTTPStatus.OK, FAVICON, FAVICON_TYPE, FAVICON_HEADERS)
        elif path == DATA_PATH:
            status = access(self.headers.get("Authorization"), self.server.config.api_keys,
                            self.server.config.operator_keys)
            if status != 200:
                message, code = ACCESS_ERRORS[status]
                self._json(HTTPStatus(status), {"error": {"message": message, "code": code}})
                return
            try:
                after = history_after(next(iter(parse_qs(query).get("history_after", [])), None))
            except ValueError as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(exc), "code": "invalid_value"}})
                return
            try:
                self._json(HTTPStatus.OK, dashboard_data(self.server.r, self.server.keys, after))
            except RedisUnavailable as exc:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": {"message": str(exc),
                                                                      "code": "redis_unavailable"}})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"no page {path}", "code": "not_found"}})

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in {"Cache-Control": "no-store", **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # through logging, not raw stderr lines
        log.debug("%s " + format, self.address_string(), *args)


class DashboardServer(ThreadingHTTPServer):
    """The stand-alone dashboard: ``serve_forever`` (or ``start`` for a thread), ``close``."""

    daemon_threads = True

    def __init__(self, config: DashboardConfig, conn: ConnectionConfig) -> None:
        super().__init__((config.host, config.port), _Handler)
        self.config = config
        self.keys = conn.keys
        self.r = dashboard_client(conn)
        self.sampler = HistorySampler(self.r, self.keys).start()
        self.port = int(self.server_address[1])
        self._thread: threading.Thread | None = None

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(target=self.serve_forever, name="batchfleet-dashboard", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join(5)
        self.server_close()
        self.sampler.close()
        self.r.close()
