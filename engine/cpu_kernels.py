"""Native float32 kernels for CPU decode steps, built on first use and called through ctypes.

`linear(x, w, b)` is `F.linear` everywhere; on an AVX2 + FMA CPU, for float32 batches of at most
`SMALL_M` rows, it runs engine/csrc/linear_f32.c instead, which reads the weight matrix in place
rather than repacking it as MKL does on every call (about 2x on a decode step's GEMMs; see
docs/benchmarks.md). Larger batches (prefill) stay on MKL, which is faster there.

The C file is compiled once per source hash with the system compiler (`$CC`, else `cc`) into
$KVSERVE_CACHE/kernels/ and linked against the OpenMP runtime torch already loaded. Without a
compiler, without AVX2, or with KVSERVE_CPU_KERNELS=0, everything stays on torch.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model_source import cache_dir

logger = logging.getLogger(__name__)

SMALL_M = 96  # rows up to which the kernel beats MKL on this shape of model (measured crossover ~110)
_SOURCE = Path(__file__).parent / "csrc" / "linear_f32.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def enabled() -> bool:
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0" and _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M, K), weight (N, K)."""
    if not _fits(x, weight) or not enabled():
        return F.linear(x, weight, bias)
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    _library().kvserve_linear_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() == 2
            and 0 < x.shape[0] <= SMALL_M and x.shape[1] % 8 == 0 and weight.is_contiguous()
            and not x.requires_grad and not weight.requires_grad)


@cache
def _library() -> ctypes.CDLL | None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("CPU kernels off: this CPU lacks AVX2/FMA")
        return None
    try:
        path = _build()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip()
        logger.warning("CPU kernels off, torch's are used instead: building %s failed: %s", _SOURCE.name, detail)
        return None
    lib = ctypes.CDLL(str(path))  # ctypes releases the GIL for the call
    fn = lib.kvserve_linear_f32
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def _build() -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"linear_f32-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s (once) into %s", _SOURCE.name, out.parent)
    # Build beside the target and rename: replicas starting together never load a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(tmp_out)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp_out, out)
    return out
