"""ProcessEngine: the engine core in its own process, behind AsyncEngine's streaming contract.

Same outputs as AsyncEngine (greedy, seeded n=2 sampling, logprobs, prompt logprobs, stop
strings, constrained JSON), merged deltas for a stream that falls behind, aborts that free their
blocks, clear errors, and a core that dies or loses its parent ends cleanly.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import AsyncEngine, LLM, SamplingParams
from engine.errors import EngineDeadError, InvalidRequestError
from engine.process_engine import ProcessEngine
from engine.protocol import EngineClient
from engine.structured.params import StructuredOutputsParams
from tests.tiny_llama import make_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    """Over the whole SmolLM2 vocabulary, so that text prompts and grammars' tokens fit."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("process"), smollm2_path, "gqa", vocab_size=49152))


@pytest.fixture(scope="module")
def engine(tiny_dir):
    e = ProcessEngine(model=tiny_dir, num_gpu_blocks_override=96, max_model_len=512)
    yield e
    asyncio.run(e.shutdown())
    assert e._proc.returncode == 0


PROMPTS = [[(7 * i + 3 * j) % 5000 + 3 for j in range(n)] for i, n in enumerate((7, 30, 18, 55))]


async def _collect(engine, rid: str, prompt, params=GREEDY, delay: float = 0.0):
    outs = []
    async for out in engine.generate(rid, prompt, params):
        outs.append(out)
        if delay:
            time.sleep(delay)  # holds the loop, as a slow relay does
    return outs


