"""GPTQ and AWQ checkpoints (engine.model.quantized, engine.model.checkpoint): greedy output
token-exact against HF on the float weights the packed ones stand for, decode reading 4-bit ones
as codes (engine.model.codes); what cannot be served is refused at start-up, naming why.
Tensor parallel: tests/test_workers.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model import codes
from engine.model.quantized import quant_config
from tests.test_engine_exact import _assert_clean
from tests.tiny_llama import hf_greedy, make_tiny_llama
from benchmarks.quantize import quantize_checkpoint

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [100, 200, 300, 400], [7] * 20]


@pytest.fixture(scope="module")
def src(tmp_path_factory, smollm2_path):
    return {kind: make_tiny_llama(tmp_path_factory.mktemp(kind), smollm2_path, kind) for kind in ("gqa", "bias")}


def _quantized(src, tmp_path, kind, method, **kw):
    packed, ref = tmp_path / "packed", tmp_path / "reference"
    quantize_checkpoint(src[kind], packed, ref, method, **kw)
    return packed, ref


def _coded_bits(llm: LLM) -> list[int]:
    model = llm.engine.executor.model
    return sorted(m.weight_codes.bits for name, m in model.named_modules()
                  if name.startswith("layers.") and getattr(m, "weight_codes", None) is not None)


@pytest.mark.parametrize("kind, method, kw, coded", [
    ("gqa", "gptq", dict(group_size=32), 4),
    ("gqa", "gptq", dict(group_size=-1), 4),  # one group per input row
    ("bias", "gptq", dict(group_size=32, act_order=True), None),  # groups out of order: no 32-weight grid
    ("gqa", "gptq", dict(bits=8, group_size=32), 8),
    ("gqa", "awq", dict(group_size=32), 4),
    ("bias", "awq", dict(group_size=64), 4),
    # compressed-tensors (bfloat16 scales): symmetric, zero points, 8-bit, per channel, act-order
    ("gqa", "compressed-tensors", dict(group_size=32), 4),
    ("bias", "compressed-tensors", dict(group_size=64, zero_points=True), 4),
    ("gqa", "compressed-tensors", dict(bits=8, group_size=32), 8),
    ("gqa", "compressed-tensors", dict(group_size=-1), 4),
    ("gqa", "compressed-tensors", dict(group_size=32, act_order=True), None),
], ids=["gptq-g32", "gptq-whole-rows", "gptq-act-order-biases", "gptq-8bit", "awq-g32", "awq-g64-biases",
        "ct-g32", "ct-zero-points-biases", "ct-8bit", "ct-channel", "ct-act-order"])
def test_a_quantized_checkpoint_is_exact_on_its_float_weights(src, tmp_path, kind, method, kw, coded):
    packed, ref = _quantized(src, tmp_path, kind, method, **kw)
    want = hf_greedy(ref, PROMPTS, MAX_NEW)
    assert want != hf_greedy(src[kind], PROMPTS, MAX_NEW)  # quantizing changed the output: the test can fail
    llm = LLM(model=str(packed), num_gpu_blocks_override=64, max_num_batched_tokens=16)  # chunked prefill too
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    layers = 4 * len([k for k in load_file(str(packed / "model.safetensors")) if k.endswith(("o_proj.qweight",
                                                                                          "o_proj.weight_packed"))])
    assert _coded_bits(llm) == ([] if coded is None else [coded] * layers)  # qkv, o, gate_up, down a layer
    _assert_clean(llm)


def test_vllms_kernel_names_are_taken_and_a_wrong_method_is_refused(src, tmp_path):
    packed, _ = _quantized(src, tmp_path, "gqa", "awq")
    LLM(model=str(packed), quantization="awq_marlin", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"quantization='gptq' does not match the checkpoint's method \(awq\)"):
        LLM(model=str(packed), quantization="gptq", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="the checkpoint is not quantized"):
        LLM(model=str(src["gqa"]), quantization="awq", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "fp8"}, "quantization method 'fp8' is not supported"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors"}, "has no config_groups"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "only symmetric"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "dynamic": {"+:.*mlp.*": {"bits": 8}}},
     "dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"}, "GEMM layout"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero points"),
    ({"quant_method": "awq", "bits": 4, "group_size": 0, "zero_point": True}, "group_size"),
    ("gptq", "must be an object"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "tensor"}, "input_activations": {"num_bits": 8}}}},
     "quantizes activations too"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}}}, "only the pack-quantized format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "tensor"}}}}, "per group .* or per channel"),
    ({"quant_method": "compressed-tensors", "quantization_status": "frozen", "config_groups": {}}, "only compressed"),
])
def test_what_cannot_be_served_is_refused_at_start_up(src, tmp_path, config, match):
    packed, _ = _quantized(src, tmp_path, "gqa", "gptq")
    written = json.loads((packed / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**written, "quantization_config": config}))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(packed), num_gpu_blocks_override=16)


def test_a_packed_tensor_that_does_not_fit_is_named(src, tmp_path):
    packed, _ = _quantized(src, tmp_path, "gqa", "awq")
    tensors = load_file(str(packed / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.scales"
    tensors[name] = tensors[name][:1]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.scales has shape \(1, 64\), expected"):
        LLM(model=str(packed), num_gpu_blocks_override=16)
    del tensors[name]
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.scales is missing"):
        LLM(model=str(packed), num_gpu_blocks_override=16)


def test_gptqs_g_idx_is_read_only_under_act_order(src, tmp_path):
    """vLLM ignores g_idx unless desc_act says the groups are reordered (some exporters write
    placeholders): a reversed g_idx changes nothing then."""
    packed, ref = _quantized(src, tmp_path, "gqa", "gptq")
    tensors = load_file(str(packed / "model.safetensors"))
    for name in [k for k in tensors if k.endswith(".g_idx")]:
        tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(packed / "model.safetensors"))
    llm = LLM(model=str(packed), num_gpu_blocks_override=64)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == hf_greedy(
        ref, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].float()}),
     r"model\.layers\.0\.mlp\.up_proj\.qweight is a 2-D torch\.float32 tensor, expected 2-D torch\.int32"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.scales": t["model.layers.0.mlp.up_proj.scales"].int()}),
     r"up_proj\.scales is a 2-D torch\.int32 tensor"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].flatten()}),
     r"up_proj\.qweight is 1-D, expected 2-D"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}),
     r"model\.layers\.0\.mlp\.up_proj has both a packed and a float weight"),
], ids=["float-qweight", "int-scales", "1d-qweight", "packed-and-float"])
def test_a_packed_tensor_of_the_wrong_kind_is_named(src, tmp_path, change, match):
    packed, _ = _quantized(src, tmp_path, "gqa", "gptq")
    tensors = load_file(str(packed / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(packed), num_gpu_blocks_override=16)


def test_a_classifier_made_from_a_quantized_head_is_refused(src, tmp_path):
    """--hf-overrides' classifier_from_token reads the head's rows, which a packed head does not hold."""
    packed, _ = _quantized(src, tmp_path, "gqa", "gptq")
    tensors = load_file(str(packed / "model.safetensors"))
    tensors["lm_head.qweight"] = tensors.pop("lm_head.weight").view(torch.int32)[:, :32].contiguous()
    save_file(tensors, str(packed / "model.safetensors"))
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                 "method": "from_2_way_softmax"}
    with pytest.raises(ValueError, match="this checkpoint's head is quantized"):
        LLM(model=str(packed), hf_overrides=overrides, num_gpu_blocks_override=16)


def test_gptqmodels_rules_that_leave_modules_unquantized_are_taken():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "dynamic": {"-:.*mlp.*": {}}}
    assert quant_config({"quantization_config": qc}).method == "gptq"


def test_packed_weights_without_a_quantization_config_are_refused(src, tmp_path):
    packed, _ = _quantized(src, tmp_path, "gqa", "gptq")
    written = json.loads((packed / "config.json").read_text())
    del written["quantization_config"]
    (packed / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match="is a quantized weight, but neither config.json's quantization_config nor "
                                         "quantize_config.json nor quant_config.json says how to read it"):
        LLM(model=str(packed), num_gpu_blocks_override=16)


@pytest.mark.parametrize("method, name, settings", [
    ("gptq", "quantize_config.json", dict(bits=4, group_size=32, desc_act=False, sym=True, damp_percent=0.01)),
    ("awq", "quant_config.json", dict(w_bit=4, q_group_size=32, zero_point=True, version="GEMM")),
], ids=["autogptq", "autoawq"])
def test_an_older_exports_settings_file_is_read_where_config_json_has_none(src, tmp_path, method, name, settings):
    """AutoGPTQ and AutoAWQ once wrote their settings beside config.json, without quant_method
    (vLLM reads these files): the method is told by their fields."""
    packed, ref = _quantized(src, tmp_path, "gqa", method, group_size=32)
    written = json.loads((packed / "config.json").read_text())
    del written["quantization_config"]
    (packed / "config.json").write_text(json.dumps(written))
    (packed / name).write_text(json.dumps(settings))
    llm = LLM(model=str(packed), num_gpu_blocks_override=64, quantization=method)
    want = hf_greedy(ref, PROMPTS, MAX_NEW)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    _assert_clean(llm)
    (packed / name).write_text(json.dumps({**settings, "bits": 3, "w_bit": 3}))
    with pytest.raises(ValueError, match=f"^{name}: .*only"):
        LLM(model=str(packed), num_gpu_blocks_override=16)
    (packed / name).write_text(json.dumps({"group_size": 32}))
    with pytest.raises(ValueError, match=f"{name}: no quant_method, and no w_bit"):
        LLM(model=str(packed), num_gpu_blocks_override=16)


def test_the_cli_takes_vllms_quantization_flag(src, tmp_path):
    import argparse

    from cluster.engine_args import add_engine_args, engine_config_from_args

    packed, _ = _quantized(src, tmp_path, "gqa", "gptq")
    parser = add_engine_args(argparse.ArgumentParser())
    kwargs = engine_config_from_args(parser.parse_args(["--model", str(packed), "-q", "gptq_marlin"]))
    assert kwargs["quantization"] == "gptq_marlin"
    assert LLM(**kwargs, num_gpu_blocks_override=16).engine.executor.model is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "bitsandbytes"])


def test_a_blocks_codes_span_the_steps_it_uses():
    """A GPTQ/AWQ block of 32 weights spans only the steps of its scale its codes use (the
    smallest and the largest code are rarely both there): each width from 1 to 15 steps is found,
    bit for bit, at a float16 scale (GPTQ's, AWQ's) or a bfloat16 one below float16's normal range
    (compressed-tensors'); a block of 17 distinct values is no 4-bit grid."""
    gen = torch.Generator().manual_seed(0)
    for scale_of in (lambda r: (r * 0.1 + 0.001).to(torch.float16), lambda r: (r * 1e-5).to(torch.bfloat16)):
        rows = []
        for span in range(16):
            scale = scale_of(torch.rand(1, generator=gen)).float()
            q = torch.randint(0, span + 1, (32,), generator=gen)
            q[0], q[1] = 0, span
            rows.append(scale * (q + torch.randint(-8, 0, (1,), generator=gen)).float())
        w = torch.stack(rows * 2)
        coded = codes.encode(w)
        assert coded is not None and coded.bits == 4
        assert torch.equal(coded.to_float().view(torch.int32), w.view(torch.int32))
    assert codes.encode(torch.linspace(-1, 1, 64).view(2, 32).repeat(4, 1) * 0.37) is None


def test_quant_config_reads_awqs_own_key_names():
    assert quant_config({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                 "zero_point": True}}).group_size == 64
    assert quant_config({}) is None

