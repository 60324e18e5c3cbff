"""workers.metrics without Ray: the recorder against fake metric sinks and a scripted clock, and
EngineServer's request stream over tests.fake_engine.FakeEngine. (Ray's own export of these metrics
is checked end to end in tests/test_router_fake.py.)"""
import asyncio
import dataclasses
import re

import pytest

from engine.config import EngineConfig
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from engine import metrics as M
from workers import metrics as W
from workers.server import EngineServer
from workers.stat_logger import StatLogger, interval_from_env
from tests.fake_engine import FAIL_TOKEN_ID


class Sink:
    """What a Ray Gauge / Counter / Histogram would have been given."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.tags: list[dict] = []

    def set(self, value, tags=None) -> None:
        self.values.append(value)
        self.tags.append(dict(tags or {}))

    def observe(self, value) -> None:
        self.values.append(value)

    def inc(self, value=1.0, tags=None) -> None:
        assert value > 0, "Ray's Counter.inc raises on a value <= 0"
        self.values.append(value)
        self.tags.append(dict(tags or {}))


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def recorder(clock=None) -> tuple[W.ReplicaMetrics, dict[str, Sink]]:
    sinks = {spec.name: Sink() for spec in M.METRICS}
    return W.ReplicaMetrics(sinks, clock or Clock()), sinks


def values(sinks: dict[str, Sink], name: str) -> list[float]:
    return sinks[name].values


def stats(**kw) -> EngineStats:
    base = dict(num_total_blocks=100, num_free_blocks=100, block_size=16, num_running=0, num_waiting=0,
                num_preemptions=0, prefix_query_tokens=0, prefix_hit_tokens=0, waiting_prefill_tokens=0)
    return EngineStats(**{**base, **kw})


# -- the recorder ------------------------------------------------------------------------------------
def test_request_timeline_gives_ttft_itl_e2e_and_token_counts():
    clock = Clock(10.0)
    m, sinks = recorder(clock)
    timer = m.start_request(num_prompt_tokens=7)
    for t, n in [(10.5, 1), (10.6, 1), (10.6, 0), (10.85, 2), (10.9, 1)]:  # n=0: a step with no new token
        clock.t = t
        timer.tokens(n)
    clock.t = 11.0
    timer.finish("stop")
    assert values(sinks, M.TTFT) == pytest.approx([0.5])
    assert values(sinks, M.ITL) == pytest.approx([0.1, 0.25, 0.05])
    assert values(sinks, M.E2E) == pytest.approx([1.0])
    assert values(sinks, M.PROMPT_TOKENS) == [7]
    assert values(sinks, M.GENERATION_TOKENS) == [5]
    assert (values(sinks, M.REQUEST_PROMPT_TOKENS), values(sinks, M.REQUEST_GENERATION_TOKENS)) == ([7], [5])
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "stop"}]
    assert values(sinks, M.REQUEST_SUCCESS) == [1]
    assert not values(sinks, M.RUNNING) and not values(sinks, M.PREEMPTIONS)  # no stats were recorded


def test_request_phases_queue_prefill_decode_inference():
    """vLLM's phase histograms, from the engine's first-scheduled time: at the end, whatever the end."""
    clock = Clock(10.0)
    m, sinks = recorder(clock)
    timer = m.start_request(num_prompt_tokens=7, n=2, max_tokens=30)
    timer.scheduled(10.25)
    timer.scheduled(10.4)  # only the first counts
    for t, n, steps in ((10.5, 2, 1), (10.6, 2, 1), (10.9, 4, 2)):  # n=2 samples; the last output two steps
        clock.t = t
        timer.tokens(n, steps)
    clock.t = 11.0
    timer.finish("abort")  # the caller left 0.1 s after the last token
    assert values(sinks, M.QUEUE_TIME) == pytest.approx([0.25])
    assert values(sinks, M.PREFILL_TIME) == pytest.approx([0.25])
    assert values(sinks, M.DECODE_TIME) == pytest.approx([0.4])  # first token -> last token
    assert values(sinks, M.INFERENCE_TIME) == pytest.approx([0.65])
    assert values(sinks, M.REQUEST_TPOT) == pytest.approx([0.4 / 3])  # three steps after the first
    assert values(sinks, M.E2E) == pytest.approx([1.0])
    assert (values(sinks, M.PARAMS_N), values(sinks, M.PARAMS_MAX_TOKENS)) == ([2], [30])
    # never scheduled (aborted in the queue): no phase; scheduled, no token yet: its queue only;
    # one token: no step after it, a TPOT of 0 (vLLM's)
    m, sinks = recorder(clock)
    m.start_request(3).finish("abort")
    timer = m.start_request(3)
    timer.scheduled(10.5)  # an engine instant before the arrival here (the hop): clamped to it
    timer.finish("abort")
    late = m.start_request(3)
    late.scheduled(12.0)  # ... or after the end
    clock.t += 0.4
    late.finish("abort")
    assert values(sinks, M.QUEUE_TIME) == pytest.approx([0.0, 0.4])
    for name in (M.PREFILL_TIME, M.DECODE_TIME, M.INFERENCE_TIME, M.REQUEST_TPOT, M.PARAMS_MAX_TOKENS):
        assert not values(sinks, name), name
    timer = m.start_request(3)
    timer.scheduled(clock.t)
    clock.t += 0.5
    timer.tokens(1)
    timer.finish("stop")
    assert values(sinks, M.REQUEST_TPOT) == [0.0] and values(sinks, M.DECODE_TIME) == [0.0]
    assert len(values(sinks, M.E2E)) == 4 and values(sinks, M.PARAMS_N) == [1, 1, 1, 1]


def test_output_of_several_steps_shares_its_gap_out_over_them():
    clock = Clock(0.0)
    m, sinks = recorder(clock)
    timer = m.start_request(num_prompt_tokens=3)
    for t, n, steps in [(0.5, 1, 1), (0.9, 4, 4), (1.0, 2, 1), (1.6, 6, 3)]:  # --stream-interval 4; n=2 samples
        clock.t = t
        timer.tokens(n, steps=steps)
    timer.finish("length")
    assert values(sinks, M.TTFT) == pytest.approx([0.5])
    assert values(sinks, M.ITL) == pytest.approx([0.1] * 4 + [0.1] + [0.2] * 3)
    assert sum(values(sinks, M.GENERATION_TOKENS)) == 13


def test_long_request_is_flushed_while_it_runs_and_adds_up_at_the_end():
    clock = Clock(0.0)
    m, sinks = recorder(clock)
    timer = m.start_request(3)
    for i in range(1, 9):  # a token every 0.4 s: flushes at 1.2 s and 2.4 s (>= FLUSH_PERIOD_S apart)
        clock.t = 0.4 * i
        timer.tokens(1)
    assert values(sinks, M.GENERATION_TOKENS) == [3, 3]
    assert len(values(sinks, M.ITL)) == 5  # the first token has no gap
    assert not values(sinks, M.E2E)
    clock.t = 3.5
    timer.finish("length")
    assert values(sinks, M.GENERATION_TOKENS) == [3, 3, 2]
    assert values(sinks, M.ITL) == pytest.approx([0.4] * 7)
    assert values(sinks, M.E2E) == pytest.approx([3.5])
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "length"}]
    assert values(sinks, M.REQUEST_GENERATION_TOKENS) == [8]  # the whole request's, flushes and all


def test_request_aborted_before_its_first_token_counts_once_as_abort():
    clock = Clock(5.0)
    m, sinks = recorder(clock)
    timer = m.start_request(12)
    clock.t = 7.0
    timer.finish("abort")
    timer.finish("stop")  # a second end is ignored
    assert values(sinks, M.E2E) == pytest.approx([2.0])
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "abort"}]
    for name in (M.TTFT, M.ITL, M.PROMPT_TOKENS, M.GENERATION_TOKENS):
        assert not values(sinks, name), name  # never prefilled: no TTFT, no tokens
    assert (values(sinks, M.REQUEST_PROMPT_TOKENS), values(sinks, M.REQUEST_GENERATION_TOKENS)) == ([12], [0])


def test_counts_by_finish_reason():
    m, sinks = recorder()
    for reason in ["stop", "length", "stop", "abort", "error", "stop"]:
        m.start_request(1).finish(reason)
    reasons = [t["finished_reason"] for t in sinks[M.REQUEST_SUCCESS].tags]
    assert {r: reasons.count(r) for r in reasons} == {"stop": 3, "length": 1, "abort": 1, "error": 1}


def test_gauges_and_engine_counters_from_stats_snapshots():
    m, sinks = recorder()
    m.record_stats(stats(num_free_blocks=25, num_running=3, num_waiting=2, num_preemptions=4,
                         prefix_query_tokens=64, prefix_hit_tokens=32))
    m.record_stats(stats(num_free_blocks=90, num_running=1, num_waiting=0, num_preemptions=4,
                         prefix_query_tokens=96, prefix_hit_tokens=32))
    assert values(sinks, M.RUNNING) == [3, 1]
    assert values(sinks, M.WAITING) == [2, 0]
    assert values(sinks, M.KV_USAGE) == pytest.approx([0.75, 0.10])
    # cumulative engine counters become increments; unchanged ones are not incremented (Ray rejects 0)
    assert values(sinks, M.PREEMPTIONS) == [4]
    assert values(sinks, M.PREFIX_QUERIES) == [64, 32]
    assert values(sinks, M.PREFIX_HITS) == [32]


def test_waiting_by_reason_and_cache_config_info_from_snapshots():
    """vLLM's num_requests_waiting_by_reason (deferred: a LoRA adapter that cannot run yet) and
    cache_config_info (the config's labels, value 1)."""
    sinks = {spec.name: Sink() for spec in M.METRICS}
    m = W.ReplicaMetrics(sinks, Clock(), cache_config=EngineConfig(enable_prefix_caching=False))
    m.record_stats(stats(num_waiting=5, num_waiting_deferred=2, num_total_blocks=300, block_size=32))
    assert list(zip(sinks[M.WAITING_BY_REASON].tags, values(sinks, M.WAITING_BY_REASON))) == [
        ({"reason": "deferred"}, 2), ({"reason": "capacity"}, 3)]
    assert values(sinks, M.CACHE_INFO) == [1]
    assert sinks[M.CACHE_INFO].tags == [{"block_size": "32", "num_gpu_blocks": "300", "enable_prefix_caching": "False",
                                         "cache_dtype": "auto", "gpu_memory_utilization": "0.9"}]
    recorder()[0].record_stats(stats())  # without an engine config: no info series
    assert len(values(sinks, M.CACHE_INFO)) == 1


def test_tokens_per_step_histogram_from_cumulative_bucket_totals():
    """Each snapshot's new steps per bucket are observed at their mean: the same buckets, and the
    same sum, as observing every step."""
    from engine.outputs import ITERATION_TOKENS_BUCKETS
    m, sinks = recorder()
    empty = [(0, 0)] * (len(ITERATION_TOKENS_BUCKETS) + 1)

    def totals(**per_bucket):  # bucket index -> (steps, tokens)
        out = list(empty)
        for k, v in per_bucket.items():
            out[int(k[1:])] = v
        return tuple(out)

    m.record_stats(stats(iteration_tokens=totals(b0=(3, 3), b4=(2, 100))))  # 3 steps of 1; 2 of 40 and 60
    m.record_stats(stats(iteration_tokens=totals(b0=(4, 4), b4=(2, 100), b13=(1, 20000))))  # one past the last
    observed = values(sinks, M.ITERATION_TOKENS)
    assert sorted(observed) == [1, 1, 1, 1, 50, 50, 20000]
    assert sum(observed) == 3 + 100 + 1 + 20000
    import bisect
    assert [bisect.bisect_left(ITERATION_TOKENS_BUCKETS, v) for v in sorted(observed)] == [0] * 4 + [4, 4, 13]


def test_cached_prompt_tokens_prefill_computed_and_preemptions_per_request():
    m, sinks = recorder()
    timer = m.start_request(num_prompt_tokens=40)
    timer.scheduled(100.0, num_cached_tokens=32)
    timer.scheduled(100.5, num_cached_tokens=0)  # only the first admission's counts
    timer.preempted(1)
    timer.tokens(1)
    timer.preempted(2)
    timer.preempted(1)  # a stale count does not lower it
    timer.finish("stop")
    assert values(sinks, M.PROMPT_TOKENS) == [40] and values(sinks, M.PROMPT_TOKENS_CACHED) == [32]
    assert values(sinks, M.PREFILL_KV_COMPUTED) == [8]
    assert values(sinks, M.REQUEST_PREEMPTIONS) == [2]
    m.start_request(10).finish("abort")  # never prefilled: no prefill count; 0 preemptions recorded
    assert values(sinks, M.PREFILL_KV_COMPUTED) == [8] and values(sinks, M.REQUEST_PREEMPTIONS) == [2, 0]


def test_engine_step_counters_become_increments_by_kind():
    m, sinks = recorder()
    m.record_stats(stats(prefill_steps=2, prefill_step_seconds=1.5, decode_steps=10, decode_step_seconds=0.5))
    m.record_stats(stats(prefill_steps=2, prefill_step_seconds=1.5, decode_steps=14, decode_step_seconds=0.75))
    assert values(sinks, M.ENGINE_STEPS) == [2, 10, 4]
    assert sinks[M.ENGINE_STEPS].tags == [{"kind": "prefill"}, {"kind": "decode"}, {"kind": "decode"}]
    assert values(sinks, M.ENGINE_STEP_SECONDS) == pytest.approx([1.5, 0.5, 0.25])
    assert sinks[M.ENGINE_STEP_SECONDS].tags == [{"kind": "prefill"}, {"kind": "decode"}, {"kind": "decode"}]


def test_refresh_loop_keeps_going_after_a_failed_read():
    m, sinks = recorder()
    calls = []

    def stats_fn():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine busy")
        return stats(num_running=len(calls))

    async def go():
        task = asyncio.get_running_loop().create_task(m.refresh_forever(stats_fn, period_s=0.001))
        while len(calls) < 3:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(go())
    assert values(sinks, M.RUNNING)[:2] == [2, 3]
    assert m.start_refresh(stats_fn) is None  # no running event loop: nothing started


# -- the periodic stats line ---------------------------------------------------------------------------
def test_stats_line_gives_the_intervals_throughput_and_is_quiet_while_idle():
    clock = Clock(0.0)
    log = StatLogger(interval_s=10.0, clock=clock)
    assert log.line(stats(prompt_tokens=5000, generation_tokens=700)) is None  # counts before it started are not its
    clock.t = 10.0
    rest = stats(prompt_tokens=5000, generation_tokens=700)
    assert log.line(rest) is None  # idle, and idle before: quiet
    clock.t = 15.0
    busy = stats(num_free_blocks=75, num_running=3, num_waiting=1, num_preemptions=2, prefix_query_tokens=400,
                 prefix_hit_tokens=100, prompt_tokens=5900, generation_tokens=750)
    assert log.line(busy) is None
    clock.t = 20.0  # 10 s after the last line: 1,000 prompt tokens computed and 250 sampled in it
    busy = dataclasses.replace(busy, prompt_tokens=6000, generation_tokens=950)
    assert log.line(busy) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 25.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, Preemptions: 2")
    rest = dataclasses.replace(busy, num_free_blocks=100, num_running=0, num_waiting=0)
    clock.t = 30.0  # back at rest: one more line, then quiet
    assert log.line(rest).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                                     "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%")
    clock.t = 40.0
    assert log.line(rest) is None
    clock.t = 50.0  # a preemption alone makes an interval busy; it counts those of the interval
    assert log.line(dataclasses.replace(rest, num_preemptions=5)).endswith("Preemptions: 3")


