"""sentence-transformers Dense modules: linear projections of the pooled vector, between the
Pooling module and any Normalize step (LaBSE's 768 -> 768 with tanh; models that project to
fewer or more dimensions). vLLM applies every Dense module a folder's modules.json lists, in
order, after pooling and before cutting to `dimensions` and normalising; so does the engine
(Request.finish_pooled).

    read_dense_modules  what each Dense module's config says, checked (the engine's PoolerConfig
                        takes the vector's size from it)
    Projection          the modules with their weights, applied to one pooled vector (float64)

Everything a module's config says that the engine would not apply as sentence-transformers does
is refused at start-up: a residual, named inputs, an activation that is not a torch.nn module
keeping the vector's size, a Dense module out of place."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

# torch is imported only where a folder has Dense modules: engine.pooling imports this module,
# and the router's ingress, which imports that, has no use for torch

# sentence-transformers' module types (modules.json), old and new package layouts
ST_POOLING = ("sentence_transformers.models.Pooling",
              "sentence_transformers.sentence_transformer.modules.pooling.Pooling")
ST_NORMALIZE = ("sentence_transformers.models.Normalize", "sentence_transformers.base.modules.normalize.Normalize",
                "sentence_transformers.sentence_transformer.modules.normalize.Normalize")
DENSE_TYPES = ("sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense")
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"  # sentence-transformers' Dense default
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class DenseModule:
    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a torch.nn module's import path, sentence-transformers' "activation_function"


def read_dense_modules(model_dir: Path) -> list[DenseModule]:
    """The Dense modules of the folder's modules.json, in order; none without one (a folder that
    is not a sentence-transformers model) or where it cannot be read (sentence_transformers_pooling
    refuses that). ValueError for a module the engine would not apply as sentence-transformers does."""
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(modules, list):
        return []
    types = [m.get("type") if isinstance(m, dict) else None for m in modules]
    dense = [i for i, t in enumerate(types) if t in DENSE_TYPES]
    if not dense:
        return []
    pooling = next((i for i, t in enumerate(types) if t in ST_POOLING), None)
    normalize = next((i for i, t in enumerate(types) if t in ST_NORMALIZE), len(types))
    if pooling is None or not all(pooling < i < normalize for i in dense):
        raise ValueError(f"{str(Path(model_dir) / 'modules.json')!r} lists Dense modules outside the place kvserve "
                         "applies them, between the Pooling module and any Normalize step")
    out: list[DenseModule] = []
    for i in dense:
        module = _read(Path(model_dir), modules[i])
        if out and out[-1].out_features != module.in_features:
            raise ValueError(f"the Dense module in {str(module.folder)!r} takes {module.in_features} features, but "
                             f"the one before it gives {out[-1].out_features}")
        out.append(module)
    return out


def _read(model_dir: Path, entry: dict) -> DenseModule:
    folder = model_dir
    try:
        folder = model_dir / entry.get("path", "")
        cfg = json.loads((folder / "config.json").read_text())
        defaults = {"use_residual": False, "module_input_name": None, "module_output_name": None}
        unapplied = [f"{k}={cfg[k]!r}" for k, default in defaults.items() if cfg.get(k, default) != default]
        activation = cfg.get("activation_function", DEFAULT_ACTIVATION)
        if not isinstance(activation, str):
            raise ValueError(f"activation_function {activation!r} is not an import path")
        dense = DenseModule(folder, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                            activation)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read the sentence-transformers Dense module in {str(folder)!r}: "
                         f"{type(e).__name__}: {e}") from None
    if unapplied:
        raise ValueError(f"the Dense module in {str(folder)!r} sets {', '.join(unapplied)}, which kvserve does not "
                         "apply")
    _activation(dense)  # refused now, at start-up, not per request
    return dense


def _activation(dense: DenseModule):
    """The torch.nn module the Dense module names, in eval mode; ValueError for anything else, or
    for one that does not map a vector to one of its size."""
    import torch

    module, _, name = dense.activation.rpartition(".")
    if not (module == "torch.nn" or module.startswith("torch.nn.")):
        raise ValueError(f"the Dense module in {str(dense.folder)!r} names the activation {dense.activation!r}; "
                         "kvserve applies torch.nn modules only")
    try:
        act = getattr(importlib.import_module(module), name)()
        if not isinstance(act, torch.nn.Module):
            raise TypeError("not a torch.nn.Module")
        act.eval()
        probe = torch.linspace(-2, 2, dense.out_features, dtype=torch.float64)
        if act.double()(probe).shape != probe.shape:
            raise ValueError("it changes the vector's size")
    except Exception as e:  # whatever building or running it raises: refused at start-up
        raise ValueError(f"the Dense module in {str(dense.folder)!r} names the activation {dense.activation!r}, "
                         f"which kvserve cannot apply: {type(e).__name__}: {e}") from None
    return act.double()


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
            if not dense.bias and bias is not None:
                raise ValueError(f"the Dense module in {str(dense.folder)!r} says bias false but has a linear.bias")
            self.layers.append((weight.double(), bias.double() if dense.bias else None, _activation(dense)))

    def __call__(self, v):
        import torch

        for weight, bias, act in self.layers:
            v = act(torch.nn.functional.linear(v, weight, bias))
        return v
