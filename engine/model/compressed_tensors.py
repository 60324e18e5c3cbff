"""compressed-tensors checkpoints (llm-compressor's, vLLM's `--quantization compressed-tensors`),
their weight-only integer scheme in the "pack-quantized" format (W4A16, W8A16), read as
engine.model.quantized reads GPTQ and AWQ: each packed weight dequantized once at load.

A linear layer `X` (p = 32 / bits codes a word, code j in bits [bits*j, bits*(j+1))):
  `X.weight_packed` int32 (out, ceil(in / p)): inputs packed, input p*i + j in code j of word i,
      each code the signed value plus 2^(bits-1);
  `X.weight_scale` (out, groups): per group of inputs ("group"), or one per row ("channel");
  `X.weight_zero_point` int32 (ceil(out / p), groups), asymmetric schemes only: outputs packed
      alike, each code the signed zero plus 2^(bits-1);
  `X.weight_shape` (2,): (out, in); `X.weight_g_idx` (in,): each input's group, where act-order
      ("group") reordered them.
  w[n, k] = weight_scale[n, g] * (q[n, k] - zero[n, g]), g = k // group_size (or g_idx[k]).
"""
from __future__ import annotations

import torch

PARTS = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")


def read_config(qc: dict) -> tuple[int, int, bool, bool]:
    """quantization_config -> (bits, group_size (-1: per row), act-order, zero points);
    ValueError for a scheme that is not weight-only integers packed."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors: only compressed checkpoints are supported, got quantization_status "
                         f"{status!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors: quantization_config has no config_groups")
    schemes = []
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ValueError(f"compressed-tensors: config group {name!r} quantizes no weights")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"compressed-tensors: config group {name!r} quantizes activations too (W8A8, FP8, ...); "
                             "only weight-only schemes (W4A16, W8A16) are supported")
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"compressed-tensors: only the pack-quantized format is supported, got {fmt!r}")
        w = group["weights"]
        strategy, bits, group_size = w.get("strategy"), w.get("num_bits"), w.get("group_size")
        if w.get("type", "int") != "int" or bits not in (4, 8) or w.get("dynamic"):
            raise ValueError(f"compressed-tensors: only static 4-bit or 8-bit integer weights are supported, got "
                             f"type {w.get('type')!r}, num_bits {bits!r}")
        if strategy == "channel":
            group_size = -1
        elif strategy != "group" or not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"compressed-tensors: weights quantized per group (with a group_size) or per channel "
                             f"are supported, got strategy {strategy!r}, group_size {group_size!r}")
        schemes.append((bits, group_size, w.get("actorder") == "group", not w.get("symmetric", True)))
    if len(set(schemes)) > 1:
        raise ValueError("compressed-tensors: config groups with different weight schemes are not supported")
    return schemes[0]


def dequantize(bits: int, group_size: int, zero_points: bool, prefix: str, parts: dict[str, torch.Tensor],
               unpack) -> torch.Tensor:
    """The float32 weight (out, in) of linear `prefix` from its tensors (PARTS: suffix -> tensor);
    `unpack(packed, bits, dim)`: the codes of int32 words. ValueError naming a tensor that does
    not fit."""
    for suffix in (".weight_packed", ".weight_scale") + ((".weight_zero_point",) if zero_points else ()):
        if suffix not in parts:
            raise ValueError(f"quantized checkpoint: {prefix}{suffix} is missing")
    packed, scale, offset = parts[".weight_packed"], parts[".weight_scale"], 1 << (bits - 1)
    out, k = _shape(prefix, parts, bits)
    groups = scale.shape[1] if scale.dim() == 2 else 0
    if scale.dim() != 2 or scale.shape[0] != out or (group_size == -1 and groups != 1) or (
            group_size != -1 and groups != -(-k // group_size)):
        raise ValueError(f"quantized checkpoint: {prefix}.weight_scale has shape {tuple(scale.shape)}, which does "
                         f"not give its ({out}, {k}) weight's groups of {group_size}")
    q = unpack(packed, bits, dim=1)[:, :k] - offset  # (out, in), signed
    cols = input_groups(f"{prefix}.weight_g_idx", parts.get(".weight_g_idx"), k, group_size, groups)
    if ".weight_zero_point" in parts:
        zero = unpack(parts[".weight_zero_point"], bits, dim=0)[:out] - offset
        if tuple(zero.shape) != (out, groups):
            raise ValueError(f"quantized checkpoint: {prefix}.weight_zero_point does not hold ({out}, {groups}) "
                             "zero points")
        q = q - zero[:, cols]
    return scale.float()[:, cols] * q.float()


def input_groups(name: str, g_idx: torch.Tensor | None, k: int, group_size: int, groups: int) -> torch.Tensor:
    """Each of a weight's k inputs' group (0 <= g < groups): `g_idx` where act-order gives it, else
    input // group_size (group_size -1: one group). ValueError naming tensor `name` where g_idx
    does not give every input a group."""
    rows = torch.arange(k) // (k if group_size == -1 else group_size) if g_idx is None else g_idx.long()
    if tuple(rows.shape) != (k,) or int(rows.min()) < 0 or int(rows.max()) >= groups:
        raise ValueError(f"quantized checkpoint: {name} does not give each of the {k} inputs one of {groups} groups")
    return rows


def _shape(prefix: str, parts: dict[str, torch.Tensor], bits: int) -> tuple[int, int]:
    rows, cols = parts[".weight_packed"].shape
    if ".weight_shape" not in parts:
        return rows, cols * (32 // bits)
    out, k = (int(v) for v in parts[".weight_shape"].tolist())
    if out != rows or not (cols - 1) * (32 // bits) < k <= cols * (32 // bits):
        raise ValueError(f"quantized checkpoint: {prefix}.weight_shape {[out, k]} does not fit its packed weight "
                         f"{[rows, cols]}")
    return out, k
