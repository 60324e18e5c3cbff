"""The global scheduler inside Ray Serve: custom RequestRouters for the engine-replica deployment.

    ingress --handle.generate(request_id, prompt_token_ids, params)--> KVRequestRouter.choose_replicas
                                                                        | choose_kv(request, stats, ledger)
    EngineServer.record_routing_stats()  --controller, every period-->  RunningReplica.routing_stats
    (a ReplicaStats as a dict: free/total/reserved blocks, queue, prefix-hash summary, timestamp)

Serve builds one router per deployment handle (so one per ingress replica); each keeps its own
ledger of what it dispatched since each replica's last report, and Serve tells it about
completions (`on_request_completed`). With several ingress replicas each ledger sees only its
own share of the traffic; the reports, every `request_routing_stats_period_s`, bound the error.
A shared actor holding one ledger would be exact but would add a remote call to every request
and a single point of failure; the simulator shows the per-router view is enough.

Selection (`--routing`): kv (KVRequestRouter), pow2 (Serve's PowerOfTwoChoicesRequestRouter),
round_robin (RoundRobinRequestRouter), and the peers of cluster/peers.py, each driving the same
wrapper the simulator runs: prefix_affinity (PrefixAffinityRequestRouter: Ray Serve LLM's rules
on Serve's probed queue lengths; prompt text from the `tokenizer` kwarg, else one character per
token id), cache_aware (CacheAwareRequestRouter: sgl-router's rules on this router's own
in-flight counts), session (SessionRequestRouter: consistent hashing of the call's Serve
`session_id`, which a caller sets with `handle.options(session_id=...)`; none: random). Their
authors deploy them without a per-replica cap, so run them with a large
`--max-ongoing-requests` to compare like for like. `request_router_config(...)` builds the
deployment option.

No replica with room: choose_replicas returns no candidates and asks Serve to back off, so the
request waits in the handle's queue (bounded by the deployment's `max_queued_requests`; beyond it
Serve raises BackPressureError, which the ingress answers with 503/429 and Retry-After). Serve
retries each held request on its own backoff timer (up to 0.5 s), so a newcomer can take room
that opened before an old request retries; the router remembers the requests it held, and once
one has waited `max_hold_s` a newcomer yields it any replica it fits on (nothing starves). The
rest of `cluster.policy.choose_held`'s order needs the simulator's retry on every change.
"""
from __future__ import annotations

import time

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.peers import CacheAwareConfig, PrefixAffinityConfig
from cluster.pending import Booking, PendingLedger
from cluster.policy import (ROUTERS, CacheAwareRouter, KVPolicyConfig, PrefixAffinityRouter, RouteRequest, SessionRouter,
                            SeenSessions, choose_kv, rank_key, record_dispatch)
from cluster.stats import ReplicaStats
from engine.config import EngineConfig
from engine.hashing import request_root

ROUTER_CLASSES = {name: policy.serve_router for name, policy in ROUTERS.items()}
GENERATE_METHOD = "generate"  # workers.server.EngineServer.generate, called with keyword arguments
FORGET_HELD_S = 2.0  # a held request asks again within Serve's max backoff (0.5 s), else it is gone


def route_request_from(pending: PendingRequest | None, default_max_tokens: int,
                       detokenize=None) -> RouteRequest | None:
    """The RouteRequest of an EngineServer.generate call; None for other calls (info, stats, ...)."""
    if pending is None or pending.metadata.call_method != GENERATE_METHOD:
        return None
    token_ids, params = pending.kwargs.get("prompt_token_ids"), pending.kwargs.get("params")
    if token_ids is None:
        return None
    # Unset: what the engine resolves it to, the rest of the context window.
    max_tokens = getattr(params, "max_tokens", None) or max(1, default_max_tokens - len(token_ids))
    return RouteRequest(token_ids, max_tokens, session=pending.metadata.session_id or None, detokenize=detokenize,
                        root=request_root(params), priority=getattr(params, "priority", 0) or 0)


def replica_key(replica_id) -> str:
    return replica_id.to_full_id_str()


