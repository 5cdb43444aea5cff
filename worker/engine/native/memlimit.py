"""Host memory a worker may use: MemAvailable, capped by the container's cgroup limit when one is set.

In a container /proc/meminfo describes the HOST, so N workers on one host would each size their KV
pool from the whole host's free memory and the kernel would OOM-kill them. The cgroup limit (v2
``memory.max``, v1 ``memory/memory.limit_in_bytes``) minus what the cgroup already uses is what this
container can still allocate. Pure file reads, no torch: tests pass a fake cgroup root.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
FALLBACK_BYTES = 4 << 30  # neither source readable
_V1_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def _read_int(path: Path) -> int | None:
    """An integer file's value; None when absent, unreadable or ``max`` (v2: no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes this cgroup may still allocate (limit - usage), or None when no limit is set.

    v2 first (``memory.max`` / ``memory.current`` at the root of the container's cgroup namespace),
    then v1 (``memory/memory.limit_in_bytes`` / ``memory/memory.usage_in_bytes``).
    """
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(root / limit_file)
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _read_int(root / usage_file) or 0
        return max(0, limit - usage)
    return None


def available_bytes(cgroup_root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO) -> int:
    """The smaller of MemAvailable and the cgroup's headroom (whichever exist), else FALLBACK_BYTES."""
    candidates = [v for v in (mem_available(meminfo), cgroup_headroom(cgroup_root)) if v is not None]
    return min(candidates) if candidates else FALLBACK_BYTES
