"""LoRA adapters beside the base weights, as vLLM's --enable-lora serves them.

An adapter is a PEFT directory (`adapter_config.json` and `adapter_model.safetensors`, what
`peft`'s `save_pretrained` writes). Each adapted projection adds, for the rows of the step that
belong to requests of that adapter, PEFT's own delta to the base layer's output:

    y[rows] += ((x[rows] @ A^T) * scaling) @ B^T        scaling = lora_alpha / r  (or / sqrt(r), rsLoRA)

(PEFT scales the product: the same up to rounding, and here the scaling touches R columns, not
the output's thousands.)

Our q/k/v and gate/up projections are packed into one linear each, so an adapter's A matrices of
the packed parts are stacked (R = r_q + r_k + r_v rows) and its B matrices placed block-diagonally
in the packed output rows; a part the adapter leaves alone has no rows in either. Under tensor
parallelism a rank holds its shard of each, cut as the weight it adapts is: B's rows of the
column-parallel q/k/v and gate/up (A whole), A's columns of the row-parallel o and down (B whole,
their partial deltas summed by the weight's all-reduce). The base weights are untouched: one batch
mixes requests of the base model and of several adapters, each row seeing only its own. A step
with no adapted row costs nothing.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import InvalidRequestError
from engine.lora_request import ADAPTED, ADAPTER_WEIGHTS, LoRARequest, adapted_key, read_adapter_config, refused
from engine.model.layers import RowParallelLinear

# A checkpoint projection -> (our module in the decoder layer, the part of it when packed)
# each of ADAPTED: (our module, its part)
TARGETS = dict(zip(ADAPTED, [("qkv_proj", 0), ("qkv_proj", 1), ("qkv_proj", 2), ("o_proj", 0), ("gate_up_proj", 0),
                             ("gate_up_proj", 1), ("down_proj", 0)]))
_NAMES = {where: name for name, where in TARGETS.items()}


@dataclass
class LoRAWeights:
    """One adapter, ready to apply: (layer index, our module name) -> (A (R, in), B (out, R)), each
    this rank's shard."""
    lora_int_id: int
    scaling: float
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def load_adapter(lora: LoRARequest, model, max_rank: int | None = None) -> LoRAWeights:
    """Read `lora`'s adapter for `model` (engine.model.llama.LlamaModel, on its device and in its
    dtype), each tensor cut to the model's tensor-parallel shard as the layer's weight is (B's rows
    of a column-parallel layer, A's columns of a row-parallel one), after checking its shape
    against the model; InvalidRequestError for anything that does not fit."""
    from safetensors.torch import load_file

    path, arch = Path(lora.lora_path), model.arch
    cfg = read_adapter_config(path, max_rank)
    r = cfg["r"]
    scaling = cfg.get("lora_alpha", 8) / (math.sqrt(r) if cfg.get("use_rslora") else r)

    parts: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except Exception as e:  # a damaged or foreign file: safetensors' own error types
        raise refused(path, f"cannot read {ADAPTER_WEIGHTS}: {e}") from None
    for key, tensor in tensors.items():
        layer, projection, ab = adapted_key(path, key, arch.num_layers)
        module, part = TARGETS[projection]
        parts.setdefault((layer, module), {}).setdefault(part, {})[ab] = tensor
    if not parts:
        raise refused(path, f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    param = model.norm.weight  # the device and dtype (a weight held as codes only is a meta tensor)
    weights = LoRAWeights(lora.lora_int_id, scaling)
    for (layer, name), found in sorted(parts.items()):
        module = _adapted(model, layer)[name]
        row_parallel = isinstance(module, RowParallelLinear)
        outs = [module.weight.shape[0]] if row_parallel else module.full_sizes  # each part's rows, whole
        a_parts, b = [], torch.zeros(module.weight.shape[0], r * len(found))
        for col, (part, ab) in enumerate(sorted(found.items())):
            what = _NAMES[name, part]
            if set(ab) != {"A", "B"}:
                raise refused(path, f"layer {layer}'s {what} has no lora_{''.join(sorted(set('AB') - set(ab)))}")
            a, b_part = ab["A"], ab["B"]
            if a.shape != (r, module.in_features) or b_part.shape != (outs[part], r):
                raise refused(path, f"layer {layer}'s {what} has A {tuple(a.shape)} and B {tuple(b_part.shape)}, "
                                    f"where this model needs ({r}, {module.in_features}) and ({outs[part]}, {r})")
            if row_parallel:  # the rank's input columns, as its weight's; B whole
                a_parts.append(module.shard("weight").take(a))
                b[:, :r] = b_part
            else:  # the rank's output rows of the part, where its weight holds them; A whole
                shard = module.shard("weight", module.shard_ids[part])
                a_parts.append(a)
                b[shard.offset:shard.offset + shard.size, col * r:(col + 1) * r] = shard.take(b_part)
        weights.modules[(layer, name)] = (torch.cat(a_parts).to(param.device, param.dtype).contiguous(),
                                          b.to(param.device, param.dtype).contiguous())
    return weights


def _adapted(model, layer: int) -> dict:
    """Decoder layer `layer`'s projections LoRA adapts, by our module names."""
    block = model.layers[layer]
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


class LoRAState:
    """The adapters a model holds, and the step's rows of each: shared by every adapted layer,
    which calls `apply` after its base projection."""

    def __init__(self) -> None:
        self.adapters: dict[int, LoRAWeights] = {}
        self.step: list[tuple[LoRAWeights, slice | torch.Tensor]] = []  # (adapter, its rows) for the running step

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += the adapter's delta of x[rows], for each adapter of the step."""
        for weights, rows in self.step:
            ab = weights.modules.get(key)
            if ab is None:
                continue
            a, b = ab
            # Scaled at rank R, not at the output's width; B's product accumulates into y itself
            # where the rows are one run (an adapter's decodes, which row_order keeps together, or
            # every row): no pass over y of its own.
            if isinstance(rows, slice):
                y[rows].addmm_((x[rows] @ a.t()).mul_(weights.scaling), b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()).mul_(weights.scaling) @ b.t())

    @contextmanager
    def running(self, rows: dict[int, list[int]], device: torch.device):
        """While a step runs: adapter id -> the flat rows of its sequences (lora_rows)."""
        self.step = [(self.adapters[i], _rows(r, device)) for i, r in rows.items()]
        try:
            yield
        finally:
            self.step = []


