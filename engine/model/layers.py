"""Linear, embedding and norm layers that know their tensor-parallel shard.

Each parameter carries a `weight_loader(param, full_tensor, shard_id)` that copies in this
rank's slice of a checkpoint tensor, so model code reads like the single-device model and tensor
parallelism lives only here. With tp_size == 1 every layer is the plain layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.cpu_kernels import linear


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)
        self.weight.weight_loader = _copy_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and cpu_kernels.fusable(x) and self.weight.dtype == x.dtype:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # Same op order as HF's LlamaRMSNorm: normalise in float32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; `output_sizes` are the logical
    sub-matrices packed together (q/k/v or gate/up), each split on its own."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, shard_ids: list | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.shard_sizes = [s // tp.size for s in output_sizes]
        self.shard_ids = shard_ids or list(range(len(output_sizes)))
        self.weight = _param(sum(self.shard_sizes), in_features, dtype=dtype)
        self.weight.weight_loader = self._load
        self.bias = _param(sum(self.shard_sizes), dtype=dtype) if bias else None
        if bias:
            self.bias.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        idx = self.shard_ids.index(shard_id if shard_id is not None else 0)
        offset, size = sum(self.shard_sizes[:idx]), self.shard_sizes[idx]
        param.data.narrow(0, offset, size).copy_(self.rank_slice(loaded, idx))

    def rank_slice(self, loaded: torch.Tensor, idx: int) -> torch.Tensor:
        size = self.shard_sizes[idx]
        return loaded.narrow(0, self.tp.rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Q heads split across ranks; KV heads split too, or replicated when tp > num_kv_heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPContext, dtype: torch.dtype) -> None:
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        local_kv = max(1, num_kv_heads // tp.size)
        super().__init__(hidden, [num_heads * head_dim, local_kv * head_dim * tp.size, local_kv * head_dim * tp.size],
                         bias, tp, dtype, shard_ids=["q", "k", "v"])
        self.head_dim = head_dim

    def rank_slice(self, loaded: torch.Tensor, idx: int) -> torch.Tensor:
        if idx == 0:
            return super().rank_slice(loaded, idx)
        size = self.shard_sizes[idx]
        return loaded.narrow(0, (self.tp.rank // self.kv_replicas) * size, size)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.in_shard = in_features // tp.size
        self.weight = _param(out_features, self.in_shard, dtype=dtype)
        self.weight.weight_loader = self._load
        self.bias = _param(out_features, dtype=dtype) if bias else None
        if bias:
            self.bias.weight_loader = _copy_loader

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(1, self.tp.rank * self.in_shard, self.in_shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; each rank looks up its range, zeros elsewhere, all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.vocab_size = vocab_size
        self.weight = _param(self.shard, dim, dtype=dtype)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start:self.start + self.shard]
        param.data.zero_()
        param.data[:part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.shard)
        y = F.embedding(local.clamp(0, self.shard - 1), self.weight) * valid.unsqueeze(-1)
        return self.tp.all_reduce(y)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """As the (tied or own) lm_head: this rank's vocab range, gathered to the full vocab."""
        y = linear(h, self.weight)  # (N, vocab/tp)
        return self.tp.all_gather_last_dim(y)[:, :self.vocab_size]


ParallelLMHead = VocabParallelEmbedding  # an untied lm_head has the same sharding
