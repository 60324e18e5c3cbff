"""The TTFT no router can beat: each request alone on an idle replica that already holds every
prefix the workload lets it reuse (its group's prefix once any request of the group came before;
a chat turn's previous prompt and answer), its prefill chunked as the engine chunks it.

    floor = sum over prefill chunks of cost.step_time(chunk, context so far)

Its P99 over a workload shows how much room routing has left: at low load every good policy sits
on it, so no policy can be 30% below another there.
"""
from __future__ import annotations

import numpy as np

from cluster.sim.cost import CostModel
from cluster.sim.workload import RequestSpec


def cached_tokens(spec: RequestSpec, seen_groups: set[int], block_size: int) -> int:
    if spec.context is not None:
        reusable = spec.context.num_prompt_tokens + spec.context.max_tokens
    elif spec.prefix is not None and spec.group in seen_groups:
        reusable = len(spec.prefix)
    else:
        reusable = 0
    full = (spec.num_prompt_tokens - 1) // block_size  # the engine always computes the last prompt token
    return min(reusable // block_size, full) * block_size


def ttft_floor(num_prompt_tokens: int, num_cached: int, cost: CostModel, max_batched_tokens: int) -> float:
    t, done = 0.0, num_cached
    while done < num_prompt_tokens:
        chunk = min(max_batched_tokens, num_prompt_tokens - done)
        done += chunk
        t += cost.step_time(chunk, done)
    return t


def floor_p99(workload: list[RequestSpec], cost: CostModel, block_size: int, max_batched_tokens: int,
              warmup_s: float = 0.0) -> float:
    seen: set[int] = set()
    floors = []
    for spec in sorted(workload, key=lambda s: (s.context is not None, s.arrival)):
        cached = cached_tokens(spec, seen, block_size)
        if spec.group >= 0:
            seen.add(spec.group)
        if spec.context is not None or spec.arrival >= warmup_s:
            floors.append(ttft_floor(spec.num_prompt_tokens, cached, cost, max_batched_tokens))
    return float(np.percentile(floors, 99)) if floors else float("nan")
