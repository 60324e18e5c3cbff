"""Compile engine.kernels for a CUDA GPU on a host that has none, as the GPU would at its first
step: Triton's frontend, its NVIDIA backend and the ptxas its wheel ships, down to a cubin. The
interpreter the other kernel tests run under checks what a kernel computes but never compiles it;
this checks that it compiles for each GPU generation, at the shapes the engine launches, and what
each compiled kernel needs (registers, spills to local memory, shared memory).

    with compile_only(arch=90) as aot:
        aot.kernels.paged_attention.paged_attention(q, ...)   # CPU tensors: compiled, not launched
    for k in aot.compiled: k.name, k.usage["REG"], k.shared_bytes

Triton must have been imported without TRITON_INTERPRET (its own jit helpers are interpreted
otherwise), which the test process's conftest sets: `in_clean_process(fn, *args)` runs a
module-level function that compiles in a fresh Python and returns its JSON result.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

KERNEL_MODULES = ("paged_attention", "rope_kv", "kv_write", "norm")
ROOT = Path(__file__).resolve().parent.parent

# Shared memory one block may use, after opting in (CUDA programming guide, compute capabilities).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass
class CompiledKernel:
    name: str
    metadata: object  # Triton's KernelMetadata: num_warps, shared (dynamic shared memory), hash, ...
    ptx: str
    cubin: bytes
    usage: dict[str, int] = field(default_factory=dict)  # cuobjdump's REG, LOCAL, SHARED, STACK

    @property
    def shared_bytes(self) -> int:
        return self.metadata.shared + self.usage.get("SHARED", 0)

    def record(self) -> dict:
        """What the tests check, as JSON data."""
        return dict(name=self.name, arch=self.metadata.arch, hash=self.metadata.hash, regs=self.usage["REG"],
                    local=self.usage["LOCAL"], shared=self.shared_bytes,
                    fp_fusion=self.metadata.enable_fp_fusion, fma_f32="fma.rn.f32" in self.ptx)


@dataclass
class AOT:
    kernels: SimpleNamespace  # the kernel modules, loaded as JIT
    compiled: list[CompiledKernel] = field(default_factory=list)  # one entry per launch
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # kernel hash -> resource usage


class _CompileOnlyDriver:
    """What Triton's launcher asks of the active driver, answered for a GPU that is not there."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = arch  # per-architecture compile caches in each JIT function

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _load_jit(name: str) -> ModuleType:
    module = importlib.import_module(f"engine.kernels.{name}")
    if type(getattr(module, next(n for n in dir(module) if n.endswith("_kernel")))).__name__ != "JITFunction":
        raise RuntimeError("engine.kernels was imported under TRITON_INTERPRET: compile in_clean_process()")
    return module


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump --dump-resource-usage of one kernel: {"REG": 40, "LOCAL": 0, "SHARED": 0, ...}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[AOT]:
    """Within: every kernel launch of `aot.kernels` compiles for sm_<arch> and returns without
    running; `aot.compiled` lists the kernels compiled, with their resource usage."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    aot = AOT(SimpleNamespace(**{name: _load_jit(name) for name in KERNEL_MODULES}))
    launch, previous = JITFunction.run, dict(vars(driver))  # the active driver, however this Triton keeps it

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        cubin = kernel.asm["cubin"]
        if kernel.metadata.hash not in aot.usage:  # a launch that reused a compile: cuobjdump read it already
            aot.usage[kernel.metadata.hash] = resource_usage(cubin)
        aot.compiled.append(CompiledKernel(self.fn.__name__, kernel.metadata, kernel.asm["ptx"], cubin,
                                           aot.usage[kernel.metadata.hash]))
        return kernel

    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = compile_instead
    try:
        yield aot
    finally:
        JITFunction.run = launch
        vars(driver).clear()
        vars(driver).update(previous)


def in_clean_process(fn, *args):
    """fn(*args) in a new Python without TRITON_INTERPRET; fn is module-level and returns JSON data."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    call = json.dumps([fn.__module__, fn.__name__, list(args)])
    proc = subprocess.run([sys.executable, "-m", "tests.triton_aot", call], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{fn.__name__}{tuple(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


if __name__ == "__main__":
    module, name, call_args = json.loads(sys.argv[1])
    print(json.dumps(getattr(importlib.import_module(module), name)(*call_args)))
