"""Constrained decoding in the engine (llguidance): outputs that always parse and validate, under
greedy and sampled decoding, forks and tensor parallelism; masks that change nothing when the
grammar allows every token; compilation off the step thread; failures that end one request only."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, AsyncEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.sampler import SequenceSampler
from engine.structured import StructuredOutputsParams as S
from engine.structured.bitmask import GrammarMask, apply_grammar_mask
from tests.tiny_llama import make_tiny_llama

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    """A tiny random Llama over the whole SmolLM2 vocabulary: llguidance forces canonical tokens
    (`{"` as one token), so the model must be able to emit every token the tokenizer has."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("structured"), smollm2_path, "gqa", vocab_size=49152))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(model=tiny_dir, num_gpu_blocks_override=256, max_model_len=512, max_num_batched_tokens=64)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(17, 49152) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _texts(outs) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_json_schema_outputs_validate_greedy_sampled_and_forked(tiny):
    spec = S(json=PERSON)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
              SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_outputs=spec),
              SamplingParams(n=3, temperature=1.2, max_tokens=120, structured_outputs=spec),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=120, structured_outputs=S(json_object=True))]
    outs = tiny.generate(_prompts(4, seed=1), params)
    for text, reason in _texts(outs[:3]):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert isinstance(json.loads(outs[3].outputs[0].text), dict)
    assert len({c.text for c in outs[2].outputs}) > 1  # the forks drew apart, each under its own matcher
    assert not tiny.engine.structured.matchers  # every matcher dropped with its request
    tiny.engine.scheduler.check_integrity()


def test_regex_choice_and_grammar(tiny):
    specs = [S(regex=r"[0-9]{3}-[a-z]{2,4}"), S(choice=["yes", "no", "maybe not"]),
             S(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]/'),
             S(grammar='root ::= "x" [0-9] [0-9]?')]  # GBNF is taken too
    outs = tiny.generate(_prompts(4, seed=2), [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                              structured_outputs=s) for i, s in enumerate(specs)])
    (a, _), (b, _), (c, _), (d, _) = _texts(outs)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", a)
    assert b in ("yes", "no", "maybe not")
    assert re.fullmatch(r"\([a-c](,[a-c])*\)", c)
    assert re.fullmatch(r"x[0-9][0-9]?", d)


def test_a_grammar_the_requests_bans_leave_no_token_says_so(tiny):
    """allowed_token_ids that rule out every token the grammar allows: the draw came from a row
    with nothing left, and the error names the request's own constraint as the likely cause."""
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=S(choice=["yes", "no"]),
                            allowed_token_ids=list(range(300, 512)))
    out = tiny.generate(_prompts(1, seed=4), params)[0].outputs[0]
    assert out.finish_reason == "error"
    assert "the request's allowed_token_ids may leave no token the grammar allows" in out.stop_reason


