"""engine/model/codes.py and engine/csrc/linear_codes.c: weights dequantized from GGUF Q4_1 / Q8_0
are found again as their codes, bit for bit, and a GEMM over the codes gives the same bits as the
float32 kernel over the float32 weights; anything else stays float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from engine import cpu_kernels
from engine.cpu_kernels import linear
from engine.model.codes import BlockCodes, codes_wanted, encode, encode_model
from tests.test_cpu_kernels import needs_kernel
from tests.tiny_llama import gguf_roundtrip


BF16 = "bf16"  # a bfloat16 checkpoint's weights, in float32


def gguf_weights(n: int, k: int, qtype: QType | str, seed: int) -> torch.Tensor:
    """Random weights quantized and dequantized by gguf-py: what transformers loads from a GGUF
    file; or (BF16) rounded to bfloat16, what a bfloat16 checkpoint loads as in float32."""
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05)
    return w.to(torch.bfloat16).float() if qtype == BF16 else gguf_roundtrip(w, qtype.name)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype, bits", [(QType.Q4_1, 4), (QType.Q8_0, 8), (BF16, 16)])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 64), (96, 576), (300, 1536)])
def test_gguf_weights_are_found_as_their_codes(qtype, bits, n, k):
    w = gguf_weights(n, k, qtype, seed=n + k)
    codes = encode(w)
    assert codes is not None and codes.bits == bits and codes.shape == (n, k)
    assert same_bits(codes.to_float(), w)
    assert codes.nbytes <= w.numel() * 4 * {4: 0.19, 8: 0.32, 16: 0.5}[bits]


def test_weights_that_are_not_codes_stay_float():
    g = torch.Generator().manual_seed(0)
    assert encode(torch.randn(64, 64, generator=g)) is None
    almost = gguf_weights(64, 64, QType.Q4_1, seed=1)
    almost[5, 17] = torch.nextafter(almost[5, 17], torch.tensor(1.0))  # one weight one ulp off its grid
    assert encode(almost) is None
    assert encode(gguf_weights(8, 64, QType.Q8_0, seed=2)[:, :48].contiguous()) is None  # K % 32 != 0
    assert encode(gguf_weights(8, 64, QType.Q8_0, seed=3).double()) is None
    almost = gguf_weights(64, 64, BF16, seed=4)
    almost[63, 63] = torch.nextafter(almost[63, 63], torch.tensor(1.0))  # not a bfloat16 any more
    assert encode(almost) is None
    assert encode(gguf_weights(64, 64, BF16, seed=4).to(torch.bfloat16)) is None  # float32 weights only


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, BF16])
def test_encoding_in_row_chunks_gives_the_same_codes(monkeypatch, qtype):
    from engine.model import codes as codes_module

    w = gguf_weights(95, 576, qtype, seed=9)
    whole = encode(w)
    monkeypatch.setattr(codes_module, "CHUNK_WEIGHTS", 576 * 10)  # 10 rows a chunk, the last one 5
    chunked = encode(w)
    assert chunked.shape == whole.shape and chunked.bits == whole.bits
    for field in ("codes", "scale", "offset"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field))
    w[90, 3] = torch.nextafter(w[90, 3], torch.tensor(1.0))  # off the grid in the last chunk only
    assert encode(w) is None


@needs_kernel
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, BF16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 33])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 50, 577])
def test_linear_over_codes_gives_the_float32_kernels_bits(qtype, m, n):
    k = 96
    w = gguf_weights(n, k, qtype, seed=m * 1000 + n)
    codes = encode(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert same_bits(linear(x, w, codes=codes), linear(x, w))
    assert same_bits(linear(x, w, bias, codes=codes), linear(x, w, bias))
    torch.testing.assert_close(linear(x, w, codes=codes), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_model_sized_shapes_over_codes():
    for n, k, qtype in [(960, 576, QType.Q4_1), (576, 1536, QType.Q4_1), (4099, 576, QType.Q8_0), (1536, 576, BF16),
                        (4099, 576, BF16)]:
        w = gguf_weights(n, k, qtype, seed=n)
        for m in (1, 2, 16):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
            assert same_bits(linear(x, w, codes=encode(w)), linear(x, w))


@needs_kernel
def test_the_kernel_refuses_codes_it_cannot_read():
    w = gguf_weights(4, 64, QType.Q8_0, seed=5)
    c = encode(w)
    bad = BlockCodes(5, c.codes, c.scale, c.offset, c.shape)
    with pytest.raises(RuntimeError, match="codes failed"):
        linear(torch.randn(2, 64), w, codes=bad)


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_codes = None


def test_encode_model_sets_codes_only_where_they_are_exact():
    model = torch.nn.Sequential(_Linear(gguf_weights(8, 64, QType.Q4_1, seed=6)), _Linear(torch.randn(8, 64)),
                                _Linear(gguf_weights(8, 64, BF16, seed=6)))
    assert encode_model(model) == 2
    assert model[0].weight_codes.bits == 4 and model[1].weight_codes is None and model[2].weight_codes.bits == 16


def test_codes_are_only_made_where_the_cpu_kernels_read_them(monkeypatch):
    cpu = torch.device("cpu")
    assert not codes_wanted(cpu, torch.bfloat16)
    for switch in ("KVSERVE_CPU_KERNELS", "KVSERVE_WEIGHT_CODES"):
        monkeypatch.setenv(switch, "0")
        assert not codes_wanted(cpu, torch.float32)
        monkeypatch.delenv(switch)
    assert codes_wanted(cpu, torch.float32) == cpu_kernels.enabled()


@needs_kernel
@pytest.mark.parametrize("kind", ["gqa-bf16", "qwen3-gguf", "qwen3-bf16"])  # an untied head; tied ones
def test_a_layer_with_codes_and_a_prepacked_copy_drops_its_float32(monkeypatch, tmp_path, smollm2_path, kind):
    """Decode reads the codes, prefill the prepacked copy: the plain float32 weight is freed (the
    embedding table's too, its lookup reading the codes), and every path gives the bits of a model
    that kept them all."""
    from engine.model.loader import build_model, float_parameters, held_weight_bytes
    from tests.tiny_llama import make_tiny_llama

    d = make_tiny_llama(tmp_path, smollm2_path, kind)
    model = build_model(d, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("KVSERVE_WEIGHT_CODES", "0")
    kept = build_model(d, torch.float32, torch.device("cpu"))  # no codes: nothing dropped
    dropped = {n for n, p in model.named_parameters() if p.is_meta}
    with_codes = {n for n, m in model.named_modules() if getattr(m, "weight_codes", None) is not None}
    assert dropped == {f"{n}.weight" for n in with_codes} and dropped
    assert model.embed_tokens.weight.is_meta  # tied head or not, the lookup reads the table's codes
    ids = torch.tensor([[0, 5, 511], [7, 7, 3]])
    for ids in (ids, ids[0], torch.tensor([], dtype=torch.long)):
        assert same_bits(model.embed_tokens(ids), kept.embed_tokens(ids))
    assert kept.layers[0].mlp.down_proj.weight.device.type == "cpu"
    freed = sum(p.numel() * 4 for n, p in model.named_parameters() if n in dropped)
    codes = sum(m.weight_codes.nbytes for m in model.modules() if getattr(m, "weight_codes", None) is not None)
    assert held_weight_bytes(kept) - held_weight_bytes(model) == freed - codes > 0
    rebuilt, want = float_parameters(model), dict(kept.named_parameters())
    assert rebuilt.keys() == want.keys() and all(same_bits(rebuilt[n], want[n]) for n in want)
    down = model.layers[0].mlp.down_proj
    for m in (1, 40, 200):  # up to SMALL_M the codes, past it the prepacked copy; 3-D: the fallback that rebuilds it
        x = torch.randn(m, down.weight.shape[1])
        assert same_bits(down(x), kept.layers[0].mlp.down_proj(x))
        assert same_bits(down(x.unsqueeze(0)), F.linear(x.unsqueeze(0), want["layers.0.mlp.down_proj.weight"]))
