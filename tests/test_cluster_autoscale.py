"""KV-pressure autoscaling policy (cluster/autoscale.py): counts, delays, and its Serve adapter."""
from types import SimpleNamespace

import pytest

from cluster.autoscale import (KV_USAGE, PREEMPTIONS_PER_S, WAITING_PREFILL_TOKENS, KVAutoscaleConfig,
                               KVAutoscaler, KVMetrics, KVPressurePolicy, ScaleDelay,
                               desired_replicas, serve_autoscaling_config)
from engine.outputs import EngineStats
from workers.autoscale_stats import KVMetricsRecorder

CFG = KVAutoscaleConfig(min_replicas=1, max_replicas=8, target_kv_usage=0.75, max_waiting_prefill_tokens=8192,
                        max_preemptions_per_s=0.5, upscale_delay_s=10, downscale_delay_s=60)


def m(n, usage=0.5, waiting=0, preempt=0.0):
    return KVMetrics(num_replicas=n, kv_usage=usage, waiting_prefill_tokens=waiting, preemptions_per_s=preempt)


@pytest.mark.parametrize("metrics, want", [
    (m(1, 0.5), 1),  # under target: stay
    (m(1, 0.75), 1),  # at target: stay
    (m(1, 0.9), 2),  # over target: grow in proportion
    (m(2, 1.0), 3),  # ceil(2 * 1.0 / 0.75)
    (m(4, 0.3), 2),  # ceil(4 * 0.3 / 0.75) = 2: shrink
    (m(3, 0.5), 2),  # ceil(3 * 0.5 / 0.75) = 2
    (m(3, 0.51), 3),  # 2 replicas would run at 0.765 > target: keep 3 (hysteresis from ceil)
    (m(2, 0.1, waiting=30000), 4),  # backlog: ceil(30000 / 8192)
    (m(2, 0.5, preempt=2.0), 3),  # preempting 1/s per replica: one more
    (m(1, 0.0), 1),  # idle: never below min_replicas
    (m(8, 1.0, waiting=10**6), 8),  # never above max_replicas
    (m(0, 0.0, waiting=100), 1),  # nothing running yet but work queued
])
def test_desired_replicas(metrics, want):
    assert desired_replicas(metrics, CFG) == want


def test_min_replicas_zero_scales_to_zero_only_when_idle():
    cfg = KVAutoscaleConfig(min_replicas=0, max_replicas=4)
    assert desired_replicas(m(1, 0.0), cfg) == 0
    assert desired_replicas(m(0, 0.0), cfg) == 0
    assert desired_replicas(m(1, 0.2), cfg) == 1


def test_delays_hold_a_change_until_it_has_been_wanted_long_enough():
    auto = KVAutoscaler(CFG)
    assert auto.target == 1
    hot, cold = m(1, 1.0), m(2, 0.05)
    assert [auto.step(hot, t) for t in (0, 5, 9.9)] == [1, 1, 1]
    assert auto.step(hot, 10) == 2  # wanted for upscale_delay_s
    assert [auto.step(cold, t) for t in (11, 40, 70.9)] == [2, 2, 2]
    assert auto.step(cold, 71) == 1  # wanted for downscale_delay_s


def test_an_interrupted_wish_restarts_its_delay():
    delay = ScaleDelay()
    assert delay.apply(3, 2, 0.0, CFG) == 2
    assert delay.apply(2, 2, 5.0, CFG) == 2  # back to steady: reset
    assert delay.apply(3, 2, 6.0, CFG) == 2
    assert delay.apply(3, 2, 15.0, CFG) == 2  # only 9 s since it restarted
    assert delay.apply(3, 2, 16.0, CFG) == 3
    assert delay.apply(1, 3, 17.0, CFG) == 3  # direction flips: a fresh downscale delay
    assert delay.apply(4, 3, 18.0, CFG) == 3
    assert delay.apply(1, 3, 19.0, CFG) == 3 and delay.apply(1, 3, 79.0, CFG) == 1