def test_reaching_max_tokens_first_ends_with_length(tiny):
    out = tiny.generate(_prompts(1, seed=3), SamplingParams(temperature=0, max_tokens=3,
                                                            structured_outputs=S(json=PERSON)))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_specs_the_library_cannot_compile_are_invalid_requests(tiny):
    for spec, says in [(S(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
                       (S(json={"type": "object", "if": {}}), "if"), (S(regex="a("), "unclosed"),
                       (S(grammar="start: foo"), "foo"),
                       # a language with no text: refused when compiled, not failed at the first step
                       (S(regex="[^\\x00-\\U0010FFFF]"), "the regex matches no text: no token can begin its output"),
                       (S(grammar='start: /[^\\x00-\\U0010FFFF]/'), "the grammar matches no text")]:
        with pytest.raises(InvalidRequestError, match=says) as e:
            tiny.generate(_prompts(1), SamplingParams(max_tokens=4, structured_outputs=spec))
        assert e.value.param == "structured_outputs"
    assert not tiny.engine.requests
    # lenient (a json_schema without strict): what llguidance does not implement is ignored
    out = tiny.generate(_prompts(1), SamplingParams(temperature=0, max_tokens=60, structured_outputs=S(
        json={"type": "object", "if": {}, "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}, lenient=True)))[0].outputs[0]
    assert json.loads(out.text) in ({"a": True}, {"a": False})
    with pytest.raises(InvalidRequestError, match="exactly one"):
        S(regex="a", choice=["b"])


def test_compiled_grammars_are_cached_by_spec_failures_too(tiny):
    compiler = tiny.engine.structured.compiler
    assert compiler.submit(S(json=PERSON)) is compiler.submit(S(json=json.dumps(PERSON, separators=(",", ":"))))
    bad = S(regex="(")
    assert compiler.submit(bad) is compiler.submit(S(regex="("))
    assert compiler.submit(S(regex="a")) is not compiler.submit(S(regex="a", lenient=True))


def test_json_is_laid_out_as_the_model_writes_it_but_never_with_a_run_of_whitespace(tokenizer):
    """Compact, one space, or a newline and an indent where JSON allows whitespace (vLLM's
    xgrammar lets a model choose its layout too); two spaces, two newlines or a deeper indent
    never: a model cannot fill max_tokens with whitespace."""
    from engine.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    schema = {"type": "object", "properties": {"a": I, "b": {"type": "array", "items": I}}, "required": ["a"]}

    def accepts(text: str) -> bool:
        matcher = compiler.compile(S(json=schema)).matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error()

    for text in ('{"a":1,"b":[2,3]}', '{"a": 1, "b": [2, 3]}', '{\n    "a": 1,\n    "b": [\n        2\n    ]\n}'):
        assert accepts(text), text
    for text in ('{  "a": 1}', '{\n\n"a": 1}', '{"a":' + "\n" + " " * 33 + "1}", '{"a": 1,\t"b": []}'):
        assert not accepts(text), text


def test_vllm_s_other_options_and_older_name(tiny):
    """vLLM's StructuredOutputsParams options: whitespace_pattern shapes the JSON's whitespace,
    disable_any_whitespace leaves none; disable_additional_properties, backend and disable_fallback
    ask what kvserve does anyway (closed objects, one backend); structural_tag is refused.
    `SamplingParams(guided_decoding=GuidedDecodingParams(...))`, the name before vLLM 0.10.2, runs the same."""
    from engine.sampling_params import GuidedDecodingParams

    prompts = _prompts(1, seed=5)
    plain = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(json=PERSON)))
    same = S(json=PERSON, disable_additional_properties=True, backend="xgrammar", disable_fallback=True)
    with pytest.warns(DeprecationWarning, match="guided_decoding"):
        older = SamplingParams(temperature=0, max_tokens=120, guided_decoding=GuidedDecodingParams(json=PERSON))
    assert older.structured_outputs == S(json=PERSON) and older.guided_decoding is None
    for params in (SamplingParams(temperature=0, max_tokens=120, structured_outputs=same), older):
        assert _texts(tiny.generate(prompts, params)) == _texts(plain)
    spaced, = _texts(tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=120, structured_outputs=S(
        json=PERSON, whitespace_pattern=" "))))  # a space where JSON allows whitespace (or none: llguidance's)
    assert spaced[0].startswith('{ "') and spaced[0].endswith(" }") and spaced[1] == "stop"
    jsonschema.validate(json.loads(spaced[0]), PERSON)
    assert "  " not in spaced[0]  # where whitespace may go, the pattern's (not it and a separator's space)
    for so in (S(json=PERSON, whitespace_pattern=""), S(json=PERSON, disable_any_whitespace=True)):  # none at all
        compact, = _texts(tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)))
        assert compact[0] == json.dumps(json.loads(compact[0]), separators=(",", ":"), ensure_ascii=False)
    assert S(json=PERSON).key != S(json=PERSON, whitespace_pattern=" ").key != S(json=PERSON, disable_any_whitespace=True).key
    for kwargs, says in [(dict(json=PERSON, structural_tag="{}"), "structural_tag is not supported"),
                         (dict(regex="a+", whitespace_pattern=" "), "whitespace_pattern applies to json")]:
        with pytest.raises(InvalidRequestError, match=says):
            S(**kwargs)
    with pytest.raises(InvalidRequestError, match="give one"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))


PARIS, HELLO = 38634, 28120  # single tokens of SmolLM2's vocabulary: "Paris", "hello"


