"""sentence-transformers Dense modules: linear projections of the pooled vector, before any
Normalize step (LaBSE's 768 -> 768 with tanh; models that project to fewer or more dimensions).
vLLM applies every Dense module a folder's modules.json lists, in order, after pooling and
before cutting to `dimensions` and normalising; so does the engine (Request.finish_pooled).

    dense_modules  what each Dense module's config says (no weights): the sizes the router
                   and the engine's PoolerConfig need
    Projection     the modules with their weights, applied to one pooled vector (float64)"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

# torch is imported where the weights are: engine.pooling reads the configs here, and the
# router's ingress, which imports it, has no use for torch

DENSE_TYPES = ("sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class DenseModule:
    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a torch.nn module's import path, sentence-transformers' "activation_function"


def dense_modules(model_dir: Path, modules: list[dict]) -> list[DenseModule]:
    """The Dense modules of a folder's modules.json (`modules`, its entries), in order; ValueError
    for one whose config cannot be read, whose sizes do not chain, or whose activation is not a
    torch.nn module."""
    out = []
    for m in (m for m in modules if isinstance(m, dict) and m.get("type") in DENSE_TYPES):
        folder = Path(model_dir) / m.get("path", "")
        try:
            cfg = json.loads((folder / "config.json").read_text())
            dense = DenseModule(folder, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                                cfg.get("activation_function") or "torch.nn.modules.linear.Identity")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read the sentence-transformers Dense module in {str(folder)!r}: "
                             f"{type(e).__name__}: {e}") from None
        if out and out[-1].out_features != dense.in_features:
            raise ValueError(f"the Dense module in {str(folder)!r} takes {dense.in_features} features, but the one "
                             f"before it gives {out[-1].out_features}")
        _activation(dense)  # refused now, at start-up, not per request
        out.append(dense)
    return out


def _activation(dense: DenseModule):
    """The torch.nn module the Dense module names (sentence-transformers' activation_function)."""
    module, _, name = dense.activation.rpartition(".")
    if not (module == "torch.nn" or module.startswith("torch.nn.")):
        raise ValueError(f"the Dense module in {str(dense.folder)!r} names the activation {dense.activation!r}; "
                         "kvserve applies torch.nn modules only")
    try:
        return getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(f"the Dense module in {str(dense.folder)!r} names the activation {dense.activation!r}, "
                         f"which torch cannot build: {e}") from None


def _weights(dense: DenseModule) -> dict:
    import torch

    for name in _WEIGHT_FILES:
        path = dense.folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
    raise ValueError(f"the Dense module in {str(dense.folder)!r} has no weights ({' or '.join(_WEIGHT_FILES)})")


class Projection:
    """The Dense modules, loaded: `__call__` maps a pooled vector (float64) through each in turn."""

    def __init__(self, modules: list[DenseModule]) -> None:
        self.layers = []
        for dense in modules:
            w = _weights(dense)
            weight, bias = w.get("linear.weight"), w.get("linear.bias")
            if weight is None or tuple(weight.shape) != (dense.out_features, dense.in_features):
                raise ValueError(f"the Dense module in {str(dense.folder)!r} needs a linear.weight of shape "
                                 f"({dense.out_features}, {dense.in_features}); it has "
                                 f"{None if weight is None else tuple(weight.shape)}")
            if dense.bias and (bias is None or tuple(bias.shape) != (dense.out_features,)):
                raise ValueError(f"the Dense module in {str(dense.folder)!r} needs a linear.bias of "
                                 f"{dense.out_features} values")
            self.layers.append((weight.double(), bias.double() if dense.bias else None, _activation(dense).double()))

    def __call__(self, v):
        import torch

        for weight, bias, act in self.layers:
            v = act(torch.nn.functional.linear(v, weight, bias))
        return v


def read_dense_modules(model_dir: Path) -> list[DenseModule]:
    """dense_modules of the folder's modules.json; none without one (a folder that is not a
    sentence-transformers model), or where it cannot be read (sentence_transformers_pooling
    refuses that)."""
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return dense_modules(model_dir, modules) if isinstance(modules, list) else []
