"""Routing policies as pure functions of (request, replica stats, pending dispatches, now).

The same functions route in Serve (cluster's RequestRouter), in unit tests and in the simulator.
Every chooser has the shape

    choose(request, stats, pending, now, ...) -> replica id | None     (None: hold the request)

`stats` maps every candidate replica id to its latest `ReplicaStats`, or to None when it has not
reported yet; `pending` maps replica ids to what was dispatched there since that report.

kv (`choose_kv`), for each replica with fresh stats:

    hit      = leading request blocks found in its prefix summary or in its pending dispatches,
               + 1 when the next one starts with the partial last block of a prompt completed
               there since its report (the answer filled it: a chat's next turn)
    need     = blocks_for(prompt + max_tokens) - hit           (hit blocks are shared, not new)
    headroom = free - reserve_weight * reserved - pending blocks
    room     = headroom >= need and a sequence seat is free (running + waiting + pending < max_num_seqs)
    backlog  = max(0, running prefill tokens + waiting prefill tokens * (1 - prefix hit rate)
                      - prefill_rate * report age)
               + pending prefill tokens
    inflight = running + waiting + pending requests
    score    = hit * block_size - load_weight * backlog - min(request_weight, request_share * prompt) * inflight
             + stay_margin if this replica holds the longest hit of all
    (the first request of a session: session_weight and session_share in place of request_*)

and picks the best score among replicas with room (ties: the longer hit, more headroom, fewer
running). The score is in prompt tokens, a first-order model of the time to first token (step
time grows linearly with the tokens batched): a cached prefix saves that many tokens of prefill, a backlog
of queued prefill delays the first token by about as many. So a hot prefix spills over to a
second replica once its home replica's backlog exceeds the prefix length, and a burst of one
prefix starts it on several replicas at once instead of queueing behind the first request.
The queue a report showed has drained since, at the replica's prefill rate (else a turn whose
home was briefly busy when it reported would move away and recompute its whole context). Each
request in flight costs a little too: its share of every step until the first token, and the
KV its session will hold. Without that, every chat that starts with one system prompt would
pile onto the first replica that cached it (its hit beats an idle replica), the replica's KV
would evict the idle sessions between their turns, and other replicas would sit idle. And the
replicas holding the longest prefix keep the request unless another is better by `stay_margin`:
smaller differences are noise, and moving would copy a chat's whole context for nothing.
A request carrying a session id the router has not routed before (Serve's session_id, from the
`x-session-id` header or the OpenAI `user` field) picks the replica that will hold the whole
conversation: every later turn finds its context there. Requests in flight weigh more for it
(`session_weight`), so new chats spread over the replicas instead of piling onto the few that
cached their system prompt; later turns and requests without a session weigh as before.

When no replica with fresh stats has room:

    stale or missing stats   -> the unknown replica with the fewest pending dispatches (a new
                                replica has not reported yet; a stuck one stops getting traffic
                                once its pending count grows, and its ledger entries expire)
    none unknown             -> None: the caller holds the request in its bounded queue and
                                answers 503/429 with Retry-After when that queue is full.

Past saturation requests wait at the router. When room opens on one replica, `choose_held`
picks which held request takes it: one held `max_hold_s` or more first (tail latency), then the
one with the most prefix blocks resident on that replica (its prefill there is the shortest),
then one that can still meet the TTFT SLO, then the oldest; once the oldest has waited twice
`max_hold_s`, nothing passes it.

pow2 (`choose_pow2`) is Serve's default: two random replicas, the one with the shorter queue,
never one whose queue is at `max_ongoing`. round_robin (`choose_round_robin`) cycles.
Both read live queue lengths when the caller has them (Serve probes replicas; the simulator
reads them) and otherwise running + waiting from stats plus pending dispatches.

The peers users run instead, with their published rules and defaults, are in cluster/peers.py:
prefix_affinity (Ray Serve LLM's PrefixCacheAffinityRouter), cache_aware (sgl-router), session
(session-sticky consistent hashing). Their stateful wrappers are below, with kv's.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile

from cluster.peers import (CacheAwareConfig, HashRing, PrefixAffinityConfig, choose_cache_aware, choose_session,
                           prefix_affinity_candidates)
from cluster.pending import EMPTY, Booking, Pending, Tail
from cluster.prefix_tree import PrefixTree, token_key
from cluster.stats import ReplicaStats
from engine.block_manager import kv_tokens
from engine.hashing import NONE_HASH, hash_prefix_blocks

StatsView = Mapping[str, ReplicaStats | None]
PendingView = Mapping[str, Pending]


class RouteRequest:
    """A request as the router sees it: prompt token ids (or precomputed hashes) and max_tokens;
    for the peers also its prompt text (`detokenize`, else one character per token) and session;
    its `priority` (vLLM's, lower first) where requests are held."""
    __slots__ = ("token_ids", "num_prompt_tokens", "max_tokens", "session", "root", "priority", "_hashes",
                 "_detokenize", "_text", "_key")

    def __init__(self, token_ids: Sequence[int] | None, max_tokens: int, *, num_prompt_tokens: int | None = None,
                 prefix_hashes: Mapping[int, list[int]] | None = None, session: str | None = None,
                 detokenize: Callable[[Sequence[int]], str] | None = None, root: int = NONE_HASH,
                 priority: int = 0) -> None:
        if token_ids is None and (num_prompt_tokens is None or prefix_hashes is None):
            raise ValueError("a RouteRequest needs token_ids, or num_prompt_tokens and prefix_hashes")
        self.token_ids = token_ids
        self.num_prompt_tokens = len(token_ids) if token_ids is not None else num_prompt_tokens
        self.max_tokens = max_tokens
        self.session = session
        self.root = root  # its first block's parent hash: a cache_salt's (engine.hashing.root_hash)
        self.priority = priority
        self._hashes: dict[int, list[int]] = dict(prefix_hashes or {})  # block_size -> hashes
        self._detokenize = detokenize
        self._text: str | None = None
        self._key: str | None = None

    @property
    def key(self) -> str:
        """The prompt's token ids, one character each (a token-level radix tree's key)."""
        if self._key is None:
            self._key = token_key(self.token_ids or ())
        return self._key

    @property
    def text(self) -> str:
        """The prompt text, for routers that match characters; one character per token without a detokenizer."""
        if self._text is None:
            self._text = self._detokenize(self.token_ids or ()) if self._detokenize else self.key
        return self._text

    def hashes(self, block_size: int) -> list[int]:
        """Hashes of the prompt blocks a replica could serve from cache (the engine always computes
        the last prompt token, so a prompt of exactly k blocks can hit at most k - 1)."""
        if block_size not in self._hashes:
            if self.token_ids is None:
                return []  # precomputed for other block sizes only: no prefix credit here
            self._hashes[block_size] = hash_prefix_blocks(self.token_ids, block_size,
                                                          (self.num_prompt_tokens - 1) // block_size, self.root)
        return self._hashes[block_size]

    def footprint_blocks(self, block_size: int) -> int:
        """KV blocks the request holds at its longest: prompt + max_tokens, but the last token."""
        return -(-kv_tokens(self.num_prompt_tokens, self.max_tokens) // block_size)


@dataclass(frozen=True)
class KVPolicyConfig:
    stale_after_s: float = 5.0  # stats older than this are treated as missing
    load_weight: float = 1.0  # queued prefill tokens that cancel one cached prefix token
    # Prompt tokens that one request in flight at a replica costs, at most `request_share` of this
    # request's prompt (a short prompt's prefill suffers less from the others). Tuned in the
    # simulator: 20 cut kv's P99 TTFT on multi-turn chat at 64 replicas from 0.25 s to 0.15 s.
    request_weight: float = 20.0
    request_share: float = 0.03
    # The same for the first request of a session (a session id not routed before): it places the
    # whole conversation. Tuned in the simulator (multi-turn chat, 64 replicas, seeds 0-2): kv's
    # P99 TTFT at 1 / 3 / 5 req/s per replica went from 0.116-0.125 / 0.125-0.141 / 0.135-0.143 s
    # to 0.117-0.119 / 0.122-0.125 / 0.125-0.126 s; at 20 / 0.03 new chats piled onto the replicas
    # holding their system prompt (10.6 requests running where the cluster's mean was 2.1). A share
    # of 0.2 did a little better there (0.116 s at load 3) but on two real replicas with 48-token
    # system prompts it sometimes moved a new chat off the replica holding its prompt.
    session_weight: float = 100.0
    session_share: float = 0.1
    # Score (prompt tokens) a replica must gain over the ones holding the longest cached prefix to
    # take the request from them: smaller differences are within the model's error, and moving
    # would copy the prefix (a chat's whole context) to a second replica for nothing.
    stay_margin: float = 64.0
    # Prompt tokens per second a replica prefills: the waiting prefill it reported drains at this
    # rate until its next report. 2000 is below any GPU we target (an 8B model on an A10G class
    # GPU prefills ~6000/s); the simulator sets its cost model's rate.
    prefill_rate: float = 2000.0
    # Share of the replicas' worst-case growth (every sequence reaching max_tokens) counted against
    # room. 1 never overcommits; 0.5 still had no preemptions in the simulator (outputs stop early
    # and sequences are midway on average) with lower TTFT than 1 (tuned there, see docs).
    reserve_weight: float = 0.5
    # Held requests (past saturation): which one takes room that opens on a replica.
    held_order: str = "affinity"  # affinity (choose_held) | fifo (oldest first, no overtaking)
    ttft_slo_s: float = 2.0  # affinity: requests held less than this can still meet the TTFT SLO: they go first
    max_hold_s: float = 5.0  # affinity: a request held this long goes before every other one
    held_window: int = 256  # affinity: how many of the oldest held requests are considered

    def __post_init__(self) -> None:
        if self.stale_after_s <= 0 or self.load_weight < 0 or not 0 <= self.reserve_weight <= 1:
            raise ValueError("KVPolicyConfig needs stale_after_s > 0, load_weight >= 0, reserve_weight in [0, 1]")
        if min(self.request_weight, self.request_share, self.session_weight, self.session_share, self.prefill_rate,
               self.stay_margin) < 0:
            raise ValueError("KVPolicyConfig needs request_weight, request_share, session_weight, session_share, "
                             "prefill_rate and stay_margin >= 0")
        if self.held_order not in ("affinity", "fifo") or self.max_hold_s < 0 or self.held_window < 1:
            raise ValueError("KVPolicyConfig needs held_order affinity|fifo, max_hold_s >= 0, held_window >= 1")
        if self.ttft_slo_s <= 0:
            raise ValueError("KVPolicyConfig needs ttft_slo_s > 0")


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


def tail_hit(request: RouteRequest, block_size: int, n: int, pending: Pending) -> int:
    """1 when the request's block after its first `n` hit blocks begins with the tail (partial last
    block) of a prompt completed at this replica since its report, else 0: the completed request's
    answer filled that block there (unless it was shorter than the rest of the block, which the
    router cannot tell), and a chat's next turn repeats the answer after the prompt."""
    hashes = request.hashes(block_size)
    if not pending.tail_parents or n >= len(hashes) or request.token_ids is None:
        return 0
    parent = hashes[n - 1] if n else request.root
    if parent not in pending.tail_parents:
        return 0
    block = tuple(request.token_ids[n * block_size:(n + 1) * block_size])
    return int(any((parent, block[:k]) in pending.tails for k in range(1, block_size)))


def request_hit_blocks(request: RouteRequest, block_size: int, cached: frozenset[int], pending: Pending) -> int:
    n = prefix_hit_blocks(request.hashes(block_size), cached, pending)
    return n + tail_hit(request, block_size, n, pending)


def prompt_tail(request: RouteRequest, block_size: int) -> Tail | None:
    """(parent hash, tokens) of the request's partial last prompt block; None on a block boundary."""
    full = request.num_prompt_tokens // block_size
    if request.token_ids is None or full * block_size == request.num_prompt_tokens:
        return None
    hashes = request.hashes(block_size)
    parent = hashes[full - 1] if full else request.root
    return parent, tuple(request.token_ids[full * block_size:])


def rank_key(request: RouteRequest, s: ReplicaStats, p: Pending, config: KVPolicyConfig,
             now: float | None = None, new_session: bool = False) -> tuple | None:
    """None when the request does not fit on this replica now, else its sort key (larger is better):
    (prefix tokens reused - weighted prefill backlog and requests in flight, hit blocks, headroom blocks,
    -running, -cached prefix blocks). Between replicas equal on the rest, the one caching the
    fewest prefix blocks takes a prefix neither holds, so distinct prefixes spread over the
    replicas instead of evicting each other on one (Ray Serve LLM's router sends an unmatched
    prompt to the replica holding the least text for the same reason).
    Without `now` the reported backlog is taken as it was; `new_session`: the request opens a session."""
    if s.max_num_seqs - s.num_running - s.num_waiting - p.num_requests < 1:
        return None  # no sequence seat
    bs = s.block_size
    hit = request_hit_blocks(request, bs, s.prefix_hashes, p)
    headroom = s.num_free_blocks - config.reserve_weight * s.num_reserved_blocks - p.num_blocks
    if headroom < request.footprint_blocks(bs) - hit:
        return None  # its KV would not fit without preempting someone
    # The engine counts a waiting request's whole prompt, but the share its prefix cache serves is
    # not prefilled: a resident chat's next turn (3000 tokens, 95% cached) counted as 3000 tokens
    # of backlog at its home, and in the simulator (multi-turn, 64 replicas) the home replicas of
    # kv's slowest turns were estimated at 2000-3000 queued tokens when 0-200 were, so those turns
    # moved and recomputed their context elsewhere. Taking the replica's own hit rate off cut kv's
    # P99 TTFT there from 0.169 to 0.140 s at 5 req/s/replica (0.154 -> 0.134 at 3), and on
    # shared-prefix at 2 from 0.179 to 0.157 s (0.276 -> 0.153 with seeds 1 and 2).
    # A prompt whose chunked prefill is under way is neither waiting nor decoding, but a request
    # sent there waits behind it: on no-prefix, kv's slowest requests had landed behind 149 such
    # tokens on average (round_robin's behind 17). Counting them took kv's P99 at loads 1 / 2
    # from 0.531 / 0.538 to 0.523 / 0.518 s (round_robin, the best peer at 2: 0.518).
    waiting = s.running_prefill_tokens + s.waiting_prefill_tokens * (1.0 - s.prefix_hit_rate)
    if now is not None and config.prefill_rate > 0:  # drained since the report
        waiting = max(0.0, waiting - config.prefill_rate * (now - s.timestamp))
    backlog = waiting + p.num_prefill_tokens
    inflight = s.num_running + s.num_waiting + p.num_requests
    weight, share = ((config.session_weight, config.session_share) if new_session
                     else (config.request_weight, config.request_share))
    per_request = min(weight, share * request.num_prompt_tokens)
    return (hit * bs - config.load_weight * backlog - per_request * inflight, hit, headroom, -s.num_running,
            -len(s.prefix_hashes))


def choose_kv(request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
              config: KVPolicyConfig = KVPolicyConfig(), new_session: bool = False) -> str | None:
    keys, unknown = {}, []
    oldest = now - config.stale_after_s
    for rid, s in stats.items():
        if s is None or s.timestamp < oldest:
            unknown.append(rid)
            continue
        key = rank_key(request, s, pending.get(rid, EMPTY), config, now, new_session)
        if key is not None:
            keys[rid] = key
    if keys:
        longest = max(k[1] for k in keys.values())
        if longest and config.stay_margin:  # the replicas holding the longest prefix keep it unless clearly worse
            keys = {rid: (k[0] + config.stay_margin,) + k[1:] if k[1] == longest else k for rid, k in keys.items()}
        return max(keys, key=keys.__getitem__)
    if unknown:
        return min(unknown, key=lambda rid: pending.get(rid, EMPTY).num_requests)
    return None


def choose_held(held: Sequence[tuple[float, RouteRequest]], rid: str, s: ReplicaStats, p: Pending, now: float,
                config: KVPolicyConfig = KVPolicyConfig()) -> int | None:
    """Which of the held (arrival, request) pairs, oldest first, takes the room that just opened
    on replica `rid` (stats `s`, pending `p`): an index into `held`, or None when none fits there.

    Among the first `held_window` that fit on `rid`, in this order of preference:
      1. held at least `max_hold_s` (tail latency: they go before everyone else),
      2. the most prefix blocks resident on `rid` (with `rid` fixed, rank_key orders by that
         alone: the seat goes where its prefix is cached, so past saturation every prefill is
         as short as it can be and the replicas drain fastest),
      3. held less than `ttft_slo_s` (it can still meet the TTFT SLO; one that cannot waits),
      4. the oldest.
    Once the oldest has waited 2 * max_hold_s nothing passes it, even where it does not fit
    (it would starve while smaller requests kept taking the room it needs)."""
    if not held:
        return None
    if config.held_order == "fifo" or now - held[0][0] >= 2 * config.max_hold_s:
        return 0 if rank_key(held[0][1], s, p, config, now) is not None else None
    best, best_score = None, None
    for i, (arrival, request) in enumerate(held[:config.held_window]):
        key = rank_key(request, s, p, config, now)
        if key is None:
            continue
        age = now - arrival
        score = (age >= config.max_hold_s, key[0], age < config.ttft_slo_s)
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best


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
                    default_block_size: int = 16) -> Booking:
    """Enter a dispatch in a `cluster.pending.PendingLedger`, with the footprint and new prefill
    tokens the replica's last stats predict (no stats: no hit assumed). Returns the booking, for
    `ledger.release` when the request completes."""
    s = stats.get(replica_id)
    bs = s.block_size if s is not None else default_block_size
    hit = request_hit_blocks(request, bs, s.prefix_hashes, ledger.get(replica_id)) if s is not None else 0
    blocks, prefill = request.footprint_blocks(bs) - hit, request.num_prompt_tokens - hit * bs
    ledger.record(replica_id, now, blocks, prefill, request.hashes(bs))
    return Booking(now, blocks, prefill, prompt_tail(request, bs))


# -- stateful wrappers with one call shape, for the simulator and the Serve router -------------------
#   choose(request, stats, pending, now, queue_lens, max_ongoing) -> replica | None (None: hold, retry later)
#   routed(request, replica, now)   the request was dispatched there (the peers' trees learn it)
def shortest_open(candidates: Sequence[str], lens: Mapping[str, int], max_ongoing: int | None) -> str | None:
    """Serve's pick within one rank: the shortest queue not at max_ongoing, the first of equals."""
    best = None
    for rid in candidates:
        q = lens.get(rid, 0)
        if (max_ongoing is None or q < max_ongoing) and (best is None or q < lens.get(best, 0)):
            best = rid
    return best


def _all_queue_lens(stats: StatsView, pending: PendingView, queue_lens: Mapping[str, int] | None) -> dict[str, int]:
    return {rid: queue_len(rid, stats, pending, queue_lens) for rid in stats}


class SeenSessions:
    """The session ids a router has routed, the most recent `capacity` of them."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def is_new(self, session: str | None) -> bool:
        return session is not None and session not in self._ids

    def add(self, session: str | None) -> None:
        if session is None:
            return
        self._ids[session] = None
        self._ids.move_to_end(session)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


class KVRouter:
    name = "kv"
    serve_router = "cluster.serve_router:KVRequestRouter"  # the same policy as a Serve RequestRouter

    def __init__(self, config: KVPolicyConfig = KVPolicyConfig()) -> None:
        self.config = config
        self.sessions = SeenSessions()

    def choose(self, request: RouteRequest, stats: StatsView, pending: PendingView, now: float,
               queue_lens: Mapping[str, int] | None = None, max_ongoing: int | None = None) -> str | None:
        return choose_kv(request, stats, pending, now, self.config, self.sessions.is_new(request.session))

    def routed(self, request: RouteRequest, rid: str, now: float) -> None:
        self.sessions.add(request.session)  # the caller's PendingLedger records the dispatch (record_dispatch)


class Pow2Router:
    name = "pow2"
    serve_router = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # Serve's default

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        return choose_pow2(request, stats, pending, now, self.rng, queue_lens, max_ongoing)

    def routed(self, request, rid, now) -> None:
        pass


class RoundRobinRouter:
    name = "round_robin"
    serve_router = "cluster.serve_router:RoundRobinRequestRouter"

    def __init__(self) -> None:
        self.cursor = 0

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        rid, self.cursor = choose_round_robin(request, stats, pending, now, self.cursor, queue_lens, max_ongoing)
        return rid

    def routed(self, request, rid, now) -> None:
        pass


class PrefixAffinityRouter:
    """Ray Serve LLM's PrefixCacheAffinityRouter (cluster.peers.prefix_affinity_candidates): a
    character tree of the prompt texts it routed, power of two choices when queues are uneven."""
    name = "prefix_affinity"
    serve_router = "cluster.serve_router:PrefixAffinityRequestRouter"
    queues_at_replica = True  # Ray Serve LLM deploys with max_ongoing_requests=1e9 (llm constants.py)

    def __init__(self, seed: int | None = None, config: PrefixAffinityConfig = PrefixAffinityConfig()) -> None:
        self.config, self.tree, self.rng = config, PrefixTree(), random.Random(seed)

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        lens = _all_queue_lens(stats, pending, queue_lens)
        for rid in lens:  # Ray adds every replica as a tenant when it joins (update_replicas)
            self.tree.add_tenant(rid, now)
        candidates = prefix_affinity_candidates(request.text, self.tree, lens, self.config)
        if not candidates:
            return choose_pow2(request, stats, pending, now, self.rng, queue_lens, max_ongoing)
        return shortest_open(candidates, lens, max_ongoing)  # none open: Serve backs off and asks again

    def routed(self, request, rid, now) -> None:
        self.tree.insert(request.text, rid, now)  # Ray: on_request_routed


class CacheAwareRouter:
    """sgl-router's cache_aware policy (cluster.peers.choose_cache_aware): a token tree of the
    prompts it routed, the least loaded worker when loads are uneven."""
    name = "cache_aware"
    serve_router = "cluster.serve_router:CacheAwareRequestRouter"
    queues_at_replica = True  # sgl-router caps nothing: its workers queue

    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        self.config, self.tree = config, PrefixTree()

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        lens = _all_queue_lens(stats, pending, queue_lens)
        rid = choose_cache_aware(request.key, self.tree, lens, self.config)
        # sgl queues at the worker; behind Serve a full replica means: back off and ask again.
        return rid if rid is not None and (max_ongoing is None or lens[rid] < max_ongoing) else None

    def routed(self, request, rid, now) -> None:
        self.tree.insert(request.key, rid, now)


class SessionRouter:
    """Session-sticky consistent hashing (cluster.peers.choose_session); not load-aware."""
    name = "session"
    serve_router = "cluster.serve_router:SessionRequestRouter"
    queues_at_replica = True  # as sgl-router's consistent_hashing: its workers queue

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.ring = HashRing(())

    def choose(self, request, stats, pending, now, queue_lens=None, max_ongoing=None) -> str | None:
        ids = list(stats)
        if self.ring.replicas != frozenset(ids):
            self.ring = HashRing(ids)
        rid = choose_session(request.session, self.ring, ids, self.rng)
        full = rid is not None and max_ongoing is not None and queue_len(rid, stats, pending, queue_lens) >= max_ongoing
        return None if full else rid

    def routed(self, request, rid, now) -> None:
        pass


# The routing policies by name: `--routing`, the app's `routing`, the simulator's `--policies`.
ROUTERS = {r.name: r for r in (KVRouter, Pow2Router, RoundRobinRouter, PrefixAffinityRouter, CacheAwareRouter,
                               SessionRouter)}


def make_router(name: str, seed: int | None = None, kv_config: KVPolicyConfig | None = None):
    if name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTERS)}")
    if name == "kv":
        return KVRouter(kv_config or KVPolicyConfig())
    if name in ("pow2", "prefix_affinity", "session"):
        return ROUTERS[name](seed)
    return ROUTERS[name]()