def test_a_grammar_gated_behind_reasoning_applies_from_the_token_after_it_ends(tiny):
    """A reasoning model's reply: free text until `reasoning_end` is written, then the grammar.
    The logit bias pushes "Paris" first: it opens the reasoning (reasoning_start), then closes it;
    the grammar then masks it away and the rest is the schema's."""
    gated = S(json=PERSON, reasoning_end="Paris", reasoning_start="Paris")
    params = [SamplingParams(temperature=0, max_tokens=120, logit_bias={PARIS: 100}, structured_outputs=gated),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=120, logit_bias={PARIS: 100},
                             structured_outputs=gated)]
    for text, reason in _texts(tiny.generate(_prompts(2, seed=11), params)):
        assert text.startswith("ParisParis") and reason == "stop", text
        jsonschema.validate(json.loads(text[len("ParisParis"):]), PERSON)
    # Until the end is written nothing is masked: a reply that never writes it is never constrained
    held = SamplingParams(temperature=0, max_tokens=6, logit_bias={HELLO: 100},
                          structured_outputs=S(json=PERSON, reasoning_end="Paris"))
    (out,) = tiny.generate(_prompts(1, seed=12), held)[0].outputs
    assert (out.text, out.finish_reason) == ("hello" * 6, "length")
    ungated = dataclasses.replace(held, structured_outputs=S(json=PERSON))
    assert tiny.generate(_prompts(1, seed=12), ungated)[0].outputs[0].text.startswith("{")
    assert not tiny.engine.structured.matchers and not tiny.engine.structured.gates


def test_gated_grammars_are_unchanged_by_preemption(tiny_dir, tiny):
    """A recomputed sequence feeds its matcher and gate nothing again: on a cache so small that the
    four requests preempt each other, reasoning and answers are a roomy engine's. Each reasoning
    ends on a token its greedy reply draws anyway, a dozen tokens in."""
    prompts, tok = _prompts(4, seed=13), tiny.engine.tokenizer
    free = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=40))
    params, thoughts = [], []
    for out in free:
        ids = out.outputs[0].token_ids
        at = next(i for i in range(12, 40) if ids[i] not in ids[:i]
                  and tok.encode(tok.decode([ids[i]]), add_special_tokens=False) == [ids[i]])
        thoughts.append(tok.decode(ids[:at + 1]))
        params.append(SamplingParams(temperature=0, max_tokens=90, structured_outputs=S(
            json=PERSON, reasoning_end=tok.decode([ids[at]]))))
    tight = LLM(model=tiny_dir, num_gpu_blocks_override=10, max_model_len=512, max_num_batched_tokens=64)
    got, want = tight.generate(prompts, params), tiny.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    assert _texts(got) == _texts(want)
    for (text, reason), thought in zip(_texts(got), thoughts):
        assert text.startswith(thought) and reason == "stop"
        jsonschema.validate(json.loads(text[len(thought):]), PERSON)


def test_the_gate_needs_one_token_tags(tiny):
    """A tag in pieces could end inside a token that carries the answer's first characters."""
    with pytest.raises(InvalidRequestError, match="'</think>' is not one token"):
        tiny.generate(_prompts(1), SamplingParams(max_tokens=4, structured_outputs=S(json=PERSON,
                                                                                     reasoning_end="</think>")))
    assert not tiny.engine.requests and not tiny.engine.structured.gates


