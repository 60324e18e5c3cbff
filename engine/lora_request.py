"""Which LoRA adapter a request runs with (vLLM's LoRARequest), and an adapter directory's
config as kvserve reads it. No torch here: SamplingParams and the CLI import it; the weights are
engine.lora's."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequestError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the decoder layers' projections an adapter may adapt (engine.lora.TARGETS: where each is)
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# an adapter tensor's name (PEFT's): its layer, projection and A or B
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class ModelDims:
    """What an adapter's weights must fit, known from the model's config alone (so the ingress,
    which holds no model, checks adapters as the engine will): its decoder layers, and each
    adapted projection's (inputs, outputs)."""
    num_layers: int
    projections: tuple[tuple[str, int, int], ...]  # (each of ADAPTED, inputs, outputs)

    @classmethod
    def of(cls, arch) -> ModelDims:
        """From an engine.model.llama.ModelArch."""
        h, i = arch.hidden_size, arch.intermediate_size
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return cls(arch.num_layers, (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                                     ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)))


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request runs with. `lora_int_id` (> 0) names the adapter in the
    engine (its loaded weights and its own prefix-cache blocks), `lora_path` is its directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_request", f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError("lora_request", f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError("lora_request", f"lora_path must be the adapter's directory, got {self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise InvalidRequestError("lora_request", f"base_model_name must be a string, got {self.base_model_name!r}")
        # absolute, so that one directory is one adapter however it was named (here, where it is named)
        object.__setattr__(self, "lora_path", os.path.abspath(os.path.expanduser(self.lora_path)))

    # vLLM's other names for the same fields
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def refused(path: str | Path, why: str) -> InvalidRequestError:
    """The error that refuses the adapter in directory `path`, saying why."""
    return InvalidRequestError("model", f"LoRA adapter {str(path)!r}: {why}")


def check_adapter(path: str | Path, max_rank: int | None = None, dims: ModelDims | None = None) -> None:
    """What can be checked of an adapter without the model's weights (--lora-modules at start-up,
    a runtime load): its config (read_adapter_config), its weights file's header, and, given the
    model's `dims`, that each tensor adapts a layer and projection of the model in its shape."""
    r = read_adapter_config(path, max_rank)["r"]
    header = check_weights_header(path)
    if dims is not None:
        _check_fit(Path(path), header, r, dims)


def _check_fit(path: Path, header: dict, r: int, dims: ModelDims) -> None:
    """Every tensor's layer and projection first, then their shapes, as engine.lora checks them."""
    sizes = {name: (k, n) for name, k, n in dims.projections}
    found = {key: adapted_key(path, key, dims.num_layers) for key in header if key != "__metadata__"}
    for key, (_, projection, ab) in found.items():
        entry, (k, n) = header[key], sizes[projection]
        need = (r, k) if ab == "A" else (n, r)
        shape = tuple(entry.get("shape", ())) if isinstance(entry, dict) else ()
        if shape != need:
            raise refused(path, f"tensor {key!r} has shape {shape}, where this model needs {need} (an adapter made "
                                "for another model, or of another rank than its config's r)")


