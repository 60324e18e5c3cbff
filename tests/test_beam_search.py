"""use_beam_search (engine.beam_search): the beams HF transformers' beam search finds, through the
real HTTP app, the official openai client and a real engine; the ranking, end tokens and length
penalty on a scripted distribution; the fields beam search refuses."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine.beam_search import BeamSearch, beam_search
from engine.outputs import ChoiceDelta, StepOutput
from engine.sampling_params import SamplingParams
from router.serving import beam_replies
from tests.tiny_app import serve_tiny
from tests.tiny_llama import make_tiny_llama
from workers.server import EngineServer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    return str(make_tiny_llama(tmp_path_factory.mktemp("beam"), smollm2_path, "gqa", vocab_size=49152))


PROMPTS = [[1, 17, 99, 250, 3, 42], [1, 400, 401, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


K, STEPS = 3, 10


@pytest.fixture(scope="module")
def hf_beams(tiny_dir) -> list[list[list[int]]]:
    """Per prompt, HF transformers' K beams of STEPS tokens (no end token), best first."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    hf = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), num_beams=K, num_return_sequences=K, max_new_tokens=STEPS,
                             do_sample=False, early_stopping=False, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        hf.append([seq[len(p):].tolist() for seq in out.sequences])
        assert out.sequences_scores.tolist() == sorted(out.sequences_scores.tolist(), reverse=True)
    return hf


@pytest.mark.parametrize("max_num_seqs", [16, 2], ids=["seats", "fewer-seats-than-beams"])
def test_beams_are_hf_transformers_beams(tiny_dir, hf_beams, max_num_seqs):
    """ignore_eos: every beam runs max_tokens, so vLLM's ranking and HF's agree exactly. Each beam
    of a round is an engine call of its own: a width past the engine's max_num_seqs is served."""
    k, steps, hf = K, STEPS, hf_beams

    async def go(client, server):
        whole = await client.completions.create(model="m", prompt=PROMPTS, n=k, max_tokens=steps, logprobs=2,
                                                extra_body={"use_beam_search": True, "ignore_eos": True,
                                                            "return_token_ids": True})
        stream = await client.completions.create(model="m", prompt=PROMPTS[0], n=k, max_tokens=steps, stream=True,
                                                 extra_body={"use_beam_search": True, "ignore_eos": True})
        streamed = [c async for c in stream]
        await asyncio.sleep(0.05)
        return whole, streamed, await server.stats()

    whole, streamed, stats = serve_tiny(tiny_dir, go, max_num_seqs=max_num_seqs)
    got = [c.token_ids for c in whole.choices]
    assert got == hf[0] + hf[1]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == steps for c in whole.choices)
    cum = [sum(c.logprobs.token_logprobs) for c in whole.choices[:k]]
    assert cum == sorted(cum, reverse=True)  # best first
    assert whole.usage.completion_tokens == 2 * k * steps
    texts = {c.index: c.text for c in streamed if c.choices for c in c.choices}
    assert [texts[i] for i in range(k)] == [c.text for c in whole.choices[:k]]
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("max_num_seqs", [16, 2], ids=["seats", "fewer-seats-than-beams"])
def test_offline_beam_search_finds_hf_transformers_beams(tiny_dir, hf_beams, max_num_seqs):
    """LLM.beam_search (vLLM's offline API): the same beams, with the prompt's tokens, their text,
    each token's round logprobs summing to cum_logprob, best first; the KV cache all free after."""
    from engine import LLM, BeamSearchParams

    llm = LLM(model=tiny_dir, max_num_seqs=max_num_seqs, num_gpu_blocks_override=128)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=K, max_tokens=STEPS, ignore_eos=True))
    assert [[q.tokens[len(p):] for q in o.sequences] for o, p in zip(outs, PROMPTS)] == hf_beams
    for o, p in zip(outs, PROMPTS):
        assert all(q.tokens[:len(p)] == p and q.finish_reason == "length" for q in o.sequences)
        assert [q.text for q in o.sequences] == [llm.tokenizer.decode(q.tokens, skip_special_tokens=True)
                                                 for q in o.sequences]
        cums = [sum(e[t].logprob for t, e in zip(q.tokens[len(p):], q.logprobs)) for q in o.sequences]
        for q in o.sequences:  # vLLM's Logprob: the token first, ranked where it stands among its round's best
            for t, e in zip(q.tokens[len(p):], q.logprobs):
                assert next(iter(e)) == t and sorted(x.rank for x in e.values()) == list(range(1, len(e) + 1))
                assert all(x.decoded_token == llm.tokenizer.convert_tokens_to_string(
                    [llm.tokenizer.convert_ids_to_tokens(k)]) for k, x in e.items())
        assert cums == pytest.approx([q.cum_logprob for q in o.sequences]) and cums == sorted(cums, reverse=True)
    one_at_a_time = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                    BeamSearchParams(beam_width=K, max_tokens=STEPS, ignore_eos=True),
                                    concurrency_limit=1)
    assert [[q.tokens for q in o.sequences] for o in one_at_a_time] == [[q.tokens for q in o.sequences] for o in outs]
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_offline_beam_ending_in_eos_keeps_its_end_token_and_logprob(smollm2_path):
    """A beam that ends is "stop" with its end token as stop_reason; the token is in its tokens
    (and in its text with skip_special_tokens=False: vLLM 0.32 decodes the text so), its logprob in
    cum_logprob, whatever include_stop_str_in_output says (vLLM's offline search; its server's
    reads the flag, as kvserve's does)."""
    from engine import LLM, BeamSearchParams

    llm = LLM(model=smollm2_path, max_model_len=256, num_gpu_blocks_override=64)
    out, = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=2, max_tokens=6))
    same, = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=2, max_tokens=6,
                                                                          include_stop_str_in_output=True))
    assert [(q.tokens, q.text) for q in same.sequences] == [(q.tokens, q.text) for q in out.sequences]
    best = out.sequences[0]
    generated = best.tokens[len(llm.tokenizer.encode("The capital of France is")):]
    assert best.finish_reason == "stop" and best.stop_reason in llm.engine.eos_token_ids
    assert generated[-1] == best.stop_reason and " Paris" in best.text
    assert best.text == llm.tokenizer.decode(best.tokens, skip_special_tokens=True)
    assert not best.text.endswith(llm.tokenizer.decode(generated[-1]))
    special, = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=2, max_tokens=6,
                                                                             skip_special_tokens=False))
    assert special.sequences[0].tokens == best.tokens
    assert special.sequences[0].text == llm.tokenizer.decode(best.tokens)
    assert special.sequences[0].text.endswith(llm.tokenizer.decode(generated[-1]))
    assert len(best.logprobs) == len(generated)
    assert sum(e[t].logprob for t, e in zip(generated, best.logprobs)) == pytest.approx(best.cum_logprob)


