"""How many CPUs this process may use: its affinity mask, capped by a cgroup CPU quota.

The service's hybrid polling needs a core for ZeroMQ's I/O thread besides the one it polls
on. Only the standard library is imported.
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus() -> float:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota if any."""
    try:
        n: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota()
    return min(n, quota) if quota is not None else n


def _cgroup_quota() -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its parents, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: float | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max is "QUOTA PERIOD" or "max PERIOD"
            root, name = Path("/sys/fs/cgroup"), "cpu.max"
        elif "cpu" in controllers.split(","):  # cgroup v1
            root, name = Path("/sys/fs/cgroup") / controllers, "cpu.cfs_quota_us"
        else:
            continue
        folder = root / path.lstrip("/")
        while True:
            quota = _read_quota(folder, name)
            if quota is not None:
                best = quota if best is None else min(best, quota)
            if folder == root or folder.parent == folder:
                break
            folder = folder.parent
    return best


def _read_quota(folder: Path, name: str) -> float | None:
    try:
        if name == "cpu.max":
            quota, period = (folder / name).read_text().split()
        else:
            quota = (folder / name).read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None