def test_the_gate_opens_on_its_tokens_only(tiny):
    from types import SimpleNamespace

    from engine.structured.matchers import GrammarMatchers

    compiler = tiny.engine.structured.compiler
    grammar = compiler.compile(S(json=PERSON))
    m = GrammarMatchers(compiler)
    reasoning, opening, plain = (SimpleNamespace(seq_id=i) for i in range(3))
    for seq, spec in ((reasoning, S(json=PERSON, reasoning_end="Paris")),
                      (opening, S(json=PERSON, reasoning_end="Paris", reasoning_start="hello")),
                      (plain, S(json=PERSON, reasoning_end="Paris", reasoning_start="<think>"))):  # 3 tokens: no gate
        m.add(seq, grammar, m.gate(spec))
    mask = m.mask([reasoning, opening, plain])
    assert mask.rows == [1, 2]  # the reasoning sequence has no row
    allowed = mask.bits.numpy().view(np.uint32)
    bit = lambda row, t: bool(allowed[row, t // 32] >> (t % 32) & 1)  # noqa: E731
    assert bit(0, HELLO) and not bit(1, HELLO)  # the grammar's row, and the opener beside it
    allowed[0, HELLO // 32] &= ~np.uint32(1 << HELLO % 32)
    assert (allowed[0] == allowed[1]).all() and allowed[1].any()
    assert m.accept(opening, HELLO) is None and m.mask([opening]) is None  # opened: now it reasons
    for t in tiny.engine.tokenizer.encode(" The user asks for a person.</think>\n", add_special_tokens=False):
        assert m.mask([reasoning]) is None and m.accept(reasoning, t) is None  # its end is no other token
    assert m.accept(reasoning, PARIS) is None and m.mask([reasoning]).rows == [0] and not m.gates.get(0)
    assert "satisfy the grammar" in m.accept(reasoning, PARIS)  # the grammar's now
    assert "satisfy the grammar" in m.accept(plain, HELLO)


def test_a_mask_that_allows_everything_changes_nothing():
    """The sampler with an all-ones bitmask: the same tokens and logprobs, greedy and seeded."""
    torch.manual_seed(0)
    logits = torch.randn(3, 100) * 3
    seqs = [type("Seq", (), dict(index=0, params=p, prompt_token_ids=[1, 2], output_token_ids=[3]))()
            for p in (SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.9, seed=4, logprobs=1),
                      SamplingParams(temperature=1.0, top_k=5, seed=9))]
    full = GrammarMask([0, 2], torch.full((2, 4), -1, dtype=torch.int32))  # 128 bits for a vocab of 100
    plain = SequenceSampler(0, [2]).sample(logits, [0, 1, 2], seqs)
    masked = SequenceSampler(0, [2]).sample(logits, [0, 1, 2], seqs, full)
    assert plain == masked
    one = GrammarMask([1], torch.zeros((1, 4), dtype=torch.int32))
    one.bits[0, 1] = 1 << 5  # token 37 only
    out = apply_grammar_mask(logits, one)
    assert out[1].argmax() == 37 and torch.isinf(out[1]).sum() == 99 and torch.equal(out[0], logits[0])
    assert torch.isinf(apply_grammar_mask(torch.zeros(1, 130), GrammarMask([0], full.bits[:1]))[0, 128:]).all()


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return LLM(model=smollm2_path, num_gpu_blocks_override=128, max_model_len=512)


def test_bitmask_path_is_token_exact_when_the_grammar_allows_every_token(smol):
    """`(?s:.*)` allows every token text can start with (all but the special tokens and lone UTF-8
    continuation bytes): an English reply takes the mask path and must not change by one token."""
    tok = smol.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in ("What is the capital of France?", "Name three colours.")]
    for p in (SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=5, max_tokens=24,
                                                                           logprobs=2)):
        plain = smol.generate(chats, p)
        constrained = smol.generate(chats, dataclasses.replace(p, structured_outputs=S(regex=r"(?s:.*)")))
        assert [c.outputs[0].token_ids for c in constrained] == [c.outputs[0].token_ids for c in plain]
        assert [c.outputs[0].finish_reason for c in constrained] == [c.outputs[0].finish_reason for c in plain]


