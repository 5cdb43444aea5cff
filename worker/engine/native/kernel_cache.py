"""The weight matmuls' kernel choices (linear.py), kept per CPU kind so that a restart, or a new worker on the
same CPU kind, does not measure them again.

What linear.py measures at load depends only on the CPU, the torch build and the weight's shape, dtype and
thread count: ``invariant_block`` (2 to 64 rows against each row alone: 1-10 s of a 2-core start for a 1.1B
model) and ``fastest``'s timed plans. ``KernelChoices`` holds them under a CPU-kind ``fingerprint`` (the CPU
model name and ISA flags from /proc/cpuinfo, torch's CPU capability and torch's version): entries are found
again by a key naming the shape (``entry_key``). A worker reads them at start from Redis
(``Keys.kernel_choices``: fleet-wide, since a Kubernetes pod has no disk of its own) and from a local file,
and writes back what it measured. An entry that fails to parse or whose value is not what linear.py could
have written is ignored (measured again, then overwritten): a bad cache never stops a worker, and a wrong one
cannot come from another CPU kind or torch build, which have other fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1  # bump when an entry's meaning changes: older entries then live under another fingerprint
REDIS_TTL_S = 30 * 86400  # renewed by each worker that writes; a CPU kind not started for a month re-measures
MAX_BYTES = 1 << 20  # a cache larger than this is not ours (a few hundred bytes per shape)


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU's model name and ISA flags (the first processor of /proc/cpuinfo; elsewhere the platform's
    processor string): what a kernel's speed and bits depend on."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("model name", "flags", "Features", "CPU implementer", "CPU part") and name not in fields:
            fields[name] = " ".join(sorted(value.split())) if name in ("flags", "Features") else value.strip()
    return "; ".join(f"{k}={v}" for k, v in sorted(fields.items())) or platform.processor() or platform.machine()


def fingerprint(cpuinfo: str | None = None) -> str:
    """16 hex digits naming this CPU kind, torch build and cache format."""
    capability = torch.backends.cpu.get_cpu_capability()
    text = f"v{FORMAT}\n{cpu_kind(cpuinfo)}\ntorch {torch.__version__} {capability}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_key(kind: str, n_out: int, n_in: int, dtype: str, threads: int) -> str:
    """``kind`` ("block", "block-amx" or "plan") of the weight [n_out, n_in] in ``dtype`` on ``threads`` threads."""
    return f"{kind}:{n_out}x{n_in}:{dtype}:t{threads}"


class KernelChoices:
    """Measured kernel choices of one fingerprint: ``entry_key`` -> a JSON value (linear.py reads and checks it).

    ``get`` counts what it found (``hits``); linear.py counts what it measured (``measured``): the start-up log
    and the tests read both. ``fresh`` holds the keys put since the last save."""

    def __init__(self, fp: str | None = None) -> None:
        self.fingerprint = fp or fingerprint()
        self.entries: dict[str, Any] = {}
        self.fresh: set[str] = set()
        self.hits = 0
        self.measured = 0

    def get(self, key: str, valid: Callable[[Any], bool]) -> tuple[bool, Any]:
        """(True, value) when ``key`` holds a value ``valid`` accepts; else (False, None) and a bad value is dropped."""
        if key not in self.entries:
            return False, None
        value = self.entries[key]
        try:
            ok = bool(valid(value))
        except (TypeError, ValueError, KeyError, AttributeError):
            ok = False
        if not ok:
            log.warning("kernel choice cache: entry %s is not valid (%r): measuring it again", key, value)
            del self.entries[key]
            return False, None
        self.hits += 1
        return True, value

    def put(self, key: str, value: Any) -> None:
        self.entries[key] = value
        self.fresh.add(key)

    # -- where they are kept ----------------------------------------------------------------------
    def document(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "cpu": cpu_kind(), "torch": torch.__version__,
                           "entries": self.entries}, sort_keys=True)

    def parse(self, raw: bytes | str | None, where: str) -> dict[str, Any]:
        """The entries of a stored document; {} for none, and for one that does not parse or is of another
        fingerprint (logged)."""
        if raw is None:
            return {}
        try:
            if len(raw) > MAX_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("fingerprint") != self.fingerprint:
                raise ValueError("another fingerprint")
            entries = doc["entries"]
            if not isinstance(entries, dict):
                raise ValueError("no entries")
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError and UnicodeDecodeError too
            log.warning("kernel choice cache in %s ignored (%s): measuring again", where, exc)
            return {}
        return {k: v for k, v in entries.items() if isinstance(k, str)}

    def merge(self, entries: dict[str, Any]) -> None:
        """Take the entries not held already (what this process measured or read first wins)."""
        for k, v in entries.items():
            self.entries.setdefault(k, v)

    def file(self, cache_dir: str | Path) -> Path:
        return Path(cache_dir).expanduser() / "kernels" / f"choices-{self.fingerprint}.json"

    def load_file(self, cache_dir: str | Path) -> dict[str, Any]:
        """The entries of this host's cache file (merged in), {} without one."""
        path = self.file(cache_dir)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("kernel choice cache %s unreadable (%s)", path, exc)
            return {}
        entries = self.parse(raw, str(path))
        self.merge(entries)
        return entries

    def save_file(self, cache_dir: str | Path) -> None:
        """Written whole to a temporary file, then renamed: a concurrent reader never sees half of it."""
        path = self.file(cache_dir)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(self.document())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("kernel choice cache %s not written (%s)", path, exc)
