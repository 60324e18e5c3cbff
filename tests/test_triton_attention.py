"""The Triton kernels (engine.kernels) against a plain torch attention, on random ragged batches:
prefill chunks with and without a cached prefix before them, single-token decodes, contexts
crossing block boundaries, GQA ratios, several block sizes and head dims. On a CPU-only host they
run under Triton's interpreter (tests/triton_interp.py), compiled on a CUDA one."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.triton_interp import kernels_here

HEADS = [(4, 4), (4, 2), (6, 2), (8, 1), (9, 3)]  # (query heads, KV heads): MHA, GQA, MQA, SmolLM2's 3:1
# Compiled (CUDA), each new shape is a compile: benchmarks/gpu_check.sh asks for fewer examples.
EXAMPLES = int(os.environ.get("KVSERVE_KERNEL_EXAMPLES", "40"))


@pytest.fixture(scope="module", autouse=True)
def device():
    with kernels_here() as d:
        yield d


def _kernels():
    from engine.kernels import kv_write, paged_attention
    return paged_attention, kv_write


def make_batch(rng: random.Random, seqs: list[tuple[int, int]], block_size: int, kvh: int, d: int,
               dtype: torch.dtype, device: torch.device) -> dict:
    """seqs: (seq_len, q_len) each -> a pool with random contents, each sequence's blocks scattered
    over it, and the kernels' metadata."""
    need = [-(-n // block_size) for n, _ in seqs]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in need:
        tables.append(ids[used:used + n])
        used += n
    width = max(need) + rng.randint(0, 2)  # wider than needed: the tail is never read
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    qs = [0]
    for _, q in seqs:
        qs.append(qs[-1] + q)
    return dict(
        k_cache=k_cache.to(device), v_cache=v_cache.to(device), tables=tables,
        block_tables=torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables],
                                  dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32, device=device),
        query_start=torch.tensor(qs, dtype=torch.int32, device=device))


def reference(q: torch.Tensor, b: dict, seqs: list[tuple[int, int]], scale: float) -> torch.Tensor:
    """Each sequence's context gathered through its block table, causal softmax, in float64."""
    _, h, d = q.shape
    k_cache, v_cache = b["k_cache"].double().cpu(), b["v_cache"].double().cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (n, ql) in enumerate(seqs):
        kvh = k_cache.shape[2]
        k = k_cache[b["tables"][i]].reshape(-1, kvh, d)[:n].repeat_interleave(h // kvh, dim=1)  # (n, H, D)
        v = v_cache[b["tables"][i]].reshape(-1, kvh, d)[:n].repeat_interleave(h // kvh, dim=1)
        rows = slice(b["query_start"][i].item(), b["query_start"][i + 1].item())
        s = torch.einsum("qhd,khd->hqk", q[rows].double().cpu(), k) * scale  # (H, ql, n)
        visible = torch.arange(n)[None, :] <= (n - ql + torch.arange(ql))[:, None]
        out[rows] = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


@st.composite
def ragged_batches(draw, max_seqs: int = 5):
    """-> (seqs, block_size, (H, KVH), D, seed): each sequence a decode, a whole prompt, or a chunk
    after a cached prefix / earlier chunks."""
    block_size = draw(st.sampled_from([4, 16, 32]))
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        if kind == "decode":
            seqs.append((draw(st.integers(1, 80)), 1))
        elif kind == "prefill":
            q = draw(st.integers(1, 40))
            seqs.append((q, q))
        else:
            q = draw(st.integers(1, 40))
            seqs.append((q + draw(st.integers(1, 60)), q))
    return seqs, block_size, draw(st.sampled_from(HEADS)), draw(st.sampled_from([16, 64])), draw(st.integers(0, 1 << 20))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches())
def test_mixed_batch_matches_reference_fp32(device, case):
    seqs, block_size, (h, kvh), d, seed = case
    rng = random.Random(seed)
    b = make_batch(rng, seqs, block_size, kvh, d, torch.float32, device)
    q = torch.randn(b["query_start"][-1].item(), h, d, generator=torch.Generator().manual_seed(seed)).to(device)
    attention, _ = _kernels()
    # In the order given (decodes among chunks), all in the prefill launch; the steps the runner
    # builds put chunks first and the decodes in a launch of their own (test below).
    out = attention.paged_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["query_start"], d ** -0.5, len(seqs), q.shape[0])
    torch.testing.assert_close(out.double().cpu(), reference(q, b, seqs, d ** -0.5), rtol=1e-4, atol=1e-5)


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_batches(max_seqs=4), st.lists(st.integers(1, 120), min_size=1, max_size=4), st.integers(1, 16))
def test_chunks_then_decodes_take_a_launch_each(device, case, decode_lens, num_splits):
    """A mixed step as the runner lays it out: chunks (and single-row prompts) in the prefill
    launch, then the decodes in their own launch at decode tiles, split over the context; each
    launch numbers its tiles from its own first sequence and row."""
    seqs, block_size, (h, kvh), d, seed = case
    chunks = [s for s in seqs if s[1] > 1] or [(30, 7)]
    seqs = chunks + [(n, 1) for n in decode_lens]
    rng = random.Random(seed)
    b = make_batch(rng, seqs, block_size, kvh, d, torch.float32, device)
    q = torch.randn(b["query_start"][-1].item(), h, d, generator=torch.Generator().manual_seed(seed)).to(device)
    attention, _ = _kernels()
    out = attention.paged_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["query_start"], d ** -0.5, len(chunks), sum(ql for _, ql in chunks),
                                    num_splits=num_splits)
    torch.testing.assert_close(out.double().cpu(), reference(q, b, seqs, d ** -0.5), rtol=1e-4, atol=1e-5)


