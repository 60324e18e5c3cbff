"""Size and allocate the paged KV pools: per layer (K, V), each (num_blocks, block_size, KVH, D)."""
from __future__ import annotations

import os

import torch

from engine import cgroup
from engine.config import EngineConfig


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _available_cpu_bytes() -> int:
    """RAM this process may still use: the host's MemAvailable, or less when its cgroup (a
    container's or a Kubernetes pod's memory limit) leaves less."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        host = info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limited = cgroup.memory_free_bytes()
    return host if limited is None else min(host, limited)


def num_kv_blocks(config: EngineConfig, block_bytes: int, device: torch.device, step_bytes: int | None = None) -> int:
    """--num-gpu-blocks-override, else --kv-cache-memory bytes, else a share of device memory.
    step_bytes (CUDA): what a step needs besides weights and pool (peak activations, CUDA graphs),
    as measured; without it 5% of the device is kept back."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # What this process's allocator caches but does not use is free for the pool (a rank that
        # loaded its shards through it holds GBs of such cache): only the rest is others'.
        used_by_others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * config.gpu_memory_utilization) - used_by_others - torch.cuda.memory_allocated(device)
        budget -= step_bytes if step_bytes is not None else int(0.05 * total)  # activations, graphs
    else:
        budget = min(int(_available_cpu_bytes() * config.cpu_kv_cache_fraction), config.max_cpu_kv_cache_bytes)
    blocks = budget // block_bytes
    if blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds {blocks} blocks of {block_bytes} bytes; "
                         "raise --kv-cache-memory / --gpu-memory-utilization or lower --block-size")
    return blocks


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pool, written once: on CPU untouched pages are not resident, so a lazily touched pool
    would grow the process's RSS over its first thousands of requests, and a pod sized by its
    start-up footprint would be OOM-killed later. Touched now, the footprint is known at start."""
    shape = (num_blocks, block_size, kv_heads, head_dim)
    # torch.zeros writes every page (torch.empty would leave them untouched).
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
