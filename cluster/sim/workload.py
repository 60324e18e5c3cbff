"""Synthetic request streams: arrivals at a rate, length distributions, shared-prefix groups, bursts.

    shared-prefix   each request picks a group (Zipf popularity); prompt = the group's prefix
                    (a long system prompt, few-shot examples or a document) + its own suffix
    no-prefix       every prompt is unique
    skewed          a few hot system prompts carry `hot_share` of the traffic, the rest spreads
                    over a long tail of rarely repeated ones (Zipf over the other groups)
    multi-turn      chat sessions start at rate / mean turns; each turn's prompt is the previous
                    prompt + the previous answer + a new user message, sent `think_s` (exponential)
                    after the previous answer finished; sessions end after 2..2*turns_mean-2
                    turns, so sessions come and go. The first turn starts with one of
                    `num_groups` system prompts.

Arrivals are Poisson, or gamma renewals with a coefficient of variation `cv` > 1 for burstier
traffic; `bursts` multiply the rate inside time windows (for multi-turn: the session starts).
Prompt tokens are drawn when a request arrives (`RequestSpec.prompt()`), so only in-flight
requests hold token lists. A multi-turn answer is fixed in advance (`RequestSpec.output()`, the
simulated replica samples exactly it), so the next turn's prompt holds the tokens the replica
generated, as a chat client's would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

VOCAB = 256  # small ints are shared objects in CPython; 16-token blocks still never collide in practice
KINDS = ("shared-prefix", "no-prefix", "skewed", "multi-turn")


def _pieces(n: int = VOCAB) -> list[str]:
    """A made-up detokenizer for the prefix-affinity router, which matches prompt text: token t
    is a word piece of 1-8 letters (mean ~4, as in English BPE vocabularies), a space before
    every other one."""
    rng = np.random.default_rng(12345)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [(" " if t % 2 else "") + "".join(rng.choice(list(letters), int(rng.integers(1, 8))))
            for t in range(n)]


PIECES = _pieces()


def detokenize(token_ids) -> str:
    return "".join(PIECES[t] for t in token_ids)


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "shared-prefix"  # shared-prefix | no-prefix | skewed | multi-turn
    rate: float = 64.0  # mean requests per second, whole cluster
    duration_s: float = 60.0  # arrivals happen in [0, duration_s)
    cv: float = 1.0  # inter-arrival coefficient of variation: 1 = Poisson, > 1 burstier (gamma)
    bursts: tuple[tuple[float, float, float], ...] = ()  # (start_s, length_s, rate multiplier)
    num_groups: int = 128  # shared-prefix / skewed: prefix groups; multi-turn: system prompts
    group_zipf: float = 1.0  # popularity of group k ~ 1 / k**s
    prefix_len: int = 1536  # tokens of each group's prefix (multi-turn: of each system prompt)
    prompt_mean: int = 128  # suffix / user message (no-prefix: whole prompt): mean tokens, lognormal
    prompt_sigma: float = 0.5  # lognormal shape of prompt lengths
    output_mean: int = 128  # output tokens, uniform in [output_mean / 2, 3 * output_mean / 2]
    max_prompt: int = 4096
    num_hot: int = 4  # skewed: hot system prompts
    hot_share: float = 0.8  # skewed: share of the requests that use a hot one
    turns_mean: float = 6.0  # multi-turn: mean turns per session (uniform over 2..2*mean-2)
    think_s: float = 3.0  # multi-turn: mean pause between an answer and the next turn
    max_context: int = 7000  # multi-turn: a session ends before its prompt + answer would pass this
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.rate <= 0 or self.duration_s <= 0 or self.cv <= 0:
            raise ValueError("rate, duration_s and cv must be > 0")
        if self.num_groups < 1 or self.prompt_mean < 1 or self.output_mean < 1:
            raise ValueError("num_groups, prompt_mean and output_mean must be >= 1")
        if self.kind == "skewed" and not (0 < self.num_hot < self.num_groups and 0 <= self.hot_share <= 1):
            raise ValueError("skewed needs 0 < num_hot < num_groups and hot_share in [0, 1]")
        if self.turns_mean < 2 or self.think_s < 0:
            raise ValueError("turns_mean must be >= 2 and think_s >= 0")


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival: float  # seconds; with `context` set, seconds after that request finished (think time)
    group: int  # -1: no shared prefix
    prefix: tuple[int, ...] | None  # shared by every request of the group (one object)
    suffix_len: int
    max_tokens: int
    seed: int
    context: "RequestSpec | None" = None  # multi-turn: the previous turn, whose prompt + answer lead this one
    session: str | None = None  # multi-turn: the conversation (what a session-sticky router keys on)

    @property
    def num_prompt_tokens(self) -> int:
        if self.context is not None:
            return self.context.num_prompt_tokens + self.context.max_tokens + self.suffix_len
        return (len(self.prefix) if self.prefix else 0) + self.suffix_len

    def prompt(self) -> list[int]:
        suffix = np.random.default_rng(self.seed).integers(0, VOCAB, self.suffix_len).tolist()
        if self.context is not None:
            return self.context.prompt() + self.context.output() + suffix
        return list(self.prefix) + suffix if self.prefix else suffix

    def output(self) -> list[int]:
        """The answer a multi-turn request gets (the simulated replica samples these tokens)."""
        return np.random.default_rng(self.seed ^ 0x5EED).integers(0, VOCAB, self.max_tokens).tolist()

    @property
    def fixed_output(self) -> bool:
        return self.session is not None


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


def _lengths(cfg: WorkloadConfig, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mu = math.log(cfg.prompt_mean) - cfg.prompt_sigma ** 2 / 2
    lens = np.clip(rng.lognormal(mu, cfg.prompt_sigma, n).astype(int), 1, cfg.max_prompt)
    outs = rng.integers(max(1, cfg.output_mean // 2), cfg.output_mean * 3 // 2 + 1, n)
    return lens, outs, rng.integers(0, 2**62, n)


def _group_weights(cfg: WorkloadConfig) -> np.ndarray:
    zipf = 1.0 / np.arange(1, cfg.num_groups + 1) ** cfg.group_zipf
    if cfg.kind != "skewed":
        return zipf / zipf.sum()
    hot, tail = zipf[:cfg.num_hot], zipf[cfg.num_hot:]
    return np.concatenate([cfg.hot_share * hot / hot.sum(), (1 - cfg.hot_share) * tail / tail.sum()])


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """Every request of the workload; multi-turn follow-ups carry their previous turn as `context`."""
    rng = np.random.default_rng(cfg.seed)
    times = arrival_times(cfg, rng)
    if cfg.kind == "multi-turn":
        return _sessions(cfg, rng, times)
    n = len(times)
    lens, outs, seeds = _lengths(cfg, rng, n)
    if cfg.kind == "no-prefix":
        return [RequestSpec(f"r{i}", float(times[i]), -1, None, int(lens[i]), int(outs[i]), int(seeds[i]))
                for i in range(n)]
    prefix_rng = np.random.default_rng(cfg.seed + 1)
    prefixes = [tuple(prefix_rng.integers(0, VOCAB, cfg.prefix_len).tolist()) for _ in range(cfg.num_groups)]
    groups = rng.choice(cfg.num_groups, size=n, p=_group_weights(cfg))
    return [RequestSpec(f"r{i}", float(times[i]), int(groups[i]), prefixes[groups[i]], int(lens[i]), int(outs[i]),
                        int(seeds[i]))
            for i in range(n)]


def _sessions(cfg: WorkloadConfig, rng: np.random.Generator, request_times: np.ndarray) -> list[RequestSpec]:
    """`request_times` are at the request rate; every turns_mean-th one starts a session."""
    starts = request_times[::max(1, round(cfg.turns_mean))]
    prefix_rng = np.random.default_rng(cfg.seed + 1)
    systems = [tuple(prefix_rng.integers(0, VOCAB, cfg.prefix_len).tolist()) for _ in range(cfg.num_groups)]
    weights = _group_weights(cfg)
    out: list[RequestSpec] = []
    for k, t0 in enumerate(starts):
        turns = int(rng.integers(2, max(3, round(2 * cfg.turns_mean - 2) + 1)))
        lens, outs, seeds = _lengths(cfg, rng, turns)
        thinks = rng.exponential(cfg.think_s, turns) if cfg.think_s > 0 else np.zeros(turns)
        group = int(rng.choice(cfg.num_groups, p=weights))
        prev = None
        for j in range(turns):
            spec = RequestSpec(f"s{k}t{j}", float(t0) if prev is None else float(thinks[j]), group, systems[group],
                               int(lens[j]), int(outs[j]), int(seeds[j]), context=prev, session=f"s{k}")
            if spec.num_prompt_tokens + spec.max_tokens > cfg.max_context:
                break
            out.append(spec)
            prev = spec
    return out
