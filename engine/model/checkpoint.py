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


def folder_quant_config(model_dir: str | Path) -> QuantConfig | None:
    """The folder's config.json quantization (None: none, or no readable config.json)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return quant_config(config) if isinstance(config, dict) else None


class Checkpoint:
    """Used as a context manager: the files are closed (their maps released) when it ends."""

    def __init__(self, model_dir: str | Path) -> None:
        self.files = [str(p) for p in safetensors_files(model_dir)]
        self.quant = folder_quant_config(model_dir)
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
                raise ValueError(f"checkpoint tensor {name!r} is a quantized weight, but config.json has no "
                                 "quantization_config saying how to read it" if self.quant is None else
                                 f"checkpoint tensor {name!r} is not how a {self.quant.method} checkpoint packs "
                                 "its weights")
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
