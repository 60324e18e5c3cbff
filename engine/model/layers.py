"""Linear, embedding and norm layers that know their tensor-parallel shard.

Every layer says, in one `shard()` method, which piece of a full checkpoint tensor a rank holds
and where that piece goes in the rank's parameter. The same answer serves both ways of loading:
a layer's `weight_loader` (in-process, from the full tensor) and rank 0 scattering each rank its
piece (workers/weights.py). So model code reads like the single-device model and tensor
parallelism lives only here. With tp_size == 1 every layer is the plain layer.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cpu_kernels import linear

SAMPLING_RANK = 0  # the rank that receives the full-vocabulary logits and samples


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """(..., d) on every rank -> (..., size * d) on SAMPLING_RANK, in rank order; None on the
        others (only the sampling rank needs the whole vocabulary)."""
        if self.size == 1:
            return x
        if x.numel() == 0:  # a step that samples nothing: every rank knows it, so none calls NCCL
            return x.new_empty(*x.shape[:-1], self.size * x.shape[-1]) if self.rank == SAMPLING_RANK else None
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == SAMPLING_RANK else None
        torch.distributed.gather(x, parts, dst=SAMPLING_RANK, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


@dataclass(frozen=True)
class Shard:
    """The piece of a full checkpoint tensor that one rank holds, and where it goes:

        checkpoint tensor, along `dim`:  [ ... | start, start + size | ... ]   (zero-padded past the end)
        rank's parameter,  along `dim`:  [ ... | offset, offset + size | ... ]

    `size` None: the rank holds the whole tensor (replicated: norms, row-parallel biases).
    """
    dim: int = 0
    start: int = 0
    size: int | None = None
    offset: int = 0

    @property
    def replicated(self) -> bool:
        return self.size is None

    def piece_shape(self, full_shape) -> list[int]:
        shape = list(full_shape)
        if self.size is not None:
            shape[self.dim] = self.size
        return shape

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full`; every rank's piece of one tensor has the same shape."""
        if self.size is None:
            return full
        start = min(self.start, full.shape[self.dim])
        n = min(self.size, full.shape[self.dim] - start)
        piece = full.narrow(self.dim, start, n)
        if n == self.size:
            return piece
        pad_shape = list(full.shape)
        pad_shape[self.dim] = self.size - n
        return torch.cat([piece, full.new_zeros(pad_shape)], dim=self.dim)

    def place(self, param: torch.Tensor, piece: torch.Tensor) -> None:
        """Copy this rank's piece (from `take`) into its parameter."""
        dst = param.data if self.size is None else param.data.narrow(self.dim, self.offset, self.size)
        if dst.shape != piece.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(piece.shape)} != parameter shape {tuple(dst.shape)}")
        dst.copy_(piece)


def check_checkpoint_shape(name: str, param: nn.Parameter, shard_id, shape) -> None:
    """Raise unless checkpoint tensor `name` has the shape the config gives it: a mismatch would
    otherwise be zero-padded or cut to the parameter's shape and served (HF refuses it too)."""
    expected = tuple(param.full_shape(shard_id) if hasattr(param, "full_shape") else param.shape)
    if tuple(shape) != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(shape)}, but the model's config.json "
                         f"makes it {expected}")


