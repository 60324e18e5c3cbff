"""engine.kernels compiled for the GPUs kvserve is deployed on, on this CPU host (tests/triton_aot.py):
Hopper (H100/H200), Ampere (A100) and the A10G class, at the head shapes of the models the engine
serves and its tests use, in every dtype the engine runs. The interpreter tests check what the
kernels compute; these check that the compiler takes them, that no kernel spills registers to
local memory, that each fits the architecture's shared memory, that one compiled attention kernel
serves every batch size (a CUDA graph's replay never meets a compile), and that the kernels which
must round as torch does are compiled without FMA contraction."""
from __future__ import annotations

import pytest
import torch

from tests.triton_aot import SHARED_LIMIT, compile_only, in_clean_process

pytest.importorskip("triton")

# (query heads, KV heads, head dim) of each model shape
SHAPES = {
    "smollm2-135m": (9, 3, 64),
    "tiny-gqa": (4, 2, 16),  # tests/tiny_llama.py, which the CUDA exactness tests run in float32
    "tiny-tied": (6, 3, 32),
    "qwen3-0.6b": (16, 8, 128),
    "llama3-8b": (32, 8, 128),
    "llama2-7b": (32, 32, 128),  # no GQA
    "llama3-70b-tp1": (64, 8, 128),  # 8 query heads per KV head
}
HALF = ("bfloat16", "float16")
# Per architecture, what must compile: Hopper every shape in every dtype; the others the shapes a
# 24-80 GB GPU serves, and float32 at head dim 128 (the largest tiles).
CASES = {
    90: [(s, dt) for s in SHAPES for dt in HALF]
        + [(s, "float32") for s in ("smollm2-135m", "tiny-gqa", "tiny-tied", "llama3-8b")],
    80: [(s, dt) for s in ("smollm2-135m", "llama3-8b", "llama2-7b") for dt in HALF] + [("llama3-8b", "float32")],
    86: [(s, "float16") for s in ("smollm2-135m", "llama3-8b")] + [("llama3-8b", "float32")],
}


def _attention_inputs(shape: str, dtype: str, num_seqs: int, num_tokens: int, block_size: int = 16):
    h, kvh, d = SHAPES[shape]
    dtype = getattr(torch, dtype)
    q = torch.zeros(num_tokens, h, d, dtype=dtype)
    k_cache = torch.zeros(8, block_size, kvh, d, dtype=dtype)
    block_tables = torch.zeros(num_seqs, 8, dtype=torch.int32)
    seq_lens = torch.ones(num_seqs, dtype=torch.int32)
    query_start = torch.linspace(0, num_tokens, num_seqs + 1).to(torch.int32)
    return q, k_cache, k_cache.clone(), block_tables, seq_lens, query_start


# --- compiled in a clean process (in_clean_process): each returns its kernels' records ---------

def compile_attention(arch: int) -> list[dict]:
    with compile_only(arch) as aot:
        for shape, dtype in CASES[arch]:
            for chunks, tokens in ((0, 4), (4, 40)):  # decodes split over the context: the merge kernel too
                inputs = _attention_inputs(shape, dtype, num_seqs=4, num_tokens=tokens)
                aot.kernels.paged_attention.paged_attention(*inputs, scale=0.125, num_chunk_seqs=chunks,
                                                            num_chunk_tokens=tokens if chunks else 0, num_splits=4)
    return [c.record() for c in aot.compiled]


def compile_elementwise(arch: int, dtype: str) -> list[dict]:
    """RoPE + KV write, the KV write alone, RMSNorm (alone and after the residual add) and
    SiLU-and-mul, at SmolLM2-135M's sizes (9 heads, 3 KV heads, 64 dims, hidden 576, intermediate
    1536) and Llama-3-8B's."""
    dtype = getattr(torch, dtype)
    with compile_only(arch) as aot:
        k = aot.kernels
        for h, kvh, d, hidden, inter in ((9, 3, 64, 576, 1536), (32, 8, 128, 4096, 14336)):
            t = 5
            qkv = torch.zeros(t, (h + 2 * kvh) * d, dtype=dtype)
            table = torch.zeros(64, d)
            positions = slots = torch.zeros(t, dtype=torch.int64)
            k_cache = torch.zeros(4, 16, kvh, d, dtype=dtype)
            k.rope_kv.rope_write_kv(qkv, table, table, positions, slots, k_cache, k_cache.clone(), h, kvh, d)
            kv = qkv[:, h * d:].view(t, 2 * kvh, d)
            k.kv_write.write_kv(kv[:, :kvh], kv[:, kvh:], k_cache, k_cache.clone(), slots)
            k.norm.rms_norm(torch.zeros(t, hidden, dtype=dtype), torch.zeros(hidden, dtype=dtype), 1e-5)
            k.norm.add_rms_norm(torch.zeros(t, hidden, dtype=dtype), torch.zeros(t, hidden, dtype=dtype),
                                torch.zeros(hidden, dtype=dtype), 1e-5)
            k.norm.silu_and_mul(torch.zeros(t, 2 * inter, dtype=dtype))
    return [c.record() for c in aot.compiled]


