"""The KV pool is resident from the start, so a replica's memory footprint is known at start-up."""
import ctypes
import mmap

import torch

from engine.kv_cache import allocate_kv_cache


def _resident_fraction(t: torch.Tensor) -> float:
    """The fraction of the tensor's pages that are in RAM, by mincore(2). The process's RSS would
    not do: in a long test run a fresh allocation may reuse pages that are already resident."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    pages = (end - start + page - 1) // page
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def test_the_cpu_kv_pool_is_resident_once_allocated():
    kv = allocate_kv_cache(num_layers=4, num_blocks=256, block_size=16, kv_heads=4, head_dim=64,
                           dtype=torch.float32, device=torch.device("cpu"))
    pool = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    assert pool == 4 * 2 * 256 * 16 * 4 * 64 * 4  # 32 MiB
    for k, v in kv:
        assert _resident_fraction(k) == 1.0 and _resident_fraction(v) == 1.0


def test_an_untouched_mapping_is_not_resident():
    # The control: a fresh anonymous mapping (never reused memory, unlike an allocator's blocks)
    # is not resident until written, and mincore says so; after a write it is.
    size = 32 << 20
    m = mmap.mmap(-1, size)
    t = torch.frombuffer(m, dtype=torch.float32)
    assert _resident_fraction(t) < 0.01
    t.fill_(1.0)
    assert _resident_fraction(t) == 1.0
    del t
    m.close()


def test_the_gpu_pool_takes_what_this_process_caches_but_does_not_use(monkeypatch):
    """A rank that loaded its weight shards through torch's allocator holds GBs it no longer uses;
    that memory is the pool's to take, not another process's. (torch.cuda's figures stubbed: 100
    GiB device, 60 free, 30 reserved here of which 10 are allocated, so 10 are others'.)"""
    from engine.config import EngineConfig
    from engine.kv_cache import num_kv_blocks

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    config = EngineConfig(gpu_memory_utilization=0.9)
    # 90 GiB allowed - 10 others' - 10 allocated here - 5 kept back for a step (5% of the device)
    assert num_kv_blocks(config, gib, torch.device("cuda", 0)) == 65
    assert num_kv_blocks(config, gib, torch.device("cuda", 0), step_bytes=2 * gib) == 68


def test_a_step_is_measured_only_where_the_pool_is_sized_from_device_memory(monkeypatch):
    """engine.runners.step_bytes: CUDA with the Triton runner measures (the caller says whether with
    graphs); a CPU device, the torch backend, or a pool whose size is given keep the fixed share."""
    from engine import runners
    from engine.config import EngineConfig

    measured = []
    monkeypatch.setattr(runners, "cuda_step_bytes", lambda *args: measured.append(args[-1]) or 7)
    cuda, config = torch.device("cuda", 0), EngineConfig()
    assert runners.step_bytes(None, config, 512, 2, torch.device("cpu")) is None
    assert runners.step_bytes(None, config, 512, 2, cuda) == 7
    assert runners.step_bytes(None, config, 512, 2, cuda, graphs=False) == 7 and measured == [True, False]
    assert runners.step_bytes(None, EngineConfig(num_gpu_blocks_override=9), 512, 2, cuda) is None
    assert runners.step_bytes(None, EngineConfig(kv_cache_memory=1 << 30), 512, 2, cuda) is None
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    assert runners.step_bytes(None, config, 512, 2, cuda) is None and measured == [True, False]