def test_offline_beam_search_refuses_what_cannot_run_and_fits_the_rest(tiny_dir):
    from engine import LLM, BeamSearchParams
    from engine.errors import InvalidRequestError

    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    llm = LLM(model=tiny_dir, max_model_len=64, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match=r"beam_width must be at most 10 \(half the engine's max_logprobs, 20\)"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_model_len"):  # the prompt leaves no room
        llm.beam_search([PROMPTS[0], list(range(3, 67))], BeamSearchParams(beam_width=2, max_tokens=16))
    assert not llm.engine.has_unfinished()
    # a max_tokens past max_model_len ends the beams there (vLLM's offline search)
    out, = llm.beam_search(list(range(3, 60)), BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True))
    assert [(len(b.tokens), b.finish_reason) for b in out.sequences] == [(64, "length")] * 2
    wide = LLM(model=tiny_dir, max_model_len=64, num_gpu_blocks_override=64, max_logprobs=24)
    out, = wide.beam_search(PROMPTS[0], BeamSearchParams(beam_width=12, max_tokens=2, ignore_eos=True))
    assert len(out.sequences) == 12


def test_offline_beam_search_fails_rather_than_hangs_when_the_engine_fails(tiny_dir, monkeypatch):
    import threading

    from engine import LLM, BeamSearchParams

    llm = LLM(model=tiny_dir, num_gpu_blocks_override=64)
    steps = []
    real_step = llm.engine.step

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("engine step failed")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    raised = []

    def search():
        try:
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
        except RuntimeError as e:
            raised.append(str(e))

    worker = threading.Thread(target=search, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and raised == ["engine step failed"]


class _Recording(EngineServer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []  # (request id, admitted)

    def generate(self, request_id, prompt_token_ids, params, admitted=False):
        self.calls.append((request_id, admitted))
        return super().generate(request_id, prompt_token_ids, params, admitted)


def test_only_the_first_engine_call_of_a_request_may_be_refused_by_a_full_queue(tiny_dir):
    """Its other calls, the rounds after the first and the other prompts', are `admitted`: the
    ingress has them wait for room in a full queue (router.ingress) rather than refuse a request
    already running."""
    async def go(client, server):
        await client.completions.create(model="m", prompt=PROMPTS, n=2, max_tokens=3,
                                        extra_body={"use_beam_search": True, "ignore_eos": True})
        beam, server.calls = server.calls, []
        await client.completions.create(model="m", prompt=PROMPTS, max_tokens=3)
        return beam, server.calls

    beam, plain = serve_tiny(tiny_dir, go, _Recording)
    assert len(beam) == 2 * (1 + 2 + 2)  # per prompt: one beam, then two, for three rounds
    assert [admitted for _, admitted in beam].count(False) == 1
    assert [admitted for _, admitted in plain] == [False, True]


def test_chat_beam_search_and_refusals(tiny_dir):
    async def go(client, server):
        msgs = [{"role": "user", "content": "Say something"}]
        chat = await client.chat.completions.create(model="m", messages=msgs, n=2, max_tokens=5,
                                                    extra_body={"use_beam_search": True, "ignore_eos": True})
        errors = []
        for extra in ({"n": 11}, {"top_p": 0.5}, {"stop": ["x"]}, {"logit_bias": {"5": 1}},
                      {"response_format": {"type": "json_object"}}):
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "use_beam_search": True, **extra}
            r = await client._client.post("http://t/v1/completions", json=body)
            errors.append((r.status_code, r.json()["error"]["message"]))
        r = await client._client.post("http://t/v1/completions",
                                      json={"model": "m", "prompt": [1, 2], "length_penalty": 2.0})
        errors.append((r.status_code, r.json()["error"]["message"]))
        return chat, errors

    chat, errors = serve_tiny(tiny_dir, go)
    assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
    assert chat.usage.completion_tokens == 10
    assert [s for s, _ in errors] == [400] * 6
    assert "at most 10" in errors[0][1] and "top_p cannot be combined" in errors[1][1]
    assert "stop cannot" in errors[2][1] and "logit_bias cannot" in errors[3][1]
    assert "response_format cannot" in errors[4][1] and "beam search only" in errors[5][1]


# -- the search itself, on a scripted distribution ------------------------------------------------
EOS = 2
TABLE = {  # context after the prompt [1] -> the next token's logprobs
    (): {EOS: -0.3, 5: -0.5, 6: -1.0, 7: -3.0},
    (5,): {5: -2.0, 6: -2.5, 7: -3.0, EOS: -4.0},
    (6,): {7: -0.1, 5: -3.0, 6: -3.5, EOS: -5.0},
}


def _scripted(seen: list):
    async def generate(request_id: str, ids: list[int], params: SamplingParams):
        seen.append((ids, params))
        entry = TABLE.get(tuple(ids[1:]), {5: -1.0, 6: -2.0, 7: -3.0, EOS: -4.0})
        token = max(entry, key=entry.get)
        yield StepOutput([ChoiceDelta(0, "", [token], [dict(entry)], "length")], len(ids), 0, True)
    return generate


def _search(beam: BeamSearch, **params) -> tuple[list[ChoiceDelta], list]:
    seen = []

    async def main():
        stream = beam_search(_scripted(seen), "r", [1], SamplingParams(**params), beam, {EOS},
                             lambda ids, skip: " ".join(map(str, ids)))
        return [s async for s in stream]

    (out,) = asyncio.run(main())
    return out.choices, seen


def test_an_ended_beam_competes_by_its_length_normalized_score():
    choices, seen = _search(BeamSearch(2), max_tokens=2, logprobs=1)
    # EOS first: -0.3 over length 1 (the prompt's; the end token does not count) beats 6 7: -1.1 / 3
    # as vLLM gives an ended beam: its end token is the stop_reason, not in the tokens
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in choices] == \
        [([], "", "stop", EOS), ([6, 7], "6 7", "length", None)]
    assert choices[1].logprobs == [{EOS: -0.3, 6: -1.0}, {7: -0.1}]  # the top 1 and the token itself
    assert [ids for ids, _ in seen] == [[1], [1, 5], [1, 6]]  # 2 rounds; the ended beam is not extended
    assert all(p.logprobs == 4 and p.max_tokens == 1 and p.temperature == 0 for _, p in seen)
    # a length penalty of 2 favours the longer beams: 6 7 at -1.1 / 9 and 5 5 at -2.5 / 9 beat -0.3 / 1
    choices, _ = _search(BeamSearch(2, length_penalty=2.0), max_tokens=2)
    assert [c.token_ids for c in choices] == [[6, 7], [5, 5]]


