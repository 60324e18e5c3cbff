"""Weights that came out of a 4-bit or 8-bit GGUF file, held again as their integer codes for CPU
decode; and weights that came out of a bfloat16 checkpoint, held again as bfloat16.

The embedded SmolLM2 ships as GGUF Q4_1 (Q8_0 for the tied embedding) and is dequantized to
float32 once, as transformers does (engine/model_source.py). Every weight is then exactly
`scale * q + offset` for one (scale, offset) per 32 weights along a row, with q a 4-bit or
8-bit integer. A decode step on CPU is bound by streaming the weights from memory, so holding
those codes (0.75 or 1.25 bytes a weight instead of 4) and dequantizing them inside the GEMM
kernel (engine/csrc/linear_codes.c) cuts a step's weight traffic about 5x without changing a
bit: `encode` recovers the codes from the float32 tensor and keeps them only if they rebuild
every weight bit for bit, so any other checkpoint simply stays float32.

Most checkpoints are bfloat16, served here in float32 (CPU's default, and what token-exactness
against transformers' float32 needs): each weight is then a float32 whose low 16 bits are zero.
Its high halves (16-bit codes, 2 bytes a weight) rebuild it bit for bit with a shift, which halves
a decode step's weight traffic with the same float32 arithmetic.

Prefill (large batches) reads the weights' oneDNN-prepacked float32 copy instead. A layer that
has both forms drops its plain float32 weight, which nothing reads then (a rare fallback rebuilds
it from the codes). The embedding table, tied head or not, is held as its codes too, and the
lookup gathers its rows from them (`BlockCodes.rows`; engine/model/loader.py,
`prepare_cpu_weights`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per (scale, offset) pair, along a row: GGUF's block size for Q4_x and Q8_0
CHUNK_WEIGHTS = 1 << 22  # weights encoded at a time


@dataclass(frozen=True)
class BlockCodes:
    """An (N, K) float32 weight as codes: w[n, 32 b + i] = scale[n, b] * q[n, 32 b + i] + offset[n, b]."""
    bits: int  # 4: q in [0, 15], two a byte; 8: q in [-127, 127], one signed byte; 16: bfloat16 (below)
    codes: torch.Tensor  # uint8 (N, K/2) or int8 (N, K); 4-bit byte j of a block: q[j] | q[j + 16] << 4
    scale: torch.Tensor  # float32 (N, K/32)
    offset: torch.Tensor  # float32 (N, K/32); -0.0 for 8-bit (adding it changes no bits)
    # 16 bits: codes int16 (N, K), each weight's high half (w's bits = code << 16); scale and
    # offset (N, 0), unused
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def to_float(self) -> torch.Tensor:
        """The float32 weight again, rounded as gguf-py dequantizes: the product, then the sum."""
        return self.rows(None)

    def rows(self, index: torch.Tensor | None) -> torch.Tensor:
        """Rows `index` (a 1-D tensor of row numbers; None: all) of the float32 weight, each the
        same bits as in the whole (an embedding lookup over codes)."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        k = self.shape[1]
        codes = pick(self.codes)
        n = codes.shape[0]
        if self.bits == 16:
            return (codes.to(torch.int32) << 16).view(torch.float32)
        if self.bits == 4:
            c = codes.view(n, k // BLOCK, BLOCK // 2)
            q = torch.cat([c & 0x0F, c >> 4], dim=2)
        else:
            q = codes.view(n, k // BLOCK, BLOCK)
        w = q.float() * pick(self.scale).unsqueeze(-1)
        return (w + pick(self.offset).unsqueeze(-1)).view(n, k)


def encode(weight: torch.Tensor) -> BlockCodes | None:
    """The weight as 4-bit codes if they rebuild it exactly, else as 8-bit codes if those do,
    else as bfloat16 if it is that, else None. Works through CHUNK_WEIGHTS weights (whole rows)
    at a time, so its temporaries stay small and a weight that is no grid is given up on at its
    first rows."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    rows = max(1, CHUNK_WEIGHTS // weight.shape[1])
    first = weight[:rows].detach()
    for encoder in (_encode_affine_4bit, _encode_scaled_8bit, _encode_bfloat16):
        parts = [encoder(first.reshape(-1, BLOCK), first.shape)]
        for start in range(rows, weight.shape[0], rows):
            if parts[-1] is None:
                break
            chunk = weight[start:start + rows].detach()
            parts.append(encoder(chunk.reshape(-1, BLOCK), chunk.shape))
        if parts[-1] is not None:
            return BlockCodes(parts[0].bits, *(torch.cat([getattr(p, f) for p in parts]) for f in
                                               ("codes", "scale", "offset")), tuple(weight.shape))
    return None


def encode_model(model: nn.Module) -> int:
    """Set `weight_codes` on every module that has it (the linear layers and the lm_head) to its
    weight's codes, or None where the weight is not exactly codes; returns how many were set."""
    count = 0
    for module in model.modules():
        if hasattr(module, "weight_codes"):
            module.weight_codes = encode(module.weight)
            count += module.weight_codes is not None
    return count


def codes_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the CPU kernels will read codes: float32 on a CPU that runs them, unless
    KVSERVE_WEIGHT_CODES=0 (to measure without them)."""
    from engine import cpu_kernels

    return (device.type == "cpu" and dtype == torch.float32 and os.environ.get("KVSERVE_WEIGHT_CODES", "1") != "0"
            and cpu_kernels.enabled())


def log_codes(held: list[BlockCodes], seconds: float) -> None:
    logger.info("decode reads %d weights as %s-bit codes (%.0f MB, for %.0f MB of float32; found in %.1fs)",
                len(held), "/".join(map(str, sorted({c.bits for c in held}))), sum(c.nbytes for c in held) / 1e6,
                sum(c.shape[0] * c.shape[1] * 4 for c in held) / 1e6, seconds)


_SAMPLE_BLOCKS = 256  # blocks whose distinct values tell a 4-bit tensor from any other at once


def _encode_affine_4bit(blocks: torch.Tensor, shape: torch.Size) -> BlockCodes | None:
    # Q4_1 quantizes a block to q = round((x - min) / d), d = (max - min) / 15, storing d and min
    # as float16: the smallest weight of a block is its offset (q = 0), the largest is q = 15,
    # where float16 neighbours of the guess absorb the rounding of the largest weight. A GPTQ or
    # AWQ weight is scale * (q - zero) with a float16 scale per group of inputs (exact in
    # float32): a block of it spans (max q - min q) <= 15 steps of that scale, each weight
    # exactly min + scale * (q - min q).
    # blocks spread over the chunk: a tensor none of whose guesses fits one of them is no 4-bit grid
    sample = torch.linspace(0, len(blocks) - 1, min(len(blocks), _SAMPLE_BLOCKS)).long()
    ordered = blocks[sample].sort(dim=1).values
    if bool(((ordered[:, 1:] != ordered[:, :-1]).sum(dim=1) >= 16).any()):
        return None  # more than 16 distinct values in a block: no 4-bit grid (8-bit codes, plain floats)
    offset = blocks.min(dim=1).values
    top = blocks.max(dim=1).values
    span = top.double() - offset.double()
    inf = torch.tensor(float("inf"))
    # one step of a GPTQ/AWQ scale, where the code next to the smallest (or the largest) is there
    next_up = torch.where(blocks > offset[:, None], blocks - offset[:, None], inf).amin(dim=1)
    next_down = torch.where(blocks < top[:, None], top[:, None] - blocks, inf).amin(dim=1)
    # GGUF's scale is float16; a GPTQ/AWQ step is taken as it is (compressed-tensors' may be bfloat16)
    guesses = [lambda t: (span[t] / 15).to(torch.float16), lambda t: next_up[t], lambda t: next_down[t]]
    guesses += [lambda t, step=step: _float16_step((span[t] / 15).to(torch.float16), step) for step in (1, -1, 2, -2)]
    guesses += [lambda t, k=k: (span[t] / k).float() for k in range(14, 1, -1)]
    fits = torch.stack([_try_scale(blocks[sample], offset[sample, None], guess(sample))[1] for guess in guesses])
    if not bool(fits.any(dim=0).all()):
        return None
    hits = fits.sum(dim=1).tolist()
    codes, scales = torch.empty_like(blocks), torch.empty_like(offset)
    ok = torch.zeros_like(offset, dtype=torch.bool)
    # the guess that fits most of the sample first (GGUF's 15 steps, or a GPTQ/AWQ block's one step):
    # it reads the blocks in place, and the next ones only the few left
    for i in sorted(range(len(guesses)), key=lambda i: -hits[i]):
        todo = (~ok).nonzero().squeeze(1)
        if not len(todo):
            break
        whole = len(todo) == len(ok)
        b, o = (blocks, offset[:, None]) if whole else (blocks[todo], offset[todo, None])
        q, exact, s = _try_scale(b, o, guesses[i](slice(None) if whole else todo))
        hit = todo[exact]
        codes[hit], scales[hit], ok[hit] = q[exact], s[exact, 0], True
    if not bool(ok.all()):
        return None
    n, k = shape
    nibbles = codes.to(torch.uint8).view(-1, 2, BLOCK // 2)
    pairs = (nibbles[:, 0] | (nibbles[:, 1] << 4)).reshape(n, k // 2)
    return BlockCodes(4, pairs.contiguous(), scales.view(n, -1).contiguous(), offset.view(n, -1).contiguous(),
                        (n, k))


def _try_scale(b: torch.Tensor, o: torch.Tensor, scale: torch.Tensor) -> tuple:
    """Blocks `b` (offsets `o`, (n, 1)) at `scale` (n,): -> (their 4-bit codes, whether
    each block's codes rebuild it bit for bit, the scale as (n, 1) float32)."""
    s = scale.float()[:, None]
    q = torch.where(s > 0, (b - o) / s, 0).round().clamp(0, 15)
    return q, _same_bits(q * s + o, b), s


def _encode_scaled_8bit(blocks: torch.Tensor, shape: torch.Size) -> BlockCodes | None:
    # Q8_0: d = max|x| / 127 (float16), q = round(x / d); the largest |weight| is d * 127 exactly.
    scale = blocks.abs().max(dim=1).values / 127
    q = torch.where(scale[:, None] > 0, blocks / scale[:, None], 0).round()
    offset = torch.full_like(scale, -0.0)
    if q.abs().max() > 127 or not bool(_same_bits(q * scale[:, None] + offset[:, None], blocks).all()):
        return None
    n, k = shape
    return BlockCodes(8, q.to(torch.int8).view(n, k).contiguous(), scale.view(n, -1).contiguous(),
                        offset.view(n, -1).contiguous(), (n, k))


def _encode_bfloat16(blocks: torch.Tensor, shape: torch.Size) -> BlockCodes | None:
    # A bfloat16 weight in float32: its low 16 bits are zero, its high half is the bfloat16.
    bits = blocks.view(torch.int32)
    if bool((bits & 0xFFFF).any()):
        return None
    n, k = shape
    empty = torch.empty(n, 0)
    return BlockCodes(16, (bits >> 16).to(torch.int16).view(n, k).contiguous(), empty, empty, (n, k))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per block (row): whether every value has the same bits (so -0.0 != 0.0, NaN == same NaN)."""
    return (a.view(torch.int32) == b.view(torch.int32)).all(dim=1)


def _float16_step(x: torch.Tensor, step: int) -> torch.Tensor:
    """x (float16, >= 0) moved `step` representable float16 values up or down."""
    if step == 0:
        return x
    bits = x.view(torch.int16).to(torch.int32) + step
    return bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16)
