"""The KV pool is resident from the start, so a replica's memory footprint is known at start-up."""
import torch

from engine.kv_cache import allocate_kv_cache


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_the_cpu_kv_pool_is_resident_once_allocated():
    before = _rss_anon()
    kv = allocate_kv_cache(num_layers=4, num_blocks=256, block_size=16, kv_heads=4, head_dim=64,
                           dtype=torch.float32, device=torch.device("cpu"))
    pool = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    assert pool == 4 * 2 * 256 * 16 * 4 * 64 * 4  # 32 MiB
    assert _rss_anon() - before >= 0.9 * pool
