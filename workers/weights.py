"""Read the checkpoint once per group (on rank 0) and scatter each rank its shard.

    rank 0:  safetensors --read--> full tensor --+--slice per rank--> scatter   (split params)
                                                 +------------------> broadcast (replicated: norms)
    rank r:  receives only its piece, writes it into its parameter

Rank 0 learns what rank r's piece is from a meta-device copy of rank r's model (no memory), so
the slicing is the parallel layers' own arithmetic (`ColumnParallelLinear.rank_slice`,
`RowParallelLinear.in_shard`, `VocabParallelEmbedding.start/shard`). Every rank walks the same
list of tensors, which rank 0 broadcasts first: ranks other than 0 never open a weight file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engine.model.layers import ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding
from engine.model.llama import LlamaModel
from engine.model.loader import safetensors_files


@dataclass
class LoadStats:
    bytes_read: int = 0  # from storage (rank 0 only)
    bytes_received: int = 0  # this rank's pieces, over the collective
    files_opened: list[str] = field(default_factory=list)
    num_tensors: int = 0


def _split_piece(module: nn.Module, attr: str, full: torch.Tensor, shard_id) -> torch.Tensor | None:
    """The part of checkpoint tensor `full` that `module` (of some rank) holds; None if replicated."""
    if isinstance(module, ColumnParallelLinear):  # QKV and gate/up too, weight and bias alike
        return module.rank_slice(full, module.shard_ids.index(shard_id if shard_id is not None else 0))
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return full.narrow(1, module.tp.rank * module.in_shard, module.in_shard)
    if isinstance(module, VocabParallelEmbedding):  # rows [start, start + shard), zero-padded
        part = full[module.start:module.start + module.shard]
        pad = full.new_zeros(module.shard - part.shape[0], *full.shape[1:])
        return torch.cat([part, pad]) if pad.shape[0] else part
    return None  # RMSNorm weight, row-parallel bias


def _place(module: nn.Module, param: nn.Parameter, piece: torch.Tensor, shard_id) -> None:
    """Write this rank's piece where the layer's own weight_loader would have put its slice."""
    if isinstance(module, ColumnParallelLinear):
        idx = module.shard_ids.index(shard_id if shard_id is not None else 0)
        param.data.narrow(0, sum(module.shard_sizes[:idx]), module.shard_sizes[idx]).copy_(piece)
    else:
        param.data.copy_(piece)


class _Checkpoint:
    """Rank 0's view of the safetensors files: the tensor list, then each tensor once."""

    def __init__(self, model_dir: str | Path, stats: LoadStats) -> None:
        from safetensors import safe_open

        self.handles = {}
        for path in safetensors_files(model_dir):
            stats.files_opened.append(str(path))
            self.handles[str(path)] = safe_open(str(path), framework="pt")
        self.specs = [(path, name, list(h.get_slice(name).get_shape()))
                      for path, h in self.handles.items() for name in h.keys()]
        self.stats = stats

    def read(self, path: str, name: str) -> torch.Tensor:
        t = self.handles[path].get_tensor(name)
        self.stats.bytes_read += t.numel() * t.element_size()
        return t


def _shadow_models(model: LlamaModel, tp: TPContext) -> list[LlamaModel]:
    """Every rank's model on the meta device (shapes and shard offsets only), this rank's real one."""
    shadows = []
    for r in range(tp.size):
        if r == tp.rank:
            shadows.append(model)
            continue
        with torch.device("meta"):
            shadows.append(LlamaModel(model.arch, next(model.parameters()).dtype, TPContext(r, tp.size)))
    return shadows


def load_sharded(model: LlamaModel, model_dir: str | Path | None, tp: TPContext) -> LoadStats:
    """Collective: every rank calls it; only rank 0 passes `model_dir` and reads it."""
    stats = LoadStats()
    ckpt = _Checkpoint(model_dir, stats) if tp.rank == 0 else None
    specs = [ckpt.specs if ckpt else None]
    dist.broadcast_object_list(specs, src=0, group=tp.group)  # the tensor list, so all walk it alike
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    modules = dict(model.named_modules())
    shadows = [dict(m.named_modules()) for m in _shadow_models(model, tp)] if tp.rank == 0 else None
    loaded: set[int] = set()
    for path, name, shape in specs[0]:
        target = model.param_for(name, params)
        if target is None:
            continue
        param, shard_id = target
        mod_name, _, attr = names[id(param)].rpartition(".")
        full = ckpt.read(path, name).to(device=param.device, dtype=param.dtype) if ckpt else None
        owners = [m[mod_name] for m in shadows] if shadows else None
        nbytes = _transfer(modules[mod_name], owners, param, attr, shard_id, full, shape, tp)
        stats.bytes_received += nbytes if tp.rank else 0
        stats.num_tensors += 1
        loaded.add(id(param))
    missing = [n for n, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    return stats


def _transfer(module: nn.Module, owners: list[nn.Module] | None, param: nn.Parameter, attr: str, shard_id,
              full: torch.Tensor | None, shape: list[int], tp: TPContext) -> int:
    """One checkpoint tensor from rank 0 (`full`, `owners` = every rank's module) into this
    rank's `param`; -> bytes that arrived here."""
    split = _split_piece(module, attr, torch.empty(shape, dtype=param.dtype, device="meta"), shard_id)
    if split is None:  # replicated: everyone gets the whole (small) tensor
        buf = full if full is not None else torch.empty(shape, dtype=param.dtype, device=param.device)
        dist.broadcast(buf, src=0, group=tp.group)
        param.weight_loader(param, buf, shard_id)
    else:  # equal-sized pieces, one per rank
        buf = torch.empty(split.shape, dtype=param.dtype, device=param.device)
        pieces = [_split_piece(m, attr, full, shard_id).contiguous() for m in owners] if owners else None
        dist.scatter(buf, pieces, src=0, group=tp.group)
        _place(module, param, buf, shard_id)
    return buf.numel() * buf.element_size()
