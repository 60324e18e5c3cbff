"""A float checkpoint as a GPTQ or AWQ one, packed as AutoGPTQ and AutoAWQ write them (written here
from the formats, apart from kvserve's reading of them in engine.model.quantized; vLLM's own
unpacking reads these files to the same weights). Each weight is rounded to its nearest code, not
calibrated as GPTQ's and AWQ's algorithms do: for benchmarks (the speed of a quantized model) and
tests (`--reference` also writes the float checkpoint of the very weights the packed ones stand
for, which HF then runs as the reference).

    python benchmarks/quantize.py SRC OUT [--method gptq|awq] [--bits 4] [--group-size 128] [--desc-act]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.lora_request import ADAPTED as PROJECTIONS  # a decoder layer's linear projections, by checkpoint name

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: code i of a word holds column AWQ_PACK_ORDER[i] of its 8


def quantize_checkpoint(src: Path, packed: Path, reference: Path | None, method: str, bits: int = 4,
                        group_size: int = 32, act_order: bool = False, seed: int = 0,
                        zero_points: bool = False) -> None:
    """`packed`: src's linear projections quantized by `method` ("gptq": symmetric; "awq": zero
    points; "compressed-tensors": pack-quantized, bfloat16 scales, symmetric unless `zero_points`),
    the rest as in src; `reference` (unless None): src with those projections replaced by the
    float32 weights the packed ones dequantize to. `act_order` (GPTQ's desc_act, compressed-tensors'
    actorder "group"): inputs assigned to the groups in a random order, as g_idx records it."""
    gen = torch.Generator().manual_seed(seed)
    files = sorted(Path(src).glob("*.safetensors"))
    for d in (packed, reference):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            for f in Path(src).iterdir():
                if f.suffix != ".safetensors" and f.is_file():
                    shutil.copy(f, d / f.name)
    for i, path in enumerate(files):
        print(f"quantizing {path.name} ({i + 1}/{len(files)})", file=sys.stderr, flush=True)
        out, ref = _quantize_file(load_file(str(path)), method, bits, group_size, act_order, zero_points, gen)
        save_file(out, str(packed / path.name))
        if reference is not None:
            save_file(ref, str(reference / path.name))
    config = json.loads((packed / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": not zero_points, "dynamic": False,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size, "actorder": "group" if act_order else None}
    config["quantization_config"] = {
        "gptq": {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": True,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                               "quantization_status": "compressed", "ignore": ["lm_head"],
                               "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                             "input_activations": None, "output_activations": None,
                                                             "format": "pack-quantized"}}},
    }[method]
    (packed / "config.json").write_text(json.dumps(config, indent=2))


def _quantize_file(weights: dict, method: str, bits: int, group_size: int, act_order: bool, zero_points: bool,
                   gen: torch.Generator) -> tuple[dict, dict]:
    out, ref = {}, {}
    for name, w in weights.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS):
            out[name] = ref[name] = w
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        size = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // size
        if act_order:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        if method == "gptq":
            q, scales, zeros, deq = _gptq(w.float(), g_idx, bits)
            out[prefix + ".qweight"] = _pack_rows(q, bits)
            out[prefix + ".qzeros"] = _pack_cols(zeros - 1, bits)  # the original format stores zero - 1
            out[prefix + ".g_idx"] = g_idx.to(torch.int32)
        elif method == "awq":
            q, scales, zeros, deq = _awq(w.float(), g_idx)
            out[prefix + ".qweight"] = _pack_cols(q, 4, AWQ_PACK_ORDER)
            out[prefix + ".qzeros"] = _pack_cols(zeros, 4, AWQ_PACK_ORDER)
        else:  # compressed-tensors, pack-quantized: outputs as rows, codes (and zeros) offset by 2^(bits-1)
            q, scales, zeros, deq = (_awq(w.float(), g_idx, torch.bfloat16) if zero_points else
                                     _gptq(w.float(), g_idx, bits, torch.bfloat16))
            out[prefix + ".weight_packed"] = _pack_cols(q.t(), bits)
            out[prefix + ".weight_scale"] = scales.t()
            out[prefix + ".weight_shape"] = torch.tensor([n, k])
            if zero_points:
                out[prefix + ".weight_zero_point"] = _pack_rows(zeros.t(), bits)
            if act_order:
                out[prefix + ".weight_g_idx"] = g_idx.to(torch.int32)
            ref[name] = deq
            continue
        out[prefix + ".scales"] = scales
        ref[name] = deq
    return ({k: v.contiguous() for k, v in out.items()}, {k: v.contiguous() for k, v in ref.items()})


def _gptq(w: torch.Tensor, g_idx: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16):
    """Symmetric: w ~ s * (q - 2^(bits-1)), s per (group, output) in `dtype`."""
    n, k = w.shape
    groups, mid = int(g_idx.max()) + 1, 1 << (bits - 1)
    scales = torch.zeros(groups, n)
    for g in range(groups):
        scales[g] = w[:, g_idx == g].abs().amax(dim=1) / (mid - 1)
    scales = scales.to(dtype).clamp(min=1e-3)
    s = scales.float()[g_idx].t()  # (n, k)
    q = (torch.round(w / s) + mid).clamp(0, 2 * mid - 1).to(torch.int64)
    zeros = torch.full((groups, n), mid, dtype=torch.int64)
    return q.t(), scales, zeros, s * (q - mid).float()


def _awq(w: torch.Tensor, g_idx: torch.Tensor, dtype: torch.dtype = torch.float16):
    """Zero points: w ~ s * (q - z), q and z in [0, 15], s per (group, output) in `dtype`."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    lo, hi = torch.zeros(groups, n), torch.zeros(groups, n)
    for g in range(groups):
        lo[g], hi[g] = w[:, g_idx == g].amin(dim=1), w[:, g_idx == g].amax(dim=1)
    scales = ((hi - lo) / 15).to(dtype).clamp(min=1e-3)
    zeros = torch.round(-lo / scales.float()).clamp(0, 15).to(torch.int64)
    s, z = scales.float()[g_idx].t(), zeros[g_idx].t()
    q = (torch.round(w / s) + z).clamp(0, 15).to(torch.int64)
    return q.t(), scales, zeros, s * (q - z).float()


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (in int64) as int32, the top bit the sign."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(k, n) codes -> (k * bits / 32, n): rows p*i + j in code j of row i (GPTQ's qweight)."""
    p = 32 // bits
    words = torch.zeros(q.shape[0] // p, q.shape[1], dtype=torch.int64)
    for j in range(p):
        words |= q[j::p] << (bits * j)
    return _int32(words)


def _pack_cols(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """(r, n) codes -> (r, n * bits / 32): code i of word c holds column c*p + order[i]."""
    p = 32 // bits
    order = order or tuple(range(p))
    words = torch.zeros(q.shape[0], q.shape[1] // p, dtype=torch.int64)
    for i in range(p):
        words |= (q[:, order[i]::p] & ((1 << bits) - 1)) << (bits * i)
    return _int32(words)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--method", choices=["gptq", "awq", "compressed-tensors"], default="gptq")
    p.add_argument("--zero-points", action="store_true", help="compressed-tensors: an asymmetric scheme (4-bit)")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4, help="gptq: 4 or 8; awq: 4")
    p.add_argument("--group-size", type=int, default=128, help="inputs per scale (-1: a whole row)")
    p.add_argument("--desc-act", action="store_true", help="gptq: the inputs' groups in a random order (g_idx)")
    p.add_argument("--reference", default=None, metavar="DIR", help="also write the dequantized float weights here")
    a = p.parse_args()
    if (a.method == "awq" or a.zero_points) and a.bits != 4:
        p.error("awq and zero points are 4-bit here")
    quantize_checkpoint(Path(a.src), Path(a.out), a.reference and Path(a.reference), a.method, a.bits, a.group_size,
                        a.desc_act, zero_points=a.zero_points)
    print(a.out)


if __name__ == "__main__":
    main()
