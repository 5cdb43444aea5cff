"""Cap a process to a share of one core (a benchmark's Redis masters), so a small fleet can saturate them.

A layout's Redis ceiling is only measured where its masters saturate; below saturation a master answers
fewer commands per wakeup and its CPU per request comes out higher than at its ceiling. The load generators
and simulated workers cost ~20x what Redis does per request, so no host of a few cores drives three
uncapped masters to saturation. Capping every master to the same share of its own core (CFS bandwidth:
cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``) makes each layout's throughput bound by its masters: the
ratio of throughputs is then the ratio of ceilings. Linux, root only.
"""

from __future__ import annotations

import os
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000  # short periods: a capped master is throttled for ms at a time, not for tens of ms
MIN_QUOTA_US = 1_000  # the kernel's smallest quota


def _v2_root() -> Path | None:
    for root in (V2, V2 / "unified"):
        if (root / "cgroup.controllers").exists() and "cpu" in (root / "cgroup.controllers").read_text().split():
            return root
    return None


def cap(pid: int, share: float, core: int, name: str) -> str:
    """Pin ``pid`` to ``core`` and cap it to ``share`` of a core; returns which mechanism did it."""
    os.sched_setaffinity(pid, {core % (os.cpu_count() or 1)})  # a host of fewer cores shares them
    period = max(PERIOD_US, int(MIN_QUOTA_US / share) + 1)
    quota = int(share * period)
    if (root := _v2_root()) is not None:
        try:
            (root / "cgroup.subtree_control").write_text("+cpu")
        except OSError:
            pass  # already on, or processes sit in the root (then the child below still takes cpu.max)
        group = root / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{quota} {period}")
        (group / "cgroup.procs").write_text(str(pid))
        return "cgroup2 cpu.max"
    if (V1 / "cpu.cfs_quota_us").exists():
        group = V1 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))  # every thread (tasks would move one)
        return "cgroup1 cfs_quota_us"
    raise RuntimeError("no writable cgroup cpu controller: --redis-cpu-share needs root and cgroups")


def release(name: str) -> None:
    """Remove a cap's group once its process has exited (best effort)."""
    for root in (_v2_root(), V1):
        if root is not None and (root / name).exists():
            try:
                (root / name).rmdir()
            except OSError:
                pass


def keep_off(cores: set[int]) -> None:
    """This process (and what it starts from now on) runs on every core but ``cores``."""
    rest = set(os.sched_getaffinity(0)) - cores
    if rest:
        os.sched_setaffinity(0, rest)
