"""Rotary embedding of a step's queries and keys fused with the KV write: one program per
(token, head) reads its slice of the fused qkv projection and

    query head h < H:     rotates it into q_out (T, H, D)
    key head j (h = H+j): rotates it into the pool at the token's slot, and copies value head j there

Same arithmetic as engine.model.rope.apply_rope (HF Llama's "rotate half" layout), rounding where
the torch ops round: cos/sin cast to the activations' dtype, each product and the sum rounded to it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                    qkv_stride,
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    half = tl.arange(0, HALF_PAD)
    mask = half < D // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + half, mask=mask).to(dtype).to(tl.float32)  # first half = second half
    sin = tl.load(sin_ptr + pos * D + half, mask=mask).to(dtype).to(tl.float32)
    row = qkv_ptr + t.to(tl.int64) * qkv_stride + h * D  # query head h, or key head h - H
    x1 = tl.load(row + half, mask=mask).to(tl.float32)
    x2 = tl.load(row + D // 2 + half, mask=mask).to(tl.float32)
    # out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, each product rounded as torch rounds it
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    if h < H:
        dst = q_out_ptr + (t.to(tl.int64) * H + h) * D
        tl.store(dst + half, out1, mask=mask)
        tl.store(dst + D // 2 + half, out2, mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            j = h - H
            dst = slot * (KVH * D) + j * D
            tl.store(k_cache_ptr + dst + half, out1, mask=mask)
            tl.store(k_cache_ptr + dst + D // 2 + half, out2, mask=mask)
            v_row = qkv_ptr + t.to(tl.int64) * qkv_stride + (H + KVH + j) * D
            v1 = tl.load(v_row + half, mask=mask)
            v2 = tl.load(v_row + D // 2 + half, mask=mask)
            tl.store(v_cache_ptr + dst + half, v1, mask=mask)
            tl.store(v_cache_ptr + dst + D // 2 + half, v2, mask=mask)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: (T, (H + 2 KVH) * D), rows contiguous; cos/sin: (max positions, D) float32 tables;
    positions, slots: (T,) int (slot -1: not written); caches (num_blocks, block_size, KVH, D)
    contiguous. -> q (T, H, D) rotated; the rotated keys and the values are in the pool."""
    t = qkv.shape[0]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim % 2 == 0
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_kv_kernel[(t, num_heads + num_kv_heads)](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, qkv.stride(0),
        H=num_heads, KVH=num_kv_heads, D=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False)  # torch rounds each product before the sum: no FMA
    return q
