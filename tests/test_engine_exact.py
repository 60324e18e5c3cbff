"""Greedy output is token-exact against HF transformers generate under every scheduling path."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.tiny_llama import hf_greedy, make_tiny_llama

MAX_NEW = 24
PROMPT_LENS = (5, 16, 17, 40, 33, 100, 64)  # cross block boundaries (block_size 16)


def _prompts(seed: int = 0, lens=PROMPT_LENS, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernels(request, monkeypatch):
    """Every path twice: with the native CPU kernels (engine.cpu_kernels) and with torch's ops."""
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "1" if request.param == "native" else "0")
    return request.param


@pytest.fixture(scope="module", params=["gqa", "tied", "tied-gguf", "qwen3"])
def tiny(request, tmp_path_factory, smollm2_path):
    d = make_tiny_llama(tmp_path_factory.mktemp(request.param), smollm2_path, request.param)
    prompts = _prompts()
    return d, prompts, hf_greedy(d, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def weights_read_as_codes(llm: LLM) -> int:
    """How many of the model's linear layers decode reads as 4/8-bit codes (engine/model/codes.py)."""
    return sum(getattr(m, "weight_codes", None) is not None for m in llm.engine.executor.model.modules())


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def _run_staggered(llm: LLM, prompts, steps_between: int) -> list[list[int]]:
    """Each prompt arrives while the earlier ones are mid-flight; greedy tokens in prompt order."""
    eng, done = llm.engine, {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
        for _ in range(steps_between):
            done.update({o.request_id: o for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=128),  # everything at once
    dict(num_gpu_blocks_override=128, max_num_batched_tokens=7),  # chunked prefill, tiny budget
    dict(num_gpu_blocks_override=128, max_num_seqs=2),  # queueing
    dict(num_gpu_blocks_override=128, block_size=4),
    dict(num_gpu_blocks_override=128, enable_prefix_caching=False),
    dict(num_gpu_blocks_override=128, long_prefill_token_threshold=3),  # vLLM's cap on a chunk beside others
], ids=["batch", "chunked", "max2seqs", "bs4", "nocache", "longcap"])
def test_exact_batch(tiny, engine_kwargs, kernels):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), **engine_kwargs)
    # Each tiny model has 2-3 layers of 4 linears, plus an lm_head: all of them codes, or none.
    assert weights_read_as_codes(llm) == (0 if kernels == "torch" or "-gguf" not in d.name else
                                          4 * llm.engine.executor.model.arch.num_layers + 1)
    native_steps = _count_native_steps(llm)
    assert _tokens(llm.generate(prompts, GREEDY)) == ref
    # With the kernels, decode-only steps run all layers in one call (engine/decode_step.py).
    assert (native_steps[0] > 0) == (kernels == "native")
    _assert_clean(llm)


def _count_native_steps(llm: LLM) -> list[int]:
    runner, count = llm.engine.executor.runner, [0]
    if runner.native_step is not None:
        forward = runner.native_step.forward

        def counted(*args):
            count[0] += 1
            return forward(*args)
        runner.native_step.forward = counted
    return count


def test_exact_under_preemption(tiny):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=12, max_num_batched_tokens=32)
    assert _tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)


def test_a_request_that_fills_the_pool_but_its_last_token_runs(tiny):
    """The last sampled token is never fed back, so it needs no KV: a prompt + max_tokens one over
    the pool's capacity fits, and runs alone without preempting itself."""
    d, prompts, _ = tiny
    prompt = prompts[1][:5]
    assert (len(prompt) + MAX_NEW) % 4 == 1  # 4k + 1 tokens: k blocks of 4 hold all but the last
    need = (len(prompt) + MAX_NEW - 1) // 4
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=need)
    assert llm.engine.block_manager.num_blocks * 4 == len(prompt) + MAX_NEW - 1
    assert _tokens(llm.generate([prompt], GREEDY)) == hf_greedy(d, [prompt], MAX_NEW)
    assert llm.engine.stats().num_preemptions == 0
    _assert_clean(llm)
    with pytest.raises(InvalidRequestError, match="can never be scheduled"):  # one more token does not fit
        llm.engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW + 1))


