"""Speculative decoding by n-gram prompt lookup (engine.speculative, vLLM's speculative_config):
greedy output token-exact against HF generate on prompts that repeat themselves (so that drafts
are proposed, some kept and some not), under chunked prefill, preemption and the prefix cache,
with both CPU kernel paths; stop rules, logprobs and seeded sampling as without drafts; the
requests that must not speculate do not; the config's checks; the metrics. The Triton runner's
rows for drafts: tests/test_triton_runner.py; tensor parallel: tests/test_workers.py."""
from __future__ import annotations

import random
import re

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.speculative import SpeculativeConfig, propose_ngram
from tests.test_engine_exact import _assert_clean
from tests.tiny_llama import hf_greedy, make_tiny_llama

MAX_NEW = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def repeating_prompts(seed: int = 0, lens=(5, 16, 17, 40, 33), vocab: int = 512) -> list[list[int]]:
    """Random segments followed by their first half again: the model's continuation and the
    prompt share n-grams."""
    rng = random.Random(seed)
    out = []
    for n in lens:
        seg = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(seg + seg[:n // 2])
    return out


PROMPTS = repeating_prompts()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    d = make_tiny_llama(tmp_path_factory.mktemp("spec"), smollm2_path, "gqa")
    return d, hf_greedy(d, PROMPTS, MAX_NEW)


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _drafted(llm: LLM) -> tuple[int, int]:
    st = llm.engine.scheduler.stats
    return st.spec_draft_tokens, st.spec_accepted_tokens


# -- the proposer -----------------------------------------------------------------------------

def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, spelled out: the longest suffix (max_n down to min_n) found earlier, at its
    earliest place with a token after it; the k tokens that followed it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_propose_ngram_follows_the_rule():
    assert propose_ngram([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's documented example
    assert propose_ngram([1, 2, 3], 1, 3, 4) == []  # nothing repeats
    assert propose_ngram([5, 5], 1, 1, 3) == [5]
    assert propose_ngram([7, 1, 2, 9, 1, 2], 3, 3, 2) == []  # only a 2-gram repeats
    rng = random.Random(1)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randint(1, 4)
        max_n, k = rng.randint(min_n, 5), rng.randint(1, 6)
        assert propose_ngram(tokens, min_n, max_n, k) == _brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_the_token_array_grows_with_the_sequence():
    """The drafter's array of a sequence's tokens (kept between steps, extended by what was
    appended) is always its token ids, and a fork starts its own."""
    from engine.sequence import Sequence
    from engine.speculative import token_array

    rng = random.Random(2)
    seq = Sequence("r", [rng.randrange(100) for _ in range(5)], SamplingParams(max_tokens=500), 500)
    for _ in range(300):
        for _ in range(rng.randrange(0, 4)):
            seq.token_ids.append(rng.randrange(100))
        assert token_array(seq).tolist() == seq.token_ids
        assert propose_ngram(token_array(seq), 1, 3, 4) == propose_ngram(seq.token_ids, 1, 3, 4)
    child = seq.fork(1)
    child.token_ids.append(7)
    seq.token_ids.append(8)
    assert token_array(child).tolist() == child.token_ids and token_array(seq).tolist() == seq.token_ids


# -- the config -------------------------------------------------------------------------------

def test_config_forms_defaults_and_refusals():
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    spec = EngineConfig(speculative_config='{"model": "[ngram]", "num_speculative_tokens": 2, '
                                           '"prompt_lookup_max": 4}').speculative_config
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 4)
    assert EngineConfig(speculative_config={}).speculative_config is None
    refused = {
        "method 'eagle' is not supported": {"method": "eagle", "model": "x", "num_speculative_tokens": 3},
        "model 'org/draft' is not supported": {"model": "org/draft", "num_speculative_tokens": 3},
        "num_speculative_tokens is required": {"method": "ngram"},
        "'foo' not supported here": {"method": "ngram", "num_speculative_tokens": 2, "foo": 1},
        "not JSON": "{method: ngram}",
        "prompt_lookup_max (2) must be >= prompt_lookup_min (4)":
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "num_speculative_tokens must be an integer": {"method": "ngram", "num_speculative_tokens": "3"},
    }
    for why, value in refused.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            EngineConfig(speculative_config=value)
    assert SpeculativeConfig.parse(spec) is spec


# -- the engine -------------------------------------------------------------------------------

@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "1" if request.param == "native" else "0")
    return request.param


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_gpu_blocks_override=64),
    dict(num_gpu_blocks_override=64, max_num_batched_tokens=24, block_size=4),  # chunks beside drafts, small blocks
    dict(num_gpu_blocks_override=24, max_num_batched_tokens=32, block_size=4),  # preemption
], ids=["batched", "chunked-bs4", "preempted"])
def test_greedy_is_token_exact_against_hf(tiny, kernels, engine_kwargs):
    d, expected = tiny
    llm = LLM(model=str(d), speculative_config=NGRAM, **engine_kwargs)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    drafted, kept = _drafted(llm)
    assert 0 < kept < drafted  # drafts ran, some kept and some not
    if engine_kwargs["num_gpu_blocks_override"] == 24:
        assert llm.engine.stats().num_preemptions > 0
    _assert_clean(llm)
    again = _tokens(llm.generate(PROMPTS[:3], GREEDY))  # prefix-cache hits, then drafts over cached blocks
    assert again == expected[:3] and llm.engine.stats().prefix_hit_tokens > 0
    _assert_clean(llm)


