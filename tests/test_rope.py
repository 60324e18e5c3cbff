"""engine.model.rope: the cos/sin tables equal HF transformers' bit for bit (default, linear and
llama3 scaling), and are built on the device the model is built on, as HF computes them where the
model runs (a GPU's cos rounds apart from the CPU's)."""
from __future__ import annotations

import pytest
import torch

from engine.model.rope import RotaryEmbedding

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("kind", SCALINGS)
def test_tables_equal_hf_bit_for_bit(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, positions, theta = 64, 4096, 500000.0
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta,
                         max_position_embeddings=positions, rope_scaling=SCALINGS[kind])
    hf = LlamaRotaryEmbedding(config)
    pos = torch.arange(positions)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos[None])
    mine = RotaryEmbedding(head_dim, positions, theta, SCALINGS[kind])
    assert torch.equal(mine.cos, cos[0]) and torch.equal(mine.sin, sin[0])


def test_tables_are_built_on_the_models_device():
    with torch.device("meta"):  # as a model built under torch.device("cuda") would be
        rotary = RotaryEmbedding(64, 1024, 10000.0, None)
    assert rotary.cos.device.type == rotary.sin.device.type == "meta"


def test_inverse_frequencies_come_from_the_cpu_as_hfs_do():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.model.rope import rope_inv_freq

    with torch.device("meta"):
        inv_freq = rope_inv_freq(128, 500000.0, SCALINGS["llama3"])
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=500000.0,
                                          rope_scaling=SCALINGS["llama3"]))
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, hf.inv_freq)


def test_build_model_builds_on_the_device_it_runs_on(smollm2_path, monkeypatch):
    """tp=1 builds its model under the device as a tensor-parallel rank does, so both take their
    rope tables from the GPU they run on."""
    from engine.model import loader

    seen = []

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        seen.append(torch.get_default_device())
        raise Stop

    monkeypatch.setattr(loader, "LlamaModel", record)
    with pytest.raises(Stop):
        loader.build_model(smollm2_path, torch.float32, torch.device("meta"))
    assert [d.type for d in seen] == ["meta"]
