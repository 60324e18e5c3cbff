"""CPU time of a server's processes from /proc: where a serving run spends the machine.

    before = cpu_seconds(server_pid)
    ... load the server ...
    used = cpu_used(before, cpu_seconds(server_pid))   # {"EngineServer": 41.2, "ProxyActor": 6.0, ...}

A server is its launched process and every descendant (Ray's GCS, raylet and workers are
children of the `kvserve serve` driver; vLLM's engine core is a child of its API server).
Processes are named by what they run (Ray's worker titles, e.g. `ServeReplica:kvserve:
EngineServer` -> `EngineServer`); Linux only, {} elsewhere.
"""
from __future__ import annotations

import os
import re

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(pid: str) -> tuple[int, str, float] | None:
    """(parent pid, name, user + system CPU seconds) of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), process_name(cmd or stat[stat.index("(") + 1:stat.rindex(")")]), \
        (int(fields[11]) + int(fields[12])) / _HZ


def process_name(cmd: str) -> str:
    """A short label: Ray's worker title without the `ray::` and the method it runs now."""
    if cmd.startswith("ray::"):
        title = cmd[5:].split()[0].split(".")[0]
        return title.rsplit(":", 1)[-1]
    words = cmd.split()
    exe = os.path.basename(words[0]) if words else "?"
    if exe.startswith("python") and len(words) > 1:  # the script or module it runs
        arg = words[2] if words[1] in ("-m", "-u") and len(words) > 2 else words[1]
        return re.sub(r"\.py$", "", os.path.basename(arg))
    return exe


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds so far) for `root` and all its descendants now alive."""
    if not os.path.isdir("/proc"):
        return {}
    procs = {int(p): r for p in os.listdir("/proc") if p.isdigit() and (r := _read(p)) is not None}
    keep, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in keep:
                keep.add(child)
                frontier.append(child)
    return {pid: procs[pid][1:] for pid in keep if pid in procs}


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each named process used between two snapshots (same names added up),
    largest first; a process that exited in between is not counted."""
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used[name] = used.get(name, 0.0) + seconds - (before[pid][1] if pid in before else 0.0)
    return dict(sorted(((k, v) for k, v in used.items() if v > 0), key=lambda kv: -kv[1]))
