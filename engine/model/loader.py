"""Build the model from an HF-style directory: config via transformers, weights via safetensors."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from engine import cpu_kernels
from engine.model import codes
from engine.model.codes import codes_wanted, log_codes
from engine.model.bert import EncoderModel
from engine.model.checkpoint import Checkpoint, folder_quant, unreadable
from engine.model.encoder_arch import hub_gte_config, is_hub_gte
from engine.model.modernbert import ModernBertEncoder
from engine.model.layers import TPContext, check_checkpoint_shape
from engine.model.llama import LlamaModel, ModelArch
from engine.model_source import ENCODER_NAMES
from engine.st_config import max_seq_length

DUMMY_RANGE, DUMMY_SEED = 1e-3, 1234  # vLLM's dummy weights: uniform in +-1e-3, seeded alike on every rank


def load_arch(model_dir: str | Path) -> tuple[ModelArch, object]:
    """-> (the architecture, transformers' config). ValueError for what the engine does not
    support; ModelError for a config.json that transformers cannot read (a field of the wrong
    type, say), which it reports with its own exception types."""
    from transformers import AutoConfig

    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise unreadable(path, e) from None
    quant = folder_quant(model_dir, raw) if isinstance(raw, dict) else None  # before transformers reads it
    try:
        if isinstance(raw, dict) and is_hub_gte(raw):  # only its remote code reads it
            cfg = hub_gte_config(raw, str(path))
        else:
            cfg = AutoConfig.from_pretrained(str(model_dir))
        arch = ModelArch.from_hf(cfg)
    except ValueError:
        raise
    except Exception as e:
        raise unreadable(path, e) from None
    if quant is not None:
        if arch.encoder:
            raise ValueError(f"a quantized encoder ({quant.method}) is not supported")
        arch = dataclasses.replace(arch, quantization=quant)
    limit = max_seq_length(model_dir) if arch.encoder else None
    if limit is not None and limit < arch.max_position_embeddings:  # vLLM's cap too: the input length it was
        arch = dataclasses.replace(arch, max_position_embeddings=limit)  # trained for bounds max_model_len
    return arch, cfg


def load_weights(model: LlamaModel, model_dir: str | Path) -> int:
    """Copy every checkpoint tensor into its (sharded) parameter; returns bytes read."""
    params = dict(model.named_parameters())
    loaded: dict[int, set] = {}  # id(param) -> the parts (shard ids) it received
    with Checkpoint(model_dir, model.arch.quantization) as ckpt:
        for name, shape in ckpt.specs:
            target = model.param_for(name, params)
            if target is None:
                continue
            param, shard = target
            check_checkpoint_shape(name, param, shard, shape)
            tensor = ckpt.read(name)
            got = loaded.setdefault(id(param), set())
            # a plain parameter (an encoder's) takes one tensor whole; a packed one, one per part
            if shard in got and (shard is not None or not hasattr(param, "weight_loader")):
                raise ValueError(f"checkpoint tensor {name!r} is a second tensor for the same parameter")
            if hasattr(param, "weight_loader"):
                param.weight_loader(param, tensor.to(param.dtype), shard)
            else:
                param.data.copy_(tensor)
            got.add(shard)
    check_complete(params, loaded)
    return ckpt.bytes_read


def check_complete(params: dict[str, nn.Parameter], loaded: dict[int, set]) -> None:
    """Raise unless every parameter (by id) received its checkpoint tensors: `loaded` maps it to
    the shard ids it got; a packed one (`shard_ids`: q/k/v, gate/up) needs each of its parts, or
    one tensor of them all (shard None)."""
    missing = []
    for n, p in params.items():
        got = loaded.get(id(p))
        parts = getattr(p, "shard_ids", None)
        if got is None:
            missing.append(n)
        elif parts and None not in got and not set(parts) <= got:
            missing.append(f"{n} (missing its part {', '.join(str(s) for s in parts if s not in got)})")
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))


def dummy_weights(model: nn.Module, seed: int = DUMMY_SEED) -> None:
    """vLLM's --load-format dummy: every parameter drawn uniform in +-DUMMY_RANGE from `seed`, in
    place where it lives (a tensor-parallel rank fills its own shard). For benchmarks and tests
    that have a model's config but not its weights; what it generates means nothing."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            gen = generators.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
            p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)


