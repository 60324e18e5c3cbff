"""AsyncEngine: streaming deltas, concurrency, abort freeing blocks, clear errors, dead engine."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from engine import AsyncEngine, LLM, SamplingParams
from engine.async_engine import EngineDeadError
from tests.tiny_llama import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    return str(make_tiny_llama(tmp_path_factory.mktemp("async"), smollm2_path, "gqa"))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 30, 18, 55)]


async def _collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY):
    deltas, last = [], None
    async for out in engine.generate(rid, prompt, params):
        deltas.append(out.outputs[0].delta_token_ids)
        last = out
    return deltas, last


def test_streams_match_offline(tiny_dir, prompts):
    ref = [o.outputs[0].token_ids for o in LLM(model=tiny_dir, num_gpu_blocks_override=64).generate(prompts, GREEDY)]

    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        results = await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(prompts)))
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    for (deltas, last), r in zip(results, ref):
        assert [t for d in deltas for t in d] == r == last.outputs[0].token_ids
        assert len(deltas) == len(r)  # one delta per generated token
        assert last.finished and last.outputs[0].finish_reason == "length"
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_stats_count_the_steps_and_their_time_by_kind(tiny_dir, prompts):
    """110 prompt tokens at 64 a step: two steps compute prompt tokens, then the last prompt's
    19 further tokens take decode-only steps."""
    llm = LLM(model=tiny_dir, num_gpu_blocks_override=64, max_num_batched_tokens=64)
    start = time.perf_counter()
    llm.generate(prompts, GREEDY)
    wall = time.perf_counter() - start
    s = llm.engine.stats()
    assert (s.prefill_steps, s.decode_steps) == (2, 19)
    assert 0 < s.prefill_step_seconds and 0 < s.decode_step_seconds
    assert s.prefill_step_seconds + s.decode_step_seconds <= wall
    assert (s.prompt_tokens, s.generation_tokens) == (110, 4 * 20)  # the stats line's throughputs
    # Again: the cached prefix blocks are not computed; each of n samples counts its tokens.
    llm.generate(prompts + [[5, 6, 7]], [GREEDY] * 4 + [SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=1)])
    again = llm.engine.stats()
    hits = again.prefix_hit_tokens - s.prefix_hit_tokens
    assert hits == 16 + 16 + 48  # the full blocks of the 30-, 18- and 55-token prompts
    assert again.prompt_tokens - s.prompt_tokens == 110 + 3 - hits
    assert again.generation_tokens - s.generation_tokens == 4 * 20 + 3 * 5


def test_outputs_say_when_their_request_was_first_scheduled(tiny_dir, prompts):
    """One seat: the second request waits for the first to end; a preempted one keeps its first time."""
    engine = LLM(model=tiny_dir, num_gpu_blocks_override=64, max_num_seqs=1).engine
    start = time.monotonic()
    engine.add_request("a", prompts[0], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    seen: dict[str, list[tuple[float, float, bool]]] = {}
    while engine.has_unfinished():
        outs = engine.step()
        after = time.monotonic()
        for out in outs:
            seen.setdefault(out.request_id, []).append((out.first_scheduled_time, after, out.finished))
    for rid in "ab":
        assert len({t for t, _, _ in seen[rid]}) == 1, rid  # the same instant in every output
    (a, a_first, _), (a_end, b_start) = seen["a"][0], (seen["a"][-1][1], seen["b"][0][0])
    assert start <= a <= a_first and seen["a"][-1][2]
    assert a_end <= b_start <= seen["b"][0][1]  # scheduled after a's last step, before its first output
    # preempted and recomputed: still the time of its first admission
    engine = LLM(model=tiny_dir, num_gpu_blocks_override=4, block_size=8).engine
    engine.add_request("c", prompts[0], GREEDY)
    first = engine.step()[0].first_scheduled_time
    seq = engine.requests["c"].seqs[0]
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert seq.num_preemptions == 1 and {o.first_scheduled_time for o in outs} == {first}


def _wait_free(engine: AsyncEngine, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_free_blocks == s.num_total_blocks and s.num_running == 0:
            return True
        time.sleep(0.01)
    return False


def test_leaving_the_stream_aborts_and_frees_blocks(tiny_dir, prompts):
    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        agen = engine.generate("a", prompts[3], long)
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
        await agen.aclose()  # what a disconnecting HTTP client does
        await asyncio.sleep(0.05)
        freed = await asyncio.to_thread(_wait_free, engine)
        await engine.shutdown()
        return freed

    assert asyncio.run(main())


def test_abort_by_id_ends_the_stream(tiny_dir, prompts):
    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        seen = []

        async def consume():
            async for out in engine.generate("b", prompts[1], long):
                seen.append(out)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.01)
        await engine.abort("b")
        await asyncio.wait_for(task, 30)
        freed = await asyncio.to_thread(_wait_free, engine)
        await engine.shutdown()
        return seen, freed

    seen, freed = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert freed


def test_an_id_used_again_at_once_gets_only_its_own_run(tiny_dir, prompts):
    """An id reused right after its stream was left: the first run's abort output (and any of its
    outputs still on their way) went to the second stream, which ended at once with the first
    run's prompt and finish_reason "abort", while the second run went on unread."""
    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        first = engine.generate("re", prompts[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await first.__anext__()
        await first.aclose()
        deltas, last = await asyncio.wait_for(_collect(engine, "re", prompts[0]), 30)
        alone = await _collect(engine, "fresh", prompts[0])
        freed = await asyncio.to_thread(_wait_free, engine)
        await engine.shutdown()
        return deltas, last, alone, freed

    deltas, last, (alone_deltas, alone), freed = asyncio.run(main())
    assert last.request_id == "re" and last.prompt_token_ids == prompts[0]
    assert last.outputs[0].finish_reason == "length" and sum(deltas, []) == sum(alone_deltas, [])
    assert freed


def test_invalid_requests_raise_at_once(tiny_dir):
    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64, max_model_len=64)
        errors = []
        for prompt, params in [([], GREEDY), ([5] * 64, GREEDY), ([5] * 10, SamplingParams(max_tokens=60)),
                               ([10_000], GREEDY)]:
            with pytest.raises(ValueError) as e:
                async for _ in engine.generate("x", prompt, params):
                    pass
            errors.append(str(e.value))
        await engine.shutdown()
        return errors

    errors = asyncio.run(main())
    assert "empty" in errors[0] and "max_model_len" in errors[1] and "max_tokens" in errors[2]
    assert "token ids" in errors[3]


def test_engine_failure_ends_requests_with_error(tiny_dir, prompts):
    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)

        def boom(batch):
            raise RuntimeError("device lost")
        engine.engine.executor.execute = boom
        with pytest.raises(EngineDeadError) as inside:
            await asyncio.wait_for(_collect(engine, "c", prompts[0]), 5)
        assert inside.value.admitted  # it was in the engine: it may be what killed it
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError) as after:
            await _collect(engine, "d", prompts[0])
        assert not after.value.admitted  # the engine was dead before it came
        with pytest.raises(EngineDeadError):
            engine.check_health()
        await engine.shutdown()

    asyncio.run(main())