def adapted_key(path: Path, key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, projection (one of ADAPTED), "A" or "B") of the adapter tensor named `key`; refused
    where it adapts no layer and projection of a model of `num_layers` layers."""
    m = _KEY.search(key)
    if m is not None and int(m.group(1)) >= num_layers:
        raise refused(path, f"tensor {key!r} adapts layer {m.group(1)}, and this model has {num_layers} layers (an "
                            "adapter made for another model)")
    if m is None or m.group(2) not in ADAPTED:
        raise refused(path, f"tensor {key!r} adapts nothing kvserve's model can (LoRA on the decoder layers' "
                            f"{', '.join(ADAPTED)} is served)")
    return int(m.group(1)), m.group(2), m.group(3)


def read_adapter_config(path: str | Path, max_rank: int | None = None) -> dict:
    """The adapter's PEFT config, refused (InvalidRequestError) where kvserve cannot serve it as
    PEFT computes it. Reads no weights."""
    path = Path(path)

    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise refused(path, f"no {ADAPTER_CONFIG} there (a PEFT adapter directory, as save_pretrained writes it)") \
            from None
    except (OSError, ValueError) as e:
        raise refused(path, f"cannot read {ADAPTER_CONFIG}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else cfg
        raise refused(path, f"not a LoRA adapter (peft_type {kind!r})")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise refused(path, f"its rank r must be a positive integer, got {r!r}")
    if max_rank is not None and r > max_rank:
        raise refused(path, f"its rank {r} is more than --max-lora-rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refused(path, f"its lora_alpha must be a number, got {alpha!r}")
    unsupported = [(what, cfg.get(key)) for key, what in (
        ("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"), ("fan_in_fan_out", "fan_in_fan_out"),
        ("layer_replication", "layer replication"), ("use_qalora", "QA-LoRA"))
        if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(("trained biases", cfg["bias"]))
    if unsupported:
        raise refused(path, "uses what kvserve does not serve: "
                      + ", ".join(f"{what} ({value!r})" for what, value in unsupported))
    targets = cfg.get("target_modules")
    others = [t for t in targets if not isinstance(t, str) or t.rpartition(".")[2] not in ADAPTED] if isinstance(
        targets, list) else []
    if others:  # PEFT would find no such module in the model (a string is a regex or "all-linear": taken)
        raise refused(path, f"its target_modules {others} are not modules kvserve adapts ({', '.join(ADAPTED)})")
    if not (path / ADAPTER_WEIGHTS).exists():
        raise refused(path, f"no {ADAPTER_WEIGHTS} there")
    return cfg


def lora_id(params) -> int | None:
    """The adapter a request's SamplingParams run with, by id; None for the base model."""
    lora = getattr(params, "lora_request", None)
    return None if lora is None else lora.lora_int_id


def lora_modules(specs, max_rank: int | None = None, dims: ModelDims | None = None) -> tuple[LoRARequest, ...]:
    """vLLM's --lora-modules: each `name=path`, or JSON (or a dict) with `name`, `path` and an
    optional `base_model_name`, as LoRARequests numbered from 1 in order; each adapter checked
    (check_adapter, against the model's `dims` where given), the paths made absolute. ValueError
    for what cannot be served."""
    out: list[LoRARequest] = []
    for spec in specs or ():
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"--lora-modules {spec!r}: not JSON ({e})") from None
        if isinstance(spec, str):
            name, sep, path = spec.partition("=")
            spec = {"name": name, "path": path} if sep else {}
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str) \
                or not spec["name"] or not spec["path"] or set(spec) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules takes name=path or JSON with name, path and base_model_name, got {spec!r}")
        if any(m.lora_name == spec["name"] for m in out):
            raise ValueError(f"--lora-modules names {spec['name']!r} twice")
        try:
            lora = LoRARequest(spec["name"], len(out) + 1, spec["path"], spec.get("base_model_name"))
            check_adapter(lora.lora_path, max_rank, dims)
        except InvalidRequestError as e:
            raise ValueError(f"--lora-modules {spec['name']}: {e.message}") from None
        out.append(lora)
    return tuple(out)


def check_weights_header(path: str | Path) -> dict:
    """The adapter's weights file's safetensors header; InvalidRequestError unless it names LoRA
    tensors and the file holds all it lists."""
    path = Path(path)
    try:
        with open(path / ADAPTER_WEIGHTS, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 << 20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
            data_bytes = os.fstat(f.fileno()).st_size - 8 - size
    except (OSError, ValueError) as e:
        raise refused(path, f"{ADAPTER_WEIGHTS} is not safetensors ({e})") from None
    if not isinstance(header, dict) or not any(".lora_A." in k for k in header):
        raise refused(path, f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    ends = [v["data_offsets"][1] for v in header.values() if isinstance(v, dict) and isinstance(
        v.get("data_offsets"), list) and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    if len(ends) < len(header) - ("__metadata__" in header) or max(ends, default=0) > data_bytes:
        raise refused(path, f"{ADAPTER_WEIGHTS} is cut short or damaged: its header lists "
                            f"{max(ends, default=0)} bytes of tensors, the file holds {data_bytes}")
    return header