def test_stats_line_adds_vllms_spec_decoding_line_for_an_interval_with_drafts():
    clock = Clock(0.0)
    log = StatLogger(interval_s=10.0, clock=clock)
    start = stats(num_running=1, generation_tokens=100, spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=12,
                  spec_accepted_per_pos=(8, 4))
    assert log.line(start) is None
    clock.t = 10.0  # 20 steps with drafts in it: 60 drafts, 30 kept (20 first, 8 second, 2 third)
    now = dataclasses.replace(start, generation_tokens=150, spec_drafts=30, spec_draft_tokens=90,
                              spec_accepted_tokens=42, spec_accepted_per_pos=(28, 12, 2))
    main, spec = log.line(now).split("\n")
    assert main.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s")
    assert spec == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.0 tokens/s, "
                    "Drafted throughput: 6.0 tokens/s, Accepted: 30 tokens, Drafted: 60 tokens, "
                    "Per-position acceptance rate: 1.000, 0.400, 0.100, Avg Draft acceptance rate: 50.0%")
    clock.t = 20.0  # no drafts in this one: no second line
    assert "\n" not in log.line(now)


def test_stats_line_interval_from_the_environment():
    assert interval_from_env({}) == 10.0
    assert interval_from_env({"KVSERVE_LOG_STATS_INTERVAL": "0.5"}) == 0.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match="KVSERVE_LOG_STATS_INTERVAL"):
            interval_from_env({"KVSERVE_LOG_STATS_INTERVAL": bad})