def test_end_tokens_ignore_eos_stop_token_ids_and_include_stop_str():
    choices, _ = _search(BeamSearch(2, include_stop_str_in_output=True), max_tokens=2, logprobs=0)
    assert (choices[0].token_ids, choices[0].text, choices[0].stop_reason) == ([EOS], "2", EOS)
    assert choices[0].logprobs == [{EOS: -0.3}]
    choices, _ = _search(BeamSearch(2), max_tokens=2, ignore_eos=True)  # EOS is a token like any other
    assert all(c.finish_reason == "length" and len(c.token_ids) == 2 for c in choices)
    choices, _ = _search(BeamSearch(2), max_tokens=2, ignore_eos=True, stop_token_ids=[EOS])  # ends it again,
    assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in choices] == [
        ([EOS], "", "stop", EOS), ([6, 7], "6 7", "length", None)]  # as sampling: in the tokens, not the text
    choices, _ = _search(BeamSearch(2, include_stop_str_in_output=True), max_tokens=2, ignore_eos=True,
                         stop_token_ids=[EOS])
    assert (choices[0].token_ids, choices[0].text) == ([EOS], "2")


def test_more_logprobs_than_the_search_needs_are_asked_for_and_given():
    choices, seen = _search(BeamSearch(1), max_tokens=1, logprobs=3)
    assert {p.logprobs for _, p in seen} == {3}
    assert choices[0].logprobs == [{5: -0.5, 6: -1.0, EOS: -0.3}]  # 5 leads once EOS ended its own beam


