"""The engine replica's periodic log line, as vLLM's engine logs its own every 10 s:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.3 tokens/s, Running: 7 reqs,
    Waiting: 2 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 37.5%, Preemptions: 0

Throughputs are the engine's own counts over the interval just ended (prompt tokens it computed,
prefix-cache hits not among them; tokens it sampled), so a long request counts while it runs; the
queue and KV use are as the interval ends; the prefix-cache hit rate is over every prompt token
looked up since the replica started, and the preemptions are those of the interval. An idle
replica is quiet: no line for an interval in which nothing ran, waited or was computed, unless the
interval before it was busy (so the last line of a burst shows the replica back at rest).
With speculative decoding (engine.speculative), an interval that ran drafts adds vLLM's second line:

    SpecDecoding metrics: Mean acceptance length: 2.31, Accepted throughput: 41.2 tokens/s, Drafted
    throughput: 94.0 tokens/s, Accepted: 412 tokens, Drafted: 940 tokens, Per-position acceptance
    rate: 0.612, 0.447, 0.255, Avg Draft acceptance rate: 43.8%

(mean acceptance length: tokens a sequence's step with drafts gave, the one after the drafts included).
`--disable-log-stats` (vLLM's flag) turns it off; the interval is KVSERVE_LOG_STATS_INTERVAL
seconds (vLLM's VLLM_LOG_STATS_INTERVAL), default 10.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from engine.outputs import EngineStats

DEFAULT_INTERVAL_S = 10.0


def interval_from_env(environ=os.environ) -> float:
    raw = environ.get("KVSERVE_LOG_STATS_INTERVAL")
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KVSERVE_LOG_STATS_INTERVAL must be a number of seconds > 0, got {raw!r}")
    return value


class StatLogger:
    """`line(...)`, called often (every metrics refresh), says what to log once an interval is over."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._since = clock()
        self._start: EngineStats | None = None  # the engine's counts when the interval began (None: no snapshot yet)
        self._was_busy = False

    def line(self, stats: EngineStats) -> str | None:
        """-> the line that ends the interval, or None (the interval goes on, or it and the one
        before it were idle)."""
        if self._start is None:  # the first snapshot: the engine's counts so far are not this interval's
            self._start = stats
        now = self.clock()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        start, self._start, self._since = self._start, stats, now
        prompt_rate = (stats.prompt_tokens - start.prompt_tokens) / elapsed
        generation_rate = (stats.generation_tokens - start.generation_tokens) / elapsed
        preempted = stats.num_preemptions - start.num_preemptions
        busy = bool(prompt_rate or generation_rate or stats.num_running or stats.num_waiting or preempted)
        was_busy, self._was_busy = self._was_busy, busy
        if not (busy or was_busy):
            return None
        queried = stats.prefix_query_tokens
        hit_rate = 100.0 * stats.prefix_hit_tokens / queried if queried else 0.0
        return (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
                f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {100.0 * stats.kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%, "
                f"Preemptions: {preempted}") + _spec_line(start, stats, elapsed)


def _spec_line(before: EngineStats, now: EngineStats, elapsed: float) -> str:
    """vLLM's SpecDecoding line for the interval from `before` to `now` (a line break first); ''
    when no draft ran in it."""
    drafts, drafted = now.spec_drafts - before.spec_drafts, now.spec_draft_tokens - before.spec_draft_tokens
    if not drafted:
        return ""
    accepted = now.spec_accepted_tokens - before.spec_accepted_tokens
    old = before.spec_accepted_per_pos
    per_pos = [(n - (old[k] if k < len(old) else 0)) / drafts for k, n in enumerate(now.spec_accepted_per_pos)]
    return (f"\nSpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / elapsed:.1f} tokens/s, Drafted throughput: {drafted / elapsed:.1f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
            f"Avg Draft acceptance rate: {100.0 * accepted / drafted:.1f}%")
