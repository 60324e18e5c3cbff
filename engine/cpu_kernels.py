"""Native float32 kernels for CPU decode steps, built on first use and called through ctypes.

On an AVX2 + FMA CPU (engine/csrc/*.c, one shared library):

- `linear(x, w, b)` is `F.linear`, but float32 batches of at most `SMALL_M` rows run a kernel
  that reads the weight matrix in place rather than repacking it as MKL does on every call
  (about 2x on a decode step's GEMMs; docs/benchmarks.md), or reads the weight's 4/8-bit codes
  where it has them (engine/model/codes.py). Larger batches (prefill) stay on MKL.
- `decode_attention(...)` reads each sequence's keys and values straight from the paged cache
  through its block table, replacing a gather plus SDPA per group of decodes.
- `rms_norm`, `silu_and_mul` and `rope_write_kv` fuse the elementwise work between GEMMs
  (each replaces 3-10 small torch ops per layer).
- `decode_step(...)` chains all of them through every layer of a small decode-only step in one
  call (engine/decode_step.py).

The sources are compiled once per content hash with the system compiler (`$CC`, else `cc`)
into $KVSERVE_CACHE/kernels/ and use the OpenMP runtime torch has already loaded. Without a
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

from engine.model.codes import BlockCodes
from engine.model_source import cache_dir

logger = logging.getLogger(__name__)

PREFILL_HINT = 512  # the batch size oneDNN's weight layout is chosen for (prefill chunks)
SMALL_M = 96  # rows up to which the kernel beats MKL on this shape of model (measured crossover ~110)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.c"))
# -ffp-contract=off: a * b + c stays two roundings, as in the torch code the kernels replace
# (the GEMM and attention kernels ask for their FMAs explicitly).
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def enabled() -> bool:
    return os.environ.get("KVSERVE_CPU_KERNELS", "1") != "0" and _library() is not None


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels take x (all of them want contiguous CPU float32)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(rows, dim) -> (rows, dim): weight * (x * rsqrt(mean(x^2) + eps)); fusable(x) holds."""
    y = torch.empty_like(x)
    _library().kvserve_rms_norm_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps,
                                    torch.get_num_threads())
    return y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(rows, 2I) -> (rows, I): silu(gate) * up; fusable(gate_up) holds."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    _library().kvserve_silu_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv: (T, (H + 2 KVH) * D), fusable; cos/sin: (max positions, D) tables; positions, slots:
    (T,) int64. Rotates q and k in place, writes k and v to their cache slots; -> q (T, H, D)."""
    t = qkv.shape[0]
    _library().kvserve_rope_write_kv_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                                         slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, num_heads,
                                         num_kv_heads, head_dim, torch.get_num_threads())
    return qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)


def supports_decode_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0 and enabled()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, H, D) one query per sequence; caches: (num_blocks, block_size, KVH, D);
    block_tables: (B, max_blocks) int64; context_lens: (B,) int64 -> (B, H, D)."""
    q = q.contiguous()
    b, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    out = torch.empty_like(q)
    rc = _library().kvserve_decode_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        context_lens.data_ptr(), out.data_ptr(), b, h, kvh, d, block_size, scale, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode attention kernel failed ({rc}) for q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    return out


def decode_step(decoder, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor) -> None:
    """Every decoder layer of a decode step (engine/decode_step.py): h (B, hidden) float32, the
    step's embeddings, becomes the last layer's output in place. `decoder` is a ctypes reference
    to the C side's description of the model; positions, slots, context_lens: (B,) int64;
    block_tables: (B, max blocks) int64."""
    rc = _library().kvserve_decode_step_f32(decoder, h.data_ptr(), h.shape[0], positions.data_ptr(), slots.data_ptr(),
                                            block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                                            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native decode step failed ({rc}) for a batch of {h.shape[0]}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           codes: BlockCodes | None = None, prepacked: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (M, K), weight (N, K). `codes`, when given, is the same
    weight as 4/8-bit codes (engine/model/codes.py): a small batch reads those instead, for the
    same bits in y. `prepacked`, when given, is the weight in oneDNN's blocked layout
    (`prepack`): a large batch (prefill) runs oneDNN's GEMM on it instead of MKL's sgemm, which
    on this 2-core AMD host does 197-216 GFLOPS against 116-180 (docs/benchmarks.md)."""
    if not _fits(x, weight) or not enabled():
        if (prepacked is not None and x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32
                and not x.requires_grad):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), prepacked, bias, "none", [], "")
        # a weight held as codes and prepacked only (loader.drop_float_weight): rebuilt, bit for bit
        return F.linear(x, codes.to_float() if weight.is_meta else weight, bias)
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    threads = torch.get_num_threads()
    if codes is not None:
        rc = _library().kvserve_linear_codes_f32(x.data_ptr(), codes.codes.data_ptr(), codes.scale.data_ptr(),
                                                 codes.offset.data_ptr(), codes.bits, y.data_ptr(), m, n, k, threads)
        if rc != 0:
            raise RuntimeError(f"linear kernel over codes failed ({rc}) for x {tuple(x.shape)}, {codes.bits}-bit W "
                               f"{codes.shape}")
    else:
        _library().kvserve_linear_f32(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, n, k, threads)
    return y if bias is None else y.add_(bias)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout for `linear(..., prepacked=)`, or None where oneDNN is
    not available."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREFILL_HINT)


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
        logger.warning("CPU kernels off, torch's are used instead: building them failed: %s", detail)
        return None
    lib = ctypes.CDLL(str(path))  # ctypes releases the GIL for each call
    ptr, long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.kvserve_linear_f32.argtypes = [ptr] * 3 + [long] * 3 + [c_int]
    lib.kvserve_linear_codes_f32.argtypes = [ptr] * 4 + [c_int, ptr] + [long] * 3 + [c_int]
    lib.kvserve_decode_attention_f32.argtypes = [ptr] * 4 + [long] + [ptr] * 2 + [long] * 5 + [ctypes.c_float, c_int]
    lib.kvserve_rms_norm_f32.argtypes = [ptr] * 3 + [long] * 2 + [ctypes.c_float, c_int]
    lib.kvserve_silu_and_mul_f32.argtypes = [ptr] * 2 + [long] * 2 + [c_int]
    lib.kvserve_rope_write_kv_f32.argtypes = [ptr] * 7 + [long] * 4 + [c_int]
    lib.kvserve_decode_step_f32.argtypes = [ptr, ptr, long, ptr, ptr, ptr, long, ptr, c_int]
    for fn in (lib.kvserve_linear_f32, lib.kvserve_linear_codes_f32, lib.kvserve_decode_attention_f32,
               lib.kvserve_decode_step_f32):
        fn.restype = c_int
    for fn in (lib.kvserve_rms_norm_f32, lib.kvserve_silu_and_mul_f32, lib.kvserve_rope_write_kv_f32):
        fn.restype = None
    return lib


def _build() -> Path:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    files = sorted(_CSRC.glob("*.[ch]"))  # headers too: a changed one must rebuild
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files) + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"kvserve_kernels-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling %s (once) into %s", ", ".join(p.name for p in _SOURCES), out.parent)
    # Build beside the target and rename: replicas starting together never load a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(tmp_out)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp_out, out)
    return out


if __name__ == "__main__":  # `python -m engine.cpu_kernels`: build now (e.g. in an image), print where
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(_build())
