"""Synthetic request streams: arrivals at a rate, length distributions, shared-prefix groups, bursts.

    shared-prefix   each request picks a group (Zipf popularity); prompt = the group's prefix
                    (a long system prompt, few-shot examples or a document) + its own suffix
    no-prefix       every prompt is unique

Arrivals are Poisson, or gamma renewals with a coefficient of variation `cv` > 1 for burstier
traffic; `bursts` multiply the rate inside time windows. Prompt tokens are drawn when a request
arrives (`RequestSpec.prompt()`), so only in-flight requests hold token lists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

VOCAB = 256  # small ints are shared objects in CPython; 16-token blocks still never collide in practice


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "shared-prefix"  # shared-prefix | no-prefix
    rate: float = 64.0  # mean requests per second, whole cluster
    duration_s: float = 60.0  # arrivals happen in [0, duration_s)
    cv: float = 1.0  # inter-arrival coefficient of variation: 1 = Poisson, > 1 burstier (gamma)
    bursts: tuple[tuple[float, float, float], ...] = ()  # (start_s, length_s, rate multiplier)
    num_groups: int = 128  # shared-prefix: prefix groups
    group_zipf: float = 1.0  # popularity of group k ~ 1 / k**s
    prefix_len: int = 1536  # shared-prefix: tokens of each group's prefix
    prompt_mean: int = 128  # suffix (shared-prefix) or whole prompt (no-prefix): mean tokens, lognormal
    prompt_sigma: float = 0.5  # lognormal shape of prompt lengths
    output_mean: int = 128  # output tokens, uniform in [output_mean / 2, 3 * output_mean / 2]
    max_prompt: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("shared-prefix", "no-prefix"):
            raise ValueError(f"workload kind must be shared-prefix or no-prefix, got {self.kind!r}")
        if self.rate <= 0 or self.duration_s <= 0 or self.cv <= 0:
            raise ValueError("rate, duration_s and cv must be > 0")
        if self.num_groups < 1 or self.prompt_mean < 1 or self.output_mean < 1:
            raise ValueError("num_groups, prompt_mean and output_mean must be >= 1")


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival: float
    group: int  # -1: no shared prefix
    prefix: tuple[int, ...] | None  # shared by every request of the group (one object)
    suffix_len: int
    max_tokens: int
    seed: int

    @property
    def num_prompt_tokens(self) -> int:
        return (len(self.prefix) if self.prefix else 0) + self.suffix_len

    def prompt(self) -> list[int]:
        suffix = np.random.default_rng(self.seed).integers(0, VOCAB, self.suffix_len).tolist()
        return list(self.prefix) + suffix if self.prefix else suffix


def arrival_times(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Renewal process at rate 1 (gamma gaps with the configured cv), time-warped by the bursts."""
    shape = 1.0 / (cfg.cv * cfg.cv)
    n_guess = int(cfg.rate * cfg.duration_s * (1 + sum(max(0, m - 1) * l for _, l, m in cfg.bursts) / cfg.duration_s))
    gaps = rng.gamma(shape, 1.0 / shape, size=int(n_guess * 1.2) + 100)
    work = np.cumsum(gaps) / cfg.rate  # arrival "work" at the base rate
    # Inside a burst window time runs `m` times faster: map work back to wall time piecewise.
    edges = sorted({0.0, cfg.duration_s} | {s for s, _, _ in cfg.bursts} | {s + l for s, l, _ in cfg.bursts})
    t_out, w0 = [], 0.0
    for lo, hi in zip(edges, edges[1:]):
        m = math.prod(mult for s, l, mult in cfg.bursts if s <= lo < s + l)
        w1 = w0 + (hi - lo) * m
        sel = work[(work >= w0) & (work < w1)]
        t_out.append(lo + (sel - w0) / m)
        w0 = w1
    return np.concatenate(t_out) if t_out else np.zeros(0)


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    rng = np.random.default_rng(cfg.seed)
    times = arrival_times(cfg, rng)
    n = len(times)
    mu = math.log(cfg.prompt_mean) - cfg.prompt_sigma ** 2 / 2
    lens = np.clip(rng.lognormal(mu, cfg.prompt_sigma, n).astype(int), 1, cfg.max_prompt)
    outs = rng.integers(max(1, cfg.output_mean // 2), cfg.output_mean * 3 // 2 + 1, n)
    seeds = rng.integers(0, 2**62, n)
    if cfg.kind == "shared-prefix":
        prefix_rng = np.random.default_rng(cfg.seed + 1)
        prefixes = [tuple(prefix_rng.integers(0, VOCAB, cfg.prefix_len).tolist()) for _ in range(cfg.num_groups)]
        weights = 1.0 / np.arange(1, cfg.num_groups + 1) ** cfg.group_zipf
        groups = rng.choice(cfg.num_groups, size=n, p=weights / weights.sum())
    return [RequestSpec(f"r{i}", float(times[i]),
                        int(groups[i]) if cfg.kind == "shared-prefix" else -1,
                        prefixes[groups[i]] if cfg.kind == "shared-prefix" else None,
                        int(lens[i]), int(outs[i]), int(seeds[i]))
            for i in range(n)]
