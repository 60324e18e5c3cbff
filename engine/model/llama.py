"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2's qkv bias, Qwen3's q/k norms) over a paged KV cache.

Input is a flat, unpadded batch of T tokens from many sequences; the step's attention metadata
(engine.attention.StepAttention: the torch backend's, or the Triton one's on CUDA) tells each layer
where every token's keys/values go and which context each query reads.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention import StepAttention
from engine.classifier import is_classifier
from engine.model.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear, RMSNorm,
                                 RowParallelLinear, TPContext, VocabParallelEmbedding)
from engine.model.encoder_arch import encoder_fields
from engine.model.quantized import QuantConfig
from engine.model.rope import RopeStep, RotaryEmbedding, apply_rope, rope_inv_freq
from engine.model_source import ENCODER_MODEL_TYPES, ENCODER_NAMES, SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # on q/k/v
    mlp_bias: bool
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k before RoPE
    sliding_window: int | None = None  # the checkpoint's attention window, where one applies
    num_labels: int = 0  # a sequence classifier's classes (its `score` head); 0: no classifier
    quantization: QuantConfig | None = None  # a quantized checkpoint's: dequantized at load (engine.model.quantized)
    token_classifier: bool = False  # an encoder's head over every token (engine.classifier)
    # An encoder's (engine.model.bert; engine.model.encoder_arch): attention both ways, absolute positions
    encoder: bool = False
    type_vocab_size: int = 0
    position_offset: int = 0  # RoBERTa's positions start past its padding index
    position_rows: int = 0  # rows of the position table (the config's max_position_embeddings)
    bert_pooler: bool = False  # a BERT classifier's head starts with its pooler; RoBERTa's with its own dense
    hidden_act: str = "silu"
    rotary: bool = False  # NomicBERT's: rotary positions (rope_theta), no position table
    gated_mlp: bool = False  # NomicBERT's SwiGLU, GTE's GeGLU: down(act(gate(x)) * up(x))
    up_bias: bool | None = None  # the up (and gate) projection's bias, where it differs from mlp_bias (GTE's: none)
    # ModernBERT's (engine.model.modernbert): rotary positions, local layers
    # (`sliding_layers`) whose tokens read `local_window` tokens each way
    modernbert: bool = False
    norm_bias: bool = True
    local_rope_theta: float = 0.0
    sliding_layers: tuple[int, ...] = ()
    local_window: int = 0
    classifier_pooling: str = "CLS"  # the state its classifier's head reads: CLS or MEAN
    classifier_bias: bool = False
    classifier_act: str = "gelu"  # its head's activation (BERT's pooler: tanh; DistilBERT's: relu)

    @classmethod
    def from_hf(cls, cfg) -> "ModelArch":
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {cfg.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if cfg.model_type in ENCODER_MODEL_TYPES:
            return cls(**encoder_fields(cfg)).rope_checked()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (only silu)")
        heads = cfg.num_attention_heads
        # transformers >= 5 keeps theta and scaling together in `rope_parameters`; older ones
        # have `rope_theta` plus an optional `rope_scaling` dict.
        rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
        window, bias = _sliding_window(cfg), bool(getattr(cfg, "attention_bias", False))
        positions = cfg.max_position_embeddings
        if window is not None and window < positions:
            _warn_window_cap(cfg.model_type, window, positions)
            positions = window
        arch = cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=positions,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # As HF builds them: Qwen2 biases q/k/v always and o_proj never, Mistral none of them,
            # Llama and Qwen3 all four where attention_bias says so.
            attention_bias=cfg.model_type == "qwen2" or (cfg.model_type != "mistral" and bias),
            o_proj_bias=cfg.model_type not in ("qwen2", "mistral") and bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=cfg.model_type == "qwen3", sliding_window=window,
            num_labels=cfg.num_labels if is_classifier(cfg) else 0,
        )
        return arch.rope_checked()

    def rope_checked(self) -> "ModelArch":
        """Itself, its rotary frequencies (if it has rotary positions: a theta) computed once here,
        where `kvserve serve` reads the config before Ray starts, not in each replica; ValueError
        for a scaling the engine cannot compute."""
        if self.rope_theta:
            try:
                rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
            except KeyError as e:
                raise ValueError(f"rope scaling {self.rope_scaling} lacks {e}") from None
        return self

    def check_tp(self, tp_size: int) -> None:
        """Raise before any weight is loaded when the model cannot be split tp_size ways."""
        if self.encoder and tp_size > 1:
            raise ValueError(f"encoder models ({ENCODER_NAMES}) run on one device: "
                             f"tensor_parallel_size {tp_size} is not supported for them")
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size}")
        kv = self.num_kv_heads
        if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
            problems.append(f"num_key_value_heads={kv}")
        if problems:
            raise ValueError(f"cannot split this model across tensor_parallel_size={tp_size}: "
                             f"{', '.join(problems)} not divisible")

    def local_kv_heads(self, tp_size: int) -> int:
        return max(1, self.num_kv_heads // tp_size)


def _sliding_window(cfg) -> int | None:
    """The window of a checkpoint whose layers (any of them) attend over one: Mistral's
    `sliding_window`; Qwen2/3's where `layer_types` names sliding layers (their configs keep
    `sliding_window` only with `use_sliding_window`)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


@functools.cache  # once per process, however often a config is read
def _warn_window_cap(model_type: str, window: int, positions: int) -> None:
    logger.warning("%s attends over a sliding window of %d tokens, which kvserve does not implement: contexts are "
                   "capped at %d tokens (max_position_embeddings %d), where the window and full attention agree",
                   model_type, window, window, positions)


class Attention(nn.Module):
    def __init__(self, a: ModelArch, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = a.num_heads // tp.size
        self.num_kv_heads = a.local_kv_heads(tp.size)
        self.head_dim = a.head_dim
        self.scale = a.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads, a.attention_bias, tp, dtype)
        self.o_proj = RowParallelLinear(a.num_heads * a.head_dim, a.hidden_size, a.o_proj_bias, tp, dtype)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: RopeStep, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: StepAttention) -> torch.Tensor:
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv, q_size, kv_size)
        if rope.fused:
            q = meta.rope_write_kv(qkv, rope.cos, rope.sin, rope.positions, *kv_cache, self.num_heads,
                                   self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.view(T, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, k, rope.cos, rope.sin)
            meta.write_kv(kv_cache[0], kv_cache[1], k, v)
        o = meta.attend(q, kv_cache[0], kv_cache[1], self.scale)  # (T, H, D)
        return self.o_proj(o.reshape(T, q_size))

    def _norm_qk(self, qkv: torch.Tensor, q_size: int, kv_size: int) -> torch.Tensor:
        """qkv with every head of q and of k RMS-normalised over its head_dim (Qwen3), as rows of
        (T * heads, head_dim) so that the norm takes its fused kernels; v as it was."""
        T, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(T * self.num_heads, d)).view(T, q_size)
        k = self.k_norm(k.reshape(T * self.num_kv_heads, d)).view(T, kv_size)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    def __init__(self, a: ModelArch, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(a.intermediate_size, a.hidden_size, a.mlp_bias, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 * intermediate)
        if cpu_kernels.fusable(gate_up):
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up))
        if gate_up.is_cuda:
            from engine.kernels.norm import silu_and_mul  # imported on CUDA only: CPU hosts need no Triton
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArch, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.self_attn = Attention(a, tp, dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.mlp = MLP(a, tp, dtype)

    def forward(self, x, residual, rope, kv_cache, meta):
        """x: the previous layer's MLP output (the embeddings in the first layer, where residual is
        None); residual: the residual stream before it. -> (this layer's MLP output, the stream
        before it): each residual add happens in the norm that follows it (RMSNorm.add_forward)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        residual, h = self.post_attention_layernorm.add_forward(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    # checkpoint name fragment -> (our module fragment, shard id inside a packed parameter)
    PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, a: ModelArch, dtype: torch.dtype, tp: TPContext = TPContext(), pooling: bool = False) -> None:
        """`pooling`: the model's final hidden states are the output (engine.pooling); it has no
        language-model head, and a checkpoint's is not read. A sequence classifier's (`num_labels`)
        output is its `score` head's logits over them."""
        super().__init__()
        a.check_tp(tp.size)
        self.arch = a
        self.tp = tp
        self.pooling = pooling
        self.rotary = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(a, tp, dtype) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype)
        self.lm_head = None if a.tie_word_embeddings or pooling else ParallelLMHead(a.vocab_size, a.hidden_size, tp,
                                                                                   dtype)
        if a.num_labels and not pooling:
            raise ValueError("this checkpoint is a sequence classifier (...ForSequenceClassification): it has no "
                             "language-model head to generate with; serve it with --runner pooling")
        self.score = ReplicatedLinear(a.hidden_size, a.num_labels, dtype) if a.num_labels else None
        if not pooling:  # a pooling model computes no logits: no second forms of the embedding for them
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            head.weight_codes = None  # its logits GEMM, like the linear layers', may read 4/8-bit codes (codes.py)
            head.weight_prepacked = None
        self.lora = None  # engine.lora.LoRAState where LoRA adapters are enabled (engine.lora.attach)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: StepAttention) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden)."""
        h = self.embed_tokens(input_ids)
        k_cache = kv_caches[0][0]
        fused = self.arch.head_dim % 2 == 0 and meta.fuses_rope(h, k_cache)
        rope = self.rotary.step(positions, h.dtype, fused)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, rope, kv, meta)
        return self.norm.add_forward(h, residual)[1]

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        """A pooling model's output for rows `h` (N, hidden), float32: the rows themselves, or a
        classifier's logits (N, num_labels), in the model's dtype first as HF computes them."""
        return (h if self.score is None else self.score(h)).float()

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """h: (N, hidden) rows to sample -> (N, vocab) float32 on the sampling rank (the only rank at
        tp=1); None on the other ranks."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        logits = head.logits(h)
        return None if logits is None else logits.float()

    def param_for(self, ckpt_name: str, params: dict[str, nn.Parameter]) -> tuple[nn.Parameter, object] | None:
        """Map a checkpoint tensor name to (our parameter, shard id); None for tensors we skip."""
        name = ckpt_name.removeprefix("model.")
        if "rotary_emb" in name or (name.startswith("lm_head") and self.lm_head is None):
            return None
        shard = None
        for src, (dst, shard_id) in self.PACKED.items():
            if f".{src}." in name:
                name, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        if name not in params:
            raise ValueError(f"unexpected checkpoint tensor {ckpt_name!r}")
        return params[name], shard