def compile_batch_sizes() -> list[dict]:
    """SmolLM2's attention at decode batches 1-256, split over the context as on an H200's 132 SMs
    (engine.kernels.paged_attention.decode_splits), at prefill steps of 100-2048 tokens, and at
    mixed steps (a prefill launch, then a decode launch from a sequence and row past 0)."""
    with compile_only(90) as aot:
        for num_seqs in (1, 2, 7, 64, 256):
            inputs = _attention_inputs("smollm2-135m", "bfloat16", num_seqs=num_seqs, num_tokens=num_seqs)
            splits = max(1, min(16, 264 // (num_seqs * 3)))  # 16, 16, 12, 1, 1
            aot.kernels.paged_attention.paged_attention(*inputs, scale=0.125, num_chunk_seqs=0, num_chunk_tokens=0,
                                                        num_splits=splits)
        for num_seqs, num_tokens in ((1, 100), (3, 517), (40, 2048)):
            inputs = _attention_inputs("smollm2-135m", "bfloat16", num_seqs=num_seqs, num_tokens=num_tokens)
            aot.kernels.paged_attention.paged_attention(*inputs, scale=0.125, num_chunk_seqs=num_seqs,
                                                        num_chunk_tokens=num_tokens)
        for chunks, chunk_tokens, decodes, splits in ((1, 100, 3, 16), (3, 517, 250, 1)):
            inputs = _attention_inputs("smollm2-135m", "bfloat16", num_seqs=chunks + decodes,
                                       num_tokens=chunk_tokens + decodes)
            aot.kernels.paged_attention.paged_attention(*inputs, scale=0.125, num_chunk_seqs=chunks,
                                                        num_chunk_tokens=chunk_tokens, num_splits=splits)
    return [c.record() for c in aot.compiled]


# --- the tests ----------------------------------------------------------------------------------

def _assert_fits(kernel: dict, arch: int) -> None:
    assert kernel["arch"] == f"sm{arch}"
    assert kernel["local"] == 0, f"{kernel['name']} spills {kernel['local']} bytes to local memory"
    assert kernel["shared"] <= SHARED_LIMIT[arch], \
        f"{kernel['name']} needs {kernel['shared']} bytes of shared memory, sm_{arch} has {SHARED_LIMIT[arch]}"


@pytest.mark.parametrize("arch", sorted(CASES))
def test_attention_compiles_and_fits(arch):
    kernels = in_clean_process(compile_attention, arch)
    assert len(kernels) == 3 * len(CASES[arch])
    assert {k["name"] for k in kernels} == {"_paged_attention_kernel", "_merge_splits_kernel"}
    for kernel in kernels:
        _assert_fits(kernel, arch)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_elementwise_kernels_compile_fit_and_round_as_torch(arch, dtype):
    kernels = in_clean_process(compile_elementwise, arch, dtype)
    assert [k["name"] for k in kernels] == \
        ["_rope_kv_kernel", "_write_kv_kernel", "_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel"] * 2
    for kernel in kernels:
        _assert_fits(kernel, arch)
        # torch computes x * cos and rotate_half(x) * sin, x * x and w * h as separate, rounded ops
        assert not kernel["fp_fusion"] and not kernel["fma_f32"], kernel["name"]


def test_one_attention_kernel_serves_every_batch_size():
    """A decode step at any batch size and a prefill step at any size reuse their first compile,
    and a mixed step both: CUDA graph capture compiles once, and a replay, a new batch size or a
    mixed step never waits on Triton."""
    kernels = in_clean_process(compile_batch_sizes)
    hashes = [k["hash"] for k in kernels if k["name"] == "_paged_attention_kernel"]
    assert len(hashes) == 12, hashes
    decode, prefill = hashes[:5] + hashes[9:12:2], hashes[5:9] + hashes[10:11]  # mixed: prefill, decode, ...
    assert len(set(decode)) == 1 and len(set(prefill)) == 1, hashes
    assert decode[0] != prefill[0]  # decode tiles and prefill tiles are two kernels
    merges = {k["hash"] for k in kernels if k["name"] == "_merge_splits_kernel"}
    assert len(merges) == 1  # one compile for every number of splits
