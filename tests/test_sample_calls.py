"""A request for more samples than the engine runs at once (n > max_num_seqs): the ingress, and
the offline LLM, ask for them in several engine calls (SamplingParams.split), each seeded where
its samples sit, so the reply is the one a single call would give."""
from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.engine_streams import sample_calls
from tests.tiny_app import serve_tiny
from tests.tiny_llama import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    return str(make_tiny_llama(tmp_path_factory.mktemp("samples"), smollm2_path, "gqa", vocab_size=49152))


def test_samples_are_cut_into_calls_that_fit_and_keep_their_seeds():
    calls = sample_calls(2, SamplingParams(n=5, seed=7), max_num_seqs=2)
    assert [(i, first, p.n, p.seed) for i, first, p in calls] == [
        (0, 0, 2, 7), (0, 2, 2, 9), (0, 4, 1, 11), (1, 0, 2, 7), (1, 2, 2, 9), (1, 4, 1, 11)]
    assert [p.seed for _, _, p in sample_calls(1, SamplingParams(n=4), 3)] == [None, None]
    assert [p.n for _, _, p in sample_calls(1, SamplingParams(n=7), 3)] == [3, 2, 2]
    params = SamplingParams(n=3, seed=1)
    assert sample_calls(1, params, 3) == [(0, 0, params)]  # fits: one call, as asked


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_more_samples_than_the_engine_runs_at_once_are_the_samples_one_call_gives(tiny_dir, stream):
    """Sample i of a seeded request is the only sample of the same request seeded seed + i (the
    engine's rule), on an engine of two seats asked for five. The prompt's cached tokens are the
    first call's (none: it is new), not those of the later calls, which find what it computed."""
    prompt = [1, 17, 99, 250, 3, 42] + list(range(500, 534))  # 40 tokens: two whole KV blocks
    body = dict(model="m", prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})

    async def go(client, server):
        if stream:
            texts = {}
            async for chunk in await client.completions.create(n=5, seed=7, stream=True, **body):
                for c in chunk.choices:
                    texts[c.index] = texts.get(c.index, "") + c.text
            many = [texts[i] for i in range(5)]
        else:
            reply = await client.completions.create(n=5, seed=7, **body)
            assert [c.index for c in reply.choices] == list(range(5)) and reply.usage.completion_tokens == 40
            assert reply.usage.prompt_tokens == 40 and reply.usage.prompt_tokens_details.cached_tokens == 0
            many = [c.text for c in reply.choices]
        ones = [(await client.completions.create(n=1, seed=7 + i, **body)).choices[0].text for i in range(5)]
        await asyncio.sleep(0.05)
        return many, ones, await server.stats()

    many, ones, stats = serve_tiny(tiny_dir, go, max_num_seqs=2)
    assert many == ones and len(set(many)) > 1
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def test_offline_generate_gives_more_samples_than_max_num_seqs_as_one_call_does(tiny_dir):
    """LLM.generate on an engine of two seats asked for five samples of each of two prompts: the
    samples an engine of eight seats gives in one call, numbered 0-4, the new prompt's cached
    tokens 0, and the KV cache all free after."""
    prompts = [[1, 17, 99, 250, 3, 42] + list(range(500, 534)), [5, 6, 7, 8]]
    params = SamplingParams(n=5, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)
    small = LLM(model=tiny_dir, max_num_seqs=2, num_gpu_blocks_override=64)
    outs = small.generate(prompts, params)
    wide = LLM(model=tiny_dir, max_num_seqs=8, num_gpu_blocks_override=64).generate(prompts, params)
    samples = [[(c.index, c.token_ids) for c in o.outputs] for o in outs]
    assert samples == [[(c.index, c.token_ids) for c in o.outputs] for o in wide]
    assert [len({tuple(t) for _, t in s}) > 1 for s in samples] == [True, True]
    assert [o.request_id for o in outs] == ["offline-0", "offline-1"] and outs[0].num_cached_tokens == 0
    bm = small.engine.block_manager
    assert not small.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_an_offline_batch_with_a_bad_prompt_runs_none_of_it(tiny_dir):
    llm = LLM(model=tiny_dir, max_num_seqs=2, num_gpu_blocks_override=64)
    with pytest.raises(InvalidRequestError, match="prompt token ids"):
        llm.generate([[1, 2, 3], [4, 5], [10 ** 6]], SamplingParams(n=3, max_tokens=4))
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # the engine was left empty and serves on
