"""Paged attention over a mixed batch of prefill chunks and decodes, ragged, in plain torch.

Per layer the new keys/values are written into the paged pools first, then every query reads
its whole context back through its block table, so a prefix-cache hit or an earlier chunk is
read exactly like tokens computed this step.

- Decodes (one query token) are batched block-wise: each context block of each sequence is one
  row of a batched matmul, and the softmax is reduced per sequence with index ops. Only the tail
  of each sequence's last block is masked; nothing is padded to the longest sequence.
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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) flat cache slot of every new token
    decode_rows: torch.Tensor | None  # (B,) rows of the flat batch that are single-token queries
    decode_blocks: torch.Tensor | None  # (NB,) physical block ids of all decode contexts
    decode_block_seq: torch.Tensor | None  # (NB,) which decode row (0..B-1) owns each block
    decode_block_mask: torch.Tensor | None  # (NB, block_size) True for valid key positions
    num_decodes: int
    prefills: list[PrefillChunk]
    all_decode: bool  # every row is a decode, in order: skip the gather/scatter


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: (num_blocks, block_size, KVH, D); k: (T, KVH, D)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D) -> (T, H, D). Caches already hold this step's keys/values."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        qd = q if meta.all_decode else q[meta.decode_rows]
        od = _decode_attention(qd, k_cache, v_cache, meta, scale)
        if meta.all_decode:
            return od
        out[meta.decode_rows] = od
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
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    B, H, D = q.shape
    kvh = k_cache.shape[2]
    g = H // kvh
    blk_seq = meta.decode_block_seq
    k = k_cache.index_select(0, meta.decode_blocks).permute(0, 2, 3, 1)  # (NB, KVH, D, bs)
    # Masked tail slots get p == 0; the runner zeroes every block before its first use, so
    # their stale values are finite and 0 * v stays 0 (never 0 * NaN from fresh memory).
    v = v_cache.index_select(0, meta.decode_blocks).transpose(1, 2)  # (NB, KVH, bs, D)
    qb = q.view(B, kvh, g, D).index_select(0, blk_seq)  # (NB, KVH, G, D)
    scores = torch.matmul(qb, k) * scale  # (NB, KVH, G, bs)
    scores.masked_fill_(~meta.decode_block_mask[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1)  # (NB, KVH, G)
    seq_max = block_max.new_full((B, kvh, g), float("-inf")).scatter_reduce_(
        0, blk_seq[:, None, None].expand_as(block_max), block_max, "amax")
    p = torch.exp(scores - seq_max.index_select(0, blk_seq).unsqueeze(-1))  # (NB, KVH, G, bs)
    denom = p.new_zeros(B, kvh, g).index_add_(0, blk_seq, p.sum(dim=-1))
    o = q.new_zeros(B, kvh, g, D).index_add_(0, blk_seq, torch.matmul(p, v))  # (B, KVH, G, D)
    return (o / denom.unsqueeze(-1)).view(B, H, D)
