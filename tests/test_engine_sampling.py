"""Sampling through the whole engine: seeds, stops, logprobs, min/max tokens, n."""
from __future__ import annotations

import dataclasses
import random

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from tests.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    return LLM(model=str(make_tiny_llama(tmp_path_factory.mktemp("samp"), smollm2_path, "gqa")),
               num_gpu_blocks_override=128, max_model_len=256)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return LLM(model=smollm2_path, num_gpu_blocks_override=64)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_seeded_sample_is_independent_of_batch_mates(tiny):
    target = _prompts(1, seed=9)[0]
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = tiny.generate([target], p)[0].outputs[0].token_ids
    mates = _prompts(5, seed=10)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True),
                    SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
                    p, SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True),
                    SamplingParams(temperature=1.2, top_k=5, max_tokens=30, ignore_eos=True),
                    SamplingParams(temperature=0.5, min_p=0.1, max_tokens=8, ignore_eos=True), p]
    outs = tiny.generate(mates[:2] + [target] + mates[2:] + [target], mixed_params)
    assert outs[2].outputs[0].token_ids == alone
    assert outs[6].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True)
    assert tiny.generate([target], other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_differ_and_reproduce(tiny):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    prompt = _prompts(1, seed=4)[0]
    first = [c.token_ids for c in tiny.generate([prompt], p)[0].outputs]
    again = [c.token_ids for c in tiny.generate([prompt], p)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1


def test_stop_token_ids_and_max_tokens(tiny):
    prompt = _prompts(1, seed=2)[0]
    greedy = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                                 ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_max_tokens_none_runs_to_max_model_len(tiny):
    prompt = _prompts(1, seed=3)[0]
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 256 and out.finish_reason == "length"


def test_model_len_is_max_model_len_and_never_past_the_models_positions():
    from engine.config import EngineConfig

    assert EngineConfig(max_model_len=256).model_len(1024) == 256
    assert EngineConfig().model_len(1024) == 1024  # the runners' step profile uses this too
    with pytest.raises(ValueError, match="max_model_len 4096 is more than the model's 1024 positions"):
        EngineConfig(max_model_len=4096).model_len(1024)  # refused, as vLLM does, not clamped


def test_a_pool_sized_from_memory_must_hold_one_max_model_len_sequence(tiny):
    """As vLLM refuses to start: else every request left to run to max_model_len is refused."""
    model = tiny.engine.config.model
    small = LLM(model=model, kv_cache_memory=1 << 18, max_model_len=256)  # 256 KiB: 512 tokens
    capacity = small.engine.block_manager.num_blocks * 16
    assert capacity < 1023  # what the model's 1024 positions need
    with pytest.raises(ValueError, match=f"the KV cache holds {capacity} tokens .* fewer than one sequence of "
                                         f"max_model_len 1024 needs: .* lower --max-model-len to at most {capacity + 1}"):
        LLM(model=model, kv_cache_memory=1 << 18)
    LLM(model=model, kv_cache_memory=1 << 18, max_model_len=capacity + 1)  # the most it holds
    LLM(model=model, num_gpu_blocks_override=2)  # an override is taken as given


def test_logprobs(tiny):
    prompt = _prompts(1, seed=5)[0]
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                 ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 6
    for tok, entry in zip(out.token_ids, out.logprobs):  # vLLM's: {token id: Logprob}, the sampled token first
        assert len(entry) == 3 and next(iter(entry)) == tok
        assert entry[tok].rank == 1 and entry[tok].logprob == max(e.logprob for e in entry.values())  # greedy
        assert sorted(e.rank for e in entry.values()) == [1, 2, 3] and all(e.logprob <= 0 for e in entry.values())
        assert entry[tok].decoded_token == tiny.tokenizer.convert_tokens_to_string(
            [tiny.tokenizer.convert_ids_to_tokens(tok)])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_a_sampled_token_outside_the_top_logprobs_has_its_vocabulary_rank(tiny):
    """Sampled at temperature 2 with one top logprob asked: most tokens are not the top one, and
    each carries its rank as vLLM's does, the top one at rank 1; without text when detokenize=False."""
    prompt = _prompts(1, seed=6)[0]
    p = SamplingParams(temperature=2.0, seed=3, max_tokens=24, logprobs=1, ignore_eos=True, detokenize=False)
    out = tiny.generate([prompt], p)[0].outputs[0]
    ranks = [entry[tok].rank for tok, entry in zip(out.token_ids, out.logprobs)]
    assert any(r > 2 for r in ranks)
    for tok, entry in zip(out.token_ids, out.logprobs):
        (top,) = [e for t, e in entry.items() if t != tok] or [entry[tok]]
        assert top.rank == 1 and top.logprob >= entry[tok].logprob
        assert entry[tok].rank == 1 or entry[tok].logprob < top.logprob
        assert top.decoded_token is None and entry[tok].decoded_token is None


def test_logprobs_mode_reaches_the_sampler(tiny):
    """--logprobs-mode through the engine: raw logits are the model's values (positive ones
    among them, which no logprob is); processed logprobs of a greedy request carry its bias."""
    prompt = _prompts(1, seed=7)[0]
    greedy = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    ref = tiny.generate([prompt], greedy)[0].outputs[0]
    logits_llm = LLM(model=tiny.engine.config.model, num_gpu_blocks_override=32, max_model_len=256,
                     logprobs_mode="raw_logits")
    out = logits_llm.generate([prompt], greedy)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    # a log-softmax shifts every value of a row alike: the raw logits sit a constant above
    for raw, normalized in zip(out.logprobs, ref.logprobs):
        shift = {t: raw[t].logprob - normalized[t].logprob for t in normalized}
        assert max(shift.values()) - min(shift.values()) < 1e-3 and min(shift.values()) > 1e-3
    del logits_llm
    processed = LLM(model=tiny.engine.config.model, num_gpu_blocks_override=32, max_model_len=256,
                    logprobs_mode="processed_logprobs")
    banned = ref.token_ids[0]
    biased = dataclasses.replace(greedy, logit_bias={banned: -100.0})
    raw_first = tiny.generate([prompt], biased)[0].outputs[0].logprobs[0]
    first = processed.generate([prompt], biased)[0].outputs[0].logprobs[0]
    assert banned in raw_first and banned not in first  # raw: still a top token; processed: pushed out
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(model=tiny.engine.config.model, logprobs_mode="logits")


def _outputs_by_request(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                        abort_after: dict[str, int] | None = None) -> dict[str, list]:
    """Every RequestOutput each request got, stepping the engine by hand; a request in
    `abort_after` is aborted once the engine has taken that many steps."""
    eng, got = llm.engine, {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        eng.add_request(f"s{i}", prompt, p)
        got[f"s{i}"] = []
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].append(out)
        steps += 1
        for rid, n in (abort_after or {}).items():
            if n == steps and rid in eng.requests:
                got[rid].append(eng.abort(rid))
    return got


@pytest.fixture(scope="module")
def every4(tiny):
    """The `tiny` engine again, handing out outputs every 4 tokens."""
    return LLM(model=tiny.engine.config.model, num_gpu_blocks_override=128, max_model_len=256, stream_interval=4)


def test_stream_interval_sends_the_same_tokens_in_fewer_outputs(tiny, every4):
    prompts = _prompts(4, seed=21)
    params = [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    each = _outputs_by_request(tiny, prompts, params)
    grouped = _outputs_by_request(every4, prompts, params, abort_after={"s3": 11})
    for rid in ("s0", "s1", "s2"):
        last, last4 = each[rid][-1], grouped[rid][-1]
        assert [c.token_ids for c in last4.outputs] == [c.token_ids for c in last.outputs]
        assert [c.text for c in last4.outputs] == [c.text for c in last.outputs]
        assert [c.logprobs for c in last4.outputs] == [c.logprobs for c in last.outputs]
        for k, comp in enumerate(last4.outputs):  # the deltas add up to the whole, nothing twice
            assert sum((o.outputs[k].delta_token_ids for o in grouped[rid] if k < len(o.outputs)), []) == comp.token_ids
            assert "".join(o.outputs[k].delta_text for o in grouped[rid] if k < len(o.outputs)) == comp.text
        assert sum(o.finished for o in grouped[rid]) == 1 and last4.finished
    # The first token at once (TTFT is unchanged), then 4 steps' tokens per output, the rest last.
    sizes = {rid: [max(len(c.delta_token_ids) for c in o.outputs) for o in outs] for rid, outs in grouped.items()}
    assert sizes["s0"] == [1, 4, 4, 4] and sizes["s1"] == [1, 4, 4, 1] and sizes["s2"] == [1]
    # Aborted after 11 steps (11 tokens): the 2 held back come with the abort.
    assert sizes["s3"] == [1, 4, 4, 2] and grouped["s3"][-1].outputs[0].finish_reason == "abort"
    assert grouped["s3"][-1].outputs[0].token_ids == each["s3"][-1].outputs[0].token_ids[:11]
    assert every4.engine.block_manager.num_free_blocks == every4.engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(model=tiny.engine.config.model, stream_interval=0)


def test_final_only_requests_get_their_first_and_finished_outputs(tiny):
    """RequestOutputKind.FINAL_ONLY (LLM.generate's requests, HTTP replies not streamed): the
    first output (its time to first token) and the finished one, with the same tokens and text."""
    prompts = _prompts(3, seed=23)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=7, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    streamed = _outputs_by_request(tiny, prompts, params)
    final_only = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
    final = _outputs_by_request(tiny, prompts, final_only, abort_after={"s2": 5})
    for rid in ("s0", "s1"):
        (first, out), last = final[rid], streamed[rid][-1]
        assert [c.token_ids for c in first.outputs] == [c.token_ids for c in streamed[rid][0].outputs]
        assert out.finished and [c.token_ids for c in out.outputs] == [c.token_ids for c in last.outputs]
        assert [c.text for c in out.outputs] == [c.text for c in last.outputs]
        assert [c.logprobs for c in out.outputs] == [c.logprobs for c in last.outputs]
        for k, comp in enumerate(out.outputs):  # the two deltas add up to the whole
            assert first.outputs[k].delta_token_ids + comp.delta_token_ids == comp.token_ids
            assert first.outputs[k].delta_text + comp.delta_text == comp.text
    first, aborted = final["s2"]  # the abort's output is the second
    assert aborted.outputs[0].finish_reason == "abort" and len(aborted.outputs[0].token_ids) == 5
    assert tiny.generate(prompts, params[0])[0].outputs[0].token_ids == streamed["s0"][-1].outputs[0].token_ids
    assert tiny.engine.block_manager.num_free_blocks == tiny.engine.block_manager.num_blocks


def test_stream_interval_hands_out_a_finished_sample_at_once(tiny, every4):
    prompt = _prompts(1, seed=22)[0]
    p = dict(n=2, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    s0, s1 = [c.token_ids for c in tiny.generate([prompt], SamplingParams(**p))[0].outputs]
    # A token that first appears in sample 0 at index k and never in sample 1: stopping on it ends
    # sample 0 after k + 1 tokens while sample 1 runs on.
    k = next(i for i in range(1, 8) if s0.index(s0[i]) == i and s0[i] not in s1 and (i + 1) % 4)
    outs = _outputs_by_request(every4, [prompt], [SamplingParams(**p, stop_token_ids=[s0[k]])])["s0"]
    at = next(i for i, o in enumerate(outs) if o.outputs[0].finish_reason == "stop")
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs[:at + 1]) == k + 1
    assert sum(len(o.outputs[1].delta_token_ids) for o in outs[:at + 1]) == k + 1  # handed out at that step
    assert outs[-1].outputs[1].token_ids == s1 and outs[-1].finished


def _chat(llm: LLM, q: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)


def test_stop_string_cuts_text(smol):
    prompt = _chat(smol, "What is the capital of France?")
    full = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert "Paris" in full.text and full.finish_reason == "stop"  # ends on eos
    cut = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=["Paris"]))[0].outputs[0]
    assert cut.text == full.text[:full.text.index("Paris")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
    kept = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=["Paris"],
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index("Paris") + len("Paris")]


def test_the_token_that_ends_a_reply_is_not_in_its_text_unless_asked_for(smol):
    """vLLM's rule for a stop-terminated reply: EOS (shown with skip_special_tokens=False) and a
    stop_token_ids token stay in token_ids; their text only with include_stop_str_in_output, in
    the final text and in the streamed deltas alike."""
    prompt = _chat(smol, "What is the capital of France?")
    eos = smol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for stop, include, text in [
            ({}, False, "The capital of France is Paris."),
            ({}, True, "The capital of France is Paris.<|im_end|>"),
            ({"stop_token_ids": [smol.tokenizer.convert_tokens_to_ids(".")]}, False, "The capital of France is Paris"),
            ({"stop_token_ids": [smol.tokenizer.convert_tokens_to_ids(".")]}, True, "The capital of France is Paris.")]:
        p = SamplingParams(temperature=0, max_tokens=30, skip_special_tokens=False, include_stop_str_in_output=include,
                           **stop)
        out = smol.generate(prompt, p)[0].outputs[0]
        assert (out.text, out.finish_reason) == (text, "stop"), (stop, include)
        assert out.token_ids[-1] == stop.get("stop_token_ids", [eos])[0]
        assert out.stop_reason == (out.token_ids[-1] if stop else None)
        streamed = _outputs_by_request(smol, [prompt], [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA)])
        assert "".join(o.outputs[0].delta_text for o in streamed["s0"]) == text


