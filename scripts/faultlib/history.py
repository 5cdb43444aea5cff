"""The history every client process writes: one JSON object per line, flushed at once, so a process
killed with SIGKILL leaves every event it recorded before the kill.

Events of one operation (``op``: ``<client>.<incarnation>.<n>``): ``start`` (kind, prompt, parameters,
job id where the caller chose it, inbox digest, timeout), ``accepted`` (the enqueue returned: an answer or a
typed error is now owed), ``end`` (outcome ``answer`` with the tokens or text, ``error`` with the error's
class and whether it is one of the fleet's types, or ``timeout``). ``boot`` and ``exit`` mark a process's
incarnations. ``t`` is ``time.time()`` (every process of a run shares the host's clock)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def inbox_digest(token: str) -> str:
    """What a history names an inbox by: the token itself is a secret (docs/SECURITY.md)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


class History:
    """Append-only JSONL writer, safe for many threads of one process."""

    def __init__(self, path: Path, client: str, incarnation: int) -> None:
        self.client = client
        self.incarnation = incarnation
        self._lock = threading.Lock()
        self._file = path.open("a", buffering=1)

    def record(self, ev: str, op: str | None = None, **fields: Any) -> None:
        line = json.dumps({"ev": ev, "client": self.client, "inc": self.incarnation, "op": op, "t": time.time(),
                           **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()  # in the kernel's hands: a SIGKILL right after loses nothing the caller saw

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Every event of a history; a line torn by a kill mid-write is skipped."""
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue
