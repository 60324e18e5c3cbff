"""A step's grammar masks, and applying them to logits on whichever device samples.

llguidance writes one bit per token, 32 tokens per int32 word (token t: word t // 32, bit t % 32):
a (k, ceil(vocab / 32)) tensor for the k constrained rows of the step, ~6 KB per row for a 49k
vocab. Unconstrained rows have no mask row at all; a step without constrained rows has no mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrammarMask:
    rows: list[int]  # which rows of the step's logits (its `sampled` order) the mask rows belong to
    bits: torch.Tensor  # (len(rows), words) int32 on the CPU; bit set = token allowed


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """(R, V) logits -> a copy with each masked row's disallowed tokens at -inf. Tokens past the
    mask's width (a model vocab larger than the tokenizer's) are disallowed; mask bits past V
    (a model vocab smaller than the tokenizer's) are dropped."""
    vocab = logits.shape[1]
    bits = mask.bits.to(logits.device, non_blocking=True)  # (k, W) int32
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # (k, 32 W)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]  # (k, V)
    rows = torch.tensor(mask.rows, device=logits.device)
    out = logits.clone()
    out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
    return out
