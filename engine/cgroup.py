"""Limits of this process's cgroup (a container's or a Kubernetes pod's), which the host-wide
numbers (/proc/meminfo, the CPU affinity mask) do not show.

    /proc/self/cgroup   "0::/path" (v2, unified)  or  "4:memory:/path", "3:cpu,cpuacct:/path" (v1)
    v2: <root>/<path>/memory.max, memory.current, cpu.max ("quota period" or "max period")
    v1: <root>/<controller>/<path>/memory.limit_in_bytes, memory.usage_in_bytes,
        cpu.cfs_quota_us (-1: none), cpu.cfs_period_us

Inside a container the cgroup is usually mounted as the root itself, so the root is tried too.
Every reader returns None when there is no limit or nothing readable.
"""
from __future__ import annotations

from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
ROOT = Path("/sys/fs/cgroup")
_V1_NO_LIMIT = 1 << 60  # v1 writes "no memory limit" as a number near 2^63


def _dirs(v1_controller: str, proc_cgroup: Path, root: Path) -> list[tuple[Path, bool]]:
    """Candidate directories for a controller, most specific first, each with `is_v2`."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            out += [(root / rel, True), (root, True)]
        elif v1_controller in controllers.split(","):
            base = root / controllers  # e.g. /sys/fs/cgroup/cpu,cpuacct
            alt = root / v1_controller  # and its usual symlink /sys/fs/cgroup/cpu
            out += [(base / rel, False), (alt / rel, False), (base, False), (alt, False)]
    return out


def _read(directory: Path, *names: str) -> list[str] | None:
    try:
        return [(directory / n).read_text().strip() for n in names]
    except OSError:
        return None


def memory_free_bytes(proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> int | None:
    """The cgroup's memory limit minus its current usage."""
    for directory, v2 in _dirs("memory", proc_cgroup, root):
        got = _read(directory, *(("memory.max", "memory.current") if v2
                                 else ("memory.limit_in_bytes", "memory.usage_in_bytes")))
        if got is None:
            continue
        limit, usage = got
        if limit == "max":
            return None
        try:
            limit_b, usage_b = int(limit), int(usage)
        except ValueError:
            continue
        return None if limit_b >= _V1_NO_LIMIT else max(0, limit_b - usage_b)
    return None


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = ROOT) -> float | None:
    """CPUs the cgroup's CFS quota allows (Kubernetes' `limits.cpu`), e.g. 2.0 or 0.5."""
    for directory, v2 in _dirs("cpu", proc_cgroup, root):
        if v2:
            got = _read(directory, "cpu.max")
            if got is None:
                continue
            quota, _, period = got[0].partition(" ")
        else:
            got = _read(directory, "cpu.cfs_quota_us", "cpu.cfs_period_us")
            if got is None:
                continue
            quota, period = got
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            continue
    return None
