"""A model directory put into a Hugging Face cache the way huggingface_hub lays one out, so that the
engine can find it by repository id with no hub in reach:

    <cache>/models--<org>--<name>/blobs/<sha256>            the files' contents
                                 /snapshots/<commit>/<file>  relative symlinks to the blobs
                                 /refs/<revision>            the commit a branch or tag names
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def put_in_hub_cache(model_dir: Path, cache: Path, repo_id: str, revision: str = "main") -> Path:
    """Caches `model_dir`'s files as the commit `revision` names (a made-up hash); returns the
    snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot, blobs = repo / "snapshots" / commit, repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            data = f.read_bytes()
            blob = blobs / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