def test_refresh_logs_the_stats_line_when_its_interval_ends(caplog):
    clock = Clock(0.0)
    m = W.ReplicaMetrics({spec.name: Sink() for spec in M.METRICS}, clock,
                        stat_logger=StatLogger(interval_s=2.0, clock=clock))
    caplog.set_level("INFO", logger="workers.metrics")
    m.refresh(stats())
    clock.t = 1.0
    m.refresh(stats(num_running=1, prompt_tokens=30, generation_tokens=1))
    assert not caplog.records  # the interval is not over
    clock.t = 2.0
    m.refresh(stats(num_running=1, prompt_tokens=30, generation_tokens=6))
    assert [r.getMessage().split(", Running")[0] for r in caplog.records] == [
        "Avg prompt throughput: 15.0 tokens/s, Avg generation throughput: 3.0 tokens/s"]
    assert W.ReplicaMetrics({}).stat_logger is None  # none unless given


def test_specs_and_ray_metric_objects():
    names = [s.name for s in M.METRICS]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"kvserve_[a-z0-9_]+", n) for n in names)
    for spec in M.METRICS:
        assert spec.kind in ("Gauge", "Counter", "Histogram")
        assert bool(spec.buckets) == (spec.kind == "Histogram"), spec.name
        assert list(spec.buckets) == sorted(set(spec.buckets)), spec.name
    assert M.METRICS[[s.name for s in M.METRICS].index(M.REQUEST_SUCCESS)].exported_names == \
        ("ray_kvserve_request_success_total",)
    objs = W.ray_metrics("my-model")  # outside Ray: real objects that record nothing
    from ray.util import metrics as ray_metrics

    for spec in M.METRICS:
        info = objs[spec.name].info
        assert isinstance(objs[spec.name], getattr(ray_metrics, spec.kind))
        assert info["name"] == spec.name and info["default_tags"] == {"model_name": "my-model"}
        assert info["tag_keys"] == ("model_name", *spec.tag_keys)
        assert tuple(info.get("boundaries") or ()) == spec.buckets
    objs[M.REQUEST_SUCCESS].inc(1, {"finished_reason": "stop"})  # the call shapes the recorder uses
    objs[M.ITL].observe(0.01)
    objs[M.KV_USAGE].set(0.5)