def test_a_grammar_failing_at_run_time_ends_only_its_request(tiny, monkeypatch):
    from engine.structured import matchers

    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(json=PERSON))
    eng, real = tiny.engine, matchers.GrammarMatchers.accept
    calls = {"n": 0}

    def flaky(self, seq, token_id):
        calls["n"] += 1
        if seq.request_id == "bad" and calls["n"] > 3:
            self.matchers[seq.seq_id].consume_token(1)  # <|im_start|> inside JSON: the matcher fails
        return real(self, seq, token_id)

    monkeypatch.setattr(matchers.GrammarMatchers, "accept", flaky)
    eng.add_request("bad", _prompts(1, seed=5)[0], params)
    eng.add_request("good", _prompts(1, seed=6)[0], params)
    eng.add_request("free", _prompts(1, seed=7)[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    bad = done["bad"].outputs[0]
    assert bad.finish_reason == "error" and "structured output failed" in bad.stop_reason
    jsonschema.validate(json.loads(done["good"].outputs[0].text), PERSON)
    assert len(done["free"].outputs[0].token_ids) == 10
    assert not eng.structured.matchers
    eng.scheduler.check_integrity()


def test_a_lexer_over_its_limit_fails_every_request_that_uses_it(tiny):
    """llguidance builds a regex's lexer lazily and shares it between copies of a compiled
    grammar: the first request fails it while consuming a token, and every later copy fails while
    computing its mask, which then allows EOS alone. Each must end with the error (the second was
    an empty reply that finished with "stop"), in a short message without llguidance's state."""
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=S(regex="b{999998}"))
    for _ in range(2):
        (out,) = tiny.generate([_prompts(1, seed=8)[0]], params)
        c = out.outputs[0]
        assert c.finish_reason == "error", (c.text, c.finish_reason)
        assert c.stop_reason == "structured output failed: lexer error: too many expressions constructed"
    assert not tiny.engine.structured.matchers


def test_compiling_never_stalls_the_step_loop(tiny_dir, monkeypatch):
    """A slow compile runs on the grammar thread while another request keeps decoding; the
    constrained request waits for it, then runs."""
    from engine.structured.compiler import GrammarCompiler

    real, threads = GrammarCompiler._compile, set()

    def slow(self, params):
        threads.add(threading.current_thread().name)
        time.sleep(1.5)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)

    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=128)
        stamps = []

        async def free():  # decodes until the constrained request is done (a fixed length may end first)
            async for out in engine.generate("free", _prompts(1)[0], SamplingParams(temperature=0, max_tokens=900,
                                                                                     ignore_eos=True)):
                stamps.append(time.monotonic())

        async def constrained():
            await asyncio.sleep(0.2)
            start = time.monotonic()
            async for out in engine.generate("json", _prompts(1, seed=9)[0], SamplingParams(
                    temperature=0, max_tokens=120, structured_outputs=S(json=PERSON))):
                last = out
            await engine.abort("free")
            return start, last

        (_, (start, last)) = await asyncio.gather(free(), constrained())
        await engine.shutdown()
        return stamps, start, last

    stamps, start, last = asyncio.run(main())
    assert threads and all(t.startswith("kvserve-grammar") for t in threads)
    jsonschema.validate(json.loads(last.outputs[0].text), PERSON)
    during = [t for t in stamps if start < t < start + 1.4]
    assert len(during) >= 2, "the step loop stalled while the grammar compiled"


# -- property: random schemas of the supported subset ---------------------------------------------

_LEAVES = st.sampled_from([
    {"type": "boolean"}, {"type": "null"}, {"type": "integer", "minimum": -40, "maximum": 300},
    {"type": "string", "maxLength": 6}, {"type": "string", "minLength": 1, "maxLength": 3},
    {"type": "string", "pattern": "^[a-z]{1,4}$"}, {"enum": ["red", "green", 3, None]}, {"const": "k"},
    {"type": "number", "minimum": 0, "maximum": 10}, {"type": "string", "format": "date"},
])
_KEYS = st.from_regex(r"[a-z][a-z_]{0,6}", fullmatch=True)


def _object(props: dict, required: list[bool]) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [k for k, r in zip(props, required) if r]}


_SCHEMAS = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.dictionaries(_KEYS, inner, min_size=1, max_size=3).flatmap(
        lambda d: st.lists(st.booleans(), min_size=len(d), max_size=len(d)).map(lambda r: _object(d, r))),
    inner.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
    st.lists(inner, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
), max_leaves=6)


@settings(max_examples=12, deadline=None, derandomize=True,  # the same examples in every CI run
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_SCHEMAS, seed=st.integers(0, 1000))
def test_random_schemas_always_validate(tiny, schema, seed):
    spec = S(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=300, structured_outputs=spec),
              SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=300, structured_outputs=spec)]
    for text, reason in _texts(tiny.generate(_prompts(2, seed=seed), params)):
        if reason == "length":  # unbounded repetition the grammar allows (a number's digits) ran to
            continue            # max_tokens: cut, as the engine reports; test_reaching_max_tokens_first_ends_with_length
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


