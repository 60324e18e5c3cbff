"""The elementwise work between a CUDA layer's GEMMs, one launch each instead of 3-8 torch ops:
RMSNorm (with the residual add before it) and SiLU-and-mul. Same op order and roundings as the
torch code they replace (engine.model.layers.RMSNorm, engine.model.llama.MLP), so bfloat16 stays
as HF computes it (compiled without FMA contraction: torch rounds a product before the sum that
follows it):

    rms_norm:      y = weight * (x * rsqrt(mean(x^2) + eps))  normalised in float32, cast, then scaled
    add_rms_norm:  s = x + residual; y = rms_norm(s)            s rounded to the dtype, as torch's add
    silu_and_mul:  y = silu(gate) * up                           silu rounded to the dtype, then the product
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_stride, y_stride, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    _norm_row(x, w_ptr, y_ptr + row * y_stride, offs, mask, eps, N)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, x_stride, r_stride, y_stride, s_stride, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = s_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * r_stride + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(dtype)  # torch adds in float32 and rounds once
    tl.store(s_ptr + row * s_stride + offs, s, mask=mask)
    _norm_row(s.to(tl.float32), w_ptr, y_ptr + row * y_stride, offs, mask, eps, N)


@triton.jit
def _norm_row(x, w_ptr, y_row_ptr, offs, mask, eps, N: tl.constexpr):
    dtype = y_row_ptr.dtype.element_ty
    var = tl.sum(x * x, axis=0) / N
    h = (x * tl.math.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(y_row_ptr + offs, (w.to(tl.float32) * h.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, x_stride, y_stride, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(y_ptr + row * y_stride + offs, (silu.to(tl.float32) * up).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (rows, dim), last dim contiguous; weight: (dim,) of x's dtype -> (rows, dim)."""
    rows, dim = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty_like(x)
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, y, x.stride(0), y.stride(0), eps, N=dim,
                                  BLOCK=triton.next_power_of_2(dim), enable_fp_fusion=False)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: (rows, dim) of one dtype, last dim contiguous -> (x + residual, its rms_norm):
    the residual stream's next value and the next sublayer's input, in one launch."""
    rows, dim = x.shape
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous() and residual.dtype == x.dtype
    s, y = torch.empty_like(x), torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](x, residual, weight, y, s, x.stride(0), residual.stride(0), y.stride(0),
                                      s.stride(0), eps, N=dim, BLOCK=triton.next_power_of_2(dim),
                                      enable_fp_fusion=False)
    return s, y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (rows, 2 I), last dim contiguous -> (rows, I)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    y = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, y, gate_up.stride(0), y.stride(0),
                                                                N=inter, BLOCK=block, enable_fp_fusion=False)
    return y