class ShardedModule(nn.Module):
    """A layer whose parameters each hold one rank's piece of a checkpoint tensor. Each parameter
    carries `weight_loader(param, full_tensor, shard_id)`, which loads this rank's piece."""

    def __init__(self, tp: TPContext = TPContext()) -> None:
        super().__init__()
        self.tp = tp

    def shard(self, attr: str, shard_id=None, rank: int | None = None) -> Shard:
        """Which piece of the checkpoint tensor of parameter `attr` (for a packed parameter: of its
        part `shard_id`) rank `rank` (default: this layer's) holds. Replicated unless overridden."""
        return Shard()

    def full_shape(self, attr: str, shard_id=None) -> tuple[int, ...]:
        """The shape the checkpoint tensor of `attr` (part `shard_id`) has, by the model's config:
        the parameter's own where it is replicated."""
        return tuple(getattr(self, attr).shape)

    def _param(self, attr: str, *shape: int, dtype: torch.dtype) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        param.weight_loader = functools.partial(self._load, attr)
        param.full_shape = functools.partial(self.full_shape, attr)
        setattr(self, attr, param)
        return param

    def _load(self, attr: str, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        shard = self.shard(attr, shard_id)
        shard.place(param, shard.take(full))


class RMSNorm(ShardedModule):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self._param("weight", dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_kernels.fusable(x) and self.weight.dtype == x.dtype:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        if x.is_cuda and x.dim() == 2 and self.weight.dtype == x.dtype:
            from engine.kernels.norm import rms_norm  # imported on CUDA only: CPU hosts need no Triton
            return rms_norm(x, self.weight, self.eps)
        # Same op order as HF's LlamaRMSNorm: normalise in float32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x + residual, its norm): a decoder layer's residual add and the norm after it, one
        launch on CUDA (two per layer fewer), the same two ops elsewhere."""
        if x.is_cuda and x.dim() == 2 and self.weight.dtype == x.dtype == residual.dtype:
            from engine.kernels.norm import add_rms_norm  # imported on CUDA only: CPU hosts need no Triton
            return add_rms_norm(x, residual, self.weight, self.eps)
        s = x + residual
        return s, self(s)


class ReplicatedLinear(ShardedModule):
    """y = x W^T, W whole on every rank: a small head (a classifier's `score`) after the
    all-reduced final norm."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self._param("weight", out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(ShardedModule):
    """y = x W^T with W's output rows split across ranks; `output_sizes` are the logical
    sub-matrices packed together (q/k/v or gate/up), each split on its own:

        checkpoint gate (I, H)  rank r's rows [r * I/tp, (r+1) * I/tp) -> parameter rows [0, I/tp)
        checkpoint up   (I, H)  rank r's rows [r * I/tp, (r+1) * I/tp) -> parameter rows [I/tp, 2 I/tp)
    """
    lora = None  # engine.lora.LoRAState, where LoRA is enabled, and this layer's key in it
    lora_key = None

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, shard_ids: list | None = None) -> None:
        super().__init__(tp)
        self.in_features = in_features
        self.full_sizes = list(output_sizes)  # each part's rows in the checkpoint
        self.shard_sizes = [s // tp.size for s in output_sizes]
        self.shard_ids = shard_ids or list(range(len(output_sizes)))
        packed = [self._param("weight", sum(self.shard_sizes), in_features, dtype=dtype)]
        self.weight_codes = None  # the same weight as 4/8-bit codes, where it is exactly that (codes.py)
        self.weight_prepacked = None  # the same weight in oneDNN's layout, for prefill on CPU (loader.prepare_cpu_weights)
        self.bias = None
        if bias:
            packed.append(self._param("bias", sum(self.shard_sizes), dtype=dtype))
        if len(self.shard_ids) > 1:  # each part comes from its own checkpoint tensor (loader.check_complete)
            for p in packed:
                p.shard_ids = tuple(self.shard_ids)

    def shard(self, attr: str, shard_id=None, rank: int | None = None) -> Shard:
        """Weight and bias alike: rank's rows of the packed part `shard_id`."""
        idx = self._part(shard_id)
        size = self.shard_sizes[idx]
        rank = self.tp.rank if rank is None else rank
        return Shard(dim=0, start=self._part_index(idx, rank) * size, size=size, offset=sum(self.shard_sizes[:idx]))

    def full_shape(self, attr: str, shard_id=None) -> tuple[int, ...]:
        rows = self.full_sizes[self._part(shard_id)]
        return (rows, self.in_features) if attr == "weight" else (rows,)

    def _part(self, shard_id) -> int:
        """The index of packed part `shard_id` (None: the only one)."""
        return self.shard_ids.index(shard_id if shard_id is not None else 0)

    def _part_index(self, idx: int, rank: int) -> int:
        """Which of the equal pieces of packed part `idx` rank holds."""
        return rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.weight_codes, self.weight_prepacked)
        if self.lora is not None and self.lora.step:  # LoRA adapters of the step's rows (engine.lora)
            self.lora.apply(self.lora_key, x, y)
        return y


class QKVParallelLinear(ColumnParallelLinear):
    """Q heads split across ranks; KV heads split too, or replicated when tp > num_kv_heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPContext, dtype: torch.dtype) -> None:
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        local_kv = max(1, num_kv_heads // tp.size)
        super().__init__(hidden, [num_heads * head_dim, local_kv * head_dim * tp.size, local_kv * head_dim * tp.size],
                         bias, tp, dtype, shard_ids=["q", "k", "v"])
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.head_dim = head_dim

    def _part_index(self, idx: int, rank: int) -> int:
        return rank if idx == 0 else rank // self.kv_replicas  # kv_replicas ranks share a KV head


class RowParallelLinear(ShardedModule):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""
    lora = None  # as ColumnParallelLinear's
    lora_key = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__(tp)
        self.in_features = in_features
        self.in_shard = in_features // tp.size
        self._param("weight", out_features, self.in_shard, dtype=dtype)
        self.weight_codes = None
        self.weight_prepacked = None
        self.bias = None
        if bias:
            self._param("bias", out_features, dtype=dtype)

    def shard(self, attr: str, shard_id=None, rank: int | None = None) -> Shard:
        """The weight's columns [rank * in/tp, (rank+1) * in/tp); the bias (added once, after the
        all-reduce) is replicated."""
        if attr == "bias":
            return Shard()
        rank = self.tp.rank if rank is None else rank
        return Shard(dim=1, start=rank * self.in_shard, size=self.in_shard)

    def full_shape(self, attr: str, shard_id=None) -> tuple[int, ...]:
        out = self.weight.shape[0]
        return (out, self.in_features) if attr == "weight" else (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, codes=self.weight_codes, prepacked=self.weight_prepacked)
        adapted = self.lora is not None and self.lora.step  # LoRA deltas of the step's rows (engine.lora)
        if adapted and self.tp.size > 1:  # each rank's part of the delta, summed with the weight's
            self.lora.apply(self.lora_key, x, y)
        y = self.tp.all_reduce(y)
        y = y + self.bias if self.bias is not None else y
        if adapted and self.tp.size == 1:  # after the bias, as PEFT adds it
            self.lora.apply(self.lora_key, x, y)
        return y


class VocabParallelEmbedding(ShardedModule):
    """Embedding rows split across ranks; each rank looks up its range, zeros elsewhere, all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__(tp)
        self.rows = -(-vocab_size // tp.size)  # per rank; the last rank's range is zero-padded
        self.start = tp.rank * self.rows
        self.vocab_size = vocab_size
        self._param("weight", self.rows, dim, dtype=dtype)

    def shard(self, attr: str, shard_id=None, rank: int | None = None) -> Shard:
        """Vocabulary rows [rank * rows, (rank+1) * rows), zero past the end of the vocabulary."""
        rank = self.tp.rank if rank is None else rank
        return Shard(dim=0, start=rank * self.rows, size=self.rows)

    def full_shape(self, attr: str, shard_id=None) -> tuple[int, ...]:
        return self.vocab_size, self.weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        valid = (local >= 0) & (local < self.rows)
        y = self._lookup(local.clamp(0, self.rows - 1)) * valid.unsqueeze(-1)
        return self.tp.all_reduce(y)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`: from the float32 table, or from its codes where the table is held
        as codes (and, a tied head's, prepacked) only (engine.model.loader.drop_float_weight)."""
        if self.weight.is_meta:
            return self.weight_codes.rows(ids.reshape(-1)).view(*ids.shape, self.weight.shape[1])
        return F.embedding(ids, self.weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """As the (tied or own) lm_head: (N, hidden) -> (N, vocab) on the sampling rank, None on
        the other ranks."""
        # The model gives its head (only) a weight_codes attribute: a lookup table never reads codes.
        y = linear(h, self.weight, codes=getattr(self, "weight_codes", None),
                   prepacked=getattr(self, "weight_prepacked", None))  # (N, rows): this rank's vocab range
        full = self.tp.gather_last_dim(y)  # (N, tp * rows)
        return None if full is None else full[:, :self.vocab_size]


ParallelLMHead = VocabParallelEmbedding  # an untied lm_head has the same sharding
