"""GPTQ, AWQ and compressed-tensors checkpoints (vLLM's `--quantization`, read from the folder's
config.json): each packed linear weight is dequantized once, as it is read, into the float weight
it stands for, and the engine then serves that. On CPU in float32 every such weight is exactly
`scale * q + offset` per 32 weights (engine.model.codes), so decode reads it as 4-bit codes again,
as it reads the embedded GGUF model's.

The formats (a linear layer `X`; `p = 32 / bits` codes in each int32, code j in bits
[bits*j, bits*(j+1))):

- GPTQ (AutoGPTQ, GPTQModel, optimum), symmetric only, as vLLM serves it:
  `X.qweight` int32 (in / p, out): input rows packed, row p*i + j in code j of row i;
  `X.scales` (groups, out); `X.g_idx` int32 (in): each input row's group, read under act-order
  (desc_act) only, else row // group_size; `X.qzeros` is not read: a symmetric zero is 2^(bits-1).
  w[n, k] = scales[g_idx[k], n] * (q[k, n] - 2^(bits-1)).
- AWQ (AutoAWQ's GEMM layout), 4-bit with zero points: `X.qweight` int32 (in, out / 8): output
  columns packed, in the order 0 2 4 6 1 3 5 7; `X.qzeros` int32 (groups, out / 8), packed
  alike; `X.scales` (groups, out). w[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = k // group_size.
- compressed-tensors' pack-quantized weight-only integers (W4A16, W8A16):
  engine.model.compressed_tensors.

The product is exact in float32 (a float16 or bfloat16 scale times an integer of at most 8 bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import compressed_tensors

METHODS = ("gptq", "awq", "compressed-tensors")
# vLLM's names for the same checkpoints (its kernels' choice on a GPU), taken for them here
ALIASES = {"gptq_marlin": "gptq", "auto_gptq": "gptq", "awq_marlin": "awq", "auto_awq": "awq"}
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")  # GPTQ's and AWQ's tensors of a linear layer, the packed one first
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column c of a group of 8 is in code _AWQ_ORDER.index(c)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of METHODS
    bits: int
    group_size: int  # -1: one group for the whole input dimension
    act_order: bool = False  # GPTQ's desc_act: g_idx gives the inputs' groups in another order
    zero_points: bool = False  # compressed-tensors' asymmetric scheme: each group's zero is a tensor

    @property
    def parts(self) -> tuple[str, ...]:
        """The suffixes of a packed linear layer's tensors, its packed weight first."""
        return compressed_tensors.PARTS if self.method == "compressed-tensors" else PARTS

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def code_bytes(self) -> float:
        """Bytes a weight's codes take where CPU decode reads it as codes (engine.model.codes),
        else 0: 4 bits and a scale and offset per 32 weights, where each 32 weights share a
        group. 8-bit GPTQ weights rarely are the 8-bit grid codes.py finds (its largest weight
        +-127 steps), so they are counted as held in float32 alone."""
        grid = self.bits == 4 and not self.act_order and (self.group_size == -1 or self.group_size % 32 == 0)
        return 0.5 + 8 / 32 if grid else 0.0

    def weight_shape(self, qweight_shape: list[int]) -> list[int]:
        """(out, in) of the float weight that a packed `qweight` of this shape stands for."""
        rows, cols = qweight_shape
        if self.method == "compressed-tensors":  # (a last word's padding is checked against weight_shape)
            return [rows, cols * self.pack]
        return [cols, rows * self.pack] if self.method == "gptq" else [cols * self.pack, rows]

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 weight (out, in) of linear `prefix` from its checkpoint tensors (PARTS:
        suffix -> tensor). ValueError naming a tensor that is missing or of the wrong shape."""
        check_dtypes(prefix, parts)
        if self.method == "compressed-tensors":
            return compressed_tensors.dequantize(self.bits, self.group_size, self.zero_points, prefix, parts, _unpack)
        for suffix in (".qweight", ".scales") + ((".qzeros",) if self.method == "awq" else ()):
            if suffix not in parts:
                raise ValueError(f"quantized checkpoint: {prefix}{suffix} is missing")
        out, k = self.weight_shape(list(parts[".qweight"].shape))
        groups = 1 if self.group_size == -1 else k // self.group_size
        scales = parts[".scales"]
        if self.group_size != -1 and k % self.group_size:
            raise ValueError(f"quantized checkpoint: {prefix} has {k} inputs, not a multiple of group_size "
                             f"{self.group_size}")
        if tuple(scales.shape) != (groups, out):
            raise ValueError(f"quantized checkpoint: {prefix}.scales has shape {tuple(scales.shape)}, expected "
                             f"{(groups, out)}")
        if self.method == "gptq":
            q = _unpack(parts[".qweight"], self.bits, dim=0)  # (in, out)
            # g_idx read only under act-order, as vLLM ignores it otherwise (some exporters write placeholders)
            g_idx = parts.get(".g_idx") if self.act_order else None
            rows = compressed_tensors.input_groups(f"{prefix}.g_idx", g_idx, k, self.group_size, groups)
            zero = torch.tensor(1 << (self.bits - 1), dtype=torch.int32)
            w = scales.float()[rows] * (q - zero).float()
        else:
            q = _unpack_awq(parts[".qweight"])  # (in, out)
            zeros = _unpack_awq(parts[".qzeros"])
            if tuple(zeros.shape) != (groups, out):
                raise ValueError(f"quantized checkpoint: {prefix}.qzeros has {tuple(parts['.qzeros'].shape)} "
                                 f"packed, expected {(groups, out // self.pack)}")
            rows = compressed_tensors.input_groups(f"{prefix}.qzeros", None, k, self.group_size, groups)
            w = scales.float()[rows] * (q - zeros[rows]).float()
        return w.t().contiguous()


def quant_config(config: dict) -> QuantConfig | None:
    """The config.json's `quantization_config` as a QuantConfig; None where there is none.
    ValueError for what cannot be served, saying why."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"quantization method {method or None!r} is not supported (supported: "
                         f"{', '.join(METHODS)}; a checkpoint in the model's own dtype needs none)")
    if method == "compressed-tensors":
        return QuantConfig(method, *compressed_tensors.read_config(qc))
    bits = qc.get("bits", qc.get("w_bit"))
    group_size = qc.get("group_size", qc.get("q_group_size", -1))
    if method == "gptq":
        if bits not in (4, 8) or qc.get("sym", True) is not True:
            raise ValueError(f"GPTQ: only symmetric 4-bit and 8-bit checkpoints are supported (as vLLM's), "
                             f"got bits={bits}, sym={qc.get('sym')}")
        if any(not str(rule).startswith("-:") for rule in qc.get("dynamic") or {}):  # "-:" rules: modules left
            raise ValueError("GPTQ: per-module settings (`dynamic`) are not supported")  # unquantized (plain weights)
    else:
        if bits != 4 or qc.get("zero_point", True) is not True:
            raise ValueError(f"AWQ: only 4-bit checkpoints with zero points are supported, got bits={bits}, "
                             f"zero_point={qc.get('zero_point')}")
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"AWQ: only the GEMM layout is supported, got version {qc.get('version')!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size > 0):
        raise ValueError(f"{method.upper()}: group_size must be a positive integer or -1, got {group_size!r}")
    # act-order with one group a row reorders nothing (vLLM's reading); with groups vLLM 0.32 refuses it
    return QuantConfig(method, bits, group_size, method == "gptq" and bool(qc.get("desc_act")) and group_size != -1)