# -- tensor parallelism: matchers stay in the engine, masks travel to rank 0 -----------------------

def test_tp2_constrained_sampling_matches_tp1(tiny_dir):
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        config = dict(num_gpu_blocks_override=64, max_model_len=512, max_num_batched_tokens=48)
        spec = S(json=PERSON)
        gated = S(json=PERSON, reasoning_end="Paris", reasoning_start="Paris")  # the gate stays in the engine too
        params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=spec),
                  SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=100, structured_outputs=spec, logprobs=1),
                  SamplingParams(temperature=0.9, seed=2, max_tokens=20, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=100, logit_bias={PARIS: 100}, structured_outputs=gated)]
        prompts = _prompts(4, seed=11)
        want = LLM(model=tiny_dir, **config).generate(prompts, params)
        tp2 = LLM(model=tiny_dir, tensor_parallel_size=2, **config)
        got = tp2.generate(prompts, params)
        tp2.engine.executor.shutdown()
    finally:
        ray.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    for text, _ in _texts(got[:2]) + [(t.removeprefix("ParisParis"), r) for t, r in _texts(got[3:])]:
        jsonschema.validate(json.loads(text), PERSON)


# -- CUDA: the mask is unpacked and applied on the GPU (skipped where there is none) --------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_decoding_on_cuda(tiny_dir, dtype):
    llm = LLM(model=tiny_dir, device="cuda", dtype=dtype, num_gpu_blocks_override=256, max_model_len=512)
    spec = S(json=PERSON)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
              SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=120, structured_outputs=spec)]
    for text, reason in _texts(llm.generate(_prompts(2, seed=12), params)):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    full = torch.full((1, 49152 // 32), -1, dtype=torch.int32)
    logits = torch.randn(2, 49152, device="cuda")
    assert torch.equal(apply_grammar_mask(logits, GrammarMask([1], full)), logits)  # allowing all: no change


# -- object schemas are closed, as vLLM's default backend reads them ---------------------------------

I = {"type": "integer"}
# Schemas whose objects take keys listed elsewhere (a composition, a $ref), or any keys: values
# they accept must stay accepted (xgrammar's strict mode sees such keys, unevaluatedProperties-like).
OPEN = [
    ({"type": "object", "allOf": [{"properties": {"a": I}, "required": ["a"]}, {"properties": {"b": I}, "required": ["b"]}]},
     {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"a": I}, "allOf": [{"properties": {"b": I}}]}, {"a": 1, "b": 2}),
    ({"$defs": {"Base": {"type": "object", "properties": {"a": I}}}, "$ref": "#/$defs/Base", "properties": {"b": I}},
     {"a": 1, "b": 2}),
    ({"$defs": {"A": {"type": "object", "properties": {"a": I}, "required": ["a"]},
                "B": {"type": "object", "properties": {"b": I}, "required": ["b"]}},
      "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, {"a": 1, "b": 2}),
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"x": I}, "required": ["x"]}, {"properties": {"y": I}, "required": ["y"]}]},
     {"kind": "k", "x": 1}),
    ({"type": "object", "oneOf": [{"properties": {"a": I}, "required": ["a"]}]}, {"a": 1}),
    ({"type": "object", "properties": {"meta": {"type": "object"}}}, {"meta": {"k": 1}}),  # a free-form map
    ({"type": "object"}, {"k": 1}),
    ({"type": "object", "patternProperties": {"^x": I}}, {"x1": 1}),
]


