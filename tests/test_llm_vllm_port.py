"""vLLM offline scripts run unchanged on `LLM`: the keywords they pass (at vLLM's defaults, as
None, as torch dtypes), the model's generation config as the default params, a max_tokens past
max_model_len, and the output fields and method keywords their code reads."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from tests.tiny_llama import make_tiny_llama

PROMPT = [1, 17, 99, 250, 3, 42]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    return make_tiny_llama(tmp_path_factory.mktemp("port"), smollm2_path, "gqa", vocab_size=49152)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), max_model_len=32, num_gpu_blocks_override=32)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_keywords_given_as_none_take_their_defaults(tiny_dir, llm):
    """A script passes its optional arguments on as they are; None is vLLM's "the default"
    (enable_prefix_caching=None turned prefix caching off, seed=None failed the first sampled request)."""
    port = LLM(model=str(tiny_dir), max_model_len=32, num_gpu_blocks_override=32, enable_prefix_caching=None,
               enable_chunked_prefill=None, enforce_eager=None, max_num_seqs=None, max_num_batched_tokens=None,
               block_size=None, seed=None, quantization=None, speculative_config=None, hf_overrides=None)
    assert port.engine.config == llm.engine.config
    sampled = SamplingParams(temperature=1.0, max_tokens=4)
    assert _tokens(port.generate([PROMPT], sampled)) == _tokens(llm.generate([PROMPT], sampled))  # seed 0 both
    shared = list(range(3, 23))  # a whole block of 16 and more
    port.generate([shared], GREEDY)
    assert port.generate([shared], GREEDY)[0].num_cached_tokens == 16


def test_vllm_keywords_at_their_defaults_are_taken_and_others_refused_saying_why(tiny_dir, llm):
    port = LLM(str(tiny_dir), max_model_len=32, num_gpu_blocks_override=32, dtype=torch.float32,
               distributed_executor_backend="mp", task="generate", runner="auto", cpu_offload_gb=0,
               enable_lora=False, skip_tokenizer_init=False, enable_sleep_mode=False, hf_overrides={},
               hf_token="hf_x", compilation_config={"level": 3}, async_scheduling=True, quantization=None,
               model_impl="auto", worker_cls="auto", config_format="hf", enable_expert_parallel=False,
               use_tqdm_on_load=False, served_model_name=["mine", "alias"], disable_log_stats=False)
    assert port.engine.config == EngineConfig(**{**vars(llm.engine.config), "dtype": "float32"})
    before = time.time()
    out, = port.generate([PROMPT], GREEDY)
    assert {m.labels["model_name"] for m in port.get_metrics()} == {"mine"}  # vLLM's label for it
    m = out.metrics  # vLLM's RequestStateStats, with metrics on
    assert (m.num_generation_tokens, m.num_preemptions, m.is_corrupted) == (6, 0, False)
    assert before - 1 < m.arrival_time <= time.time()
    assert 0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts <= time.monotonic()
    assert m.first_token_latency == pytest.approx(m.first_token_ts - m.queued_ts)
    assert _tokens(port.generate([PROMPT], GREEDY)) == _tokens(llm.generate([PROMPT], GREEDY))
    for kwargs, says in [(dict(quantization="awq"), "quantization='awq', but the checkpoint is not quantized"),
                         (dict(quantization="fp8"), "quantization must be one of gptq, awq"),
                         (dict(task="embed"), "task='embed' is not supported: vLLM's older name: give runner='pooling'"),
                         (dict(model_impl="transformers"), "model_impl='transformers' is not supported: kvserve runs its own")]:
        with pytest.raises(ValueError, match=says):
            LLM(str(tiny_dir), **kwargs)
    numpy = EngineConfig(max_num_seqs=np.int64(8), enable_prefix_caching=np.bool_(False), max_model_len=np.int32(64))
    assert (numpy.max_num_seqs, numpy.enable_prefix_caching, numpy.max_model_len) == (8, False, 64)
    assert type(numpy.max_num_seqs) is int and type(numpy.enable_prefix_caching) is bool
    for kwargs, says in [(dict(max_num_seqs="8"), "max_num_seqs must be an integer, got '8'"),
                         (dict(max_model_len=32.0), "max_model_len must be an integer, got 32.0"),
                         (dict(num_gpu_blocks_override=True), "num_gpu_blocks_override must be an integer"),
                         (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
                         (dict(distributed_executor_backend="mp", tensor_parallel_size=2),
                          "vLLM's 'mp' and 'uni' only with tensor_parallel_size 1"),
                         (dict(dtype=torch.int8), "dtype must be auto|float32|bfloat16|float16")]:
        with pytest.raises(ValueError, match=says):
            EngineConfig(**kwargs)


def test_a_call_without_params_runs_with_the_model_s_generation_config(tiny_dir, tmp_path, monkeypatch):
    """vLLM's LLM reads the generation config's sampling fields (generation_config="auto") as the
    params of a call given none (get_default_sampling_params, which vLLM's basic example calls)."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_dir.iterdir():
        (model / f.name).symlink_to(f)
    config = json.loads((tiny_dir / "generation_config.json").read_text())
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "max_new_tokens": 5}))
    llm = LLM(str(model), max_model_len=32, num_gpu_blocks_override=32)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=5)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    for _ in range(2):  # top_k 1: greedy every time, not temperature 1's draws
        assert llm.generate(PROMPT)[0].outputs[0].token_ids == greedy.token_ids
    assert "".join(llm.stream(PROMPT)) == greedy.text
    assert llm.chat([{"role": "user", "content": "hi"}])[0].outputs[0].finish_reason is not None
    bare = LLM(str(model), max_model_len=32, num_gpu_blocks_override=32, generation_config="vllm")
    assert bare.get_default_sampling_params() == SamplingParams()
    assert LLM(str(model), max_model_len=32, num_gpu_blocks_override=32, generation_config=None).sampling_defaults \
        == llm.sampling_defaults
    shorter = LLM(str(model), max_model_len=32, num_gpu_blocks_override=32,
                  override_generation_config={"max_new_tokens": 2})
    assert shorter.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=2)
    monkeypatch.setattr("engine.llm.LLMEngine", None)  # a bad generation config is refused before any load
    with pytest.raises(ValueError, match="generation config: top_p must be in"):
        LLM(str(model), num_gpu_blocks_override=32, override_generation_config={"top_p": 0})