_INTEGER = (torch.int32, torch.int64)
_DTYPES = {".qweight": _INTEGER, ".qzeros": _INTEGER, ".g_idx": _INTEGER, ".weight_packed": _INTEGER,
           ".weight_zero_point": _INTEGER, ".weight_g_idx": _INTEGER, ".weight_shape": _INTEGER}
_DIMS = {".g_idx": 1, ".weight_g_idx": 1, ".weight_shape": 1}  # the others are 2-D


def check_dtypes(prefix: str, parts: dict[str, torch.Tensor]) -> None:
    """ValueError naming a packed linear's tensor of the wrong kind: packed words and indices are
    int32 (or int64), scales float16, bfloat16 or float32."""
    for suffix, t in parts.items():
        allowed = _DTYPES.get(suffix, (torch.float16, torch.bfloat16, torch.float32))
        if t.dtype not in allowed or t.dim() != _DIMS.get(suffix, 2):
            raise ValueError(f"quantized checkpoint: {prefix}{suffix} is a {t.dim()}-D {t.dtype} tensor, expected "
                             f"{_DIMS.get(suffix, 2)}-D {' or '.join(str(d) for d in allowed)}")


def check_method(given: str | None, checkpoint: QuantConfig | None) -> None:
    """vLLM's `quantization` argument against the checkpoint's (ModelArch.quantization): None
    takes the checkpoint's; another must name its method (or be one of vLLM's kernel names for
    it). ValueError otherwise."""
    if given is None:
        return
    if checkpoint is None:
        raise ValueError(f"quantization={given!r}, but the checkpoint is not quantized (its config.json has no "
                         "quantization_config); kvserve does not quantize weights at load")
    if ALIASES.get(given, given) != checkpoint.method:
        raise ValueError(f"quantization={given!r} does not match the checkpoint's method ({checkpoint.method})")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 codes along `dim` of `packed`, 32/bits a word, low bits first -> (unsigned) int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:  # (rows, cols) -> (rows * p, cols)
        codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask
        return codes.reshape(-1, packed.shape[1])
    codes = (packed.unsqueeze(2) >> shifts[None, None, :]) & mask
    return codes.reshape(packed.shape[0], -1)


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's 4-bit codes, output columns packed 8 a word in its interleaved order -> (rows, cols * 8)."""
    codes = _unpack(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return codes[:, :, list(_AWQ_ORDER.index(c) for c in range(8))].reshape(packed.shape[0], -1)
