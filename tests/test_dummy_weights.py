"""vLLM's --load-format dummy (engine.model.loader.dummy_weights): a folder with a config.json and
a tokenizer, and no weights, serves with random ones, the same on every start."""
from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model.loader import DUMMY_RANGE, float_parameters
from engine.model_source import ModelError
from tests.test_engine_exact import _assert_clean
from tests.tiny_llama import make_tiny_llama

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40))]


def _weightless(src, out):
    """A copy of `src` without its safetensors files: config.json and the tokenizer."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    return out


def test_a_folder_without_weights_serves_random_ones_with_load_format_dummy(tmp_path, smollm2_path):
    d = _weightless(make_tiny_llama(tmp_path / "src", smollm2_path, "gqa"), tmp_path / "config-only")
    with pytest.raises(ModelError, match=r"has no \*\.safetensors weights \(--load-format dummy fills them"):
        LLM(model=str(d), num_gpu_blocks_override=16)
    outs = []
    for _ in range(2):
        llm = LLM(model=str(d), load_format="dummy", num_gpu_blocks_override=16)
        params = float_parameters(llm.engine.executor.model)
        assert params and all(float(p.abs().max()) <= DUMMY_RANGE for p in params.values())
        assert all(float(p.std()) > DUMMY_RANGE / 4 for p in params.values())  # filled, not left at zeros or ones
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)])
        assert [len(t) for t in outs[-1]] == [8, 8]
        _assert_clean(llm)
    assert outs[0] == outs[1]  # seeded: the same weights on every start


def test_an_encoder_embeds_with_dummy_weights(tmp_path):
    from tests.tiny_bert import make_tiny_encoder

    d = _weightless(make_tiny_encoder(tmp_path / "src", "bert"), tmp_path / "config-only")
    llm = LLM(model=str(d), load_format="dummy")
    (out,) = llm.embed(["a few words"], use_tqdm=False)
    v = torch.tensor(out.outputs.embedding)
    assert torch.isfinite(v).all() and abs(float(v.norm()) - 1) < 1e-5  # the folder's Normalize module


def test_load_format_is_checked():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="load_format must be auto|safetensors|dummy, got 'gguf'"):
        EngineConfig(load_format="gguf")
