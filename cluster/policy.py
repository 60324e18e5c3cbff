"""Routing policies as pure functions of (request, replica stats, pending dispatches, now).

The same functions route in Serve (cluster's RequestRouter), in unit tests and in the simulator.
Every chooser has the shape

    choose(request, stats, pending, now, ...) -> replica id | None     (None: hold the request)

`stats` maps every candidate replica id to its latest `ReplicaStats`, or to None when it has not
reported yet; `pending` maps replica ids to what was dispatched there since that report.

kv (`choose_kv`), for each replica with fresh stats:

    hit      = leading request blocks found in its prefix summary or in its pending dispatches
    need     = blocks_for(prompt + max_tokens) - hit           (hit blocks are shared, not new)
    headroom = free - reserve_weight * reserved - pending blocks
    room     = headroom >= need and a sequence seat is free (running + waiting + pending < max_num_seqs)
    backlog  = waiting prefill tokens + pending prefill tokens
    score    = hit * block_size - load_weight * backlog

and picks the best score among replicas with room (ties: more headroom, then fewer running). The
score is in prompt tokens, a first-order model of the time to first token (step time grows
linearly with the tokens batched): a cached prefix saves that many tokens of prefill, a backlog
of queued prefill delays the first token by about as many. So a hot prefix spills over to a
second replica once its home replica's backlog exceeds the prefix length, and a burst of one
prefix starts it on several replicas at once instead of queueing behind the first request.

When no replica with fresh stats has room:

    stale or missing stats   -> the unknown replica with the fewest pending dispatches (a new
                                replica has not reported yet; a stuck one stops getting traffic
                                once its pending count grows, and its ledger entries expire)
    none unknown             -> None: the caller holds the request in its bounded queue and
                                answers 503/429 with Retry-After when that queue is full.

pow2 (`choose_pow2`) is Serve's default: two random replicas, the one with the shorter queue,
never one whose queue is at `max_ongoing`. round_robin (`choose_round_robin`) cycles.
Both read live queue lengths when the caller has them (Serve probes replicas; the simulator
reads them) and otherwise running + waiting from stats plus pending dispatches.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

from cluster.pending import EMPTY, Pending
from cluster.stats import ReplicaStats
from engine.hashing import hash_prefix_blocks

StatsView = Mapping[str, ReplicaStats | None]
PendingView = Mapping[str, Pending]


class RouteRequest:
    """A request as the router sees it: prompt token ids (or precomputed hashes) and max_tokens."""
    __slots__ = ("token_ids", "num_prompt_tokens", "max_tokens", "_hashes")

    def __init__(self, token_ids: Sequence[int] | None, max_tokens: int, *, num_prompt_tokens: int | None = None,
                 prefix_hashes: Mapping[int, list[int]] | None = None) -> None:
        if token_ids is None and (num_prompt_tokens is None or prefix_hashes is None):
            raise ValueError("a RouteRequest needs token_ids, or num_prompt_tokens and prefix_hashes")
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids) if token_ids is not None else num_prompt_tokens
        self.max_tokens = max_tokens
        self._hashes: dict[int, list[int]] = dict(prefix_hashes or {})  # block_size -> hashes

    def hashes(self, block_size: int) -> list[int]:
        """Hashes of the prompt blocks a replica could serve from cache (the engine always computes
        the last prompt token, so a prompt of exactly k blocks can hit at most k - 1)."""
        if block_size not in self._hashes:
            if self.token_ids is None:
                return []  # precomputed for other block sizes only: no prefix credit here
            self._hashes[block_size] = hash_prefix_blocks(self.token_ids, block_size,
                                                          (self.num_prompt_tokens - 1) // block_size)
        return self._hashes[block_size]

    def footprint_blocks(self, block_size: int) -> int:
        """KV blocks the request holds at its longest: prompt + max_tokens."""
        return -(-(self.num_prompt_tokens + self.max_tokens) // block_size)


@dataclass(frozen=True)
class KVPolicyConfig:
    stale_after_s: float = 5.0  # stats older than this are treated as missing
    load_weight: float = 1.0  # queued prefill tokens that cancel one cached prefix token
    # Share of the replicas' worst-case growth (every sequence reaching max_tokens) counted against
    # room. 1 never overcommits; 0.5 still had no preemptions in the simulator (outputs stop early
    # and sequences are midway on average) with lower TTFT than 1 (tuned there, see docs).
    reserve_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.stale_after_s <= 0 or self.load_weight < 0 or not 0 <= self.reserve_weight <= 1:
            raise ValueError("KVPolicyConfig needs stale_after_s > 0, load_weight >= 0, reserve_weight in [0, 1]")


def prefix_hit_blocks(hashes: list[int], cached: frozenset[int], pending: Pending) -> int:
    """Leading blocks of `hashes` the replica holds, or will hold once its pending dispatches run.
    (Walked in C by alternating runs of cached and booked hashes: this runs per replica per request.)"""
    booked = pending.prefix_hashes
    if not hashes or (hashes[0] not in cached and hashes[0] not in booked):
        return 0  # most replicas, most of the time
    n, total = 0, len(hashes)
    while n < total:
        m = n + len(list(takewhile(cached.__contains__, islice(hashes, n, None))))
        if booked:
            m += len(list(takewhile(booked.__contains__, islice(hashes, m, None))))
        if m == n:
            break
        n = m
    return n


def rank_key(request: RouteRequest, s: ReplicaStats, p: Pending, config: KVPolicyConfig) -> tuple | None:
    """None when the request does not fit on this replica now, else its sort key (larger is better):
    (prefix tokens reused - weighted prefill backlog, headroom blocks, -running)."""
    if s.max_num_seqs - s.num_running - s.num_waiting - p.num_requests < 1:
        return None  # no sequence seat
    bs = s.block_size
    hit = prefix_hit_blocks(request.hashes(bs), s.prefix_hashes, p)
    headroom = s.num_free_blocks - config.reserve_weight * s.num_reserved_blocks - p.num_blocks
    if headroom < request.footprint_blocks(bs) - hit:
        return None  # its KV would not fit without preempting someone
    backlog = s.waiting_prefill_tokens + p.num_prefill_tokens
    return hit * bs - config.load_weight * backlog, headroom, -s.num_running


def choose_kv(request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
              config: KVPolicyConfig = KVPolicyConfig()) -> str | None:
    best, best_key, unknown = None, None, []
    oldest = now - config.stale_after_s
    for rid, s in stats.items():
        if s is None or s.timestamp < oldest:
            unknown.append(rid)
            continue
        key = rank_key(request, s, pending.get(rid, EMPTY), config)
        if key is not None and (best_key is None or key > best_key):
            best, best_key = rid, key
    if best is not None:
        return best
    if unknown:
        return min(unknown, key=lambda rid: pending.get(rid, EMPTY).num_requests)
    return None


def queue_len(rid: str, stats: StatsView, pending: PendingView, queue_lens: Mapping[str, int] | None) -> int:
    """Requests in flight at a replica: live when the caller probes, else stats + pending."""
    if queue_lens is not None and rid in queue_lens:
        return queue_lens[rid]
    s = stats.get(rid)
    base = s.num_running + s.num_waiting if s is not None else 0
    return base + pending.get(rid, EMPTY).num_requests


def choose_pow2(request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
                rng: random.Random, queue_lens: Mapping[str, int] | None = None,
                max_ongoing: int | None = None) -> str | None:
    ids = list(stats)
    if not ids:
        return None
    picks = rng.sample(ids, min(2, len(ids)))  # random order: ties go to either
    lens = [(queue_len(r, stats, pending, queue_lens), r) for r in picks]
    lens = [(q, r) for q, r in lens if max_ongoing is None or q < max_ongoing]
    return min(lens, key=lambda qr: qr[0])[1] if lens else None


def choose_round_robin(request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
                       cursor: int, queue_lens: Mapping[str, int] | None = None,
                       max_ongoing: int | None = None) -> tuple[str | None, int]:
    """-> (replica or None, the next cursor). Skips replicas whose queue is at `max_ongoing`."""
    ids = list(stats)
    for k in range(len(ids)):
        rid = ids[(cursor + k) % len(ids)]
        if max_ongoing is None or queue_len(rid, stats, pending, queue_lens) < max_ongoing:
            return rid, cursor + k + 1
    return None, cursor


def record_dispatch(ledger, replica_id: str, request: RouteRequest, stats: StatsView, now: float,
                    default_block_size: int = 16) -> int:
    """Enter a dispatch in a `cluster.pending.PendingLedger`, with the footprint and new prefill
    tokens the replica's last stats predict (no stats: no hit assumed). Returns the footprint in
    blocks, for `ledger.release` when the request completes."""
    s = stats.get(replica_id)
    bs = s.block_size if s is not None else default_block_size
    hashes = request.hashes(bs)
    hit = prefix_hit_blocks(hashes, s.prefix_hashes, ledger.get(replica_id)) if s is not None else 0
    blocks = request.footprint_blocks(bs) - hit
    ledger.record(replica_id, now, blocks, request.num_prompt_tokens - hit * bs, hashes)
    return blocks


# -- stateful wrappers with one call shape, for the simulator and the Serve router -------------------
class KVRouter:
    name = "kv"
    serve_router = "cluster.serve_router:KVRequestRouter"  # the same policy as a Serve RequestRouter

    def __init__(self, config: KVPolicyConfig = KVPolicyConfig()) -> None:
        self.config = config

    def choose(self, request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
               queue_lens: Mapping[str, int] | None = None, max_ongoing: int | None = None) -> str | None:
        return choose_kv(request, stats, pending, now, self.config)


class Pow2Router:
    name = "pow2"
    serve_router = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # Serve's default

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        return choose_pow2(request, stats, pending, now, self.rng, queue_lens, max_ongoing)


class RoundRobinRouter:
    name = "round_robin"
    serve_router = "cluster.serve_router:RoundRobinRequestRouter"

    def __init__(self) -> None:
        self.cursor = 0

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        rid, self.cursor = choose_round_robin(request, stats, pending, now, self.cursor, queue_lens, max_ongoing)
        return rid


# The routing policies by name: `--routing`, the app's `routing`, the simulator's `--policies`.
ROUTERS = {r.name: r for r in (KVRouter, Pow2Router, RoundRobinRouter)}


def make_router(name: str, seed: int | None = None, kv_config: KVPolicyConfig | None = None):
    if name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTERS)}")
    if name == "kv":
        return KVRouter(kv_config or KVPolicyConfig())
    return Pow2Router(seed) if name == "pow2" else RoundRobinRouter()
