"""benchmarks/gpu_check.sh runs on a GPU host that reaches no package index and whose image lacks
some of kvserve's dependencies (the device's KINDS.md lists what it has: torch, transformers,
triton, pytest, hypothesis, safetensors, tokenizers, numpy, tqdm; llguidance, which the engine
imports only for a constrained request, can travel as a wheel, `make gpu-carry`). GPU time comes
in short windows, so an import that fails there loses one. This runs, in a fresh interpreter where
the dependencies the image lacks cannot be imported (a meta-path finder refuses them, as an
absent module is refused), what the script runs first: the engine's imports and an engine's
first requests, collection of its test stage, and its benchmark scripts' start-up; and, with
torch told it has a GPU, what the engine does with a device name before its first CUDA call."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# kvserve's dependencies (pyproject.toml, with the test extras the script does not run) that the
# GPU image does not have.
ABSENT_ON_GPU_HOST = ("ray", "pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "gguf", "openai",
                      "jsonschema", "schemathesis", "lm_eval", "llguidance")

# What the script runs, read from it so this follows the script: its test stage's files and its
# Python scripts.
_GPU_CHECK = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
GPU_CHECK_TESTS = sorted(set(re.findall(r"tests/test_\w+\.py", _GPU_CHECK)))
GPU_CHECK_SCRIPTS = sorted(set(re.findall(r"benchmarks/\w+\.py", _GPU_CHECK)))

_ABSENT = textwrap.dedent("""\
    import sys

    class Absent:
        names = set(sys.argv.pop(1).split(","))

        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] in cls.names:
                raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU host)", name=name)
            return None

    sys.meta_path.insert(0, Absent)
""")


def _run(*code_or_args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """python -c '<absent finder>; <tail>' with ABSENT_ON_GPU_HOST refused."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _ABSENT + code_or_args[0], ",".join(ABSENT_ON_GPU_HOST),
                           *code_or_args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_finder_refuses_what_the_gpu_host_lacks():
    r = _run("import importlib.util\nprint(importlib.util.find_spec('json') is not None)\nimport ray")
    assert r.stdout.strip() == "True"
    assert "ModuleNotFoundError: No module named 'ray' (not on the GPU host)" in r.stderr


def test_the_engine_and_its_cuda_path_import_without_them():
    r = _run("import engine, engine.llm, engine.runners, engine.triton_runner, engine.cuda_graphs, engine.structured\n"
             "print('imported')")
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-2000:]


def test_gpu_check_tests_collect_without_them():
    assert {"tests/test_engine_cuda.py", "tests/test_triton_attention.py"} <= set(GPU_CHECK_TESTS), GPU_CHECK_TESTS
    r = _run("import pytest\nsys.exit(pytest.main(sys.argv[1:]))", "-q", "--co", "-p", "no:cacheprovider",
             *GPU_CHECK_TESTS)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert " collected" in r.stdout and "error" not in r.stdout.lower(), r.stdout[-3000:]


def test_gpu_check_benchmarks_start_without_them():
    assert {"benchmarks/random_model.py", "benchmarks/offline.py"} <= set(GPU_CHECK_SCRIPTS), GPU_CHECK_SCRIPTS
    for script in GPU_CHECK_SCRIPTS:
        r = _run("import runpy\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')",
                 script, "--help")
        assert r.returncode == 0 and "usage:" in r.stdout, f"{script}: {r.stderr[-2000:]}"


@pytest.mark.parametrize("name", ["cuda", "auto", "cuda:1"])
def test_a_cuda_device_is_resolved_with_its_index(monkeypatch, name):
    """torch.cuda.set_device refuses a bare "cuda" (the executor makes the engine's device the
    current one before anything else on CUDA): every engine on a GPU failed at start-up."""
    import torch
    from torch.cuda._utils import _get_device_index

    from engine.executor import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = resolve_device(name)
    assert device.type == "cuda" and _get_device_index(device) == (1 if name == "cuda:1" else 0)


def test_the_engine_generates_without_them(tmp_path, smollm2_path):
    """The stages that build an LLM (step_times, offline, the CUDA tests) run where llguidance is
    absent: nothing imports it before a request asks for a grammar."""
    from tests.tiny_llama import make_tiny_llama

    d = make_tiny_llama(tmp_path / "tiny", smollm2_path, "gqa")
    r = _run("from engine import LLM, SamplingParams\n"
             f"out = LLM(model={str(d)!r}, num_gpu_blocks_override=32).generate([[5, 6, 7]], "
             "SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))\n"
             "print(len(out[0].outputs[0].token_ids))")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "4", r.stderr[-2000:]


_FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in
  "-m pytest --help") seq -f "help line %g" 1 3000; echo "  --session-timeout=SECONDS"; seq -f "more %g" 1 3000 ;;
  "-m pytest"*) echo "============ 2 passed in 0.10s ============" ;;
esac
"""


@pytest.mark.parametrize("deadline, props", [(450, True), (20, False)])
def test_gpu_check_gives_the_exactness_tests_their_time_and_the_property_tests_what_is_left(tmp_path, deadline, props):
    """The script's own scheduling, with a stand-in python: the test stage runs with pytest-timeout's
    --session-timeout where pytest has it (read whole: a `pytest --help | grep -q` under pipefail
    failed on pytest's broken pipe), before the attention sweep; the property tests run in the
    time left, or are skipped when none is; both stages' summaries reach summary.txt."""
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PYTHON": str(fake), "CALLS": str(calls), "OUT": str(tmp_path / "out"),
           "KVSERVE_GPU_WORK": str(tmp_path / "work"), "KVSERVE_GPU_DEADLINE_S": str(deadline),
           "STAGES": "tests attention props"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = [line for line in calls.read_text().splitlines() if line.startswith("-m pytest -v")]
    assert "tests/test_engine_cuda.py" in runs[0] and "--session-timeout=" in runs[0]
    session = int(re.search(r"--session-timeout=(\d+)", runs[0]).group(1))
    assert session <= max(deadline - 60, 60) - 15  # a minute kept for the sweep after it; at least a minute
    sweep = next(i for i, line in enumerate(calls.read_text().splitlines()) if "attention_splits.py" in line)
    assert calls.read_text().splitlines().index(runs[0]) < sweep
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert (len(runs) == 2 and "tests/test_triton_attention.py" in runs[1]) is props
    assert summary.count("2 passed") == (2 if props else 1) and ("skipped, no time left" in summary) is not props
