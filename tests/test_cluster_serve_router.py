"""The Serve RequestRouters (cluster/serve_router.py) driven directly, without a Serve cluster."""
import asyncio
import random
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from cluster.serve_router import KVRequestRouter, RoundRobinRequestRouter, request_router_config  # noqa: E402
from cluster.stats import ReplicaStats  # noqa: E402
from engine.hashing import hash_prefix_blocks  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

DEP = DeploymentID(name="EngineServer", app_name="kvserve")
PREFIX = [random.Random(0).randrange(1000) for _ in range(256)]


def replica(name, **stats):
    rid = ReplicaID(unique_id=name, deployment_id=DEP)
    raw = None
    if stats:
        raw = ReplicaStats(replica_id=rid.to_full_id_str(), num_free_blocks=stats.get("free", 500),
                           num_total_blocks=500, block_size=16, num_reserved_blocks=0,
                           num_running=stats.get("running", 0), num_waiting=0,
                           max_num_seqs=64, waiting_prefill_tokens=0, num_preemptions=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0, prefix_hashes=frozenset(stats.get("hashes", ())),
                           timestamp=time.time()).to_dict()
    return SimpleNamespace(replica_id=rid, routing_stats=raw or {})


def pending(n, tokens, method="generate", priority=0):
    meta = RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}", call_method=method)
    return PendingRequest(args=[], kwargs={"request_id": f"r{n}", "prompt_token_ids": tokens,
                                           "params": SamplingParams(max_tokens=32, priority=priority)}, metadata=meta)


def make(cls, **kwargs):
    router = cls(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


def test_kv_router_routes_to_the_cached_prefix_and_holds_when_full():
    async def main():
        router = make(KVRequestRouter)
        a, b = replica("a"), replica("b", hashes=hash_prefix_blocks(PREFIX, 16))
        a.routing_stats = replica("a", free=500).routing_stats
        ranks = await router.choose_replicas([a, b], pending(1, PREFIX + [1, 2, 3]))
        assert ranks == [[b]]
        pr = pending(2, PREFIX + [4, 5])
        full = [replica("a", free=1), replica("b", free=1)]
        assert await router.choose_replicas(full, pr) == [] and pr.routing_context.should_backoff
        # a replica that has not reported yet is tried before holding
        assert await router.choose_replicas(full + [replica("new")], pending(3, [7] * 40)) == [[replica("new")]]
        # non-generate calls (info, stats) may go anywhere
        assert await router.choose_replicas([a, b], pending(4, [], method="info")) == [[a, b]]
    asyncio.run(main())


def test_kv_router_books_dispatches_until_completion_and_rebooks_retries():
    async def main():
        router = make(KVRequestRouter)
        reps = [replica(n, free=500) for n in "ab"]
        first = await router.choose_replicas(reps, pending(1, [3] * 100))
        second = await router.choose_replicas(reps, pending(2, [4] * 100))
        assert first != second  # the burst spreads: the first booking counts against its replica
        booked = router.ledger.get(first[0][0].replica_id.to_full_id_str())
        assert booked.num_requests == 1
        again = await router.choose_replicas(reps, pending(1, [3] * 100))  # Serve retries request 1
        assert router.ledger.get(again[0][0].replica_id.to_full_id_str()).num_requests == 1
        router.on_request_completed(again[0][0].replica_id, "i1")
        router.on_request_completed(second[0][0].replica_id, "i2")
        assert all(p.num_requests == 0 for p in router.ledger.view().values())
    asyncio.run(main())


def test_round_robin_router_rotates_single_replica_ranks():
    async def main():
        router = make(RoundRobinRequestRouter)
        reps = [replica(n) for n in "abc"]
        firsts = [(await router.choose_replicas(reps, pending(i, [1])))[0][0].replica_id.unique_id for i in range(4)]
        assert firsts == ["a", "b", "c", "a"]
    asyncio.run(main())


def test_request_router_config_selects_the_policy():
    assert request_router_config("kv").request_router_class == "cluster.serve_router:KVRequestRouter"
    assert request_router_config("pow2", stats_period_s=1).request_routing_stats_period_s == 1
    with pytest.raises(ValueError):
        request_router_config("random")


def peer_replica(name):
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEP), routing_stats={},
                           max_ongoing_requests=64)


def session_pending(n, tokens, session=""):
    meta = RequestMetadata(request_id=f"r{n}", internal_request_id=f"i{n}", call_method="generate",
                           session_id=session)
    return PendingRequest(args=[], kwargs={"request_id": f"r{n}", "prompt_token_ids": tokens,
                                           "params": SamplingParams(max_tokens=32)}, metadata=meta)


def test_peer_routers_learn_where_prompts_went_and_follow_them():
    from cluster.serve_router import CacheAwareRequestRouter, PrefixAffinityRequestRouter

    async def main():
        reps = [peer_replica(n) for n in "abc"]
        for cls in (PrefixAffinityRequestRouter, CacheAwareRequestRouter):
            router = make(cls)
            if cls is PrefixAffinityRequestRouter:  # queue lengths from Serve's cache, as Ray reads them
                router._use_replica_queue_len_cache = True
                for r in reps:
                    router._replica_queue_len_cache.update(r.replica_id, 0)
            first = await router.choose_replicas(reps, session_pending(1, PREFIX + [1]))
            router.on_request_routed(session_pending(1, PREFIX + [1]), first[0][0].replica_id, None)
            again = await router.choose_replicas(reps, session_pending(2, PREFIX + [2, 3]))
            assert again == first, cls.__name__  # the shared prefix follows the first request
            router.on_request_completed(first[0][0].replica_id, "i1")
            assert await router.choose_replicas(reps, pending(3, [], method="info")) == [reps]
    asyncio.run(main())


