"""engine.kernels.norm against the torch code it replaces on CUDA (RMSNorm, SiLU-and-mul); on a
CPU-only host under Triton's interpreter (tests/triton_interp.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import kernels_here


@pytest.fixture(scope="module", autouse=True)
def device():
    with kernels_here() as d:
        yield d


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 64), (3, 96)])
def test_rms_norm_matches_torch(device, dtype, rows, dim):
    from engine.kernels import norm
    from engine.model.layers import RMSNorm

    layer = RMSNorm(dim, 1e-5, dtype).to(device)
    layer.weight.data.copy_(torch.rand(dim) + 0.5)
    x = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype).to(device)
    h = x.float()
    expected = layer.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # torch's path
    torch.testing.assert_close(norm.rms_norm(x, layer.weight.data, 1e-5), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, dim", [(1, 576), (5, 64), (3, 96)])
def test_add_rms_norm_is_the_add_then_the_norm(device, dtype, rows, dim):
    """The fused residual add: the sum exactly as torch's add rounds it, and the norm exactly as
    the plain kernel computes it from that sum (bitwise: the layer's output does not move)."""
    from engine.kernels import norm

    gen = torch.Generator().manual_seed(dim)
    x, residual = ((torch.randn(2, rows, dim, generator=gen) * 3).to(dtype)).to(device)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype).to(device)
    s, y = norm.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(s, x + residual)
    assert torch.equal(y, norm.rms_norm(x + residual, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, inter", [(1, 1536), (4, 160), (2, 2500)])
def test_silu_and_mul_matches_torch(device, dtype, rows, inter):
    from engine.kernels import norm

    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(norm.silu_and_mul(gate_up), F.silu(gate) * up, **TOL[dtype])
