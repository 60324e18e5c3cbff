"""Autoscaling engine replicas on KV pressure.

Serve's default policy scales on ongoing requests per replica, which says little about an LLM
engine: 30 long-context requests can exhaust the KV cache while 200 short ones fit. Here the
replicas report KV block usage, queued prefill tokens and preemptions, and the policy sizes the
fleet so that mean usage sits at `target_kv_usage`, with two pressure signals that force growth:

    by_usage   = ceil(n * mean_kv_usage / target_kv_usage)
    by_backlog = ceil(total_waiting_prefill_tokens / max_waiting_prefill_tokens)
    by_preempt = n + 1  if preemptions/s per replica > max_preemptions_per_s  else 0
    desired    = clamp(max(by_usage, by_backlog, by_preempt), min_replicas, max_replicas)

`ceil` gives hysteresis for free: from n replicas it scales down only once usage would stay
under target on n - 1. Changes wait `upscale_delay_s` / `downscale_delay_s` of consistent
decisions (`ScaleDelay`, Serve's own rule, so the simulator and tests see what Serve does).

Wiring into Serve (Ray 2.60 API, `ray.serve.config`):

    replica:  EngineServer.record_autoscaling_stats(self) -> dict[str, float]
                  return self._kv_metrics.record(self.engine.stats())   # workers.autoscale_stats
              (Serve calls it every metrics push; values are averaged over look_back_period_s)
    policy:   AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=30,
                  downscale_delay_s=300, look_back_period_s=30,
                  policy=AutoscalingPolicy(policy_function="cluster.autoscale:KVPressurePolicy",
                                           policy_kwargs={"target_kv_usage": 0.75, ...}))
              `serve_autoscaling_config(...)` builds this as a plain dict (Serve config YAML too).
              Serve instantiates the class once with policy_kwargs, calls it with an
              `AutoscalingContext` per control-loop tick, reads our metrics from
              ctx.aggregated_metrics[name][replica_id], and itself applies min/max, the
              up/down scaling factors and the delays to what we return.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from workers.autoscale_stats import KV_USAGE, PREEMPTIONS_PER_S, WAITING_PREFILL_TOKENS

POLICY_PATH = "cluster.autoscale:KVPressurePolicy"


@dataclass(frozen=True)
class KVAutoscaleConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_usage: float = 0.75  # mean fraction of KV blocks in use to aim for
    max_waiting_prefill_tokens: int = 8192  # queued prompt tokens per replica before growing
    max_preemptions_per_s: float = 0.5  # per replica, before growing
    upscale_delay_s: float = 30.0  # a scale-up must be wanted this long (Serve's default)
    downscale_delay_s: float = 300.0  # a scale-down must be wanted this long

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if not 0 < self.target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {self.target_kv_usage}")
        if self.max_waiting_prefill_tokens < 1 or self.max_preemptions_per_s < 0:
            raise ValueError("max_waiting_prefill_tokens must be >= 1 and max_preemptions_per_s >= 0")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")

    def policy_kwargs(self) -> dict:
        """The thresholds KVPressurePolicy takes (min/max and delays live in Serve's config)."""
        return {"target_kv_usage": self.target_kv_usage, "max_waiting_prefill_tokens": self.max_waiting_prefill_tokens,
                "max_preemptions_per_s": self.max_preemptions_per_s}


@dataclass(frozen=True)
class KVMetrics:
    """Fleet-wide KV pressure, from the replicas that reported."""
    num_replicas: int  # running replicas
    kv_usage: float  # mean over reporting replicas, in [0, 1]
    waiting_prefill_tokens: float  # summed over replicas
    preemptions_per_s: float  # summed over replicas


def desired_replicas(m: KVMetrics, cfg: KVAutoscaleConfig) -> int:
    """The replica count these metrics call for, within [min_replicas, max_replicas], no delays."""
    n = m.num_replicas
    if n == 0:  # nothing reports: only the backlog (seen by nobody yet) could say more
        return max(cfg.min_replicas, 1 if m.waiting_prefill_tokens > 0 else 0)
    by_usage = math.ceil(n * m.kv_usage / cfg.target_kv_usage - 1e-9)
    by_backlog = math.ceil(m.waiting_prefill_tokens / cfg.max_waiting_prefill_tokens - 1e-9)
    by_preempt = n + 1 if m.preemptions_per_s / n > cfg.max_preemptions_per_s else 0
    return min(cfg.max_replicas, max(cfg.min_replicas, by_usage, by_backlog, by_preempt))


@dataclass
class ScaleDelay:
    """Serve's delay rule (`ray.serve.autoscaling_policy._apply_delay_logic`): move the target
    only after the same direction has been wanted for the delay; any other decision resets."""
    direction: int = 0  # +1 wanting up, -1 wanting down, 0 neither
    since: float | None = None

    def apply(self, desired: int, current_target: int, now: float, cfg: KVAutoscaleConfig) -> int:
        direction = (desired > current_target) - (desired < current_target)
        if direction == 0:
            self.direction, self.since = 0, None
            return current_target
        if direction != self.direction:
            self.direction, self.since = direction, now
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        if now - self.since + 1e-6 >= delay:
            self.direction, self.since = 0, None
            return desired
        return current_target


@dataclass
class KVAutoscaler:
    """desired_replicas + ScaleDelay: the whole decision, for the simulator and tests."""
    config: KVAutoscaleConfig
    target: int = -1  # current target replica count; -1: start at min_replicas
    delay: ScaleDelay = field(default_factory=ScaleDelay)

    def __post_init__(self) -> None:
        if self.target < 0:
            self.target = max(1, self.config.min_replicas)

    def step(self, metrics: KVMetrics, now: float) -> int:
        self.target = self.delay.apply(desired_replicas(metrics, self.config), self.target, now, self.config)
        return self.target


# -- Serve side --------------------------------------------------------------------------------------
def metrics_from_reports(per_metric: Mapping[str, Mapping[object, float]], num_replicas: int) -> KVMetrics | None:
    """From Serve's ctx.aggregated_metrics ({metric: {replica_id: value}}); None before any report."""
    usage = per_metric.get(KV_USAGE) or {}
    if not usage:
        return None
    return KVMetrics(num_replicas=num_replicas, kv_usage=sum(usage.values()) / len(usage),
                     waiting_prefill_tokens=sum((per_metric.get(WAITING_PREFILL_TOKENS) or {}).values()),
                     preemptions_per_s=sum((per_metric.get(PREEMPTIONS_PER_S) or {}).values()))


class KVPressurePolicy:
    """A Serve custom autoscaling policy (class form: Serve builds it once with policy_kwargs)."""

    def __init__(self, target_kv_usage: float = 0.75, max_waiting_prefill_tokens: int = 8192,
                 max_preemptions_per_s: float = 0.5) -> None:
        self.thresholds = dict(target_kv_usage=target_kv_usage, max_waiting_prefill_tokens=max_waiting_prefill_tokens,
                               max_preemptions_per_s=max_preemptions_per_s)
        KVAutoscaleConfig(**self.thresholds)  # validate now, not at the first tick

    def __call__(self, ctx) -> tuple[int, dict]:
        """ctx: ray.serve.config.AutoscalingContext. Serve applies delays and bounds afterwards."""
        metrics = metrics_from_reports(ctx.aggregated_metrics or {}, ctx.current_num_replicas)
        if metrics is None:
            return ctx.target_num_replicas, {}
        cfg = KVAutoscaleConfig(min_replicas=ctx.capacity_adjusted_min_replicas,
                                max_replicas=max(1, ctx.capacity_adjusted_max_replicas), **self.thresholds)
        return desired_replicas(metrics, cfg), {}


def serve_autoscaling_config(policy: str = "kv", config: KVAutoscaleConfig | None = None,
                             target_ongoing_requests: float | None = None, look_back_period_s: float = 30.0) -> dict:
    """The engine deployment's `autoscaling_config` (a dict, as in a Serve config file).

    policy "kv": KVPressurePolicy; "requests": Serve's default ongoing-requests policy."""
    cfg = config or KVAutoscaleConfig()
    out = {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
           "upscale_delay_s": cfg.upscale_delay_s, "downscale_delay_s": cfg.downscale_delay_s,
           "look_back_period_s": look_back_period_s}
    if policy == "kv":
        out["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": cfg.policy_kwargs()}
    elif policy == "requests":
        if target_ongoing_requests is not None:
            out["target_ongoing_requests"] = target_ongoing_requests
    else:
        raise ValueError(f"unknown autoscaling policy {policy!r}; choose kv or requests")
    return out