def test_detokenize_false_gives_the_same_tokens_without_text(smol):
    prompt = _chat(smol, "What is the capital of France?")
    full = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=1))[0].outputs[0]
    p = SamplingParams(temperature=0, max_tokens=12, logprobs=1, detokenize=False)
    ids_only = smol.generate(prompt, p)[0].outputs[0]
    assert full.text and ids_only.text == "" and ids_only.token_ids == full.token_ids
    assert ids_only.cumulative_logprob == full.cumulative_logprob
    streamed = _outputs_by_request(smol, [prompt], [dataclasses.replace(p, output_kind=RequestOutputKind.DELTA)])
    assert {o.outputs[0].delta_text for o in streamed["s0"]} == {""}


def test_min_tokens_holds_back_eos(smol):
    prompt = _chat(smol, "What is the capital of France?")
    short = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    n = len(short.token_ids)
    longer = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5))[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert longer.token_ids[:n - 1] == short.token_ids[:n - 1]


def test_streamed_deltas_join_to_text(smol):
    prompt = _chat(smol, "Write one sentence about the sea.")
    params = SamplingParams(temperature=0, max_tokens=24)
    text = smol.generate(prompt, params)[0].outputs[0].text
    assert "".join(smol.stream(prompt, params)) == text
    assert smol.engine.block_manager.num_free_blocks == smol.engine.block_manager.num_blocks


def test_allowed_token_ids_and_bad_words_hold_through_the_engine(smol):
    """vLLM's two bans, on the real model, greedy and sampled: every token allowed, and the banned
    word never completed where the unbanned run writes it."""
    from engine.errors import InvalidRequestError
    from engine.token_bans import bad_words_token_ids

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    free = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert "Paris" in free.text
    banned = bad_words_token_ids(smol.engine.tokenizer, ["Paris"])
    for p in (SamplingParams(temperature=0, max_tokens=12, bad_words=["Paris"]),
              SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=12, bad_words=["Paris"])):
        for out in smol.generate([prompt], p)[0].outputs:
            ids = out.token_ids
            assert not any(ids[i:i + len(w)] == w for w in banned for i in range(len(ids))), out.text
    allowed = sorted(set(free.token_ids))[:3] + [2]  # three of its tokens and eos
    for p in (SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=8, allowed_token_ids=allowed)):
        for out in smol.generate([prompt], p)[0].outputs:
            assert set(out.token_ids) <= set(allowed), out.token_ids
    with pytest.raises(InvalidRequestError) as e:
        smol.generate([prompt], SamplingParams(allowed_token_ids=[10 ** 6]))
    assert e.value.param == "allowed_token_ids"