def test_an_object_schema_that_lists_its_keys_gets_no_others(tokenizer):
    """A schema without additionalProperties gets no invented keys (vLLM's default backend, xgrammar
    strict); one that allows them, json_object mode, free-form objects and compositions keep every
    key they allowed."""
    from engine.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(spec: S, value) -> bool:
        compiled = compiler.compile(spec)
        assert compiled.error is None, compiled.error
        matcher = compiled.matcher()
        ids = tokenizer.encode(json.dumps(value), add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()

    person = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    nested = {"type": "object", "properties": {"people": {"type": "array", "items": person}}, "required": ["people"]}
    who = {"name": "a", "age": 1, "tags": []}
    assert accepts(S(json=person), who) and not accepts(S(json=person), {**who, "x": 1})
    assert accepts(S(json=nested), {"people": [who]}) and not accepts(S(json=nested), {"people": [{**who, "x": 1}]})
    assert not accepts(S(json=nested), {"people": [], "x": 1})
    optional = {"type": "object", "properties": {"p": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]}},
                "$defs": {"P": person}}  # pydantic's Optional[Model]
    assert accepts(S(json=optional), {"p": who}) and not accepts(S(json=optional), {"p": {**who, "x": 1}})
    # the whole schema a $ref to one of its definitions: pydantic's recursive model (Node.child: Node | None)
    node = {"type": "object", "properties": {"v": I, "child": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
            "required": ["v"]}
    tree = {"$defs": {"Node": node}, "$ref": "#/$defs/Node", "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert accepts(S(json=tree), {"v": 1, "child": {"v": 2, "child": None}})
    assert not accepts(S(json=tree), {"v": 1, "x": 1}) and not accepts(S(json=tree), {"v": 1, "child": {"v": 2, "x": 1}})
    assert accepts(S(json={**person, "additionalProperties": True}), {**who, "x": 1})
    assert accepts(S(json={**person, "additionalProperties": {"type": "integer"}}), {**who, "x": 1})
    assert accepts(S(json_object=True), {**who, "x": 1})
    for schema, value in OPEN:
        assert accepts(S(json=schema), value), schema


def test_closing_objects_changes_schemas_only():
    from engine.structured.schemas import closed_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}},
                                               "type": {"const": {"properties": {"x": 1}}}},
              "$defs": {"d": {"properties": {"y": {"type": "string"}}}}, "items": [{"properties": {}}],
              "default": {"properties": {}}}
    assert closed_objects(schema) == {
        "type": "object", "additionalProperties": False,
        "properties": {"properties": {"type": "object", "properties": {}, "additionalProperties": False},
                       "type": {"const": {"properties": {"x": 1}}}},  # data, not a schema
        "$defs": {"d": {"properties": {"y": {"type": "string"}}, "additionalProperties": False}},
        "items": [{"properties": {}, "additionalProperties": False}], "default": {"properties": {}}}
    assert closed_objects({"type": "object"}) == {"type": "object"}  # a free-form map
    assert "additionalProperties" not in closed_objects({"properties": {}, "unevaluatedProperties": True})