class KVRequestRouter(RequestRouter):
    """Routes generate calls with `cluster.policy.choose_kv`; other calls go to any replica."""

    def initialize_state(self, default_max_tokens: int = 256, default_block_size: int = EngineConfig.block_size,
                         **policy) -> None:
        """`policy`: KVPolicyConfig fields (its defaults apply to the others)."""
        self.config = KVPolicyConfig(**policy)
        self.default_max_tokens = default_max_tokens  # for params.max_tokens=None (the engine's max_model_len - n)
        self.default_block_size = default_block_size
        self.ledger = PendingLedger(expire_after_s=4 * self.config.stale_after_s)
        self._stats: dict[str, ReplicaStats] = {}  # parsed reports, by replica
        self._booked: dict[str, tuple[str, Booking]] = {}  # internal request id -> (replica, its booking)
        self._held: dict[str, tuple[float, float, RouteRequest]] = {}  # id -> (first held, last asked, request)
        self._sessions = SeenSessions()  # the session ids this router has routed (ingress replicas: each its own)
        self._last_expire = 0.0

    def _view(self, replicas: list[RunningReplica]) -> dict[str, ReplicaStats | None]:
        view = {}
        for r in replicas:
            key, raw = replica_key(r.replica_id), r.routing_stats
            known = self._stats.get(key)
            if raw and "prefix_hashes" in raw and (known is None or raw["timestamp"] > known.timestamp):
                known = self._stats[key] = ReplicaStats.from_dict(raw)  # parse each report once
                self.ledger.covered(key, known.timestamp)
            view[key] = known
        return view

    def _unbook(self, request_key: str, now: float) -> None:
        booked = self._booked.pop(request_key, None)
        if booked is not None:
            self.ledger.release(booked[0], now, booked[1])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = route_request_from(pending_request, self.default_max_tokens)
        if request is None:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # we always consider every replica
        now = time.time()
        if now - self._last_expire > self.config.stale_after_s:
            self.ledger.expire(now)
            self._last_expire = now
        key = pending_request.metadata.internal_request_id
        self._unbook(key, now)  # a retry: Serve found our last pick full
        view = self._view(candidate_replicas)
        rid = choose_kv(request, view, self.ledger.view(), now, self.config, self._sessions.is_new(request.session))
        if rid is None or self._yields(key, request, rid, view, now):
            first = self._held.get(key, (now,))[0]
            self._held[key] = (first, now, request)
            return []  # hold: Serve backs off and asks again
        self._held.pop(key, None)
        self._sessions.add(request.session)
        self._booked[key] = (rid, record_dispatch(self.ledger, rid, request, view, now, self.default_block_size))
        return [[r for r in candidate_replicas if replica_key(r.replica_id) == rid]]

    def _yields(self, key: str, request: RouteRequest, rid: str, view: dict, now: float) -> bool:
        """Whether this request leaves `rid` to a held one that fits there and comes first: one of a
        lower `priority` (vLLM's priority scheduling, which a request waiting out here would
        otherwise miss: the engine orders only its own queue), or one of the same priority that has
        waited max_hold_s. Held requests that stopped asking (cancelled, routed elsewhere) are
        forgotten."""
        mine = self._held.get(key, (now,))[0]
        s = view.get(rid)
        for other, (first, asked, held) in list(self._held.items()):
            if now - asked > FORGET_HELD_S:
                del self._held[other]
            elif other == key or s is None or held.priority > request.priority:
                continue
            elif ((held.priority < request.priority or (first < mine and now - first >= self.config.max_hold_s))
                  and rank_key(held, s, self.ledger.get(rid), self.config, now) is not None):
                return True
        return False

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._unbook(internal_request_id, time.time())

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.ledger.forget(replica_key(replica_id))
        self._stats.pop(replica_key(replica_id), None)


class RoundRobinRequestRouter(RequestRouter):
    """Cycles through the replicas (a baseline for comparisons)."""

    def initialize_state(self, **_) -> None:
        self._cursor = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        ordered = sorted(candidate_replicas, key=lambda r: replica_key(r.replica_id))
        i = self._cursor % len(ordered)
        self._cursor += 1
        # One replica per rank: Serve tries the ranks in order (within a rank it would take the
        # shortest queue), so a full replica is skipped for the next one.
        return [[r] for r in ordered[i:] + ordered[:i]]