def test_staggered_arrivals_and_one_by_one(tiny):
    """Requests joining mid-flight (prefill chunks beside decodes with drafts), then each alone."""
    d, expected = tiny
    llm = LLM(model=str(d), speculative_config=NGRAM, num_gpu_blocks_override=64, max_num_batched_tokens=20)
    eng, done = llm.engine, {}
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
        done.update({o.request_id: o for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [list(done[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))] == expected
    assert [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS] == expected
    _assert_clean(llm)


def _pair(d, **kw) -> tuple[LLM, LLM]:
    return (LLM(model=str(d), num_gpu_blocks_override=64, **kw),
            LLM(model=str(d), num_gpu_blocks_override=64, speculative_config=NGRAM, **kw))


def test_stop_rules_and_logprobs_as_without_drafts(tiny):
    """A stop token or string, or max_tokens, met inside a step's kept drafts ends the output
    there, as one token a step would; each kept token has its own logprobs."""
    d, expected = tiny
    plain, spec = _pair(d)
    stop_token = expected[1][7]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 11)]
    cases += [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=["e"], detokenize=True)]
    for params in cases:
        a, b = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
        for x, y in zip(a, b):
            ox, oy = x.outputs[0], y.outputs[0]
            assert (ox.token_ids, ox.text, ox.finish_reason, ox.stop_reason) == \
                (oy.token_ids, oy.text, oy.finish_reason, oy.stop_reason), params
            if params.logprobs:
                assert [sorted(e) for e in ox.logprobs] == [sorted(e) for e in oy.logprobs]
                assert all(abs(e1[t].logprob - e2[t].logprob) < 1e-4 for e1, e2 in zip(ox.logprobs, oy.logprobs) for t in e1)
    assert _drafted(spec)[1] > 0
    _assert_clean(spec)


def _samples(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def test_sampling_with_drafts(tiny):
    """top_k=1 samples what greedy picks, through the random path; a seeded request draws the
    tokens it draws without drafts (its generator is left as if only the kept rows had drawn), at
    any batch, n > 1 samples included."""
    d, expected = tiny
    plain, spec = _pair(d)
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX_NEW, ignore_eos=True, seed=3)
    assert _tokens(spec.generate(PROMPTS, top1)) == expected
    seeded = [SamplingParams(temperature=t, max_tokens=MAX_NEW, ignore_eos=True, seed=11 + i, n=1 + i % 2, top_p=p)
              for i, (t, p) in enumerate([(0.7, 1.0), (0.3, 1.0), (0.5, 0.9), (1.0, 1.0), (0.2, 0.8)])]
    want = _samples(plain.generate(PROMPTS, seeded))
    assert _samples(spec.generate(PROMPTS, seeded)) == want
    assert _samples(spec.generate(PROMPTS[1:2], seeded[1:2])) == want[1:2]  # alone: the same
    assert _drafted(spec)[1] > 0
    _assert_clean(spec)