# -- EngineServer's request stream ---------------------------------------------------------------------
def engine_server(sinks: dict[str, Sink]) -> EngineServer:
    config = EngineConfig(max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=64)
    server = EngineServer(config, "tests.fake_engine:FakeEngine", metrics=W.ReplicaMetrics(sinks))
    server.engine.token_delay_s = 0.005
    return server


async def drain(server: EngineServer, prompt: list[int], stop_after: int | None = None, **params) -> list:
    steps = []
    gen = server.generate("r1", prompt, SamplingParams(**params))
    try:
        async for step in gen:
            steps.append(step)
            if len(steps) == stop_after:
                break  # the caller goes away
    finally:
        await gen.aclose()
    return steps


def test_engine_server_records_a_whole_request():
    sinks = {spec.name: Sink() for spec in M.METRICS}
    server = engine_server(sinks)
    steps = asyncio.run(drain(server, [5, 6, 7], max_tokens=4, n=2))
    assert steps[-1].finished
    assert len(values(sinks, M.TTFT)) == 1 and 0 < values(sinks, M.TTFT)[0] < 5
    assert len(values(sinks, M.ITL)) == 3 and all(0 < g < 5 for g in values(sinks, M.ITL))
    assert values(sinks, M.PROMPT_TOKENS) == [3]
    assert sum(values(sinks, M.GENERATION_TOKENS)) == 8  # 4 steps x 2 samples
    assert values(sinks, M.E2E)[0] >= values(sinks, M.TTFT)[0] + sum(values(sinks, M.ITL)) - 1e-9
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "length"}]
    # the engine's first-scheduled time splits the timeline: TTFT = queue + prefill, then decode to
    # the last token, which the end follows
    (queue,), (prefill,), (decode,), (inference,) = (values(sinks, k) for k in (M.QUEUE_TIME, M.PREFILL_TIME,
                                                                                 M.DECODE_TIME, M.INFERENCE_TIME))
    assert queue >= 0 and prefill > 0 and decode > 0
    assert queue + prefill == pytest.approx(values(sinks, M.TTFT)[0])
    assert values(sinks, M.TTFT)[0] + decode <= values(sinks, M.E2E)[0]
    assert inference == pytest.approx(prefill + decode)
    assert values(sinks, M.REQUEST_TPOT) == pytest.approx([decode / 3])  # 4 tokens per sample
    assert (values(sinks, M.PARAMS_N), values(sinks, M.PARAMS_MAX_TOKENS)) == ([2], [4])
    assert values(sinks, M.MAX_SAMPLE_TOKENS) == [4]  # each of its 2 samples made 4: the longest one's