def test_a_max_tokens_past_max_model_len_ends_that_prompt_length_and_the_batch_runs(llm):
    """vLLM's offline LLM refuses only a prompt that leaves no room; the server keeps its 400."""
    long = list(range(3, 33))  # 30 tokens: room for 2 of max_model_len 32
    short, cut = llm.generate([PROMPT, long], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(short.outputs[0].token_ids) == 20
    assert (len(cut.outputs[0].token_ids), cut.outputs[0].finish_reason) == (2, "length")
    assert cut.outputs[0].token_ids == llm.generate([long], SamplingParams(temperature=0, max_tokens=2))[0] \
        .outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        llm.generate([PROMPT, list(range(3, 35))], GREEDY)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len"):
        llm.engine.validate(long, SamplingParams(max_tokens=20))  # what the server asks
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_the_output_fields_and_method_keywords_vllm_code_reads(llm):
    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.done = total, 0
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            pass

    out, = llm.generate([PROMPT], GREEDY, use_tqdm=Bar, lora_request=None)
    assert out.outputs[0].finished() and out.finished
    assert out.metrics is None and out.lora_request is None and llm.llm_engine is llm.engine  # metrics off: vLLM's
    assert [(b.total, b.done) for b in bars] == [(1, 1)]
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate([PROMPT], GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="tokenization_kwargs takes truncation, max_length, add_special_tokens; "
                                         "not padding"):
        llm.generate(["hi"], GREEDY, tokenization_kwargs={"padding": True})
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, mm_processor_kwargs={"x": 1})


