"""Paged attention over a mixed batch of prefill chunks and decodes, ragged, in plain torch.

Per layer the new keys/values are written into the paged pools first, then every query reads
its whole context back through its block table, so a prefix-cache hit or an earlier chunk is
read exactly like tokens computed this step.

- Decodes (one query token) are grouped by their number of context blocks; each group is one
  SDPA call over its gathered blocks, masking only the unused tail of each last block. Nothing
  is padded to the longest sequence in the batch.
- Prefill chunks (several query tokens) run one SDPA call each, causal with their offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # first row of this chunk in the flat token batch
    q_len: int
    key_slots: torch.Tensor  # (ctx_len,) flat slot ids of positions 0..ctx_len-1
    ctx_len: int


@dataclass
class DecodeGroup:
    """Decodes whose contexts span the same number of blocks (nb)."""
    rows: torch.Tensor  # (b,) rows of the flat batch
    block_tables: torch.Tensor  # (b, nb) physical block ids
    mask: torch.Tensor | None  # (b, nb * block_size) True for real keys; None when all blocks are full


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: (num_blocks, block_size, KVH, D); k: (T, KVH, D)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D) -> (T, H, D). Caches already hold this step's keys/values."""
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        out.index_copy_(0, group.rows, _decode_attention(q.index_select(0, group.rows), k_cache, v_cache, group, scale))
    kv_heads = k_cache.shape[2]
    for chunk in meta.prefills:
        out[chunk.q_start:chunk.q_start + chunk.q_len] = _prefill_attention(
            q[chunk.q_start:chunk.q_start + chunk.q_len], k_cache, v_cache, chunk, kv_heads, scale)
    return out


def _prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       chunk: PrefillChunk, kv_heads: int, scale: float) -> torch.Tensor:
    flat_k = k_cache.view(-1, kv_heads, k_cache.shape[-1])
    flat_v = v_cache.view(-1, kv_heads, v_cache.shape[-1])
    k = flat_k.index_select(0, chunk.key_slots).transpose(0, 1).unsqueeze(0)  # (1, KVH, C, D)
    v = flat_v.index_select(0, chunk.key_slots).transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, Q, D)
    if chunk.ctx_len == chunk.q_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position ctx_len - q_len + i and sees keys up to it
        mask = torch.ones(chunk.q_len, chunk.ctx_len, dtype=torch.bool, device=q.device)
        mask = mask.tril(diagonal=chunk.ctx_len - chunk.q_len)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # (Q, H, D)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      group: DecodeGroup, scale: float) -> torch.Tensor:
    """q: (b, H, D) -> (b, H, D) for one decode group."""
    b, nb = group.block_tables.shape
    _, bs, kvh, d = k_cache.shape
    ids = group.block_tables.flatten()
    k = k_cache.index_select(0, ids).view(b, nb * bs, kvh, d).transpose(1, 2)  # (b, KVH, nb*bs, D)
    v = v_cache.index_select(0, ids).view(b, nb * bs, kvh, d).transpose(1, 2)
    mask = None if group.mask is None else group.mask[:, None, None, :]
    # Masked tail slots hold stale but finite values: the runner zeroes blocks before first use.
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)
