"""Run engine.kernels wherever the tests run: compiled on a CUDA host, under Triton's interpreter
on a CPU-only one. tests/conftest.py sets TRITON_INTERPRET before anything imports Triton and
clears it after collection; `kernels_here()` sets it again only while the kernel tests run."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def kernels_here() -> Iterator[torch.device]:
    """-> the device the kernels run on; skips the calling tests without triton."""
    if torch.cuda.is_available():
        pytest.importorskip("triton")
        yield torch.device("cuda")
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run these kernels (before 3.7 it fails "
                        "on a loop bound loaded from memory); they still compile for GPUs from 3.4 "
                        "(tests/test_triton_compile.py). pip install 'triton>=3.7' to run them here")
        from engine.kernels import paged_attention
        if type(paged_attention._paged_attention_kernel).__name__ != "InterpretedFunction":
            pytest.fail("Triton was imported before tests/conftest.py set TRITON_INTERPRET=1; "
                        "its kernels cannot run on this CPU-only host")
        yield torch.device("cpu")
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
