"""Fixtures of the reliability suite: the tiny model its servers load, and the figures each test
reports (printed at the end of the run, and appended as JSON lines to $RELIABILITY_REPORT when
that is set)."""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.reliability.harness import FULL

_FIGURES: list[dict] = []


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm2_path):
    """A tiny random Llama (tests/tiny_llama.py) with SmolLM2's tokenizer and a vocabulary as
    large as it, so that text prompts and the chat template work: the whole HTTP, routing,
    scheduling and KV path of a real model, at a fraction of its compute."""
    from transformers import AutoTokenizer

    from tests.tiny_llama import make_tiny_llama

    vocab = len(AutoTokenizer.from_pretrained(smollm2_path))
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", tokenizer_dir=smollm2_path,
                           vocab_size=vocab)


@pytest.fixture
def figures(request):
    """figures(**kv): record what this test measured."""
    def record(**kv) -> None:
        entry = {"test": request.node.name, "scale": "full" if FULL else "default",
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **kv}
        _FIGURES.append(entry)
        path = os.environ.get("RELIABILITY_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(entry) + "\n")
    return record


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("reliability figures")
    for entry in _FIGURES:
        rest = {k: v for k, v in entry.items() if k not in ("test", "time")}
        terminalreporter.write_line(f"{entry['test']}: {json.dumps(rest)}")
