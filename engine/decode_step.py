"""A decode-only CPU step through every decoder layer in one native call (engine/csrc/decode_step_f32.c).

The per-layer path makes about ten kernel calls a layer from Python, each a ctypes call plus a
tensor or two; on a small batch that is a fifth of the step. `NativeDecodeStep` describes the
model to the C side once (every layer's weights, or their 4/8-bit codes, and KV pools as
pointers) and then runs a step from its embeddings to the final norm's input with one call, over
the same kernels in the same order: the hidden states are bit for bit the per-layer path's.

It takes a step when the per-layer path would run the native kernels for every op of it: float32
on a CPU with the kernels, tensor parallel size 1, a pure decode batch of at most SMALL_M rows,
and weights the kernels read. KVSERVE_NATIVE_DECODE_STEP=0 keeps every step on the per-layer path.
"""
from __future__ import annotations

import ctypes
import os

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata
from engine.model.llama import LlamaModel

_ptr = ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("codes", _ptr), ("scale", _ptr), ("offset", _ptr), ("bias", _ptr),
                ("bits", ctypes.c_long), ("n", ctypes.c_long), ("k", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", _ptr), ("v_cache", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr)]


class _Decoder(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_long), ("hidden", ctypes.c_long), ("inter", ctypes.c_long),
                ("num_heads", ctypes.c_long), ("num_kv_heads", ctypes.c_long), ("head_dim", ctypes.c_long),
                ("block_size", ctypes.c_long), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", _ptr), ("sin", _ptr), ("layers", ctypes.POINTER(_Layer))]


def _f32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _linear(module) -> _Linear | None:
    """The kernel's view of a linear layer, choosing as cpu_kernels.linear does (its codes when it
    has them); None when the kernels would not take its weight."""
    w, codes, bias = module.weight, module.weight_codes, module.bias
    n, k = w.shape
    as_codes = codes is not None and w.dtype == torch.float32  # its float32 may be freed (drop_float_weight)
    if not (as_codes or _f32(w)) or k % 8 or (bias is not None and not _f32(bias)):
        return None
    if codes is None:
        return _Linear(w.data_ptr(), None, None, None, bias.data_ptr() if bias is not None else None, 0, n, k)
    return _Linear(None, codes.codes.data_ptr(), codes.scale.data_ptr(), codes.offset.data_ptr(),
                   bias.data_ptr() if bias is not None else None, codes.bits, n, k)


def _layer(layer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> _Layer | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    head_norms = () if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
    if None in linears or not all(map(_f32, (*norms, *head_norms, k_cache, v_cache))):
        return None
    q_norm, k_norm = (w.data_ptr() for w in head_norms) if head_norms else (None, None)
    return _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *linears, k_cache.data_ptr(), v_cache.data_ptr(),
                  q_norm, k_norm)


class NativeDecodeStep:
    """Built once per runner by `build` (the weights and KV pools must not move afterwards);
    `runs(meta, T)` says whether a step qualifies, `forward` runs it."""

    def __init__(self, model: LlamaModel, layers: list[_Layer], block_size: int) -> None:
        self.model = model
        self._layers = (_Layer * len(layers))(*layers)  # kept alive here: the decoder points into it
        a, attn, rot = model.arch, model.layers[0].self_attn, model.rotary
        self._decoder = _Decoder(len(layers), a.hidden_size, model.layers[0].mlp.down_proj.weight.shape[1],
                                 attn.num_heads, attn.num_kv_heads, a.head_dim, block_size, a.rms_norm_eps,
                                 attn.scale, rot.cos.data_ptr(), rot.sin.data_ptr(), self._layers)

    @classmethod
    def build(cls, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              block_size: int) -> "NativeDecodeStep | None":
        """None where no step could qualify: another device or dtype, tp > 1, kernels off, or a
        weight the kernels do not read."""
        k0 = kv_caches[0][0]
        if (os.environ.get("KVSERVE_NATIVE_DECODE_STEP", "1") == "0" or model.tp.size != 1
                or not cpu_kernels.supports_decode_attention(k0.device, k0.dtype, model.arch.head_dim)
                or model.arch.hidden_size % 8 or k0.shape[1] != block_size
                or not (_f32(model.rotary.cos) and _f32(model.rotary.sin))):
            return None
        layers = [_layer(layer, k, v) for layer, (k, v) in zip(model.layers, kv_caches)]
        return None if None in layers else cls(model, layers, block_size)

    @staticmethod
    def runs(meta: AttentionMetadata, num_tokens: int) -> bool:
        nd = meta.native_decode
        return (nd is not None and not meta.prefills and not meta.decode_groups and nd.first_row == 0
                and nd.context_lens.shape[0] == num_tokens and 0 < num_tokens <= cpu_kernels.SMALL_M)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (B,) -> final hidden states (B, hidden), as LlamaModel.forward."""
        h = self.model.embed_tokens(input_ids).contiguous()  # a fresh tensor, updated in place
        nd = meta.native_decode
        cpu_kernels.decode_step(ctypes.byref(self._decoder), h, positions, meta.slot_mapping, nd.block_tables,
                                nd.context_lens)
        return self.model.norm(h)
