"""A request for more samples than the engine runs at once (n > max_num_seqs): the ingress asks
for them in several engine calls (router.engine_streams.sample_calls), each seeded where its
samples sit, so the reply is the one a single call would give."""
from __future__ import annotations

import asyncio

import pytest

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
