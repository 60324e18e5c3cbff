"""The offline LLM after a call that did not finish (Ctrl-C in a notebook, a step that raised): the
next call runs as if it never happened. Its requests were aborted and their blocks returned, and
the prefix cache holds no block whose KV the failed step never wrote (a later prompt sharing the
prefix would read it and answer wrong tokens, silently)."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.tiny_llama import hf_greedy, make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_path)
    rng = random.Random(31)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (13, 10)]
    return d, prompts, hf_greedy(d, prompts, GREEDY.max_tokens)


def _clean(llm: LLM) -> bool:
    eng = llm.engine
    eng.scheduler.check_integrity()
    return not eng.requests and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_step_that_raised_leaves_no_unwritten_block_in_the_prefix_cache(tiny, monkeypatch):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    model, calls = llm.engine.executor.runner.model, []
    forward = model.forward

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # in the first prefill's forward: no KV written
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _clean(llm) and not llm.engine.block_manager.hash_to_block
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.num_cached_tokens for o in outs] == [0, 0]  # computed, not read from the failed step's blocks
    assert _clean(llm)


def test_a_failed_step_requeues_its_sequences_when_the_engine_goes_on(tiny, monkeypatch):
    """A direct LLMEngine user may step again after a step raised: its sequences start over."""
    d, prompts, ref = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, GREEDY)
    eng.step()  # both prefilled, their blocks written and cached
    execute, failed = eng.executor.execute, []

    def once(*args, **kwargs):  # a decode step (which may not call the model's forward)
        if not failed:
            failed.append(1)
            raise RuntimeError("out of memory")
        return execute(*args, **kwargs)

    monkeypatch.setattr(eng.executor, "execute", once)
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.step()
    assert len(eng.scheduler.waiting) == 2 and not eng.scheduler.running
    eng.scheduler.check_integrity()
    done = {o.request_id: o for o in _step_out(eng)}
    assert [done[str(i)].outputs[0].token_ids for i in range(2)] == ref and _clean(llm)


@pytest.mark.parametrize("n", [1, 2])
def test_a_draw_that_raised_is_undone_and_the_engine_goes_on(tiny, monkeypatch, n):
    """At tp=1 the draws run after the model, where the host waits for the device: Ctrl-C or a
    device error lands there most. Nothing of the step stays (no advanced sequence spinning with
    nothing to compute, no fork of a prefill whose draw failed)."""
    from engine.executor import LocalDraws

    d, prompts, ref = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    eng, params = llm.engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=n)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    sample, failed = LocalDraws.sample, []

    def once(self, rows, seqs):
        if not failed:
            failed.append(1)
            raise KeyboardInterrupt
        return sample(self, rows, seqs)

    monkeypatch.setattr(LocalDraws, "sample", once)
    with pytest.raises(KeyboardInterrupt):
        eng.step()  # the prefills' draws
    assert len(eng.scheduler.waiting) == 2 and not eng.scheduler.running
    assert all(len(r.seqs) == 1 for r in eng.requests.values())  # no fork stayed
    eng.scheduler.check_integrity()
    done = {o.request_id: o for o in _step_out(eng)}
    assert [[c.token_ids for c in done[str(i)].outputs] for i in range(2)] == [[r] * n for r in ref] and _clean(llm)


def _step_out(eng, max_steps: int = 200) -> list:
    """Steps `eng` until nothing is left; -> the finished outputs, in the order they came."""
    outs = []
    for _ in range(max_steps):
        outs += [o for o in eng.step() if o.finished]
        if not eng.has_unfinished():
            break
    return outs


def _second_append_interrupted(tiny, monkeypatch, first: SamplingParams) -> tuple[LLM, object]:
    """An engine whose first step raised (Ctrl-C) in its second append: request "0" (`first`)
    had its token appended, request "1" (GREEDY) not."""
    d, prompts, _ = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    eng = llm.engine
    eng.add_request("0", prompts[0], first)
    eng.add_request("1", prompts[1], GREEDY)
    step_interrupted_in_second_append(eng, monkeypatch)
    return llm, eng


def step_interrupted_in_second_append(eng, monkeypatch) -> None:
    """One step of `eng` whose second Request.append_token raises KeyboardInterrupt (a Ctrl-C
    while detokenizing); later appends run as usual."""
    from engine.request import Request

    append_token, calls = Request.append_token, []

    def second_raises(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return append_token(self, *args, **kwargs)

    monkeypatch.setattr(Request, "append_token", second_raises)
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    monkeypatch.setattr(Request, "append_token", append_token)


@pytest.mark.parametrize("n,max_tokens", [(1, 1), (2, 8)])
def test_an_append_that_raised_loses_nothing_and_the_engine_goes_on(tiny, monkeypatch, n, max_tokens):
    """Ctrl-C in an append (a request's detokenizing, after the draws): a request another append of
    the step finished still gets its last output, on the next step; a child forked in the step
    starts over with its parent (n=2: it raised in the child's first append)."""
    d, prompts, ref = tiny
    llm, eng = _second_append_interrupted(tiny, monkeypatch, SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n))
    eng.scheduler.check_integrity()
    done = {o.request_id: o for o in _step_out(eng)}
    assert [c.token_ids for c in done["0"].outputs] == [ref[0][:max_tokens]] * n
    assert done["1"].outputs[0].token_ids == ref[1] and _clean(llm)


def test_a_held_output_is_dropped_with_its_request_and_its_id_reused(tiny, monkeypatch):
    """The request whose last output is held (test above) aborted, and its id taken by a new one
    before the next step: the new one is served, once, and nothing of the old one goes out."""
    d, prompts, ref = tiny
    llm, eng = _second_append_interrupted(tiny, monkeypatch, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    eng.abort("0")
    eng.add_request("0", prompts[0], GREEDY)
    outs = _step_out(eng)
    assert sorted((o.request_id, o.outputs[0].token_ids) for o in outs) == [("0", ref[0]), ("1", ref[1])]
    assert _clean(llm)


def test_an_interrupted_generate_aborts_its_requests_and_the_next_one_runs(tiny):
    d, prompts, ref = tiny

    class CtrlC:  # a progress bar whose update the user interrupts
        def __init__(self, **kwargs):
            pass

        def update(self, n):
            raise KeyboardInterrupt

        def close(self):
            pass

    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):  # the first prompt finishes first; the second is still running
        llm.generate(prompts, [short, GREEDY], use_tqdm=CtrlC)
    assert _clean(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # raised KeyError on an orphan's output
    assert [o.outputs[0].token_ids for o in outs] == ref and _clean(llm)


def test_a_ctrl_c_right_after_the_engine_took_a_request_aborts_it_too(tiny, monkeypatch):
    from engine.llm_engine import LLMEngine

    d, prompts, ref = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    add, calls = LLMEngine.add_request, []

    def then_ctrl_c(self, *args, **kwargs):
        add(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the second prompt is in the engine; generate has not recorded it yet
            raise KeyboardInterrupt

    monkeypatch.setattr(LLMEngine, "add_request", then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _clean(llm)
    monkeypatch.undo()

    from engine.scheduler import Scheduler

    queue = Scheduler.add

    def ctrl_c_first(self, seq):  # inside add_request: the engine holds the request, the queue not yet
        raise KeyboardInterrupt

    monkeypatch.setattr(Scheduler, "add", ctrl_c_first)
    with pytest.raises(KeyboardInterrupt):  # not the abort's ValueError of a sequence never queued
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(Scheduler, "add", queue)
    assert _clean(llm)


def test_generate_leaves_the_engines_other_requests_alone(tiny):
    d, prompts, ref = tiny
    llm = LLM(model=str(d), block_size=4, num_gpu_blocks_override=64)
    llm.engine.add_request("mine", prompts[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outs = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0]