def test_a_prompt_that_forks_after_its_last_token_gets_no_drafts_then(tiny):
    """n > 1: a prompt whose last chunk is its last token forks after that step; its drafts would
    be copied into the children's state, so it has none then (its samples draft later)."""
    from engine.sequence import Sequence

    d, _ = tiny
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    plain, spec = _pair(d, **kw)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 10]  # 8 tokens in the first step, then the last alone
    for params in (SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True),
                   SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True)):
        assert spec.engine.scheduler.propose(Sequence("x", prompt, params, 12), 8) == [11, 12, 13, 14]  # on offer
        assert _samples(spec.generate([prompt], params)) == _samples(plain.generate([prompt], params))
        _assert_clean(spec)


def test_drafts_never_preempt():
    """Drafts take what the budget and the free blocks leave after every running sequence has
    its token: a sequence that would fit without them is never preempted for another's drafts."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler, SchedulerConfig
    from engine.sequence import Sequence

    bm = BlockManager(5, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(8, 64), bm, propose=lambda seq, budget: [5, 6, 7][:budget])
    a = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), 20)
    b = Sequence("b", [7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=20), 20)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.update_from_output(batch, batch.sampled(4), lambda rows, seqs: [9] * len(seqs),
                             lambda seq, t: seq.token_ids.append(t) or False)
    # 1 block free: b's next token needs it, and a's drafts would too (a's token fits its last
    # block, its drafts not): a gets none, b's drafts fit the block its token took
    batch = sched.schedule()
    assert not batch.preempted and [len(s.spec_token_ids) for s in batch.seqs] == [0, 3]
    assert batch.num_new_tokens == [1, 4] and bm.num_free_blocks == 0
    sched.check_integrity()


def test_penalties_min_tokens_and_bad_words_read_the_drafts_before(tiny):
    """A draft's row reads the drafts before it as output, so what reads the output gives what it
    gives one token a step."""
    d, expected = tiny
    plain, spec = _pair(d)
    bad = [expected[0][3:5], expected[3][6:8]]  # two tokens each, which greedy writes
    for params in (SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, presence_penalty=0.5),
                   SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, frequency_penalty=0.4),
                   SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3),
                   SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW - 2,
                                  stop_token_ids=[expected[2][5]]),
                   SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, bad_words_token_ids=bad)):
        before = _drafted(spec)
        assert _tokens(spec.generate(PROMPTS, params)) == _tokens(plain.generate(PROMPTS, params)), params
        assert _drafted(spec)[0] > before[0], params  # they did run drafts
    _assert_clean(spec)


def test_disable_by_batch_size(tiny):
    d, expected = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=64, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    assert _tokens(llm.generate(PROMPTS[:3], GREEDY)) == expected[:3]  # three running: none speculates
    assert _drafted(llm) == (0, 0)
    assert _tokens(llm.generate(PROMPTS[:2], GREEDY)) == expected[:2]
    assert _drafted(llm)[0] > 0


def test_drafts_per_batch_size_follow_vllms_schedule(tiny):
    """vLLM's num_speculative_tokens_per_batch_size: each inclusive range of running requests
    takes its own count (a gap and the tail keep the one before; none above num_speculative_tokens)."""
    c = SpeculativeConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=[[8, 16, 1], [1, 4, 3]])
    assert [c.k_at(b) for b in (1, 4, 5, 7, 8, 16, 100)] == [2, 2, 2, 2, 1, 1, 1]
    assert SpeculativeConfig(num_speculative_tokens=4, num_speculative_tokens_per_batch_size=[(1, 2, 0), (3, 9, 3)]
                             ).num_speculative_tokens_per_batch_size == ((1, 2, 0), (3, 9, 3))
    for bad, says in [([], "a non-empty list"), ([(2, 4, 1)], "the first range must start at 1"),
                      ([(1, 4, 1), (4, 8, 0)], "must not overlap"), ([(1, 0, 1)], "0 < first <= last"),
                      ([(1, 4)], "entries"), ([(1, 4, -1)], "num_speculative_tokens >= 0")]:
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig(num_speculative_tokens=2, num_speculative_tokens_per_batch_size=bad)
    d, expected = tiny
    schedule = {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 64, 0]]}
    llm = LLM(model=str(d), num_gpu_blocks_override=64, speculative_config=schedule)
    assert _tokens(llm.generate(PROMPTS[:3], GREEDY)) == expected[:3]  # three running: k is 0
    assert _drafted(llm) == (0, 0)
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY)) == expected[:1]  # alone: k is 4
    assert _drafted(llm)[0] > 0


def test_metrics(tiny):
    d, _ = tiny
    llm = LLM(model=str(d), num_gpu_blocks_override=64, speculative_config=NGRAM, disable_log_stats=False)
    llm.generate(PROMPTS, GREEDY)
    values = {(m.name.removeprefix("kvserve_spec_decode_"), m.labels.get("position")): m.value
              for m in llm.get_metrics() if m.name.startswith("kvserve_spec_decode")}
    st = llm.engine.scheduler.stats
    assert values["num_drafts", None] == st.spec_drafts > 0
    assert values["num_draft_tokens", None] == st.spec_draft_tokens
    assert values["num_accepted_tokens", None] == st.spec_accepted_tokens
    per_pos = [values.get(("num_accepted_tokens_per_pos", str(k)), 0) for k in range(4)]
    assert per_pos == st.spec_accepted_per_pos + [0] * (4 - len(st.spec_accepted_per_pos))
    assert sum(per_pos) == st.spec_accepted_tokens and per_pos == sorted(per_pos, reverse=True)


def test_streams_from_the_process_engine(tiny):
    """The server's engine core (its own process) with drafts: a step's kept drafts reach the
    stream as one delta of several tokens, in order, and the text is the text."""
    import asyncio

    from engine.process_engine import ProcessEngine

    d, expected = tiny
    plain = LLM(model=str(d), num_gpu_blocks_override=64).generate(PROMPTS, GREEDY)

    async def collect(engine, rid, prompt):
        deltas, text, last = [], "", None
        async for out in engine.generate(rid, prompt, GREEDY):
            deltas.append(list(out.outputs[0].delta_token_ids))
            text += out.outputs[0].delta_text
            last = out
        return deltas, text, last

    async def main():
        engine = ProcessEngine(model=str(d), num_gpu_blocks_override=64, speculative_config=NGRAM)
        try:
            results = await asyncio.gather(*(collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            return results, engine.stats()
        finally:
            await engine.shutdown()

    results, stats = asyncio.run(main())
    for (deltas, text, last), want, ref in zip(results, expected, plain):
        assert [t for delta in deltas for t in delta] == want == list(last.outputs[0].token_ids)
        assert text == ref.outputs[0].text and last.outputs[0].finish_reason == "length"
    assert any(len(delta) > 1 for deltas, _, _ in results for delta in deltas)
    assert stats.spec_accepted_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks


def test_lora_adapters_with_drafts(tiny, tmp_path):
    """Adapted decodes with drafts (their rows run the adapter's delta) beside the base model's:
    each output is what the same adapter gives one token a step (tests/test_lora.py: PEFT-exact)."""
    from engine import LoRARequest
    from tests.tiny_lora import make_adapter

    d, _ = tiny
    loras = [None] + [LoRARequest(f"a{i}", i, make_adapter(d, tmp_path / f"a{i}", seed=i)) for i in (1, 2)]
    which = [loras[i % 3] for i in range(len(PROMPTS))]
    kw = dict(enable_lora=True, max_loras=2, max_num_batched_tokens=24, block_size=4)
    plain, spec = _pair(d, **kw)
    ex, adapted_drafts = spec.engine.executor, []
    execute = ex.execute

    def recording(batch, mask=None):
        adapted_drafts.extend(len(s.spec_token_ids) for s in batch.seqs if s.lora_int_id and s.spec_token_ids)
        return execute(batch, mask)

    ex.execute = recording
    want = _tokens(plain.generate(PROMPTS, GREEDY, lora_request=which))
    assert _tokens(spec.generate(PROMPTS, GREEDY, lora_request=which)) == want
    assert want != _tokens(plain.generate(PROMPTS, GREEDY))  # the adapters change the output
    assert adapted_drafts and _drafted(spec)[1] > 0
    _assert_clean(spec)


def test_structured_outputs_with_drafts(smollm2_path, tmp_path):
    """A grammar's request drafts too: each draft row gets the mask of the matcher having taken the
    drafts before it (rows after a draft the grammar refuses stay unmasked: nothing after it is
    kept), and the matcher is rolled back; outputs are the ones without drafts, and valid."""
    import json

    from engine.structured import StructuredOutputsParams as S

    d = make_tiny_llama(tmp_path / "m", smollm2_path, "gqa", vocab_size=49152)  # every token the grammar forces
    kw = dict(num_gpu_blocks_override=128, max_model_len=512, max_num_batched_tokens=64)
    plain, spec = _pair(d, **{k: v for k, v in kw.items() if k != "num_gpu_blocks_override"})
    constrained = []
    execute = spec.engine.executor.execute

    def recording(batch, mask=None):
        if mask is not None:
            constrained.append(len(mask.rows) - len([i for i in mask.rows if i < len(batch.sampled(16))]))
        return execute(batch, mask)

    spec.engine.executor.execute = recording
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 8, "maxItems": 8}
    rng = random.Random(0)
    prompts = [[rng.randrange(17, 49152) for _ in range(n)] for n in (5, 12, 30)]
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(json=schema)),
              SamplingParams(temperature=0, max_tokens=80, structured_outputs=S(regex="(ab|cd){12}")),
              SamplingParams(temperature=0.8, seed=2, max_tokens=80, structured_outputs=S(json=schema))]
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert _samples(got) == _samples(want)
    assert len(json.loads(got[0].outputs[0].text)) == 8 and len(got[1].outputs[0].text) == 24
    assert sum(constrained) > 0 and _drafted(spec)[1] > 0  # draft rows were masked, drafts kept
    _assert_clean(spec)
    # A grammar held behind its reasoning gate (which reads one token at a time) is offered none.
    eng, tokens = spec.engine, [50, 60, 70, 80, 50, 60]
    eng.add_request("gated", tokens, SamplingParams(max_tokens=10, structured_outputs=S(json=schema, reasoning_end="\n")))
    eng.add_request("open", tokens, SamplingParams(max_tokens=10, structured_outputs=S(json=schema)))
    assert eng.scheduler.propose(eng.requests["gated"].seqs[0], 8) == []
    assert eng.scheduler.propose(eng.requests["open"].seqs[0], 8) == [70, 80, 50, 60]
    assert eng.scheduler.propose(eng.requests["open"].seqs[0], 2) == [70, 80]  # within the step's budget
    eng.add_request("short", tokens, SamplingParams(max_tokens=3))
    assert eng.scheduler.propose(eng.requests["short"].seqs[0], 8) == [70, 80]  # and max_tokens (2 + the next)
    eng.abort("gated"), eng.abort("open"), eng.abort("short")
    _assert_clean(spec)