def test_what_vllm_scripts_pass_in_other_shapes(llm):
    """A tuple of params, one priority for all, vLLM 0.32's tokenization_kwargs (its prompt
    truncation), and SamplingParams.from_optional's None max_tokens and string logit_bias keys."""
    from engine import RequestOutputKind

    tok = llm.get_tokenizer()
    text = "one two three four five six seven"
    assert _tokens(llm.generate([PROMPT, PROMPT], (GREEDY, GREEDY))) == _tokens(llm.generate([PROMPT] * 2, GREEDY))
    assert _tokens(llm.generate([PROMPT], GREEDY, priority=0)) == _tokens(llm.generate([PROMPT], GREEDY))
    cut, = llm.generate([text], GREEDY, tokenization_kwargs={"truncation": True, "max_length": 3})
    assert cut.prompt_token_ids == tok(text)["input_ids"][:3] and cut.prompt == text
    assert _tokens([cut]) == _tokens(llm.generate([tok(text)["input_ids"][:3]], GREEDY))
    bare, = llm.generate([{"prompt": text}], GREEDY, tokenization_kwargs={"add_special_tokens": False})
    assert bare.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": text}]
    short, = llm.chat(chat, GREEDY, priority=0, tokenization_kwargs={"truncation": True, "max_length": 5})
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert short.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)[:5] and short.prompt == rendered
    assert SamplingParams.from_optional(max_tokens=None, seed=None).max_tokens is None  # no cap but the room
    assert SamplingParams.from_optional(temperature=None).max_tokens == 16
    assert SamplingParams.from_optional(logit_bias={"28": 500.0, 3: -7.0}).logit_bias == {28: 100.0, 3: -7.0}
    assert SamplingParams(logit_bias={"28": 5.0}).logit_bias == {28: 5.0}
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={"x": 5.0})
    assert RequestOutputKind.CUMULATIVE == 0


def test_vllms_prompt_types_and_version_are_importable(llm):
    import engine
    from engine import TextPrompt, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT), TextPrompt(prompt="hello", cache_salt="a")], GREEDY)
    assert outs[0].outputs[0].token_ids == _tokens(llm.generate([PROMPT], GREEDY))[0] and outs[1].prompt == "hello"
    assert engine.__version__ and engine.__version__ == __import__("engine.version").version.kvserve_version()


def test_the_engine_takes_vllms_llm_engine_calls(llm):
    """vLLM's llm_engine_example: add_request with a prompt dict, has_unfinished_requests,
    get_num_unfinished_requests, abort_request; a CUMULATIVE request streams as DELTA does."""
    from engine import RequestOutputKind

    eng = llm.llm_engine
    eng.add_request("ids", {"prompt_token_ids": PROMPT}, GREEDY)
    eng.add_request("text", {"prompt": "hello there", "cache_salt": "s"}, GREEDY)
    eng.add_request("gone", PROMPT, GREEDY)
    eng.add_request("all", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                  output_kind=RequestOutputKind.CUMULATIVE))
    assert eng.get_num_unfinished_requests() == 4 and eng.get_tokenizer() is llm.get_tokenizer()
    eng.abort_request(["gone"])
    finished, seen = {}, []
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append((out.request_id, out.finished, len(out.outputs[0].token_ids)))
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"ids", "text", "all"} and eng.get_num_unfinished_requests() == 0
    assert finished["ids"].outputs[0].token_ids == _tokens(llm.generate([PROMPT], GREEDY))[0]
    assert finished["text"].prompt == "hello there" and finished["text"].prompt_token_ids == llm.get_tokenizer()("hello there")["input_ids"]
    assert [n for rid, done, n in seen if rid == "all"] == [1, 2, 3]  # an output a step, each with all so far


def test_reset_prefix_cache_as_vllms_between_calls(llm):
    """RL loops call it after loading new weights: the next call computes every prompt token."""
    prompt = PROMPT * 4  # 24 tokens: a cached block or more
    llm.generate([prompt], GREEDY, use_tqdm=False)
    hits = llm.engine.stats().prefix_hit_tokens
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens > hits
    assert llm.reset_prefix_cache() is True
    hits = llm.engine.stats().prefix_hit_tokens
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens == hits
    llm.engine.add_request("held", prompt, GREEDY)  # a request holding blocks: refused, as vLLM's
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort("held")