@settings(max_examples=max(1, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 100), min_size=1, max_size=6), st.sampled_from([16, 32]), st.sampled_from(HEADS))
def test_decode_tiles_match_mixed_tiles(device, lens, block_size, heads):
    """Decode-only batches take the small tiles; the result is the same as with the large ones."""
    h, kvh = heads
    seqs = [(n, 1) for n in lens]
    b = make_batch(random.Random(len(lens)), seqs, block_size, kvh, 64, torch.float32, device)
    q = torch.randn(len(lens), h, 64, generator=torch.Generator().manual_seed(1)).to(device)
    attention, _ = _kernels()
    args = (q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"], b["query_start"], 0.125)
    small, large = attention.paged_attention(*args, 0, 0), attention.paged_attention(*args, len(lens), len(lens))
    torch.testing.assert_close(small, large, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(small.double().cpu(), reference(q, b, seqs, 0.125), rtol=1e-4, atol=1e-5)


@settings(max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 300), min_size=1, max_size=4), st.sampled_from([4, 16]), st.sampled_from(HEADS),
       st.sampled_from([16, 64]), st.integers(2, 16))
def test_split_decode_matches_reference(device, lens, block_size, heads, d, num_splits):
    """Split-KV decoding: each program's context cut into num_splits ranges (some empty when the
    context is short), merged by a second launch; length-0 sequences (graph padding) come out 0."""
    h, kvh = heads
    seqs = [(max(n, 1), 1) for n in lens]
    b = make_batch(random.Random(sum(lens)), seqs, block_size, kvh, d, torch.float32, device)
    b["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(len(lens))).to(device)
    attention, _ = _kernels()
    out = attention.paged_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["query_start"], d ** -0.5, 0, 0, num_splits=num_splits)
    expected = reference(q, b, seqs, d ** -0.5)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i].cpu(), torch.zeros(h, d))
        else:
            torch.testing.assert_close(out[i].double().cpu(), expected[i], rtol=1e-4, atol=1e-5)


def test_decode_splits_fill_four_waves_of_the_sms(monkeypatch):
    """The split count a CUDA graph fixes per batch size: H200 (132 SMs), SmolLM2's 3 KV heads."""
    from engine.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert [paged_attention.decode_splits(n, 3, cuda) for n in (1, 2, 8, 44, 64, 88, 89, 256)] == [16, 16, 16, 4, 2, 2, 1, 1]
    assert paged_attention.decode_splits(1, 3, torch.device("cpu")) == 1


def test_split_scratch_views_are_apart_and_16_byte_aligned():
    """Triton specializes a pointer on 16-byte alignment: a view off it would compile the kernel
    again (mid-serving, on an eager step) for some batch sizes."""
    from engine.kernels import paged_attention

    cpu = torch.device("cpu")
    for rows, d, splits in [(13 * 9, 64, 13), (3 * 14, 64, 3), (1, 128, 16), (7, 64, 1), (5, 80, 2)]:
        views = paged_attention.split_scratch(cpu, rows, d, splits)
        base = min(v.data_ptr() for v in views)
        assert all((v.data_ptr() - base) % 16 == 0 for v in views), (rows, d, splits)
        parts = rows * splits
        assert [v.numel() for v in views] == ([parts * d, parts, parts] if splits > 1 else [1, 1, 1])
        spans = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for v in views)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
    assert paged_attention.split_scratch(cpu, 9, 64, 1)[0].data_ptr() == paged_attention.split_scratch(
        cpu, 300, 64, 1)[0].data_ptr()  # one kept for every launch of one split


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_its_rounding(device, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("Triton's interpreter computes bfloat16 dots wrongly (numpy has no bfloat16); CUDA only")
    seqs = [(37, 37), (50, 9), (21, 1), (64, 1)]
    b = make_batch(random.Random(0), seqs, 16, 2, 128, dtype, device)
    q = torch.randn(b["query_start"][-1].item(), 6, 128, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    attention, _ = _kernels()
    out = attention.paged_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["query_start"], 128 ** -0.5, 2, 46)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), reference(q, b, seqs, 128 ** -0.5), rtol=2e-2, atol=2e-2)


