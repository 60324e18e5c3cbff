"""engine.cpu_kernels: the native small-batch linear agrees with F.linear, is batch invariant,
and falls back to torch wherever it does not apply."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.cpu_kernels import SMALL_M, linear

CAN_BUILD = shutil.which("cc") is not None and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler or no AVX2 on this host")


@needs_kernel
def test_kernel_builds_where_it_can():
    """A host with a compiler and AVX2 must get the kernel: a broken build would otherwise
    silently leave every other test here on torch."""
    assert cpu_kernels.enabled()


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33, SMALL_M])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 96, 577])
def test_matches_torch_on_every_tile_shape(m, n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, 64, generator=g), torch.randn(n, 64, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_model_sized_shapes_match_torch():
    g = torch.Generator().manual_seed(0)
    for n, k in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        x, w = torch.randn(16, k, generator=g), torch.randn(n, k, generator=g)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gives_the_same_bits_in_any_batch():
    """Batch invariance: a sequence's output does not depend on how many others share its step
    or where its row falls in the tiles."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(SMALL_M, 576, generator=g), torch.randn(100, 576, generator=g)
    full = linear(x, w)
    for m in (1, 2, 3, 5, 17, SMALL_M - 1):
        for start in (0, 1, SMALL_M - m):
            assert torch.equal(linear(x[start:start + m], w), full[start:start + m])


def test_shapes_outside_the_kernel_use_torch_exactly():
    g = torch.Generator().manual_seed(2)
    cases = [
        (torch.randn(SMALL_M + 1, 64, generator=g), torch.randn(8, 64, generator=g)),  # prefill-sized
        (torch.randn(4, 60, generator=g), torch.randn(8, 60, generator=g)),  # K not a multiple of 8
        (torch.randn(4, 64, generator=g).double(), torch.randn(8, 64, generator=g).double()),
        (torch.randn(4, 64, generator=g), torch.randn(64, 8, generator=g).t()),  # non-contiguous weight
    ]
    for x, w in cases:
        assert torch.equal(linear(x, w), F.linear(x, w))


@needs_kernel
def test_non_contiguous_input_is_accepted():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 8, generator=g).t(), torch.randn(5, 64, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_env_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    assert not cpu_kernels.enabled()
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 64, generator=g), torch.randn(7, 64, generator=g)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_failed_build_falls_back_to_torch_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernels._library.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="engine.cpu_kernels"):
            assert not cpu_kernels.enabled()
            x, w = torch.randn(4, 64), torch.randn(7, 64)
            assert torch.equal(linear(x, w), F.linear(x, w))
        assert "CPU kernels off" in caplog.text
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        cpu_kernels._library.cache_clear()


@needs_kernel
def test_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    first = cpu_kernels._build()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temp dir left


def _paged_case(lens, kvh, group, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kvh, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kvh, head_dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered; block 0 only pads
    width = max(-(-n // block_size) for n in lens)
    tables = []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // block_size))]
        tables.append(own + [0] * (width - len(own)))
    q = torch.randn(len(lens), kvh * group, head_dim, generator=g)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


def _reference(q, k_cache, v_cache, tables, lens, scale):
    out = torch.empty_like(q)
    bs, kvh, d = k_cache.shape[1:]
    for i, n in enumerate(lens.tolist()):
        k = k_cache[tables[i]].reshape(-1, kvh, d)[:n].transpose(0, 1)
        v = v_cache[tables[i]].reshape(-1, kvh, d)[:n].transpose(0, 1)
        out[i] = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1)
    return out


@needs_kernel
@pytest.mark.parametrize("lens,kvh,group,head_dim,block_size", [
    ([1], 1, 1, 64, 16),
    ([1, 15, 16, 17, 33, 64], 3, 3, 64, 16),  # around block boundaries, GQA as in SmolLM2
    ([7, 1000, 250], 2, 4, 64, 16),  # long context, uneven lengths
    ([40] * 16, 4, 1, 64, 16),  # plain multi-head
    ([1, 9, 70, 300], 2, 3, 128, 16),
    ([1, 9, 70, 300], 2, 3, 96, 32),  # 96 and 8: past the kernel's 64-lane blocks
    ([1, 9, 70, 300], 2, 3, 8, 16),
])
def test_decode_attention_matches_sdpa(lens, kvh, group, head_dim, block_size):
    q, k_cache, v_cache, tables, ctx = _paged_case(lens, kvh, group, head_dim=head_dim, block_size=block_size)
    scale = q.shape[-1] ** -0.5
    out = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, ctx, scale), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_decode_attention_ignores_what_lies_past_each_context():
    """Slots past a sequence's length (the rest of its last block, padding in its table) hold
    anything, even NaN, without changing its output."""
    q, k_cache, v_cache, tables, ctx = _paged_case([5, 20], 3, 3, seed=1)
    scale = q.shape[-1] ** -0.5
    clean = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    for i, n in enumerate(ctx.tolist()):
        last = tables[i][(n - 1) // 16]
        k_cache[last, n % 16:] = float("nan")
        v_cache[last, n % 16:] = float("nan")
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # block 0 pads the first table
    assert torch.equal(cpu_kernels.decode_attention(q, k_cache, v_cache, tables, ctx, scale), clean)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 576 crosses the threads' threshold
def test_rms_norm_matches_hf_order(rows):
    from engine.model.layers import RMSNorm

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(576, 1e-5, torch.float32)
    norm.weight.data.copy_(torch.randn(576, generator=g))
    x = torch.randn(rows, 576, generator=g) * 3
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # HF's LlamaRMSNorm in float32
    torch.testing.assert_close(cpu_kernels.rms_norm(x, norm.weight, 1e-5), norm.weight * h, rtol=2e-6, atol=2e-6)
    assert torch.equal(norm(x), cpu_kernels.rms_norm(x, norm.weight, 1e-5))  # the module takes the kernel


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 8), (16, 1536), (100, 1540)])  # 1540: a scalar tail
def test_silu_and_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 8  # exp well beyond +-20
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up, rtol=3e-6, atol=1e-6)


@needs_kernel
def test_rope_write_kv_is_bitwise_the_torch_path():
    from engine.attention import write_kv
    from engine.model.rope import RotaryEmbedding, apply_rope

    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, t = 9, 3, 64, 21
    rotary = RotaryEmbedding(dim, 4096, 100000.0, None)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g)
    positions = torch.randint(0, 4096, (t,), generator=g)
    slots = torch.randperm(64, generator=g)[:t]
    caches = [torch.zeros(4, 16, kv_heads, dim) for _ in range(4)]  # fused k, v; torch k, v

    q_ref, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k = apply_rope(q_ref.view(t, heads, dim), k.reshape(t, kv_heads, dim), *rotary.cos_sin(positions, torch.float32))
    write_kv(caches[2], caches[3], k, v.reshape(t, kv_heads, dim), slots)
    q = cpu_kernels.rope_write_kv(qkv, rotary.cos, rotary.sin, positions, slots, caches[0], caches[1],
                                  heads, kv_heads, dim)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("m", [SMALL_M + 1, 512, 1500])
def test_prefill_sized_batches_run_on_the_prepacked_weight(m):
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 576, generator=g), torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    packed = cpu_kernels.prepack(w)
    assert packed is not None and cpu_kernels.prepack(w.double()) is None
    torch.testing.assert_close(linear(x, w, prepacked=packed), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w, b, prepacked=packed), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    w.zero_()  # the prepacked copy is what a prefill-sized batch reads
    assert linear(x, w, prepacked=packed).abs().sum() > 0