def test_a_request_the_engine_cut_fails_the_search_and_cancels_the_rest_of_its_round():
    from router.errors import OpenAIError

    closed = []

    async def generate(request_id, ids, params):
        try:
            if ids[1:] == [6]:  # the second beam of round 2: the engine drained it
                yield StepOutput([ChoiceDelta(0, "", [], None, "abort")], len(ids), 0, True)
                return
            if ids[1:] == [5]:  # the first: still running when the other fails
                await asyncio.sleep(30)
            async for step in _scripted([])(request_id, ids, params):
                yield step
        finally:
            closed.append(tuple(ids[1:]))

    async def main():
        stream = beam_replies(beam_search(generate, "r", [1], SamplingParams(max_tokens=3), BeamSearch(2), {EOS}, str))
        with pytest.raises(OpenAIError) as e:
            await asyncio.wait_for(anext(stream), 10)
        return e.value

    error = asyncio.run(main())
    assert error.status == 503 and "stopped this beam search" in error.body()["error"]["message"]
    assert sorted(closed) == [(), (5,), (6,)]  # the waiting request was closed too (its engine request aborted)


def test_any_length_penalty_ranks_without_overflow():
    """vLLM's score divides by length ** length_penalty; ranked in log space, 1e308 is no 500."""
    for penalty, lengths in ((1e308, [2, 2]), (-1e308, [0, 1]), (0.0, [0, 2])):  # longest first / shortest / by cum
        choices, _ = _search(BeamSearch(2, length_penalty=penalty), max_tokens=2)
        assert [len(c.token_ids) for c in choices] == lengths, penalty
