"""Fill the models volume with one checkpoint, once: the weights Job runs this (from a ConfigMap)
in the kvserve image.

    python fill_weights.py hf://meta-llama/Llama-3.1-8B-Instruct /models/Llama-3.1-8B-Instruct

Downloads config, tokenizer and *.safetensors from the Hugging Face hub (token: $HF_TOKEN) into a
partial directory next to the destination, checks that the engine can read the config, then
renames it into place and writes the marker file that the Ray pods' init containers wait for.
A destination that already has its marker is left alone, so re-running the Job is cheap.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

MARKER = ".kvserve-complete"  # the pods' init containers wait for this file
PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def download_hf(repo_id: str, dest: Path) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id, local_dir=str(dest), allow_patterns=PATTERNS, token=os.environ.get("HF_TOKEN") or None)


def check(model_dir: Path) -> None:
    if not (model_dir / "config.json").is_file() or not list(model_dir.glob("*.safetensors")):
        raise SystemExit(f"{model_dir}: no config.json or no *.safetensors after the download")
    try:
        from engine.model.loader import load_arch  # in the kvserve image: the engine's own reading
    except ImportError:
        return
    load_arch(model_dir)


def fill(source: str, dest: Path, download=download_hf) -> bool:
    """-> True when it downloaded, False when dest was already complete."""
    if (dest / MARKER).is_file():
        print(f"{dest} is complete already")
        return False
    scheme, _, path = source.partition("://")
    if scheme != "hf" or not path:
        raise SystemExit(f"source must look like hf://<org>/<repo>, got {source!r} (S3: components/weights-from-s3)")
    partial = dest.with_name(dest.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)  # a re-run resumes: the hub client skips finished files
    download(path, partial)
    check(partial)
    if dest.exists():
        shutil.rmtree(dest)
    partial.rename(dest)
    (dest / MARKER).write_text(source + "\n")
    print(f"{source} -> {dest}: {sum(f.stat().st_size for f in dest.iterdir() if f.is_file()) / 1e9:.1f} GB")
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    fill(sys.argv[1], Path(sys.argv[2]))
