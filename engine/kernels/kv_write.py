"""Write a step's new keys and values into their slots of the paged pool, one program per token.

    slot s  ->  pool row s of the cache viewed as (num_blocks * block_size, KVH * D)
    slot -1 ->  nothing written (a padding row of a CUDA-graph batch)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_row_stride, v_row_stride,
                     ROW: tl.constexpr,  # KVH * D: one token's keys, contiguous in the pool
                     ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + t * k_row_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_row_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (T, KVH, D), each token's heads contiguous (a row may be a view into qkv);
    caches: (num_blocks, block_size, KVH, D) contiguous; slot_mapping: (T,) int32/int64, -1 = skip."""
    t, kvh, d = k.shape
    if t == 0:
        return
    for x in (k, v):
        assert x.stride(2) == 1 and x.stride(1) == d, f"token rows must be contiguous, got strides {x.stride()}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    row = kvh * d
    _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                           ROW=row, ROW_PAD=triton.next_power_of_2(row), enable_fp_fusion=False)