def test_bad_config_is_rejected():
    for kw in (dict(min_replicas=3, max_replicas=2), dict(target_kv_usage=0), dict(max_waiting_prefill_tokens=0),
               dict(upscale_delay_s=-1)):
        with pytest.raises(ValueError):
            KVAutoscaleConfig(**kw)
    with pytest.raises(ValueError):
        KVPressurePolicy(target_kv_usage=1.5)


def engine_stats(free, preemptions=0, waiting_tokens=0):
    return EngineStats(num_total_blocks=100, num_free_blocks=free, block_size=16, num_running=1, num_waiting=0,
                       num_preemptions=preemptions, prefix_query_tokens=0, prefix_hit_tokens=0,
                       waiting_prefill_tokens=waiting_tokens)


def test_recorder_reports_usage_backlog_and_a_preemption_rate():
    clock = iter([0.0, 2.0, 4.0]).__next__
    rec = KVMetricsRecorder(clock)
    first = rec.record(engine_stats(40, preemptions=5, waiting_tokens=300))
    assert first == {KV_USAGE: 0.6, WAITING_PREFILL_TOKENS: 300.0, PREEMPTIONS_PER_S: 0.0}
    assert rec.record(engine_stats(40, preemptions=9))[PREEMPTIONS_PER_S] == 2.0
    assert rec.record(engine_stats(40, preemptions=9))[PREEMPTIONS_PER_S] == 0.0


def ctx(per_replica: dict, current=2, target=2, lo=1, hi=6):
    metrics = {KV_USAGE: {}, WAITING_PREFILL_TOKENS: {}, PREEMPTIONS_PER_S: {}}
    for rid, (usage, waiting, rate) in per_replica.items():
        metrics[KV_USAGE][rid] = usage
        metrics[WAITING_PREFILL_TOKENS][rid] = waiting
        metrics[PREEMPTIONS_PER_S][rid] = rate
    return SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=current, target_num_replicas=target,
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi)


def test_serve_policy_reads_the_replicas_custom_metrics():
    policy = KVPressurePolicy(target_kv_usage=0.5)
    assert policy(ctx({"a": (0.9, 0, 0.0), "b": (0.7, 0, 0.0)}))[0] == 4  # ceil(2 * 0.8 / 0.5)
    assert policy(ctx({"a": (0.1, 0, 0.0), "b": (0.2, 0, 0.0)}))[0] == 1
    assert policy(ctx({"a": (0.1, 20000, 0.0), "b": (0.1, 0, 0.0)}))[0] == 3  # backlog
    assert policy(ctx({"a": (1.0, 0, 0.0), "b": (1.0, 0, 0.0)}, hi=3))[0] == 3  # Serve's capacity bound
    assert policy(ctx({}, target=5))[0] == 5  # no reports yet: keep the current target


def test_serve_config_dict_is_a_valid_autoscaling_config_with_our_policy():
    from ray.serve.config import AutoscalingConfig

    cfg = KVAutoscaleConfig(min_replicas=1, max_replicas=3, target_kv_usage=0.6, upscale_delay_s=5,
                            downscale_delay_s=20)
    serve_cfg = AutoscalingConfig(**serve_autoscaling_config("kv", cfg))
    assert (serve_cfg.min_replicas, serve_cfg.max_replicas) == (1, 3)
    assert (serve_cfg.upscale_delay_s, serve_cfg.downscale_delay_s) == (5, 20)
    policy_cls = serve_cfg.policy.get_policy()  # what Serve's controller deserializes
    policy = policy_cls(**serve_cfg.policy.policy_kwargs)
    assert policy.thresholds["target_kv_usage"] == 0.6
    default = AutoscalingConfig(**serve_autoscaling_config("requests", cfg, target_ongoing_requests=8))
    assert default.policy.is_default_policy_function() and default.target_ongoing_requests == 8
    with pytest.raises(ValueError):
        serve_autoscaling_config("queue")