def _rows(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows in increasing order as a slice where they are one run, else as an index tensor."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def attach(model, state: LoRAState) -> None:
    """Let every projection LoRA can adapt read `state` (engine.model.layers' linear layers)."""
    model.lora = state
    for i in range(len(model.layers)):
        for name, module in _adapted(model, i).items():
            module.lora, module.lora_key = state, (i, name)


def adapters_of(model, batch, block_size: int, device: torch.device):
    """-> (a context the model's forward runs in, whether any row of `batch` is adapted): the
    step's rows of each adapter, where `model` serves LoRA and `batch` runs any."""
    state = model.lora
    rows = lora_rows(batch, block_size) if state is not None else {}
    return (state.running(rows, device) if rows else nullcontext()), bool(rows)


def lora_rows(batch, block_size: int) -> dict[int, list[int]]:
    """Adapter id -> the flat rows (engine.scheduler.ScheduledBatch.row_order) of its sequences'
    new tokens in `batch`; empty when no sequence runs with an adapter."""
    rows: dict[int, list[int]] = {}
    row = 0
    for i in batch.row_order(block_size):
        n = batch.num_new_tokens[i]
        adapter = batch.seqs[i].lora_int_id
        if adapter is not None:
            rows.setdefault(adapter, []).extend(range(row, row + n))
        row += n
    return rows


class LoadedAdapters:
    """The adapters an engine's executor holds (by lora_int_id, least recently used first): at
    most max_cpu_loras, beyond those its unfinished requests run with, from each use on."""

    def __init__(self, executor, capacity: int) -> None:
        self.executor = executor
        self.capacity = capacity
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()

    def use(self, lora: LoRARequest, in_use: set[int | None]) -> None:
        """Load `lora` where it is not loaded yet (InvalidRequestError for an adapter that does
        not fit the model), unloading the least recently used ones no request runs with."""
        known = self.loaded.get(lora.lora_int_id)
        if known is None:
            self.executor.add_lora(lora)
            self.loaded[lora.lora_int_id] = lora
        elif known.lora_path != lora.lora_path:
            raise InvalidRequestError("lora_request", f"LoRA adapter id {lora.lora_int_id} is loaded from "
                                      f"{known.lora_path!r}, not {lora.lora_path!r}: each adapter needs its own "
                                      "lora_int_id")
        self.loaded.move_to_end(lora.lora_int_id)
        for old in [i for i in self.loaded if i != lora.lora_int_id and i not in in_use]:
            if len(self.loaded) <= self.capacity:
                break
            self.executor.remove_lora(old)
            del self.loaded[old]
