"""Prompt logprobs and logit_bias in the engine.

Prompt logprobs come from the forward pass that fills the KV cache, chunk by chunk: they must equal
HF's log_softmax over the whole prompt (fp32, 1e-4) at every chunking, after a preemption that
recomputes part of the prompt, with n > 1, and at tp=2 (on the sampling rank); a request asking for
them does not take its prompt from the prefix cache. Greedy tokens stay exact with HF meanwhile.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.tiny_llama import hf_greedy, make_tiny_llama

MAX_NEW = 8
PROMPT_LENS = (2, 5, 16, 17, 40, 100)  # cross block boundaries (block_size 16)
TOL = 1e-4


def _prompts(seed: int = 0, lens=PROMPT_LENS, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def hf_prompt_logprobs(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: (len - 1, V) log_softmax of HF's logits, row p scoring token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


def assert_prompt_logprobs(got, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's offline shape: None, then per prompt token {token id: Logprob}, that token first and
    the k most likely ranked 1..k."""
    assert len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        row, token = ref[p], prompt[p + 1]
        assert next(iter(entry)) == token
        pl = entry[token]
        assert abs(pl.logprob - row[token].item()) < TOL
        lp = row[token]
        assert int((row > lp + TOL).sum()) + 1 <= pl.rank <= int((row >= lp - TOL).sum())  # near-ties may swap
        top = sorted(entry.values(), key=lambda e: e.rank)[:k]
        assert [e.rank for e in top] == list(range(1, k + 1)) and len(entry) in (k, k + 1)
        assert [e.logprob for e in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        assert all(isinstance(e.decoded_token, str) for e in entry.values())


@pytest.fixture(scope="module", params=["gqa", "tied"])
def tiny(request, tmp_path_factory, smollm2_path):
    d = make_tiny_llama(tmp_path_factory.mktemp(request.param), smollm2_path, request.param)
    prompts = _prompts()
    return d, prompts, hf_prompt_logprobs(d, prompts), hf_greedy(d, prompts, MAX_NEW)


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    eng.scheduler.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=128),
    dict(num_gpu_blocks_override=128, max_num_batched_tokens=7),  # chunked prefill, tiny budget
    dict(num_gpu_blocks_override=128, max_num_batched_tokens=16, max_num_seqs=2),  # chunks meet decodes
    dict(num_gpu_blocks_override=12, max_num_batched_tokens=24),  # chunked prefill + preemption
], ids=["batch", "chunked", "chunked+decodes", "preempt"])
def test_prompt_logprobs_equal_hf_and_greedy_stays_exact(tiny, engine_kwargs):
    d, prompts, ref, greedy = tiny
    llm = LLM(model=str(d), **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    for prompt, out, r in zip(prompts, outs, ref):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, r, 3)
    assert [o.outputs[0].token_ids for o in outs] == greedy
    if engine_kwargs["num_gpu_blocks_override"] == 12:
        assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_n2(tiny):
    d, prompts, ref, greedy = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=128)
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate(prompts, plain)  # every prompt's full blocks are cached now
    again = llm.generate(prompts[-1:], plain)[0]
    assert again.num_cached_tokens > 0  # a plain request takes the cached prefix
    scored = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                                  prompt_logprobs=0))
    for prompt, out, r, g in zip(prompts, scored, ref, greedy):
        assert out.num_cached_tokens == 0  # recomputed: a cached token's logits are gone
        assert_prompt_logprobs(out.prompt_logprobs, prompt, r, 0)
        assert [c.token_ids for c in out.outputs] == [g, g]
    _assert_clean(llm)


def test_max_tokens_one_scores_the_prompt_and_one_token(tiny):
    """What lm-evaluation-harness asks: the prompt's logprobs and one more token."""
    d, prompts, ref, greedy = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=128, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1))
    for prompt, out, r, g in zip(prompts, outs, ref, greedy):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, r, 1)
        assert out.outputs[0].token_ids == g[:1] and out.outputs[0].finish_reason in ("length", "stop")


def test_prompt_rows_turn_into_logits_a_bounded_chunk_at_a_time(tiny, monkeypatch):
    """A step's prompt rows become logits a few rows at a time (here 3, where the real bound is
    256 MiB of float32), and the logprobs are the same as HF's."""
    from engine import prompt_logprobs as module

    d, prompts, ref, greedy = tiny
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(module, "PROMPT_LOGITS_BYTES", 3 * 4 * vocab + 5)
    chunks, logits = [], module.PromptRows.logits

    def counted(self):
        for chunk in logits(self):
            chunks.append(chunk.shape[0])
            yield chunk

    monkeypatch.setattr(module.PromptRows, "logits", counted)
    llm = LLM(model=str(d), num_gpu_blocks_override=128, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    for prompt, out, r, g in zip(prompts, outs, ref, greedy):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, r, 2)
        assert out.outputs[0].token_ids == g[:2]
    assert max(chunks) == 3 and sum(chunks) == sum(len(p) - 1 for p in prompts)
    _assert_clean(llm)


