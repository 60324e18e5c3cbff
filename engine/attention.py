"""Paged attention over a mixed batch of prefill chunks and decodes, ragged, in plain torch: the
CPU engine's backend (CUDA runs engine.triton_attention's kernels behind the same StepAttention
interface; this one runs there only if a ModelRunner is built for CUDA by hand).

Per layer the new keys/values are written into the paged pools first, then every query reads
its whole context back through its block table, so a prefix-cache hit or an earlier chunk is
read exactly like tokens computed this step.

- Decodes (one query token) are grouped by their number of context blocks; each group is one
  SDPA call over its gathered blocks, masking only the unused tail of each last block. Nothing
  is padded to the longest sequence in the batch, except on a GPU, where the runner puts all
  decodes in one group padded to the longest (one launch per layer; the padding is masked).
- Prefill chunks (several query tokens) run one SDPA call each, causal with their offset.

On CPU with float32 the decodes instead run one native kernel (engine.cpu_kernels) that reads
each sequence's blocks in place; the runner then fills `native_decode` instead of the groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine import cpu_kernels


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the flat token batch
    q_len: int
    block_table: torch.Tensor  # (ceil(ctx_len / block_size),) blocks holding positions 0..ctx_len-1
    ctx_len: int


@dataclass
class DecodeGroup:
    """`size` consecutive decode rows whose contexts span `nb` blocks (fewer, padded to `nb` and
    masked, when the runner makes one group of all decodes).

    rows:    first_row ........ first_row + size
    blocks:  decode_block_ids[block_start : block_start + size * nb], nb per sequence
    """
    first_row: int
    size: int
    block_start: int
    nb: int
    mask: torch.Tensor | None  # (size, nb * block_size) True for real keys; None when all blocks are full


@dataclass
class NativeDecodes:
    """Decode rows first_row .. first_row + B for the native kernel."""
    first_row: int
    block_tables: torch.Tensor  # (B, max blocks) int64, padded with block 0
    context_lens: torch.Tensor  # (B,) int64, this step's token included


class StepAttention(Protocol):
    """What a layer asks of a step's attention metadata; one implementation per backend (this
    module's torch one; engine.triton_attention's on CUDA)."""

    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot of every new token

    def fuses_rope(self, h: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether rope_write_kv takes this step (else apply_rope, then write_kv)."""
        ...

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> torch.Tensor:
        """Rotary embedding fused with the KV write: qkv (T, (H + 2 KVH) * D), cos/sin the (max
        positions, D) tables -> q (T, H, D); rotated keys and values go to their slots."""
        ...

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    decode_block_ids: torch.Tensor  # (sum of size * nb,) every decode group's blocks, in row order
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    native_decode: NativeDecodes | None = None  # set instead of the groups when the kernel runs

    # The calls a layer makes (engine.triton_attention's metadata answers the same ones).
    def fuses_rope(self, h: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """The native CPU float32 kernel (engine.cpu_kernels)."""
        return cpu_kernels.fusable(h) and k_cache.dtype == h.dtype and k_cache.is_contiguous()

    def rope_write_kv(self, qkv, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, head_dim):
        return cpu_kernels.rope_write_kv(qkv, cos, sin, positions, self.slot_mapping, k_cache, v_cache, num_heads,
                                         num_kv_heads, head_dim)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, k, v, self.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, self, scale)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: (num_blocks, block_size, KVH, D); k: (T, KVH, D)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D) -> (T, H, D). Caches already hold this step's keys/values."""
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        out[rows] = _prefill_attention(q[rows], k_cache, v_cache, chunk, scale)
    if meta.native_decode is not None:
        nd = meta.native_decode
        rows = slice(nd.first_row, nd.first_row + nd.context_lens.shape[0])
        out[rows] = cpu_kernels.decode_attention(q[rows], k_cache, v_cache, nd.block_tables, nd.context_lens, scale)
    if meta.decode_groups:
        k_all = k_cache.index_select(0, meta.decode_block_ids)  # (NB, bs, KVH, D): one gather per layer
        v_all = v_cache.index_select(0, meta.decode_block_ids)
        for g in meta.decode_groups:
            rows = slice(g.first_row, g.first_row + g.size)
            out[rows] = _decode_attention(q[rows], k_all, v_all, g, scale)
    return out


def _context(cache: torch.Tensor, blocks: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """(num_blocks, bs, KVH, D) pool -> (1, KVH, ctx_len, D) keys or values of one sequence."""
    kvh, d = cache.shape[2:]
    return cache.index_select(0, blocks).view(-1, kvh, d)[:ctx_len].transpose(0, 1).unsqueeze(0)


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       chunk: PrefillChunk, scale: float) -> torch.Tensor:
    k = _context(k_cache, chunk.block_table, chunk.ctx_len)  # (1, KVH, C, D)
    v = _context(v_cache, chunk.block_table, chunk.ctx_len)
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, Q, D)
    if chunk.ctx_len == chunk.q_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position ctx_len - q_len + i and sees keys up to it
        mask = torch.ones(chunk.q_len, chunk.ctx_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=chunk.ctx_len - chunk.q_len)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # (Q, H, D)


def _decode_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                      g: DecodeGroup, scale: float) -> torch.Tensor:
    """q: (b, H, D) -> (b, H, D) for one decode group; k_all/v_all: gathered decode blocks."""
    _, bs, kvh, d = k_all.shape
    blocks = slice(g.block_start, g.block_start + g.size * g.nb)
    k = k_all[blocks].view(g.size, g.nb * bs, kvh, d).transpose(1, 2)  # (b, KVH, nb*bs, D)
    v = v_all[blocks].view(g.size, g.nb * bs, kvh, d).transpose(1, 2)
    mask = None if g.mask is None else g.mask[:, None, None, :]
    # Masked tail slots hold stale but finite values: the runner zeroes blocks before first use.
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
