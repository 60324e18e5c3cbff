"""Read the checkpoint once per group (on rank 0) and scatter each rank its shard.

    rank 0:  safetensors --read--> full tensor --+--piece per rank--> scatter   (split params)
                                                 +------------------> broadcast (replicated: norms)
    rank r:  receives only its piece, writes it into its parameter

Which piece rank r holds, and where it goes, is the layer's own `shard(attr, shard_id, rank=r)`
(engine/model/layers.py), the same rule its `weight_loader` follows in a single process. Every
rank walks the same list of tensors, which rank 0 broadcasts first: ranks other than 0 never
open a weight file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from engine.model.layers import Shard, TPContext, check_checkpoint_shape
from engine.model.llama import LlamaModel
from engine.model.checkpoint import Checkpoint
from engine.model.loader import check_complete


@dataclass
class LoadStats:
    bytes_read: int = 0  # from storage (rank 0 only)
    bytes_received: int = 0  # this rank's pieces, over the collective
    files_opened: list[str] = field(default_factory=list)
    num_tensors: int = 0


def load_sharded(model: LlamaModel, model_dir: str | Path | None, tp: TPContext) -> LoadStats:
    """Collective: every rank calls it; only rank 0 passes `model_dir` and reads it."""
    stats = LoadStats()
    ckpt = Checkpoint(model_dir, model.arch.quantization) if tp.rank == 0 else None
    try:
        if ckpt is not None:
            stats.files_opened = list(ckpt.files)
        _load(model, ckpt, tp, stats)
    finally:
        if ckpt is not None:
            ckpt.close()
    stats.bytes_read = ckpt.bytes_read if ckpt else 0
    return stats


def _load(model: LlamaModel, ckpt: Checkpoint | None, tp: TPContext, stats: LoadStats) -> None:
    specs = [ckpt.specs if ckpt else None]
    dist.broadcast_object_list(specs, src=0, group=tp.group)  # the tensor list, so all walk it alike
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    modules = dict(model.named_modules())
    loaded: dict[int, set] = {}  # id(param) -> the parts (shard ids) it received
    for name, shape in specs[0]:
        target = model.param_for(name, params)
        if target is None:
            continue
        param, shard_id = target
        check_checkpoint_shape(name, param, shard_id, shape)  # every rank alike: all raise, none waits
        mod_name, _, attr = names[id(param)].rpartition(".")
        layer = modules[mod_name]
        shards = [layer.shard(attr, shard_id, rank=r) for r in range(tp.size)]
        full = ckpt.read(name).to(device=param.device, dtype=param.dtype) if ckpt else None
        nbytes = _transfer(shards, param, full, shape, tp)
        stats.bytes_received += nbytes if tp.rank else 0
        stats.num_tensors += 1
        loaded.setdefault(id(param), set()).add(shard_id)
    check_complete(params, loaded)


def _transfer(shards: list[Shard], param: nn.Parameter, full: torch.Tensor | None, shape: list[int],
              tp: TPContext) -> int:
    """One checkpoint tensor from rank 0 (`full`; `shards`: every rank's piece of it) into this
    rank's `param`; -> bytes that arrived here."""
    mine = shards[tp.rank]
    if mine.replicated:  # everyone gets the whole (small) tensor
        buf = full if full is not None else torch.empty(shape, dtype=param.dtype, device=param.device)
        dist.broadcast(buf, src=0, group=tp.group)
    else:  # equal-sized pieces, one per rank
        buf = torch.empty(mine.piece_shape(shape), dtype=param.dtype, device=param.device)
        pieces = [s.take(full).contiguous() for s in shards] if full is not None else None
        dist.scatter(buf, pieces, src=0, group=tp.group)
    mine.place(param, buf)
    return buf.numel() * buf.element_size()