def test_logit_bias_steers_greedy_and_leaves_logprobs_raw(tiny):
    d, prompts, _, greedy = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=128)
    prompt, first = prompts[3], greedy[3][0]
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0,
                                                   logit_bias={7: 100.0}))[0].outputs[0]
    assert forced.token_ids == [7, 7, 7, 7]
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                   logit_bias={first: -100.0}))[0].outputs[0]
    assert banned.token_ids[0] != first
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0))
    biased = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0,
                                                   logit_bias={first: 1.0}))
    assert biased[0].outputs[0].logprobs == plain[0].outputs[0].logprobs  # logprobs of the raw logits


def test_logit_bias_and_prompt_logprobs_are_validated(tiny):
    d = tiny[0]
    llm = LLM(model=str(d), num_gpu_blocks_override=128)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([[5, 6]], SamplingParams(logit_bias={512: 1.0}))
    assert e.value.param == "logit_bias"
    for bad in [dict(logit_bias={1: float("inf")}), dict(logit_bias={1: float("nan")}), dict(logit_bias={1: 1e31}),
                dict(logit_bias={-1: 1.0}), dict(logit_bias=dict.fromkeys(range(301), 1.0)),
                dict(prompt_logprobs=-2), dict(logprobs=-2)]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))
    # vLLM's offline params: a bias past OpenAI's [-100, 100] applies as given, and True is 1
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias={7: -1e9})
    free = SamplingParams(temperature=0, max_tokens=1, logit_bias={7: 1e9}, logprobs=True, prompt_logprobs=True)
    assert (free.logprobs, free.prompt_logprobs) == (1, 1)
    picked, avoided = (o.outputs[0].token_ids for o in (llm.generate([[5, 6]], free)[0], llm.generate([[5, 6]], banned)[0]))
    assert picked == [7] and avoided != [7]


def test_max_logprobs_bounds_offline_requests_and_minus_one_asks_the_whole_vocabulary(tiny):
    d, prompts = tiny[0], tiny[1]
    capped = LLM(model=str(d), num_gpu_blocks_override=128)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match="greater than max allowed: 20") as e:
            capped.generate([prompts[0]], SamplingParams(max_tokens=1, **{field: 21}))
        assert e.value.param == field
    assert capped.engine.requests == {}  # refused before it was queued
    uncapped = LLM(model=str(d), num_gpu_blocks_override=128, max_logprobs=-1)
    vocab = uncapped.engine.executor.info.vocab_size
    (out,) = uncapped.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1))
    assert [len(e) for e in out.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(e) == vocab for e in out.prompt_logprobs[1:])
    best = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]]
    assert best.rank == 1 and best.logprob == max(lp.logprob for lp in out.outputs[0].logprobs[0].values())


def test_smollm2_prompt_logprobs_equal_hf(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["The capital of France is Paris, and the capital of Germany is Berlin.",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    ref = hf_prompt_logprobs(smollm2_path, prompts)
    for kwargs in [dict(), dict(max_num_batched_tokens=16)]:
        llm = LLM(model=smollm2_path, num_gpu_blocks_override=64, **kwargs)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
        for prompt, out, r in zip(prompts, outs, ref):
            assert_prompt_logprobs(out.prompt_logprobs, prompt, r, 2)


# -- tp=2: the sampling rank computes them, only the numbers come back ------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def test_tp2_prompt_logprobs_and_logit_bias_match_tp1_and_hf(ray_cluster, tmp_path, smollm2_path):
    d = make_tiny_llama(tmp_path / "gqa", smollm2_path, "gqa")
    prompts = _prompts(seed=1)
    ref, greedy = hf_prompt_logprobs(d, prompts), hf_greedy(d, prompts, MAX_NEW)
    engine = dict(num_gpu_blocks_override=12, max_num_batched_tokens=24)  # chunked prefill + preemption
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=2)] * len(prompts)
    params[1] = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logit_bias={7: 100.0})
    params[2] = SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    tp1 = LLM(model=str(d), **engine).generate(prompts, params)
    llm = LLM(model=str(d), tensor_parallel_size=2, **engine)
    try:
        tp2 = llm.generate(prompts, params)
        assert llm.engine.stats().num_preemptions > 0
        _assert_clean(llm)
    finally:
        llm.engine.executor.shutdown()
    for i, (prompt, a, b) in enumerate(zip(prompts, tp2, tp1)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        if i == 1:
            assert a.prompt_logprobs is None and a.outputs[0].token_ids == [7] * MAX_NEW
            continue
        assert [c.token_ids for c in a.outputs] == [greedy[i]] * params[i].n
        assert_prompt_logprobs(a.prompt_logprobs, prompt, ref[i], params[i].prompt_logprobs)
        for token, x, y in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x[token].logprob - y[token].logprob) < TOL


def test_apply_logit_bias_adds_to_each_rows_own_tokens():
    from engine.sampler import SamplingRow, apply_logit_bias

    def row(**kwargs) -> SamplingRow:
        return SamplingRow(params=SamplingParams(**kwargs), prompt_token_ids=[], output_token_ids=[],
                           generator=None, eos_token_ids=[])

    logits = torch.randn(3, 10)
    rows = [row(logit_bias={1: 5.0, 9: -100.0}), row(), row(logit_bias={0: 0.5})]
    want = logits.clone()
    want[0, 1] += 5.0
    want[0, 9] -= 100.0
    want[2, 0] += 0.5
    got = apply_logit_bias(logits, rows)
    assert torch.equal(got, want) and not torch.equal(logits, want)  # a copy
    assert apply_logit_bias(logits, rows[1:2]) is logits
