"""Rotary position embedding with the config's rope scaling (default, linear, llama3)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, computed the way HF transformers does: on
    the CPU, whatever device the model is built on."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exps)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables over every position. The inverse frequencies come from the CPU and the
    tables from the device the model is built on (the default device), as HF computes its cos and
    sin where the model runs: CUDA's and the CPU's cos round differently in the last bit, and a
    table built on the CPU would set a GPU engine a bit apart from HF on the same GPU (and tp=1
    apart from tp>1, whose ranks build on their GPUs)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        device = torch.get_default_device()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D), halves layout as in HF Llama
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) -> cos, sin: (T, 1, D), looked up once per step for all layers."""
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))

    def step(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> "RopeStep":
        """What every layer of one step needs: the fused kernel reads the tables by position
        itself; the torch path gets cos/sin gathered once here."""
        if fused:
            return RopeStep(positions, self.cos, self.sin, fused=True)
        return RopeStep(positions, *self.cos_sin(positions, dtype), fused=False)


@dataclass
class RopeStep:
    positions: torch.Tensor  # (T,)
    cos: torch.Tensor  # fused: the (max positions, D) table; else gathered (T, 1, D)
    sin: torch.Tensor
    fused: bool


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, H, D); k: (T, KVH, D); cos/sin: (T, 1, D)."""
    return rotate_heads(q, cos, sin), rotate_heads(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def prompt_rope(inv_freq: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An encoder step's cos and sin, (T, D) in `dtype` (HF rounds its float32 tables to the
    model's dtype), for positions (T,) that restart at each prompt: computed per step, as HF does,
    since an encoder keeps no table of every position."""
    angles = positions[:, None].float() * inv_freq.to(positions.device)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, upcast: bool = False) -> torch.Tensor:
    """x rotated by cos and sin that broadcast over its heads (an encoder's: x (heads, T, D) and
    prompt_rope's (T, D)), in HF's halves layout; `upcast`: in float32, then back (ModernBERT's),
    else in x's dtype (Llama's, NomicBERT's)."""
    if not upcast:
        return x * cos + _rotate_half(x) * sin
    return (x.float() * cos.float() + _rotate_half(x.float()) * sin.float()).to(x.dtype)