def test_model_loads_and_steps_on_one_thread(tiny_dir, prompts, monkeypatch):
    """One OpenMP pool per process: the engine is built on the same thread that runs its steps
    (two pools made every CPU decode step ~1.5x slower)."""
    import threading

    from engine import async_engine

    seen: dict[str, set[str]] = {"init": set(), "step": set()}
    real = async_engine.LLMEngine

    class Recording(real):
        def __init__(self, *args, **kwargs):
            seen["init"].add(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def step(self):
            seen["step"].add(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", Recording)

    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        await _collect(engine, "a", prompts[0])
        await engine.shutdown()

    asyncio.run(main())
    assert len(seen["init"]) == 1 and seen["init"] == seen["step"]
    assert seen["init"] != {threading.current_thread().name}


def test_routing_snapshot_is_taken_between_steps(tiny_dir, prompts):
    """Idle: taken at once, with the prefix hashes of what finished. During a step: the last one
    is returned and the running step takes a fresh one as it ends (never a half-stepped state)."""
    from engine.hashing import hash_prefix_blocks
    from engine.protocol import EngineClient, EngineState

    async def main():
        engine = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=64)
        assert isinstance(engine, EngineClient) and isinstance(engine.engine, EngineState)
        await _collect(engine, "warm", prompts[3])
        idle = engine.routing_snapshot()
        prompt_blocks = hash_prefix_blocks(prompts[3], engine.engine.config.block_size)
        assert idle.num_running == 0 and len(prompt_blocks) == 3 and set(prompt_blocks) <= idle.prefix_hashes
        assert idle.num_free_blocks == idle.num_total_blocks == engine.stats().num_total_blocks

        seen = []
        original = engine.engine.step

        def step():  # a routing snapshot asked for while this step runs
            seen.append(engine.routing_snapshot())
            return original()

        engine.engine.step = step
        await _collect(engine, "r", prompts[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        await engine.shutdown()
        return idle, seen, engine.routing_snapshot()

    idle, seen, after = asyncio.run(main())
    assert seen[0] is idle  # the step that admitted "r" was running: the previous snapshot came back
    assert seen[1].timestamp > idle.timestamp and seen[1].num_running == 1  # taken as the first step ended
    assert after.num_running == 0 and after.prefix_hashes >= idle.prefix_hashes


def test_priority_scheduling_runs_the_urgent_request_first_and_fcfs_refuses_priorities(tiny_dir):
    """vLLM's --scheduling-policy priority through the engine, with one seat: a request with a lower
    priority value overtakes the ones that arrived before it (the running one keeps its seat)."""
    from engine.errors import InvalidRequestError
    from engine.llm_engine import LLMEngine
    from engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=tiny_dir, max_num_seqs=1, num_gpu_blocks_override=64,
                                    scheduling_policy="priority"))
    def add(rid: str, priority: int) -> None:
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, priority=priority))

    add("running", 9)
    finished = [o.request_id for o in engine.step() if o.finished]  # it takes the seat
    for rid, priority in [("later", 5), ("normal", 0), ("urgent", -3)]:
        add(rid, priority)
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["running", "urgent", "normal", "later"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    fcfs = LLM(model=tiny_dir, max_num_seqs=1, num_gpu_blocks_override=64)
    with pytest.raises(InvalidRequestError, match="Got priority 1 but priority scheduling is not enabled"):
        fcfs.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
    assert len(fcfs.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=2), priority=[0, 0])) == 2


def test_a_params_object_reused_with_other_allowed_ids_samples_those(tiny_dir):
    """What the engine caches for a request (its allowed ids as a tensor) is kept on its own copy
    of the params, not on the caller's object, which may be changed and sent again."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_dir, num_gpu_blocks_override=64))
    params = SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=[30])
    got = {}
    for rid, allowed in [("a", [30]), ("b", [31])]:
        params.allowed_token_ids = allowed
        engine.add_request(rid, [5, 6, 7], params)
        while engine.has_unfinished():
            got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert got == {"a": [30, 30, 30], "b": [31, 31, 31]}
