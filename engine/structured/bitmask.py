"""A step's grammar masks, and applying them to logits on whichever device samples.

llguidance writes one bit per token, 32 tokens per int32 word (token t: word t // 32, bit t % 32):
a (k, ceil(vocab / 32)) tensor for the k constrained rows of the step, ~6 KB per row for a 49k
vocab. Unconstrained rows have no mask row at all; a step without constrained rows has no mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.device_copy import to_device


@dataclass(frozen=True)
class GrammarMask:
    rows: list[int]  # which rows of the step's logits (its `sampled` order) the mask rows belong to
    bits: torch.Tensor  # (len(rows), words) int32 on the CPU; bit set = token allowed


def _allowed_np(bits: torch.Tensor, vocab: int) -> np.ndarray:
    """(k, W) int32 bits -> (k, vocab) bool. Tokens past 32 W (a model vocab larger than the
    tokenizer's) are disallowed; bits past vocab (one smaller) are dropped."""
    flat = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")  # (k, 32 W); little-endian words
    if flat.shape[1] < vocab:
        flat = np.pad(flat, ((0, 0), (0, vocab - flat.shape[1])))
    return flat[:, :vocab].astype(bool)


def _apply_np(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """On CPU, in numpy: one thread, no parallel regions. torch's int/bool kernels and their
    thread-pool hand-offs cost tens of ms per step on a busy 2-core host; this costs ~1 ms."""
    out = logits.numpy().copy()  # (R, V) float32
    rows = out[mask.rows]  # (k, V), a copy
    np.putmask(rows, ~_allowed_np(mask.bits, out.shape[1]), np.float32(-np.inf))
    out[mask.rows] = rows
    return torch.from_numpy(out)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """(R, V) logits -> a copy with each masked row's disallowed tokens at -inf (`logits` itself
    is not modified)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return _apply_np(logits, mask)
    vocab, device = logits.shape[1], logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=device)  # the 6 KB rows travel; the device unpacks them
    allowed = ((mask.bits.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]  # (k, V)
    ninf = float("-inf")
    if mask.rows == list(range(logits.shape[0])):  # every row constrained: no gather, no scatter
        return torch.where(allowed, logits, ninf)
    rows = to_device(mask.rows, torch.long, device)
    out = logits.clone()
    out[rows] = torch.where(allowed, logits[rows], ninf)
    return out
