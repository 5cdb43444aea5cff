"""Log formats: ``text`` (the default, for people) and ``json`` (one object per line, for log shippers).

A JSON line holds ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, ``exc_info`` when there
is a traceback, and the fields ``job``, ``bucket`` and ``worker`` where they apply: log calls about one
job pass them with ``extra={"job": ..., "bucket": ...}``; the worker name is process-wide context set once
with ``set_context(worker=...)`` (one worker per process).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = ("job", "bucket", "worker")  # optional per-record fields, from ``extra=`` or the context

_context: dict[str, Any] = {}


def set_context(**fields: Any) -> None:
    """Process-wide fields added to every JSON line unless the record sets them (e.g. ``worker``)."""
    _context.update({k: v for k, v in fields.items() if v is not None})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped by json.dumps)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is None:
                value = _context.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``fmt`` (one of LOG_FORMATS)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


_format = {"current": "text"}  # what the last configure() set: a later call with fmt None keeps it


def current_format() -> str:
    """The log format in force ("text" until configure() is given another)."""
    return _format["current"]


def configure(level: str | int | None = None, fmt: str | None = None) -> None:
    """Set up the root logger (a stderr handler when there is none) with ``fmt``; ``level`` or ``fmt``
    None keeps the current one. Calling it again switches the format of the existing handlers.

    JSON mode also routes Python warnings through logging, so stderr stays one JSON object per line."""
    fmt = fmt or _format["current"]
    formatter(fmt)  # ValueError on an unknown format, before anything changes
    _format["current"] = fmt
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:
        handler.setFormatter(formatter(fmt))
    logging.captureWarnings(fmt == "json")
    if level is not None:
        root.setLevel(level.upper() if isinstance(level, str) else level)


STARTUP_LOGGER = "batchfleet.startup"


def startup_phase(message: str, *args: Any) -> None:
    """Say what a starting worker does now, the slow steps before its first heartbeat (loading torch, building
    or loading the model, compiling a kernel, probing the matmul kernels, joining the fleet): one INFO line
    on the ``batchfleet.startup`` logger, which `batchfleet demo` relays while it waits for its worker."""
    logging.getLogger(STARTUP_LOGGER).info(message, *args)
