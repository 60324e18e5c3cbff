"""Rotary embedding of a step's queries and keys fused with the KV write: one program per token
reads its row of the fused qkv projection, all heads at once as a (heads, D/2) tile, and

    query head h < H:     rotates it into q_out (T, H, D)
    key head j (h = H+j): rotates it into the pool at the token's slot, and copies value head j there

(one program per token, as vLLM's rotary kernel: a program per (token, head) moved a few dozen
elements with a whole warp group, and a 16k-token prefill step launched 7 M of them).
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
                    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HEADS_PAD: tl.constexpr,
                    HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    heads = tl.arange(0, HEADS_PAD)[:, None]  # query heads, then key heads
    half = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < H + KVH) & (half < D // 2)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + half, mask=half < D // 2).to(dtype).to(tl.float32)  # first half = second
    sin = tl.load(sin_ptr + pos * D + half, mask=half < D // 2).to(dtype).to(tl.float32)
    row = qkv_ptr + t * qkv_stride + heads * D
    x1 = tl.load(row + half, mask=mask).to(tl.float32)
    x2 = tl.load(row + D // 2 + half, mask=mask).to(tl.float32)
    # out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin, each product rounded as torch rounds it
    out1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    is_q = mask & (heads < H)
    q_dst = q_out_ptr + t * (H * D) + heads * D
    tl.store(q_dst + half, out1, mask=is_q)
    tl.store(q_dst + D // 2 + half, out2, mask=is_q)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    kv_end = tl.where(slot >= 0, H + KVH, H)  # slot -1: a padding row, no key head written
    is_kv = mask & (heads >= H) & (heads < kv_end)
    dst = slot * (KVH * D) + (heads - H) * D
    tl.store(k_cache_ptr + dst + half, out1, mask=is_kv)
    tl.store(k_cache_ptr + dst + D // 2 + half, out2, mask=is_kv)
    v_row = row + KVH * D  # key head j's row + KVH heads: value head j
    tl.store(v_cache_ptr + dst + half, tl.load(v_row + half, mask=is_kv), mask=is_kv)
    tl.store(v_cache_ptr + dst + D // 2 + half, tl.load(v_row + D // 2 + half, mask=is_kv), mask=is_kv)


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
    heads_pad = triton.next_power_of_2(num_heads + num_kv_heads)
    half_pad = triton.next_power_of_2(head_dim // 2)
    _rope_kv_kernel[(t,)](
        qkv, cos, sin, positions, slots, q, k_cache, v_cache, qkv.stride(0),
        H=num_heads, KVH=num_kv_heads, D=head_dim, HEADS_PAD=heads_pad, HALF_PAD=half_pad,
        num_warps=max(1, min(8, heads_pad * half_pad // 256)),  # ~8 elements a thread
        enable_fp_fusion=False)  # torch rounds each product before the sum: no FMA
    return q
