"""The routers users run instead of ours, as pure functions: what kv routing is measured against.

Each is written from its published source (read, not copied) with that source's defaults; the
line that says where each rule comes from sits next to it. They take what their originals read:
live in-flight counts per replica (Serve's probed queue lengths; sgl-router's own per-worker
load counter) and the router's own memory of what it sent where (a `PrefixTree`), never the
engines' KV state, which is what sets kv apart.

prefix_affinity   Ray Serve LLM's PrefixCacheAffinityRouter (ray-project/ray,
                  python/ray/llm/_internal/serve/routing_policies/prefix_aware/
                  prefix_aware_router.py and prefix_tree.py):
                  queues imbalanced (max - min > 10)        -> Serve's power of two choices
                  else best match of the prompt text >= 10%  -> the replicas owning that match
                  else                                       -> the replicas owning the least text
                  and among the replicas chosen, Serve takes the shortest queue that is not full
                  (RequestRouter._select_from_candidate_replicas), else backs off and retries.
cache_aware       sgl-router's cache_aware policy (sgl-project/sglang,
                  sgl-model-gateway/src/policies/cache_aware.rs, formerly sgl-router/...; defaults
                  from its CLI): loads imbalanced (max - min > 64 and max > 1.5 * min) -> least
                  load; else match of the prompt's tokens > 30% -> the worker owning that match;
                  else the least loaded worker. (Older sgl-router versions took the worker with
                  the smallest tree there; the current code takes the least loaded one.)
session           session-sticky consistent hashing (sgl-model-gateway/src/policies/
                  consistent_hashing.rs and core/worker_registry.rs): the session key's position
                  on a ring of 150 virtual nodes per worker, clockwise to the first worker
                  present; no key -> a random worker. Not load-aware.
"""
from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from cluster.prefix_tree import PrefixTree


@dataclass(frozen=True)
class PrefixAffinityConfig:
    # Both defaults from PrefixCacheAffinityRouter.initialize_state.
    imbalanced_threshold: int = 10  # queue-length spread (max - min) above which it falls back to pow2
    match_rate_threshold: float = 0.1  # matched share of the prompt text needed to follow the match

    def __post_init__(self) -> None:
        if self.imbalanced_threshold < 0 or not 0 <= self.match_rate_threshold <= 1:
            raise ValueError("PrefixAffinityConfig needs imbalanced_threshold >= 0, match_rate_threshold in [0, 1]")


@dataclass(frozen=True)
class CacheAwareConfig:
    # sgl-router's CLI defaults (--cache-threshold, --balance-abs-threshold, --balance-rel-threshold).
    cache_threshold: float = 0.3  # matched share of the prompt's tokens needed to follow the match (strictly above)
    balance_abs_threshold: int = 64  # imbalanced if max load - min load exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max load exceeds this times min load

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1 or self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("CacheAwareConfig needs cache_threshold in [0, 1], balance_abs_threshold >= 0, "
                             "balance_rel_threshold >= 1")


def prefix_affinity_candidates(text: str, tree: PrefixTree, queue_lens: Mapping[str, int],
                               config: PrefixAffinityConfig = PrefixAffinityConfig()) -> list[str]:
    """Ray's `_prefix_match_best_replicas`: the replicas to take the shortest open queue among, or
    [] when it falls back to power of two choices (imbalanced queues, or nothing to follow)."""
    if not queue_lens or not text:
        return []
    lens = queue_lens.values()
    if max(lens) - min(lens) > config.imbalanced_threshold:  # strictly above: prefix_aware_router.py
        return []
    matched, owners = tree.match(text, list(queue_lens))
    if matched / len(text) < config.match_rate_threshold:
        # get_smallest_tenants: over every tenant in the tree, not only these candidates
        return [t for t in tree.smallest_tenants() if t in queue_lens]
    return owners


def choose_cache_aware(key: str, tree: PrefixTree, loads: Mapping[str, int],
                       config: CacheAwareConfig = CacheAwareConfig()) -> str | None:
    """sgl's `CacheAwarePolicy::select_worker` over `loads` (worker -> in-flight requests, in
    worker order; ties go to the first, as its `min_by_key` does)."""
    if not loads:
        return None
    least = min(loads, key=loads.__getitem__)
    lo, hi = loads[least], max(loads.values())
    if hi - lo > config.balance_abs_threshold and hi > lo * config.balance_rel_threshold:
        return least
    matched, owners = tree.match(key)
    owners = [t for t in owners if t in loads]
    if key and matched / len(key) > config.cache_threshold and owners:
        # Its tree hands back the first tenant of the node's map (hash order, effectively
        # arbitrary but fixed per node); the smallest id is our fixed choice.
        return min(owners)
    return least


class HashRing:
    """Consistent hashing: `VNODES` points per replica on a 64-bit ring (sgl-model-gateway's
    worker_registry.rs: 150 virtual nodes, blake3 of "url#vnode"; blake2b here, from hashlib)."""
    VNODES = 150

    def __init__(self, replicas: Collection[str]) -> None:
        points = sorted((self.position(f"{r}#{i}"), r) for r in replicas for i in range(self.VNODES))
        self.keys = [p for p, _ in points]
        self.owners = [r for _, r in points]
        self.replicas = frozenset(replicas)

    @staticmethod
    def position(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")

    def lookup(self, key: str, present: Collection[str]) -> str | None:
        """Clockwise from the key's position to the first point whose replica is in `present`."""
        if not self.keys:
            return None
        start = bisect.bisect_left(self.keys, self.position(key))
        n = len(self.keys)
        for k in range(n):
            rid = self.owners[(start + k) % n]
            if rid in present:
                return rid
        return None


def choose_session(session: str | None, ring: HashRing, replicas: Sequence[str], rng: random.Random) -> str | None:
    """consistent_hashing.rs `select_worker`: the ring's worker for the session key, else random."""
    if not replicas:
        return None
    if session:
        return ring.lookup(session, set(replicas))
    return replicas[rng.randrange(len(replicas))]