def build_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                tp: TPContext = TPContext(), pooling: bool = False, dummy: bool = False) -> LlamaModel | EncoderModel:
    """The model of `model_dir` on `device`, its weights read from the folder (or, where `dummy`,
    dummy_weights)."""
    arch, _ = load_arch(model_dir)
    if arch.encoder and not pooling:
        raise ValueError(f"an encoder model ({ENCODER_NAMES}) has no language-model head to "
                         "generate with: it serves embeddings and scores (--runner pooling, which --runner auto picks "
                         "for it)")
    with torch.device(device):  # built where it runs, as a tensor-parallel rank builds its shard
        if arch.encoder:
            model = (ModernBertEncoder if arch.modernbert else EncoderModel)(arch, dtype)
        else:
            model = LlamaModel(arch, dtype, tp, pooling)
    if dummy:
        dummy_weights(model)
    else:
        load_weights(model, model_dir)
    model = model.eval()
    if not arch.encoder:
        prepare_cpu_weights(model, device, dtype)
    return model


def prepare_cpu_weights(model: LlamaModel, device: torch.device, dtype: torch.dtype) -> int:
    """The second forms of the weights that engine.cpu_kernels.linear reads on a float32 CPU with
    its kernels on: a oneDNN-prepacked copy for prefill (unless KVSERVE_ONEDNN_PREFILL=0), and
    4/8-bit or bfloat16 codes for decode where the weights are exactly those (codes.py). A layer
    that gets both no longer needs its float32 weight, which is dropped then (`drop_float_weight`),
    layer by layer, so that loading holds at most one layer's weight three ways at once. Returns
    how many weights have codes."""
    if device.type != "cpu" or dtype != torch.float32 or not cpu_kernels.enabled():
        return 0
    prepack, encode = os.environ.get("KVSERVE_ONEDNN_PREFILL", "1") != "0", codes_wanted(device, dtype)
    t0, freed = time.perf_counter(), 0
    for module in model.modules():
        if not hasattr(module, "weight_prepacked"):  # the linear layers and the head (tied: the embedding)
            continue
        if encode:
            module.weight_codes = codes.encode(module.weight)
        if prepack:
            module.weight_prepacked = cpu_kernels.prepack(module.weight)
        freed += drop_float_weight(module)
    table = model.embed_tokens
    if encode and not hasattr(table, "weight_codes"):  # a lookup table only (an untied head, or none)
        table.weight_codes = codes.encode(table.weight)
        freed += drop_float_weight(table, lookup_only=True)
    if freed:
        _release_freed_memory()
    coded = [m.weight_codes for m in model.modules() if getattr(m, "weight_codes", None) is not None]
    if coded:
        log_codes(coded, time.perf_counter() - t0)
    return len(coded)


def drop_float_weight(module: nn.Module, lookup_only: bool = False) -> int:
    """Free a layer's float32 weight where it is held twice over besides, as codes (which decode
    reads) and prepacked (which prefill reads), or (`lookup_only`: an embedding table that is no
    head) as codes alone: its parameter becomes a meta tensor of the same shape, and whatever else
    would read it rebuilds it from the codes bit for bit (`float_weight`; an embedding lookup reads
    the codes' rows). Returns the bytes freed."""
    if getattr(module, "weight_codes", None) is None or (
            not lookup_only and getattr(module, "weight_prepacked", None) is None):
        return 0
    w = module.weight
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    return w.numel() * w.element_size()


def _release_freed_memory() -> None:
    """Hand the freed weights' pages back to the system: glibc keeps freed blocks of a few MB in
    its heap (its mmap threshold rises past them), where they would still count in the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def float_weight(module: nn.Module) -> torch.Tensor:
    """A layer's float32 weight, rebuilt from its codes where `drop_float_weight` freed it."""
    w = module.weight
    return module.weight_codes.to_float() if w.is_meta else w


def float_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, a freed weight rebuilt (for tests and debugging)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            out[f"{prefix}.{name}" if prefix else name] = float_weight(module) if p.is_meta else p
    return out


def held_weight_bytes(model: nn.Module) -> int:
    """The bytes every form of the weights takes: the parameters still held, their prepacked
    copies and their codes."""
    held = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    for m in model.modules():
        if (packed := getattr(m, "weight_prepacked", None)) is not None:
            held += packed.numel() * packed.element_size()
        if (coded := getattr(m, "weight_codes", None)) is not None:
            held += coded.nbytes
    return held