def test_formats_the_grammar_lacks_are_annotations_and_uuid_versions_are_held(tokenizer):
    """pydantic's UUID4, SecretStr, bytes, Path write formats llguidance lacks: the schema is served
    (the format is an annotation, JSON Schema's default, as vLLM's xgrammar reads it), a uuidN one
    held to that version; an integer bound beyond 64 bits is refused, not saturated (the output
    broke the schema), and a range the grammar cannot build is said plainly."""
    import uuid

    from engine.structured.compiler import GrammarCompiler, check

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])

    def accepts(schema: dict, value) -> bool:
        compiled = compiler.compile(S(json=schema))
        matcher, ids = compiled.matcher(), tokenizer.encode(json.dumps(value), add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()

    pydantic_like = {"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid4"}, "secret": {"type": "string", "format": "password", "writeOnly": True},
        "blob": {"type": "string", "format": "binary"}, "where": {"type": "string", "format": "path"},
        "when": {"type": "string", "format": "date"}}, "required": ["id", "secret", "blob", "where", "when"]}
    value = {"id": str(uuid.UUID(int=7, version=4)), "secret": "x", "blob": "b", "where": "/tmp", "when": "2026-12-05"}
    assert check(S(json=pydantic_like)) is None and accepts(pydantic_like, value)
    assert not accepts(pydantic_like, {**value, "id": str(uuid.UUID(int=7, version=1))})  # not a version 4
    assert not accepts(pydantic_like, {**value, "when": "yesterday"})  # a format the grammar has is still held
    assert check(S(json={"type": "object", "properties": {"format": {"type": "string"}}})) is None  # a key, not one

    assert "minimum 9223372036854775808 is beyond what constrained decoding enforces for an integer" in check(S(
        json={"type": "integer", "minimum": 2 ** 63, "maximum": 2 ** 63 + 92}))
    assert "maximum 18446744073709551616 is beyond" in check(S(json={"anyOf": [{"type": "integer"}],
                                                                      "maximum": 2 ** 64}))  # beside the type
    for name in ("default", "const", "enum", "examples"):  # property names, not the keywords
        assert check(S(json={"type": "object", "properties": {name: {"type": "string", "format": "uuid4"}},
                             "$defs": {name: {"type": "string", "format": "password"}}})) is None
    for depth in (600, 900):  # a schema sent as a string is not held to the body's depth limit: a 400, not a 500
        assert "too deeply" in check(S(json='{"items":' * depth + "{}" + "}" * depth)) or \
            "recursion limit exceeded" in check(S(json='{"items":' * depth + "{}" + "}" * depth))
    assert "the number range (minimum 1e18, maximum 1e19) cannot be enforced" in check(S(json={
        "type": "number", "minimum": 1e18, "maximum": 1e19}))
    assert check(S(json={"type": "integer", "minimum": -(2 ** 62), "maximum": 2 ** 62})) is None
    # past 2**53 the grammar reads a bound as a float64: rounded inward, no value past it let in
    held = {"type": "integer", "minimum": 2 ** 53 + 1, "maximum": 2 ** 58 - 1}
    assert not accepts(held, 2 ** 53) and accepts(held, 2 ** 53 + 2) and not accepts(held, 2 ** 58)
    assert accepts({"type": "integer", "exclusiveMaximum": 2 ** 54 + 1}, 2 ** 54)
    assert not accepts({"type": "integer", "exclusiveMaximum": 2 ** 54}, 2 ** 54)  # held as exclusive there too
    assert not accepts({"type": "integer", "exclusiveMinimum": 2 ** 54, "minimum": 5}, 2 ** 54)
    assert check(S(json={"type": "string", "maximum": 2 ** 64})) is None  # a bound that holds no integer
    # a range with no float64 in it: said plainly, in the bounds the schema gave
    assert "no integer within minimum 1152921504606846977, maximum 1152921504606847076 can be enforced" in check(
        S(json={"type": "integer", "minimum": 2 ** 60 + 1, "maximum": 2 ** 60 + 100}))
    assert "no integer within maximum 1152921504606846977, exclusiveMinimum 1152921504606846976" in check(
        S(json={"type": "integer", "exclusiveMinimum": 2 ** 60, "maximum": 2 ** 60 + 1}))  # an exclusive one too
    either = {"type": ["integer", "number"], "minimum": 0.5, "exclusiveMinimum": -2 ** 60}  # numbers too: as given
    assert accepts(either, 0.7) and not accepts(either, 0.2)
    deep = {"type": "string"}
    for _ in range(40):  # 40 nested models, 80 JSON levels (the server takes bodies 128 deep)
        deep = {"type": "object", "properties": {"k": deep}, "required": ["k"]}
    assert check(S(json=deep)) is None


def test_a_regexs_perl_classes_are_ascii(tokenizer):
    """\\d is [0-9] (vLLM's xgrammar, JSON Schema's pattern); Rust's Unicode \\d let a model write
    U+1FBF4 SEGMENTED DIGIT FOUR for it."""
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.regex import ascii_classes

    assert ascii_classes(r"\d{3}-\w\s[a\D]\\d\p{L}") == r"[0-9]{3}-[0-9A-Za-z_][\t\n\x0B\f\r\x20][a[^0-9]]\\d\p{L}"
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = compiler.compile(S(regex=r"\d{3}-\w+"))

    def accepts(text: str) -> bool:
        matcher, ids = compiled.matcher(), tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()

    assert accepts("123-ab_9") and not accepts("\U0001fbf411-ab") and not accepts("123-é")
    verbose = compiler.compile(S(regex=r"(?x) a \s b"))  # verbose mode ignores a bare space, in a class too
    matcher, ids = verbose.matcher(), tokenizer.encode("a b", add_special_tokens=False)
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