class _PeerRequestRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """A cluster.policy peer wrapper inside Serve: it picks one replica for each generate call
    (Serve then skips it while full, backs off and asks again), learns where calls were routed
    (on_request_routed) and counts this router's calls in flight per replica."""

    def initialize_state(self, default_max_tokens: int = 256, tokenizer: str | None = None,
                         trust_remote_code: bool = False, **policy) -> None:
        self.default_max_tokens = default_max_tokens
        self.detokenize = _detokenizer(tokenizer, trust_remote_code) if tokenizer else None
        self.policy = self.make_policy(**policy)
        self._requests: dict[str, RouteRequest] = {}  # internal request id -> request, until routed
        self._inflight: dict[str, int] = {}  # replica -> calls this router sent there, not yet completed

    def make_policy(self, **policy):
        raise NotImplementedError

    async def queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        return {replica_key(r.replica_id): self._inflight.get(replica_key(r.replica_id), 0) for r in replicas}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = route_request_from(pending_request, self.default_max_tokens, self.detokenize)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True
        by_key = {replica_key(r.replica_id): r for r in candidate_replicas}
        lens = await self.queue_lens(candidate_replicas)
        full = min(r.max_ongoing_requests for r in candidate_replicas)
        rid = self.policy.choose(request, dict.fromkeys(by_key), {}, time.time(), lens, full)
        if rid is None:
            return []  # its choice is full: back off and ask again
        self._requests[pending_request.metadata.internal_request_id] = request
        return [[by_key[rid]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request = self._requests.pop(pending_request.metadata.internal_request_id, None)
        key = replica_key(replica_id)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        if request is not None:
            self.policy.routed(request, key, time.time())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        key = replica_key(replica_id)
        if self._inflight.get(key, 0) > 0:
            self._inflight[key] -= 1

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._inflight.pop(replica_key(replica_id), None)
        tree = getattr(self.policy, "tree", None)
        if tree is not None:
            tree.remove_tenant(replica_key(replica_id))


def _detokenizer(path: str, trust_remote_code: bool = False):
    from engine.model_source import load_tokenizer

    tokenizer = load_tokenizer(path, trust_remote_code)
    return lambda ids: tokenizer.decode(ids)


class PrefixAffinityRequestRouter(_PeerRequestRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter rules; queue lengths as Ray reads them (Serve's
    cache, else a probe). Kwargs: PrefixAffinityConfig fields, `tokenizer` (a directory) and
    `trust_remote_code`."""

    def make_policy(self, **policy):
        return PrefixAffinityRouter(config=PrefixAffinityConfig(**policy))

    async def queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        lens, unknown = {}, []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None or q >= r.max_ongoing_requests:
                unknown.append(r)
            else:
                lens[replica_key(r.replica_id)] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None:
                    lens[replica_key(r.replica_id)] = q
        return lens


class CacheAwareRequestRouter(_PeerRequestRouter):
    """sgl-router's cache_aware rules on this router's own in-flight counts (as sgl counts its
    workers' load). Kwargs: CacheAwareConfig fields."""

    def make_policy(self, **policy):
        return CacheAwareRouter(CacheAwareConfig(**policy))


class SessionRequestRouter(_PeerRequestRouter):
    """Consistent hashing of the call's Serve session_id (random without one)."""

    def make_policy(self, seed: int | None = None):
        return SessionRouter(seed)


def request_router_config(routing: str = "kv", stats_period_s: float = 0.5, **router_kwargs):
    """The engine deployment's `request_router_config` for `--routing` (cluster.policy.ROUTERS)."""
    from ray.serve.config import RequestRouterConfig

    if routing not in ROUTER_CLASSES:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTER_CLASSES)}")
    return RequestRouterConfig(request_router_class=ROUTER_CLASSES[routing], request_router_kwargs=router_kwargs,
                               request_routing_stats_period_s=stats_period_s,
                               request_routing_stats_timeout_s=max(1.0, 4 * stats_period_s))