async def _wait_free(engine, timeout: float = 30.0) -> bool:
    """On the loop: the core's stats come in through it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.stats()
        if s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0:
            return True
        await asyncio.sleep(0.02)
    return False


def test_greedy_streams_match_offline_and_free_their_blocks(engine, tiny_dir):
    assert isinstance(engine, EngineClient)
    ref = [o.outputs[0].token_ids for o in LLM(model=tiny_dir, num_gpu_blocks_override=96).generate(PROMPTS, GREEDY)]

    async def main():
        start = time.monotonic()
        results = await asyncio.gather(*(_collect(engine, f"g{i}", p) for i, p in enumerate(PROMPTS)))
        return start, time.monotonic(), results, await _wait_free(engine)

    start, end, results, freed = asyncio.run(main())
    assert freed
    for outs in results:  # the core's clock is this process's (time.monotonic, one host)
        (scheduled,) = {o.first_scheduled_time for o in outs}
        assert start <= scheduled <= end
    for outs, r, prompt in zip(results, ref, PROMPTS):
        last = outs[-1]
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == r == last.outputs[0].token_ids
        assert "".join(o.outputs[0].delta_text for o in outs) == last.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length" and last.prompt_token_ids == prompt
        assert not any(o.finished for o in outs[:-1])


def test_outputs_equal_async_engines_for_every_kind_of_request(engine, tiny_dir):
    """Sampled n=2 with a seed, logprobs, prompt logprobs, a text prompt, a stop string, FINAL_ONLY."""
    from engine import RequestOutputKind

    cases = [
        ("n2", PROMPTS[1], SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=16, logprobs=2)),
        ("plp", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)),
        ("text", TEXT, SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=12)),
        ("final", PROMPTS[3], SamplingParams(temperature=0, max_tokens=9, output_kind=RequestOutputKind.FINAL_ONLY)),
    ]

    async def run(e):
        return await asyncio.gather(*(_collect(e, rid, p, params) for rid, p, params in cases))

    async def reference():
        e = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=96, max_model_len=512)
        try:
            return await run(e)
        finally:
            await e.shutdown()

    want, got = asyncio.run(reference()), asyncio.run(run(engine))
    for (rid, *_), w, g in zip(cases, want, got):
        wl, gl = w[-1], g[-1]
        assert gl.prompt_token_ids == wl.prompt_token_ids and gl.prompt == wl.prompt, rid
        assert _same_logprobs(gl.prompt_logprobs, wl.prompt_logprobs), rid
        for wc, gc in zip(wl.outputs, gl.outputs, strict=True):
            assert (gc.index, gc.text, gc.token_ids, gc.finish_reason, gc.stop_reason) == \
                   (wc.index, wc.text, wc.token_ids, wc.finish_reason, wc.stop_reason), rid
            # the same tokens; the figures within float32 noise of another process's matmuls
            assert _same_logprobs(gc.logprobs, wc.logprobs), rid
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-4), rid
    assert len(got[3]) == len(want[3]) == 2  # FINAL_ONLY: the first token, then the whole
    greedy = asyncio.run(_collect(engine, "greedy", TEXT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    text = greedy[-1].outputs[0].text
    assert len(text) > 12
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text[8:11]])
    w, g = asyncio.run(_reference_one(tiny_dir, stop)), asyncio.run(_collect(engine, "stop", TEXT, stop))
    assert (g[-1].outputs[0].text, g[-1].outputs[0].stop_reason) == (w[-1].outputs[0].text, w[-1].outputs[0].stop_reason)
    assert g[-1].outputs[0].finish_reason == "stop"


def _same_logprobs(got, want) -> bool:
    """Per token (a dict, or a PromptLogprob): the same tokens, figures within 1e-4."""
    if got is None or want is None:
        return got is want

    def entry(e):
        return {} if e is None else (e.entry() if hasattr(e, "entry") else e)
    return len(got) == len(want) and all(
        entry(g).keys() == entry(w).keys() and all(abs(entry(g)[k] - entry(w)[k]) < 1e-4 for k in entry(w))
        for g, w in zip(got, want))


async def _reference_one(tiny_dir, params):
    e = AsyncEngine(model=tiny_dir, num_gpu_blocks_override=96, max_model_len=512)
    try:
        return await _collect(e, "stop", TEXT, params)
    finally:
        await e.shutdown()


def test_a_stream_that_falls_behind_takes_the_steps_since_as_one_output(engine):
    async def main():
        fast = asyncio.create_task(_collect(engine, "fast", PROMPTS[0], LONG))
        slow = await _collect(engine, "slow", PROMPTS[1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                              delay=0.05)
        fast.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fast
        return slow, await _wait_free(engine)

    slow, freed = asyncio.run(main())
    assert freed
    tokens = [t for o in slow for t in o.outputs[0].delta_token_ids]
    assert len(tokens) == 60 and tokens == slow[-1].outputs[0].token_ids
    assert len(slow) < 30  # one output per read, not per step


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def main():
        agen = engine.generate("leave", PROMPTS[3], LONG)
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        assert engine.stats().num_free_blocks < engine.stats().num_total_blocks
        await agen.aclose()  # what a disconnecting HTTP client does
        return await _wait_free(engine)

    assert asyncio.run(main())


def test_abort_by_id_ends_the_stream(engine):
    async def main():
        seen = []

        async def consume():
            async for out in engine.generate("b", PROMPTS[1], LONG):
                seen.append(out)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.01)
        await engine.abort("b")
        await asyncio.wait_for(task, 30)
        return seen, await _wait_free(engine)

    seen, freed = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert freed


def test_invalid_requests_raise_from_the_stream(engine):
    async def main():
        errors = []
        for prompt, params in [([], GREEDY), ([5] * 512, GREEDY), ([5] * 10, SamplingParams(max_tokens=600)),
                               ([10**6], GREEDY)]:
            with pytest.raises(InvalidRequestError) as e:
                await _collect(engine, "x", prompt, params)
            errors.append(e.value)
        agen = engine.generate("dup", PROMPTS[0], LONG)
        await agen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, "dup", PROMPTS[0])
        await agen.aclose()
        assert await _wait_free(engine)
        return errors

    errors = asyncio.run(main())
    assert [e.param for e in errors] == ["prompt", "prompt", "max_tokens", "prompt"]
    assert "empty" in str(errors[0]) and errors[1].code == "context_length_exceeded"


def test_constrained_requests_compile_in_the_core(engine):
    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}}, "required": ["n"],
              "additionalProperties": False}
    ok = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    bad = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="(unclosed"))

    async def main():
        outs = await _collect(engine, "json", TEXT, ok)
        with pytest.raises(InvalidRequestError) as e:
            await _collect(engine, "bad", TEXT, bad)
        return outs, e.value

    outs, err = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert json.loads(outs[-1].outputs[0].text)["n"] in (1, 22, 333)
    assert err.param == "structured_outputs"


def test_routing_snapshot_is_refreshed_by_the_core(engine):
    from engine.hashing import hash_prefix_blocks

    async def main():
        await _collect(engine, "warm", PROMPTS[3])
        engine.routing_snapshot()  # asks for a fresh one
        end = time.monotonic() + 5
        while time.monotonic() < end:
            await asyncio.sleep(0.02)
            snap = engine.routing_snapshot()
            if set(hash_prefix_blocks(PROMPTS[3], 16)) <= snap.prefix_hashes:
                return snap
        raise AssertionError("no fresh routing snapshot")

    snap = asyncio.run(main())
    assert snap.num_running == 0 and snap.num_free_blocks == snap.num_total_blocks


async def _streaming(engine, rid: str, prompt, params) -> asyncio.Task:
    """_collect as a task, once its first output has come: a fault then lands mid-stream (a fixed
    wait did not: 400 tokens of the tiny model can take less than 0.2 s)."""
    first = asyncio.Event()

    async def run():
        outs = []
        async for out in engine.generate(rid, prompt, params):
            outs.append(out)
            first.set()
        return outs

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 30)
    assert not task.done()
    return task


def test_a_core_that_fails_ends_every_stream(tiny_dir):
    async def main():
        e = ProcessEngine(model=tiny_dir, num_gpu_blocks_override=64)
        task = await _streaming(e, "a", PROMPTS[0], LONG)
        e._send(("no such message",))  # the core's loop raises on it
        with pytest.raises(EngineDeadError, match="no such message"):
            await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDeadError):
            e.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(e, "b", PROMPTS[0])
        await e.shutdown()
        return e

    e = asyncio.run(main())
    assert e._proc.returncode not in (None, 0) and not e.is_healthy


def test_a_killed_core_ends_every_stream(tiny_dir):
    async def main():
        e = ProcessEngine(model=tiny_dir, num_gpu_blocks_override=64)
        task = await _streaming(e, "a", PROMPTS[0], LONG)
        os.kill(e._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited") as inside:
            await asyncio.wait_for(task, 10)
        assert inside.value.admitted
        with pytest.raises(EngineDeadError) as after:
            await _collect(e, "b", PROMPTS[0])
        assert not after.value.admitted
        with pytest.raises(EngineDeadError):
            e.check_health()
        await e.shutdown()

    asyncio.run(main())


def test_the_core_logs_what_the_engine_logs(tiny_dir, capfd):
    """The model loaded, its KV blocks, the attention backend: on the stderr the core shares with
    its replica, as an in-process engine logs them (the core's logging was unconfigured: lost)."""
    asyncio.run(ProcessEngine(model=tiny_dir, num_gpu_blocks_override=64).shutdown())
    err = capfd.readouterr().err
    assert "engine-core" in err and "KV cache 64 blocks" in err and "attention backend" in err, err[-2000:]


def test_a_core_that_cannot_load_says_why(tmp_path):
    with pytest.raises(Exception, match="config.json|not a directory|No such file|does not"):
        ProcessEngine(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        ProcessEngine(model=str(tmp_path), tensor_parallel_size=2)


def test_the_core_exits_when_its_parent_is_killed(tiny_dir):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from engine.process_engine import ProcessEngine
        e = ProcessEngine(model={tiny_dir!r}, num_gpu_blocks_override=64)
        print(e._proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    core = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert _gone_within(core, 20)


def _gone_within(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.1)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_request_that_fails_oddly_fails_alone(engine):
    """Any error a request raises in the core's admission (not only the ValueErrors of validation)
    goes to that request's stream, as AsyncEngine raises it in the caller: the core and every
    other stream go on."""
    class Unpicklable(SamplingParams):
        pass  # a local class: pickle cannot name it, so the request cannot be sent

    async def main():
        long = asyncio.create_task(_collect(engine, "long", PROMPTS[1], LONG))
        await asyncio.sleep(0.2)
        with pytest.raises(TypeError):
            await _collect(engine, "bad-ids", [5, "x", 7])
        with pytest.raises(RuntimeError, match="could not be sent"):
            await _collect(engine, "bad-params", PROMPTS[0], Unpicklable(temperature=0, max_tokens=4))
        outs = await asyncio.wait_for(long, 60)
        after = await _collect(engine, "after", PROMPTS[0])
        return outs, after, await _wait_free(engine)

    outs, after, freed = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == LONG.max_tokens and after[-1].finished and freed
    engine.check_health()


def test_a_finished_output_that_came_before_the_core_died_is_delivered(tiny_dir):
    async def main():
        e = ProcessEngine(model=tiny_dir, num_gpu_blocks_override=64)
        stream = e.generate("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        first = await stream.__anext__()
        # The loop stays busy (no await) while the core finishes "a": its last tick is read here by
        # hand, as the loop's reader would, so that it is in before the core fails however slow
        # the host (a fixed sleep was not always enough).
        s, deadline = e._streams[e._keys["a"]], time.monotonic() + 60
        while not s.finished:
            assert time.monotonic() < deadline, "the core never finished 'a'"
            if e._conn_in.poll(0.1):
                e._dispatch(e._conn_in.recv())
        e._send(("no such message",))  # then the core fails
        e._proc.wait(timeout=60)
        rest = [out async for out in stream]
        with pytest.raises(EngineDeadError, match="no such message"):  # the cause, not the EOF after it
            e.check_health()
        await e.shutdown()
        return first, rest

    first, rest = asyncio.run(main())
    last = [first, *rest][-1]  # a slow start may take all four tokens in the first output
    assert last.finished and len(last.outputs[0].token_ids) == 4, (first, rest)


def test_shutdown_with_the_cores_pipe_full_is_prompt_and_ends_every_stream(tiny_dir):
    """The loop held while 48 streams run: the core blocks sending into a full pipe, and would
    never read the shutdown if nobody read on."""
    async def main():
        e = ProcessEngine(model=tiny_dir, num_gpu_blocks_override=256, max_num_seqs=64)
        tasks = [asyncio.create_task(_collect(e, f"s{i}", PROMPTS[i % 4], LONG)) for i in range(48)]
        while e.stats().num_running < 48:
            await asyncio.sleep(0.01)
        time.sleep(1.0)  # a burst of relay work holds the loop
        t0 = time.monotonic()
        await e.shutdown()
        took = time.monotonic() - t0
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await e.shutdown()  # twice is once
        return e, took, results

    e, took, results = asyncio.run(main())
    assert took < 25 and e._proc.returncode == 0, (took, e._proc.returncode)  # not 30 s, then SIGKILL
    assert all(isinstance(r, EngineDeadError) and "shut down" in str(r) for r in results), results


def test_a_core_whose_parent_dies_while_it_loads_exits(tiny_dir, tmp_path):
    """Loading reads no pipe; the core watches its parent meanwhile (a load that takes minutes
    on a GPU would otherwise go on beside the replica that replaces it)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys, time
        if "engine.core_process" in sys.orig_argv:  # the core: a model that takes 60 s to load
            import engine.llm_engine as m
            load = m.LLMEngine.__init__
            m.LLMEngine.__init__ = lambda self, *a, **k: (time.sleep(60), load(self, *a, **k))[1]
    """))
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(os.getcwd())!r})
        from engine.process_engine import ProcessEngine
        ProcessEngine(model={tiny_dir!r}, num_gpu_blocks_override=64)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        core = None
        end = time.monotonic() + 30
        while core is None and time.monotonic() < end:
            time.sleep(0.2)
            found = subprocess.run(["pgrep", "-P", str(parent.pid), "-f", "engine.core_process"],
                                   capture_output=True, text=True).stdout.split()
            core = int(found[0]) if found else None
        assert core is not None
        time.sleep(1.0)  # inside the load
    finally:
        parent.kill()
        parent.wait()
    assert _gone_within(core, 10)