def test_session_router_keeps_a_session_on_one_replica():
    from cluster.serve_router import SessionRequestRouter

    async def main():
        router = make(SessionRequestRouter)
        reps = [peer_replica(n) for n in "abcd"]
        picks = {(await router.choose_replicas(reps, session_pending(i, [i], "chat-7")))[0][0].replica_id.unique_id
                 for i in range(6)}
        assert len(picks) == 1
        spread = {(await router.choose_replicas(reps, session_pending(i, [i], f"chat-{i}")))[0][0].replica_id.unique_id
                  for i in range(40)}
        assert len(spread) > 1
    asyncio.run(main())


def test_kv_router_spreads_new_sessions_and_keeps_known_ones_by_the_cache():
    async def main():
        router = make(KVRequestRouter)
        # a holds two 16-block prefixes but runs 20 requests; b is idle with nothing cached
        other = [random.Random(1).randrange(1000) for _ in range(256)]
        held = hash_prefix_blocks(PREFIX, 16) + hash_prefix_blocks(other, 16)
        reps = [replica("a", hashes=held, running=20), replica("b", free=500)]
        names = lambda ranks: [r.replica_id.unique_id for r in ranks[0]]  # noqa: E731
        assert names(await router.choose_replicas(reps, session_pending(1, PREFIX + [1] * 60))) == ["a"]
        # a session's first request places the whole chat: the busy replica loses it
        assert names(await router.choose_replicas(reps, session_pending(2, PREFIX + [2] * 60, "chat-1"))) == ["b"]
        router.on_request_completed(reps[1].replica_id, "i2")
        # the same session's next request weighs in-flight requests as any other request does (b
        # holds PREFIX now, so this one starts with the prefix only a holds)
        assert names(await router.choose_replicas(reps, session_pending(3, other + [3] * 60, "chat-1"))) == ["a"]
        # and a turn that continues the chat on b stays there
        assert names(await router.choose_replicas(reps, session_pending(4, PREFIX + [2] * 64, "chat-1"))) == ["b"]
    asyncio.run(main())


def test_every_routing_policy_has_a_request_router_config():
    from cluster.policy import ROUTERS

    for name, policy in ROUTERS.items():
        assert request_router_config(name).request_router_class == policy.serve_router


def test_kv_router_newcomers_yield_to_a_request_held_past_max_hold():
    async def main():
        router = make(KVRequestRouter, max_hold_s=0.2)
        full = [replica("a", free=1)]
        old = pending(1, [5] * 100)
        assert await router.choose_replicas(full, old) == []  # no room: held
        time.sleep(0.25)
        roomy = [replica("a", free=500)]
        assert await router.choose_replicas(roomy, pending(2, [6] * 100)) == []  # yields to the overdue one
        assert await router.choose_replicas(roomy, old) == [roomy]  # which takes the room
        assert await router.choose_replicas(roomy, pending(3, [7] * 100)) == [roomy]  # nobody overdue now
    asyncio.run(main())


def test_kv_router_room_goes_to_the_held_request_of_lowest_priority():
    """vLLM's priority scheduling where requests wait for room outside the engine (whose own queue
    is the only one it orders): a request leaves the room to a held one of lower priority that fits."""
    async def main():
        router = make(KVRequestRouter)
        full = [replica("a", free=1)]
        late, urgent, mid = pending(1, [5] * 100, priority=10), pending(2, [6] * 100, priority=-10), pending(
            3, [7] * 100, priority=5)
        for p in (late, urgent, mid):
            assert await router.choose_replicas(full, p) == []  # no room: all held, in arrival order
        roomy = [replica("a", free=500)]
        assert await router.choose_replicas(roomy, late) == []  # yields to the urgent one
        assert await router.choose_replicas(roomy, mid) == []
        assert await router.choose_replicas(roomy, urgent) == [roomy]
        assert await router.choose_replicas(roomy, late) == []  # then to mid, the next lowest
        assert await router.choose_replicas(roomy, mid) == [roomy]
        assert await router.choose_replicas(roomy, late) == [roomy]
        huge = pending(4, [8] * 100, priority=-20)
        huge.kwargs["params"] = SamplingParams(max_tokens=10**5, priority=-20)
        assert await router.choose_replicas(full, huge) == []
        assert await router.choose_replicas(roomy, pending(5, [9] * 100)) == [roomy]  # it does not fit: no yield
    asyncio.run(main())


def test_a_drain_call_goes_to_an_ingress_replica_not_asked_yet():
    from cluster.ingress_router import IngressRequestRouter

    async def main():
        router = make(IngressRequestRouter)
        a, b, c = replica("a"), replica("b"), replica("c")

        def drain(*asked):
            meta = RequestMetadata(request_id="d", internal_request_id="d", call_method="drain")
            return PendingRequest(args=[], kwargs={"exclude": [r.replica_id.to_full_id_str() for r in asked]},
                                  metadata=meta)

        assert await router.choose_replicas([a, b, c], drain()) == [[a, b, c]]
        assert await router.choose_replicas([a, b, c], drain(a, c)) == [[b]]
        assert await router.choose_replicas([a, b, c], drain(a, b, c)) == [[a, b, c]]  # all asked: any, seen again
    asyncio.run(main())