def test_padding_sequences_read_nothing_and_come_out_zero(device):
    """CUDA-graph padding: a sequence with no context (seq_len 0) yields zeros, not NaN."""
    seqs = [(20, 1), (0, 1), (0, 1)]
    b = make_batch(random.Random(0), [(20, 1), (1, 1), (1, 1)], 16, 2, 64, torch.float32, device)
    b["seq_lens"][1:] = 0
    q = torch.randn(3, 4, 64).to(device)
    attention, _ = _kernels()
    out = attention.paged_attention(q, b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
                                    b["query_start"], 0.125, 0, 0)
    assert torch.equal(out[1:].cpu(), torch.zeros(2, 4, 64))
    torch.testing.assert_close(out[:1].double().cpu(), reference(q, b, seqs[:1], 0.125)[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_slots_and_skips_padding(device, dtype):
    num_blocks, block_size, kvh, d, t = 6, 16, 3, 64, 7
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(t, (9 + 2 * kvh) * d).to(dtype).to(device)  # k and v as views into a fused qkv
    k = qkv[:, 9 * d:(9 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (9 + kvh) * d:].view(t, kvh, d)
    slots = torch.tensor([5, 17, 16, -1, 95, 40, -1], device=device)
    _, kv_write = _kernels()
    kv_write.write_kv(k, v, k_cache, v_cache, slots)
    expect_k, expect_v = torch.zeros_like(k_cache).view(-1, kvh, d), torch.zeros_like(v_cache).view(-1, kvh, d)
    keep = slots >= 0
    expect_k[slots[keep]] = k[keep]
    expect_v[slots[keep]] = v[keep]
    assert torch.equal(k_cache.view(-1, kvh, d), expect_k)
    assert torch.equal(v_cache.view(-1, kvh, d), expect_v)


@pytest.mark.parametrize("dtype, heads, d", [(torch.float32, (9, 3), 64), (torch.float16, (4, 2), 128),
                                             (torch.float32, (6, 3), 16)])
def test_rope_write_kv_matches_apply_rope_then_write(device, dtype, heads, d, monkeypatch):
    from engine.attention import write_kv
    from engine.kernels import rope_kv
    from engine.model.rope import RotaryEmbedding, apply_rope

    grids = []
    kernel = rope_kv._rope_kv_kernel

    class Launches:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rope_kv, "_rope_kv_kernel", Launches())

    h, kvh = heads
    t, num_blocks, block_size = 7, 4, 16
    rotary = RotaryEmbedding(d, 256, 10000.0, None).to(device)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    positions = torch.tensor([0, 1, 5, 17, 40, 200, 3], device=device)
    slots = torch.tensor([0, 1, 5, -1, 40, 63, 33], device=device)
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    q = rope_kv.rope_write_kv(qkv, rotary.cos, rotary.sin, positions, slots, k_cache, v_cache, h, kvh, d)

    q_ref, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    cos, sin = rotary.cos_sin(positions, dtype)
    q_ref, k = apply_rope(q_ref.view(t, h, d), k.view(t, kvh, d), cos, sin)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    write_kv(k_ref, v_ref, k[keep], v.reshape(t, kvh, d)[keep], slots[keep])
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    assert torch.equal(v_cache, v_ref)
    assert grids == [(t,)]  # one program per token, all its heads (not one per (token, head))


def test_attention_benchmark_checks_and_reports_each_case(device, tmp_path):
    """benchmarks/attention_splits.py, which a GPU run (benchmarks/gpu_check.sh) takes its WAVES
    and mixed-step figures from: every case's outputs agree, and each gets its row."""
    from benchmarks import attention_splits

    path = tmp_path / "attention.json"
    attention_splits.main(["--shapes", "tiny", "--batches", "1,3", "--contexts", "20", "--splits", "1,2",
                           "--mixed-chunk", "9", "--mixed-decodes", "2", "--mixed-context", "30", "--json", str(path)])
    result = json.loads(path.read_text())
    assert [(r["batch"], r["best"] in (1, 2), set(r["ms"])) for r in result["splits"]] == \
        [(1, True, {"1", "2"}), (3, True, {"1", "2"})]
    assert [(r["decodes"], r["two_launches_ms"] > 0, r["one_launch_ms"] > 0) for r in result["mixed"]] == [(2, True, True)]
