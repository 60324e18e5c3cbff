"""The Triton attention backend: per layer, one KV-write launch for a whole mixed batch and one
paged-attention launch for its prefill chunks and one for its decodes (engine.kernels), reading
the pool in place. Selected on CUDA at start-up;
the CPU engine never imports this module (Triton's interpreter runs it on CPU in the tests)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Through the modules, not their functions: tests re-import them under Triton's interpreter.
from engine.kernels import kv_write, paged_attention, rope_kv


@dataclass
class TritonAttentionMetadata:
    """One step's batch as the kernels read it, every tensor on the device. Sequence i owns query
    rows query_start[i]:query_start[i + 1] and context seq_lens[i] (its new tokens included). The
    first num_chunk_seqs sequences (num_chunk_tokens rows) are prefill chunks; the rest decode one
    token each (a prompt's last token among them)."""
    slot_mapping: torch.Tensor  # (T,) int64 cache slot of every new token; -1: a padding row
    block_tables: torch.Tensor  # (B, W) int32; entries past a sequence's blocks are never read
    seq_lens: torch.Tensor  # (B,) int32; 0 for a padding sequence
    query_start: torch.Tensor  # (B + 1,) int32
    num_chunk_seqs: int
    num_chunk_tokens: int

    def fuses_rope(self, h: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return k_cache.dtype == h.dtype

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> torch.Tensor:
        return rope_kv.rope_write_kv(qkv, cos, sin, positions, self.slot_mapping, k_cache, v_cache, num_heads,
                                     num_kv_heads, head_dim)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kv_write.write_kv(k, v, k_cache, v_cache, self.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q: (T, H, D) -> (T, H, D)."""
        return paged_attention.paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens,
                                               self.query_start, scale, self.num_chunk_seqs, self.num_chunk_tokens)