def test_engine_server_counts_a_caller_that_left_as_abort_and_frees_the_request():
    sinks = {spec.name: Sink() for spec in M.METRICS}
    server = engine_server(sinks)
    steps = asyncio.run(drain(server, [5, 6, 7], stop_after=2, max_tokens=None))  # None: the model's room
    assert len(steps) == 2 and not steps[-1].finished
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "abort"}]
    assert values(sinks, M.PARAMS_MAX_TOKENS) == [64 - 3]
    assert values(sinks, M.GENERATION_TOKENS) == [2] and len(values(sinks, M.E2E)) == 1
    assert server.engine.stats().num_running == 0  # the engine's stream was closed too


def test_engine_server_counts_an_engine_failure_as_error():
    sinks = {spec.name: Sink() for spec in M.METRICS}
    server = engine_server(sinks)
    with pytest.raises(RuntimeError):
        asyncio.run(drain(server, [1, FAIL_TOKEN_ID, 2], max_tokens=5))
    assert sinks[M.REQUEST_SUCCESS].tags == [{"finished_reason": "error"}]
    assert values(sinks, M.GENERATION_TOKENS) == [2]


def test_engine_server_refreshes_gauges_in_the_background_until_shutdown():
    sinks = {spec.name: Sink() for spec in M.METRICS}

    async def go():
        server = engine_server(sinks)  # constructed on a running loop, as Serve does
        await asyncio.sleep(0.01)
        assert values(sinks, M.KV_USAGE) == [0.0] and values(sinks, M.RUNNING) == [0]
        task = server._metrics_task
        await server.shutdown()
        await asyncio.sleep(0)
        assert task.cancelled()

    asyncio.run(go())
