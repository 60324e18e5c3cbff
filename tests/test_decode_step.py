"""engine.decode_step: a decode-only CPU step in one native call gives the per-layer path's hidden
states and KV writes bit for bit, over float32 weights, 4/8-bit codes and biases, and it takes
only the steps the per-layer path would run natively throughout."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention import AttentionMetadata, NativeDecodes, PrefillChunk
from engine.decode_step import NativeDecodeStep
from engine.kv_cache import allocate_kv_cache
from engine.model.codes import encode_model
from engine.model.llama import LlamaModel, ModelArch
from engine.model_runner import ModelRunner
from tests.test_cpu_kernels import needs_kernel
from tests.tiny_llama import gguf_roundtrip

BLOCK = 16
ARCH = ModelArch(vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6, num_kv_heads=2,
                 head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                 tie_word_embeddings=True, attention_bias=False, mlp_bias=False)


def _model(arch: ModelArch, codes: bool | str, seed: int = 0) -> LlamaModel:
    """codes: False (float32 weights), True (GGUF 4/8-bit codes) or "bf16" (a bfloat16 checkpoint's)."""
    g = torch.Generator().manual_seed(seed)
    model = LlamaModel(arch, torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.15 if p.dim() == 2 else 0.5) + (p.dim() == 1))
            if codes == "bf16":
                p.copy_(p.to(torch.bfloat16))
            elif codes and p.dim() == 2:
                p.copy_(gguf_roundtrip(p, "Q8_0" if "embed" in name or "down" in name else "Q4_1"))
    if codes:
        assert encode_model(model) > 0
    return model


def _decode_batch(lens: list[int], num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One new token per sequence at position len - 1, blocks drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lens)
    tables, slots = [], []
    for n in lens:
        own = [perm.pop() for _ in range(-(-n // BLOCK))]
        tables.append(own + [0] * (width - len(own)))
        slots.append(own[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    ids = torch.randint(0, ARCH.vocab_size, (len(lens),), generator=g)
    nd = NativeDecodes(0, torch.tensor(tables), torch.tensor(lens))
    return ids, torch.tensor(lens) - 1, AttentionMetadata(torch.tensor(slots), torch.tensor([]), [], [], nd)


def _random_pool(arch: ModelArch, num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    pool = allocate_kv_cache(arch.num_layers, num_blocks, BLOCK, arch.num_kv_heads, arch.head_dim, torch.float32,
                             torch.device("cpu"))
    for k, v in pool:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return pool


@needs_kernel
@pytest.mark.parametrize("codes", [False, True, "bf16"], ids=["float32", "codes", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("lens", [[1], [17], [5, 40, 16, 33, 100, 2, 64]])
def test_one_call_gives_the_per_layer_paths_bits(codes, bias, lens):
    arch = dataclasses.replace(ARCH, attention_bias=bias, mlp_bias=bias)
    model = _model(arch, codes)
    pool = _random_pool(arch, 64, seed=1)
    ids, positions, meta = _decode_batch(lens, 64, seed=2)
    step = NativeDecodeStep.build(model, pool, BLOCK)
    assert step is not None and step.runs(meta, len(lens))
    before = [(k.clone(), v.clone()) for k, v in pool]
    with torch.inference_mode():
        want = model(ids, positions, pool, meta)
        want_pool = [(k.clone(), v.clone()) for k, v in pool]
        for (k, v), (k0, v0) in zip(pool, before):  # the same pool again, before this step's writes
            k.copy_(k0)
            v.copy_(v0)
        got = step.forward(ids, positions, meta)
    assert torch.equal(got, want)
    for (k, v), (wk, wv) in zip(pool, want_pool):
        assert torch.equal(k, wk) and torch.equal(v, wv)


@needs_kernel
def test_it_takes_only_small_pure_decode_steps():
    model = _model(ARCH, codes=False)
    pool = _random_pool(ARCH, 64, seed=1)
    step = NativeDecodeStep.build(model, pool, BLOCK)
    _, _, meta = _decode_batch([5, 9], 64, seed=2)
    assert step.runs(meta, 2)
    assert not step.runs(meta, 3)  # a prefill row beside the decodes
    mixed = dataclasses.replace(meta, prefills=[PrefillChunk(0, 4, torch.tensor([3]), 4)])
    assert not step.runs(mixed, 2)
    assert not step.runs(dataclasses.replace(meta, native_decode=None), 2)
    _, _, big = _decode_batch([3] * 97, 400, seed=3)
    assert not step.runs(big, 97)  # past SMALL_M the GEMMs run on MKL/oneDNN


def test_it_is_not_built_where_the_per_layer_path_is_not_native(monkeypatch):
    model = _model(ARCH, codes=False)
    pool = _random_pool(ARCH, 8, seed=1)
    monkeypatch.setenv("KVSERVE_NATIVE_DECODE_STEP", "0")
    assert NativeDecodeStep.build(model, pool, BLOCK) is None
    monkeypatch.delenv("KVSERVE_NATIVE_DECODE_STEP")
    half = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in pool]
    assert NativeDecodeStep.build(model.to(torch.bfloat16), half, BLOCK) is None


@needs_kernel
def test_the_cpu_runner_uses_it():
    model = _model(ARCH, codes=False)
    runner = ModelRunner(model, _random_pool(ARCH, 8, seed=1), BLOCK, torch.device("cpu"))
    assert isinstance(runner.native_step, NativeDecodeStep)
