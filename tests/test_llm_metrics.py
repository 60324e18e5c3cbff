"""vLLM's `LLM.get_metrics()` (LLM(disable_log_stats=False)): the server's metrics, recorded in
memory by the offline engine (engine.metrics into engine.metric_sinks), each request counted
once however it ends, the gauges read at the call."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.metric_sinks import Counter, Gauge, Histogram, MemorySinks
from tests.test_llm_interrupted import step_interrupted_in_second_append
from tests.tiny_llama import make_tiny_llama

PROMPTS = [[1, 17, 99, 250, 3, 42], [5, 6, 7], [9] * 11]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    return make_tiny_llama(tmp_path_factory.mktemp("metrics"), smollm2_path, "gqa", vocab_size=49152)


def _llm(tiny_dir, **kw) -> LLM:
    return LLM(model=str(tiny_dir), max_model_len=64, num_gpu_blocks_override=32, disable_log_stats=False, **kw)


def _by_name(metrics) -> dict[str, list]:
    out: dict[str, list] = {}
    for m in metrics:
        out.setdefault(m.name, []).append(m)
    return out


def _value(metrics, name: str, **labels) -> float:
    [m] = [m for m in _by_name(metrics)[name] if labels.items() <= m.labels.items()]
    return m.value


def test_generate_counts_each_request_and_token(tiny_dir):
    llm = _llm(tiny_dir)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    fanned = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS[:1], fanned)
    metrics = llm.get_metrics()
    names = _by_name(metrics)
    assert {m.labels["model_name"] for m in metrics} == {str(tiny_dir)}  # the model as given, as vLLM's
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert generated == 3 * 5 + 3 * 4
    assert _value(metrics, "kvserve_generation_tokens") == generated
    assert _value(metrics, "kvserve_prompt_tokens") == sum(map(len, PROMPTS)) + len(PROMPTS[0])
    assert _value(metrics, "kvserve_request_success", finished_reason="length") == 4
    assert _value(metrics, "kvserve_request_success", finished_reason="abort") == 0  # every reason from 0
    assert _value(metrics, "kvserve_num_requests_running") == 0 and _value(metrics, "kvserve_kv_cache_usage_perc") == 0
    hist = {name: ms[0] for name, ms in names.items() if isinstance(ms[0], Histogram)}
    assert hist["kvserve_time_to_first_token_seconds"].count == 4
    # one gap per step after the first: the fanned request's 3 samples step together
    assert hist["kvserve_inter_token_latency_seconds"].count == 3 * 4 + 3
    assert hist["kvserve_request_params_n"].sum == 1 + 1 + 1 + 3
    assert hist["kvserve_request_max_num_generation_tokens"].sum == 5 + 5 + 5 + 4  # the fanned one's longest sample
    assert hist["kvserve_request_generation_tokens"].sum == generated
    for h in hist.values():
        counts = list(h.buckets.values())
        assert counts == sorted(counts) and counts[-1] == h.count and list(h.buckets)[-1] == "+Inf"
    assert all(isinstance(m, Counter) for m in names["kvserve_engine_steps"])
    steps = {m.labels["kind"]: m.value for m in names["kvserve_engine_steps"]}
    assert steps["prefill"] >= 2 and steps["decode"] >= 4
    assert llm.engine._timers == {}


def test_prefix_hits_preemptions_and_tokens_per_step(tiny_dir):
    """vLLM's prompt_tokens_cached, request_prefill_kv_computed_tokens, request_num_preemptions,
    iteration_tokens_total and cache_config_info, from a run with a prefix hit and preemptions."""
    llm = LLM(model=str(tiny_dir), max_model_len=64, block_size=4, num_gpu_blocks_override=10,
              max_num_batched_tokens=32, disable_log_stats=False)
    shared = list(range(100, 120))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [shared + [1], shared + [2], [7] * 9, [8] * 9]
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)  # 21 blocks wanted, 10 held
    metrics = llm.get_metrics()
    hist = {m.name: m for m in metrics if isinstance(m, Histogram)}
    cached = sum(o.num_cached_tokens for o in outs)
    assert cached == 20  # the second prompt's first 5 blocks
    assert _value(metrics, "kvserve_prompt_tokens_cached") == cached
    assert hist["kvserve_request_prefill_kv_computed_tokens"].count == 4
    assert hist["kvserve_request_prefill_kv_computed_tokens"].sum == sum(map(len, prompts)) - cached
    preemptions = _value(metrics, "kvserve_num_preemptions")
    assert preemptions > 0
    assert hist["kvserve_request_num_preemptions"].count == 4
    assert hist["kvserve_request_num_preemptions"].sum == preemptions
    steps = sum(m.value for m in metrics if m.name == "kvserve_engine_steps")
    assert hist["kvserve_iteration_tokens_total"].count == steps
    # every step's tokens: the prompts' (less the hit, plus what preemptions recompute) and the decodes'
    assert hist["kvserve_iteration_tokens_total"].sum >= sum(map(len, prompts)) - cached + 4 * 11
    assert hist["kvserve_iteration_tokens_total"].buckets["1.0"] > 0  # steps of one decode alone
    [info] = [m for m in metrics if m.name == "kvserve_cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "4" and info.labels["num_gpu_blocks"] == "10"
    waiting = {m.labels["reason"]: m.value for m in metrics if m.name == "kvserve_num_requests_waiting_by_reason"}
    assert waiting == {"capacity": 0, "deferred": 0}


def test_gauges_are_read_at_the_call_and_an_abort_counts_once(tiny_dir):
    llm = _llm(tiny_dir)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("a", PROMPTS[0], params)
    eng.add_request("b", PROMPTS[1], params)
    metrics = llm.get_metrics()
    assert _value(metrics, "kvserve_num_requests_waiting") == 2 and _value(metrics, "kvserve_num_requests_running") == 0
    eng.step()
    eng.step()
    metrics = llm.get_metrics()
    assert _value(metrics, "kvserve_num_requests_running") == 2 and _value(metrics, "kvserve_kv_cache_usage_perc") > 0
    eng.abort("a")
    eng.abort("a")  # a second abort of it is nothing
    while eng.has_unfinished():
        eng.step()
    metrics = llm.get_metrics()
    assert _value(metrics, "kvserve_request_success", finished_reason="abort") == 1
    assert _value(metrics, "kvserve_request_success", finished_reason="length") == 1
    e2e = [m for m in metrics if m.name == "kvserve_e2e_request_latency_seconds"][0]
    assert e2e.count == 2
    with pytest.raises(InvalidRequestError):  # refused: not a request the engine served
        eng.add_request("c", [], params)
    assert _value(llm.get_metrics(), "kvserve_request_success", finished_reason="length") == 1
    assert eng._timers == {}


def test_a_step_that_raised_in_an_append_counts_only_what_was_kept(tiny_dir, monkeypatch):
    """The second append of a step raises (Ctrl-C): its token is drawn again next step and counted
    then; the first request, finished by that step and held, ends as it ended though aborted."""
    llm = _llm(tiny_dir)
    eng = llm.engine
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    eng.add_request("1", PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    step_interrupted_in_second_append(eng, monkeypatch)
    assert [r.request_id for r in eng._held] == ["0"]
    held = eng.abort("0")
    outs = [held]
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    metrics = llm.get_metrics()
    assert _value(metrics, "kvserve_generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs) == 7
    assert _value(metrics, "kvserve_request_success", finished_reason="length") == 2
    assert _value(metrics, "kvserve_request_success", finished_reason="abort") == 0
    [ttft] = [m for m in metrics if m.name == "kvserve_time_to_first_token_seconds"]
    [itl] = [m for m in metrics if m.name == "kvserve_inter_token_latency_seconds"]
    assert (ttft.count, itl.count) == (2, 5)


def test_a_batch_refused_at_admission_counts_nothing(tiny_dir):
    llm = _llm(tiny_dir)
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPTS[0], []], SamplingParams(max_tokens=2))
    metrics = llm.get_metrics()
    assert sum(m.value for m in metrics if m.name == "kvserve_request_success") == 0
    assert [m.count for m in metrics if m.name == "kvserve_e2e_request_latency_seconds"] == [0]
    assert llm.engine._timers == {} and not llm.engine.has_unfinished()


def test_off_by_default_as_in_vllm(tiny_dir):
    llm = LLM(model=str(tiny_dir), max_model_len=64, num_gpu_blocks_override=32)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    assert llm.engine.metrics is None and llm.engine._timers == {}
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_histogram_buckets_are_cumulative_and_inclusive():
    sinks = MemorySinks("m")
    prompt_tokens = sinks["kvserve_request_prompt_tokens"]  # bounds 1, 2, 5, 10, ...
    for v in (1, 2, 3, 5, 7, 10 ** 7):
        prompt_tokens.observe(v)
    sinks["kvserve_num_requests_running"].set(4)
    read = {m.name: m for m in sinks.read()}
    h = read["kvserve_request_prompt_tokens"]
    assert (h.count, h.sum) == (6, 1 + 2 + 3 + 5 + 7 + 10 ** 7)
    assert [h.buckets[b] for b in ("1.0", "2.0", "5.0", "10.0", "+Inf")] == [1, 2, 4, 5, 6]  # a bound holds its value
    assert list(h.buckets)[-3:] == ["500000.0", "1e+06", "+Inf"]  # as Prometheus writes `le`
    assert read["kvserve_num_requests_running"] == Gauge("kvserve_num_requests_running", {"model_name": "m"}, 4)
    assert read["kvserve_time_to_first_token_seconds"].count == 0  # there, empty, from the start