def test_exact_staggered_arrivals(tiny):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=20, max_num_batched_tokens=24)
    assert _run_staggered(llm, prompts, steps_between=3) == ref
    _assert_clean(llm)


def test_exact_with_all_decodes_in_one_padded_group(tiny):
    """The GPU's decode layout (one group padded to its longest context, masked), here on CPU."""
    d, prompts, ref = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=20, max_num_batched_tokens=24)
    runner = llm.engine.executor.runner
    runner.native_decode, runner.one_decode_group = False, True
    assert _run_staggered(llm, prompts, steps_between=3) == ref
    _assert_clean(llm)


def test_exact_with_prefix_cache_hits(tiny):
    d, _, _ = tiny
    shared = _prompts(seed=1, lens=(48,))[0]
    prompts = [shared + tail for tail in _prompts(seed=2, lens=(3, 20, 1, 37))] + [shared]
    ref = hf_greedy(d, prompts, MAX_NEW)
    llm = LLM(model=str(d), num_gpu_blocks_override=64)
    first = llm.generate(prompts[:1], GREEDY)  # warm the cache
    rest = llm.generate(prompts[1:], GREEDY)
    assert _tokens(first + rest) == ref
    assert llm.engine.stats().prefix_hit_tokens == 48 * 3 + 32  # the bare prompt recomputes its last block
    assert all(o.num_cached_tokens >= 32 for o in rest)
    _assert_clean(llm)


def test_exact_n_greater_than_one(tiny):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=96)
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for out, r in zip(outs, ref):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == r for c in out.outputs)
    _assert_clean(llm)


def test_n_greater_than_one_copy_on_write_under_pressure(tiny):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=14, max_num_batched_tokens=32)
    copies = []
    orig = llm.engine.scheduler.schedule

    def spy():
        batch = orig()
        copies.extend(batch.copies)
        return batch
    llm.engine.scheduler.schedule = spy
    outs = llm.generate(prompts[:4], SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for out, r in zip(outs, ref[:4]):
        assert all(c.token_ids == r for c in out.outputs)
    assert copies, "forked sequences writing a shared partial block must copy it"
    _assert_clean(llm)


@pytest.fixture(scope="module")
def smol_case(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain what a KV cache is in one sentence."]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    return prompts, hf_greedy(smollm2_path, prompts, MAX_NEW)


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=256),
    dict(num_gpu_blocks_override=9, max_num_batched_tokens=20),  # chunked prefill + preemption
], ids=["batch", "chunked+preempt"])
def test_smollm2_exact(smollm2_path, smol_case, engine_kwargs, kernels):
    prompts, ref = smol_case
    llm = LLM(model=smollm2_path, **engine_kwargs)
    # Its GGUF file is Q4_1 (Q8_0 embedding): with the native kernels, decode reads every weight as codes.
    assert weights_read_as_codes(llm) == (0 if kernels == "torch" else 30 * 4 + 1)
    assert _run_staggered(llm, prompts, steps_between=1) == ref
    assert llm.engine.stats().prefix_hit_tokens > 0  # the chat template's system prompt is shared
    _assert_clean(llm)


