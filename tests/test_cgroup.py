"""Limits of the process's cgroup (a container's or a Kubernetes pod's): memory for the CPU KV
cache, the CFS quota for the engine's CPU threads."""
from pathlib import Path

import pytest
import torch

from engine import cgroup
from engine.cgroup import cpu_quota, memory_free_bytes
from engine.config import EngineConfig
from engine.kv_cache import num_kv_blocks

GiB = 1 << 30


def tree(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys-fs-cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_cgroup)
    return proc, root


@pytest.mark.parametrize("proc_cgroup, files, expected", [
    # cgroup v2, the pod's cgroup mounted as the root (the usual container view)
    ("0::/\n", {"memory.max": "4294967296\n", "memory.current": "1073741824\n"}, 3 * GiB),
    # v2 with a nested path visible from the host
    ("0::/kubepods/pod1\n", {"kubepods/pod1/memory.max": "2147483648\n",
                             "kubepods/pod1/memory.current": "0\n"}, 2 * GiB),
    ("0::/\n", {"memory.max": "max\n", "memory.current": "123\n"}, None),  # v2, no limit
    # cgroup v1: the memory controller's own hierarchy
    ("4:memory:/docker/abc\n3:cpu:/\n", {"memory/docker/abc/memory.limit_in_bytes": "1073741824",
                                         "memory/docker/abc/memory.usage_in_bytes": "536870912"}, GiB // 2),
    ("4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712",
                      "memory/memory.usage_in_bytes": "5"}, None),  # v1 writes "no limit" as ~2^63
    ("0::/\n", {}, None),  # no readable cgroup files
    ("0::/\n", {"memory.max": "1000\n", "memory.current": "5000\n"}, 0),  # over the limit: nothing left
    ("garbage\n0::/\n", {"memory.max": "oops\n", "memory.current": "1\n"}, None),  # unreadable: no limit known
])
def test_memory_free_bytes(tmp_path, proc_cgroup, files, expected):
    proc, root = tree(tmp_path, proc_cgroup, files)
    assert memory_free_bytes(proc, root) == expected


@pytest.mark.parametrize("proc_cgroup, files, expected", [
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),  # v2: limits.cpu 2
    ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "50000 100000\n"}, 0.5),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("3:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000",
                                      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000"}, 3.0),  # v1
    ("3:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ("0::/\n", {}, None),
])
def test_cpu_quota(tmp_path, proc_cgroup, files, expected):
    proc, root = tree(tmp_path, proc_cgroup, files)
    assert cpu_quota(proc, root) == expected


def test_missing_proc_file_means_no_limit(tmp_path):
    assert memory_free_bytes(tmp_path / "absent", tmp_path) is None
    assert cpu_quota(tmp_path / "absent", tmp_path) is None


def test_cpu_kv_cache_fits_the_cgroup_limit(monkeypatch):
    block_bytes = 1 << 20
    config = EngineConfig(model=None, cpu_kv_cache_fraction=0.5, max_cpu_kv_cache_bytes=64 * GiB)
    monkeypatch.setattr(cgroup, "memory_free_bytes", lambda: 256 << 20)  # a pod with 256 MiB left
    assert num_kv_blocks(config, block_bytes, torch.device("cpu")) == 128  # half of it, in 1 MiB blocks
    monkeypatch.setattr(cgroup, "memory_free_bytes", lambda: None)  # no limit: the host's RAM decides
    assert num_kv_blocks(config, block_bytes, torch.device("cpu")) > 128


@pytest.mark.parametrize("requested, quota, expected", [(16, 2.0, 2), (2, 8.0, 2), (4, None, 4), (4, 0.5, 1)])
def test_replica_threads_stay_within_the_cpu_limit(requested, quota, expected):
    from workers.server import replica_threads

    assert replica_threads(requested, quota) == expected
