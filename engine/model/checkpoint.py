"""A model folder's checkpoint: its safetensors files' tensors by name, each listed with its shape
before any is read, then read on demand (engine.model.loader in one process; rank 0 of a
tensor-parallel group in workers.weights). A quantized checkpoint's packed linear weights (GPTQ,
AWQ, compressed-tensors) are listed and read as the float weights they stand for
(engine.model.quantized)."""
from __future__ import annotations

import json
from pathlib import Path

import safetensors
import torch

from engine.model.quantized import QuantConfig, quant_config
from engine.model_source import ModelError


def open_safetensors(path: Path):
    """safe_open, its errors naming the file (a truncated or corrupt one says only what broke)."""
    try:
        return safetensors.safe_open(str(path), framework="pt")  # looked up per call: tests spy on it
    except Exception as e:
        raise unreadable(path, e) from None


def unreadable(path: Path, e: Exception) -> ModelError:
    """One line: the file, and the error its reader raised."""
    return ModelError(f"cannot read {str(path)!r}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


# Where an older AutoGPTQ or AutoAWQ export keeps its settings instead of config.json (vLLM reads
# them too); the first one found is read
QUANT_FILES = ("quantize_config.json", "quant_config.json")


def folder_quant(model_dir: str | Path, config: dict) -> QuantConfig | None:
    """The checkpoint's quantization: `config` (its config.json)'s quantization_config, else the
    folder's QUANT_FILES, whose method is their `quant_method` or told by their fields (AutoAWQ's
    `w_bit`, AutoGPTQ's `bits`). None where neither is there; ValueError naming the file for
    what cannot be served."""
    if config.get("quantization_config") is not None:
        return quant_config(config)
    for name in QUANT_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            qc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise unreadable(path, e) from None
        if not isinstance(qc, dict):
            raise ValueError(f"{name}: expected a JSON object, got {type(qc).__name__}")
        if "quant_method" not in qc:
            method = "awq" if "w_bit" in qc else "gptq" if "bits" in qc else None
            if method is None:
                raise ValueError(f"{name}: no quant_method, and no w_bit (AutoAWQ) or bits (AutoGPTQ) to tell it by")
            qc = {**qc, "quant_method": method}
        try:
            return quant_config({"quantization_config": qc})
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    return None


class Checkpoint:
    """Used as a context manager: the files are closed (their maps released) when it ends.
    `quant`: the folder's quantization, as load_arch read it (ModelArch.quantization)."""

    def __init__(self, model_dir: str | Path, quant: QuantConfig | None) -> None:
        self.files = [str(p) for p in safetensors_files(model_dir)]
        self.quant = quant
        self._where = {}  # tensor name -> the open file that holds it
        self._handles = []
        self._packed: dict[str, str] = {}  # a dequantized weight's name -> its linear's prefix
        self.specs: list[tuple[str, list[int]]] = []  # (name, shape), in the files' order
        self.bytes_read = 0
        try:
            self._list()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles:
            h.__exit__(None, None, None)
        self._handles = []

    def _list(self) -> None:
        for path in self.files:
            h = open_safetensors(Path(path))
            self._handles.append(h)
            for name in h.keys():
                if name in self._where:
                    raise ValueError(f"checkpoint tensor {name!r} is in two files (the second: {path})")
                self._where[name] = h
        for name, h in self._where.items():
            prefix, suffix = _split(name)
            if suffix in PACKED and (self.quant is None or suffix != self.quant.parts[0]):
                raise ValueError(f"checkpoint tensor {name!r} is a quantized weight, but neither config.json's "
                                 f"quantization_config nor {' nor '.join(QUANT_FILES)} says how to read it"
                                 if self.quant is None else f"checkpoint tensor {name!r} is not how a "
                                 f"{self.quant.method} checkpoint packs its weights")
            if self.quant is None or suffix not in self.quant.parts:
                self.specs.append((name, list(h.get_slice(name).get_shape())))
            elif suffix == self.quant.parts[0]:
                shape = list(h.get_slice(name).get_shape())
                if len(shape) != 2 or prefix + ".weight" in self._where:
                    raise ValueError(f"quantized checkpoint: {name} is {len(shape)}-D, expected 2-D" if len(shape) != 2
                                     else f"quantized checkpoint: {prefix} has both a packed and a float weight")
                self._packed[prefix + ".weight"] = prefix
                self.specs.append((prefix + ".weight", self.quant.weight_shape(shape)))

    def read(self, name: str) -> torch.Tensor:
        prefix = self._packed.get(name)
        if prefix is None:
            return self._read(name)
        parts = {suffix: self._read(prefix + suffix) for suffix in self.quant.parts if prefix + suffix in self._where}
        return self.quant.dequantize(prefix, parts)

    def _read(self, name: str) -> torch.Tensor:
        t = self._where[name].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t


PACKED = (".qweight", ".weight_packed")  # a quantized format's packed weight (GPTQ/AWQ's, compressed-tensors')


def _split(name: str) -> tuple[str, str]:
    """"a.b.qweight" -> ("a.b", ".qweight")."""
    prefix, _, last = name.rpartition(".")
    return prefix, "." + last