def test_a_bfloat16_checkpoint_decodes_from_its_bfloat16_halves(tmp_path, smollm2_path, kernels):
    """A checkpoint saved in bfloat16, served in float32: decode reads each weight's bfloat16
    (16-bit codes, half the float32 traffic), token-exact against HF float32 on the same weights."""
    d = make_tiny_llama(tmp_path / "gqa-bf16", smollm2_path, "gqa-bf16")
    prompts = _prompts()
    ref = hf_greedy(d, prompts, MAX_NEW)
    llm = LLM(model=str(d), num_gpu_blocks_override=128, max_num_batched_tokens=7)
    model = llm.engine.executor.model
    held = [m.weight_codes for m in model.modules() if getattr(m, "weight_codes", None) is not None]
    assert len(held) == (0 if kernels == "torch" else 4 * model.arch.num_layers + 2)  # + the head, the untied table
    assert all(c.bits == 16 for c in held)
    native_steps = _count_native_steps(llm)
    assert _run_staggered(llm, prompts, steps_between=1) == ref
    assert (native_steps[0] > 0) == (kernels == "native")
    _assert_clean(llm)


def test_smollm2_exact_n2(smollm2_path, smol_case):
    prompts, ref = smol_case
    llm = LLM(model=smollm2_path, num_gpu_blocks_override=64)
    outs = llm.generate(prompts[:2], SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref[:2]]
    _assert_clean(llm)


@pytest.mark.parametrize("kind, biased", [("bias", ("qkv_proj", "o_proj", "down_proj")), ("qwen2", ("qkv_proj",))])
def test_every_bias_the_checkpoint_has_is_read(tmp_path, smollm2_path, kernels, kind, biased):
    """Llama's attention_bias gives q/k/v and o_proj biases, mlp_bias the MLP's; Qwen2 has only q/k/v's."""
    d = make_tiny_llama(tmp_path / kind, smollm2_path, kind)
    llm = LLM(model=str(d), num_gpu_blocks_override=64)
    assert _tokens(llm.generate(_prompts(), GREEDY)) == hf_greedy(d, _prompts(), MAX_NEW)
    layer = llm.engine.executor.model.layers[0]
    linears = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj, "down_proj": layer.mlp.down_proj}
    assert {name for name, m in linears.items() if m.bias is not None} == set(biased)
    _assert_clean(llm)


def test_sliding_window_checkpoint_is_served_within_its_window(tmp_path, smollm2_path, kernels):
    """A Mistral checkpoint with a 128-token attention window (its positions go to 1,024): kvserve
    attends to whole contexts, so it serves contexts up to the window, where both agree with HF."""
    d = make_tiny_llama(tmp_path / "swa", smollm2_path, "mistral-swa")
    prompts = _prompts(lens=(5, 40, 100))  # + 24 new tokens: at most 124 of the 128
    llm = LLM(model=str(d), num_gpu_blocks_override=64)
    assert llm.engine.max_model_len == 128
    assert _tokens(llm.generate(prompts, GREEDY)) == hf_greedy(d, prompts, MAX_NEW)
    long = _prompts(lens=(120,))[0]
    with pytest.raises(InvalidRequestError, match=r"exceeds max_model_len \(128\)"):  # the server's check
        llm.engine.validate(long, GREEDY)
    out = llm.generate([long], GREEDY)[0].outputs[0]  # offline: cut at the window, as vLLM's LLM
    assert (out.token_ids, out.finish_reason) == (hf_greedy(d, [long], 8)[0], "length")
    _assert_clean(llm)
    with pytest.raises(ValueError, match="max_model_len 256 is more than the model's 128 positions"):
        LLM(model=str(d), max_model_len=256)


@pytest.mark.parametrize("field, value, tensor", [
    ("num_key_value_heads", 1, "model.layers.0.self_attn.k_proj.weight"),  # would be cut to one head
    ("intermediate_size", 256, "model.layers.0.mlp.down_proj.weight"),  # would be zero-padded
    ("vocab_size", 600, "model.embed_tokens.weight"),  # would sample rows of zeros
])
def test_a_config_that_does_not_match_its_weights_is_refused_naming_the_tensor(tmp_path, smollm2_path, field,
                                                                               value, tensor):
    import json

    d = make_tiny_llama(tmp_path / "m", smollm2_path, "qwen3")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{tensor}' has shape \(\d+, \d+\), but the model's "
                                         r"config.json makes it \(\d+, \d+\)"):
        LLM(model=str(d))
