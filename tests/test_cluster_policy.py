"""Routing policies (cluster/policy.py), the pending ledger and replica stats, without Ray."""
import dataclasses
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.pending import EMPTY, Booking, PendingLedger
from cluster.policy import (KVPolicyConfig, RouteRequest, choose_kv, choose_pow2, choose_round_robin,
                            record_dispatch)
from cluster.stats import ReplicaStats, build_replica_stats, summarize_prefix_hashes
from engine.block_manager import BlockManager
from engine.hashing import hash_prefix_blocks
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

BS = 16
NOW = 100.0


def stats(rid, free=1000, total=1000, reserved=0, running=0, waiting=0, max_num_seqs=64, waiting_prefill=0,
          hashes=(), timestamp=NOW):
    return ReplicaStats(replica_id=rid, num_free_blocks=free, num_total_blocks=total, block_size=BS,
                        num_reserved_blocks=reserved, num_running=running, num_waiting=waiting,
                        max_num_seqs=max_num_seqs, waiting_prefill_tokens=waiting_prefill, num_preemptions=0,
                        prefix_query_tokens=0, prefix_hit_tokens=0, prefix_hashes=frozenset(hashes),
                        timestamp=timestamp)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


PREFIX = prompt(1, 512)  # 32 blocks


def req(suffix_seed=2, prefix=PREFIX, suffix_len=40, max_tokens=64):
    return RouteRequest(prefix + prompt(suffix_seed, suffix_len), max_tokens)


def cached(tokens):
    return hash_prefix_blocks(tokens, BS)


# -- kv -------------------------------------------------------------------------------------------
def test_picks_the_prefix_hit_replica_with_room():
    view = {"a": stats("a"), "b": stats("b", hashes=cached(PREFIX)), "c": stats("c", free=2000, total=2000)}
    assert choose_kv(req(), view, {}, NOW) == "b"


def test_a_prefix_no_replica_holds_goes_where_fewest_prefixes_are_cached():
    """Two idle replicas, equal free blocks (free cached blocks count as free): the new prefix goes
    to the replica caching fewer blocks, whichever comes first in the view, rather than evicting
    another prefix's blocks on one replica while the other's cache sits unused."""
    other = cached(prompt(9, 256))
    for order in (("a", "b"), ("b", "a")):
        view = {rid: stats(rid, hashes=other if rid == "a" else ()) for rid in order}
        assert choose_kv(req(), view, {}, NOW) == "b"


def test_longer_prefix_match_wins():
    view = {"a": stats("a", hashes=cached(PREFIX[:256])), "b": stats("b", hashes=cached(PREFIX))}
    assert choose_kv(req(), view, {}, NOW) == "b"


def test_skips_a_prefix_hit_replica_without_room():
    r = req()  # 552 + 64 tokens = 39 blocks, 32 of them cached on b
    view = {"a": stats("a", free=300), "b": stats("b", free=5, hashes=cached(PREFIX)), "c": stats("c", free=500)}
    assert choose_kv(r, view, {}, NOW) == "c"  # no room on b: the most free blocks
    view["b"] = stats("b", free=8, hashes=cached(PREFIX))  # the 7 new blocks fit next to the cached 32
    assert choose_kv(r, view, {}, NOW) == "b"


def test_reserved_growth_and_seats_count_against_room():
    r = req()
    cfg = KVPolicyConfig(reserve_weight=1.0)
    view = {"a": stats("a", free=500, reserved=495, hashes=cached(PREFIX)), "b": stats("b", free=100)}
    assert choose_kv(r, view, {}, NOW, cfg) == "b"  # a's running requests will still grow into its free blocks
    view = {"a": stats("a", running=60, waiting=4, hashes=cached(PREFIX)), "b": stats("b", free=100)}
    assert choose_kv(r, view, {}, NOW, cfg) == "b"  # a has no sequence seat


def test_no_room_anywhere_holds():
    view = {"a": stats("a", free=10), "b": stats("b", running=64)}
    assert choose_kv(req(), view, {}, NOW) is None


def test_hot_prefix_spills_over_when_its_replica_is_backlogged():
    view = {"a": stats("a", hashes=cached(PREFIX), waiting_prefill=4000), "b": stats("b")}
    assert choose_kv(req(), view, {}, NOW) == "b"  # 512 cached tokens do not beat a 4000-token queue


def test_the_cached_share_of_a_reported_queue_is_not_backlog():
    """The engine reports a waiting request's whole prompt; a replica serving 90% of its prompt
    tokens from cache prefills a tenth of that, so a queue of resident chats' next turns does not
    push a turn off the replica holding its context (with a 0% hit rate the same queue does)."""
    system, context = PREFIX[:256], PREFIX
    turn = RouteRequest(context + prompt(60, 40), 64)
    other = stats("other", hashes=cached(system), running=1)
    queued = stats("home", hashes=cached(context), running=3, waiting=1, waiting_prefill=1000)
    assert choose_kv(turn, {"home": queued, "other": other}, {}, NOW) == "other"
    mostly_cached = dataclasses.replace(queued, prefix_query_tokens=10_000, prefix_hit_tokens=9_000)
    assert choose_kv(turn, {"home": mostly_cached, "other": other}, {}, NOW) == "home"


def test_a_prefill_under_way_is_reported_and_counts_as_backlog():
    """A prompt admitted and chunked over several steps is neither waiting nor decoding: the
    report carries what it has left, and the router counts it like a queue."""
    sched = Scheduler(SchedulerConfig(8, 10), BlockManager(64, 4))
    sched.add(Sequence("long", prompt(15, 30), SamplingParams(max_tokens=4), 4))
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    reported = build_replica_stats("busy", sched, NOW)
    assert (reported.running_prefill_tokens, reported.waiting_prefill_tokens, reported.num_running) == (20, 0, 1)
    busy = dataclasses.replace(stats("busy", running=1), running_prefill_tokens=3000)
    assert choose_kv(req(), {"busy": busy, "idle": stats("idle", running=1)}, {}, NOW) == "idle"


def _burst(view, ledger: PendingLedger, requests: list[RouteRequest]) -> list[str]:
    """Route requests one after another with no stats report in between; the replicas picked."""
    picks = []
    for r in requests:
        rid = choose_kv(r, view, ledger.view(), NOW)
        record_dispatch(ledger, rid, r, view, NOW)
        picks.append(rid)
    return picks


def test_spreads_a_burst_of_distinct_prompts():
    view = {rid: stats(rid) for rid in "abcd"}
    # no report arrives during the burst
    picks = _burst(view, PendingLedger(), [RouteRequest(prompt(100 + i, 300), 64) for i in range(8)])
    assert sorted(picks) == sorted("abcd" * 2)


def test_a_shared_prefix_burst_computes_the_prefix_once_per_replica_then_reuses_it():
    view = {rid: stats(rid) for rid in "abcd"}
    ledger = PendingLedger()
    picks = _burst(view, ledger, [req(suffix_seed=200 + i, suffix_len=100) for i in range(12)])
    # Queueing behind a 612-token prefill costs more than computing the 512-token prefix again, so
    # the burst starts the prefix on every replica; later requests reuse the pending prefixes.
    assert sorted(picks[:4]) == list("abcd") and sorted(picks) == sorted("abcd" * 3)
    booked = sum(ledger.get(rid).num_prefill_tokens for rid in "abcd")
    assert booked == 4 * 612 + 8 * 100


def test_stale_stats_are_ignored_while_fresh_replicas_have_room():
    view = {"a": stats("a", hashes=cached(PREFIX), timestamp=NOW - 60), "b": stats("b", free=100)}
    assert choose_kv(req(), view, {}, NOW, KVPolicyConfig(stale_after_s=5)) == "b"


def test_unknown_replicas_take_requests_only_when_no_known_one_has_room():
    full = {"a": stats("a", free=0), "b": stats("b", free=0)}
    assert choose_kv(req(), {**full, "new": None}, {}, NOW) == "new"  # a replica that has not reported yet
    assert choose_kv(req(), {"a": stats("a"), "new": None}, {}, NOW) == "a"
    stale = {**full, "s": stats("s", free=0, timestamp=NOW - 60)}
    assert choose_kv(req(), stale, {}, NOW) == "s"  # stale numbers are not trusted either way


def test_without_any_stats_spreads_by_pending_dispatches():
    view = dict.fromkeys("abc")
    picks = _burst(view, PendingLedger(), [RouteRequest(prompt(300 + i, 100), 16) for i in range(6)])
    assert sorted(picks) == sorted("abc" * 2)


def test_precomputed_hashes_route_like_token_ids():
    tokens = PREFIX + prompt(5, 40)
    by_hash = RouteRequest(None, 64, num_prompt_tokens=len(tokens),
                           prefix_hashes={BS: hash_prefix_blocks(tokens, BS, (len(tokens) - 1) // BS)})
    view = {"a": stats("a"), "b": stats("b", hashes=cached(PREFIX))}
    assert choose_kv(by_hash, view, {}, NOW) == choose_kv(RouteRequest(tokens, 64), view, {}, NOW) == "b"


def test_a_salted_request_sees_only_its_salts_cached_prefix():
    """cache_salt (engine.hashing.root_hash): the router credits a salted request only with blocks
    cached under the same salt, as the engine would hit them."""
    from engine.hashing import root_hash

    salted = hash_prefix_blocks(PREFIX, BS, root=root_hash("t1"))
    view = {"a": stats("a", hashes=cached(PREFIX)), "b": stats("b", hashes=salted)}
    tokens = PREFIX + prompt(5, 40)
    assert choose_kv(RouteRequest(tokens, 64, root=root_hash("t1")), view, {}, NOW) == "b"
    assert choose_kv(RouteRequest(tokens, 64), view, {}, NOW) == "a"


@st.composite
def cluster_views(draw):
    n = draw(st.integers(1, 6))
    view = {}
    for i in range(n):
        prefix_blocks = draw(st.integers(0, 40))
        view[f"r{i}"] = stats(f"r{i}", free=draw(st.integers(0, 120)), total=200, reserved=draw(st.integers(0, 60)),
                              running=draw(st.integers(0, 8)), waiting=draw(st.integers(0, 2)), max_num_seqs=8,
                              waiting_prefill=draw(st.integers(0, 3000)),
                              hashes=cached(PREFIX)[:prefix_blocks],
                              timestamp=NOW - draw(st.sampled_from([0, 0, 0, 1, 30])))
    return view


@settings(max_examples=300, deadline=None)
@given(view=cluster_views(), suffix_len=st.integers(1, 600), max_tokens=st.integers(1, 400),
       reserve_weight=st.sampled_from([0.0, 0.5, 1.0]))
def test_never_picks_a_replica_without_room_when_one_has_room(view, suffix_len, max_tokens, reserve_weight):
    r = RouteRequest(PREFIX + prompt(9, suffix_len), max_tokens)
    cfg = KVPolicyConfig(stale_after_s=5, reserve_weight=reserve_weight)

    def has_room(s):  # independent restatement of the rule in cluster/policy.py
        n = len(r.token_ids)
        hit = 0
        for h in hash_prefix_blocks(r.token_ids, BS, (n - 1) // BS):
            if h not in s.prefix_hashes:
                break
            hit += 1
        need = -(-(n + max_tokens) // BS) - hit
        return (s.num_free_blocks - reserve_weight * s.num_reserved_blocks >= need
                and s.num_running + s.num_waiting < s.max_num_seqs)

    fresh_with_room = {rid for rid, s in view.items() if NOW - s.timestamp <= 5 and has_room(s)}
    pick = choose_kv(r, view, {}, NOW, cfg)
    if fresh_with_room:
        assert pick in fresh_with_room
    elif any(NOW - s.timestamp > 5 for s in view.values()):
        assert pick is not None and NOW - view[pick].timestamp > 5
    else:
        assert pick is None


# -- pow2 / round robin -------------------------------------------------------------------------------
def test_pow2_takes_the_shorter_queue_and_never_a_full_one():
    rng = random.Random(0)
    view = {"a": stats("a"), "b": stats("b")}
    assert choose_pow2(req(), view, {}, NOW, rng, queue_lens={"a": 5, "b": 2}) == "b"
    assert choose_pow2(req(), view, {}, NOW, rng, queue_lens={"a": 5, "b": 8}, max_ongoing=8) == "a"
    assert choose_pow2(req(), view, {}, NOW, rng, queue_lens={"a": 8, "b": 8}, max_ongoing=8) is None
    picks = {choose_pow2(req(), dict.fromkeys("abcdef"), {}, NOW, rng) for _ in range(200)}
    assert picks == set("abcdef")


def test_round_robin_cycles_and_skips_full_replicas():
    view, cursor, picks = dict.fromkeys("abc"), 0, []
    for _ in range(6):
        rid, cursor = choose_round_robin(req(), view, {}, NOW, cursor)
        picks.append(rid)
    assert picks == list("abcabc")
    rid, _ = choose_round_robin(req(), view, {}, NOW, 0, queue_lens={"a": 4, "b": 1, "c": 0}, max_ongoing=4)
    assert rid == "b"


def test_a_finished_turn_keeps_its_chat_at_home_until_the_next_report():
    """The router never sees an answer. Until the home replica reports again, a chat's next turn
    (prompt + answer + new message) seems to hit there only the full blocks of the last prompt,
    here the system prompt, which the other replica holds too, and a little load there sends the
    turn away to recompute its context. A completion books its prompt's partial last block (the
    answer filled it), which makes home the replica holding the longest prefix."""
    system = prompt(20, 48)  # 3 blocks
    turn1 = RouteRequest(system + prompt(21, 12), 8)  # 3 full blocks + 12 tokens of the 4th
    turn2 = RouteRequest(turn1.token_ids + prompt(22, 8) + prompt(23, 12), 8)  # + answer + new message
    led = PendingLedger()
    view = {rid: stats(rid, hashes=cached(system), timestamp=NOW - 1) for rid in ("home", "other")}
    booking = record_dispatch(led, "home", turn1, view, NOW - 0.9)
    assert booking == Booking(NOW - 0.9, 2, 12, (cached(system)[-1], tuple(turn1.token_ids[48:])))
    # A report while turn 1 ran (it covers the dispatch); home serves 10 other requests.
    view["home"] = stats("home", hashes=cached(system), running=11, timestamp=NOW - 0.5)
    led.covered("home", NOW - 0.5)
    assert choose_kv(turn2, view, led.view(), NOW) == "other"  # without the answer's block: even hits
    led.release("home", NOW - 0.2, booking)
    assert choose_kv(turn2, view, led.view(), NOW) == "home"
    assert choose_kv(req(), view, led.view(), NOW) == "other"  # a tail counts only for prompts that continue it
    led.covered("home", NOW - 0.1)  # the next report holds the block itself
    assert not led.view()
    on_boundary = RouteRequest(system, 8)
    assert record_dispatch(led, "other", on_boundary, view, NOW).tail is None


# -- ledger ---------------------------------------------------------------------------------------------
def test_ledger_nets_dispatches_and_completions_until_a_report_covers_them():
    led = PendingLedger(expire_after_s=10)
    led.record("a", 1.0, 10, 100, (11, 12))
    led.record("a", 2.0, 5, 50, (11,))
    led.release("a", 3.0, Booking(2.0, 5, 50, (12, (5, 6))))  # done before any report: prefilled, tail left
    p = led.get("a")
    assert (p.num_requests, p.num_blocks, p.num_prefill_tokens) == (1, 10, 100) and 11 in p and 12 in p
    assert p.tails == {(12, (5, 6)): 1} and p.tail_parents == {12: 1}
    led.covered("a", 1.5)
    p = led.get("a")
    assert (p.num_requests, p.num_blocks, p.num_prefill_tokens) == (0, 0, 0) and 11 in p and 12 not in p
    # the dispatch at 1.0 is in the report's figures now: its completion frees its seat and blocks,
    # and leaves the prefill figure to that report (its queue, less what drained since)
    led.release("a", 3.5, Booking(1.0, 10, 100))
    p = led.get("a")
    assert (p.num_requests, p.num_blocks, p.num_prefill_tokens) == (-1, -10, 0) and p.tails
    led.covered("a", 3.0)  # a report after the first completion holds the block its answer filled
    p = led.get("a")
    assert (p.num_requests, p.num_blocks, p.num_prefill_tokens) == (-1, -10, 0) and not p.tails
    assert not p.tail_parents and not p.prefix_hashes
    led.expire(20.0)
    assert led.get("a").num_requests == 0 and not led.view()


# -- stats ------------------------------------------------------------------------------------------------
def test_stats_round_trip_through_plain_types():
    s = stats("a", hashes=cached(PREFIX), reserved=7)
    d = s.to_dict()
    assert isinstance(d["prefix_hashes"], list) and ReplicaStats.from_dict(d) == s


def _bm_with(prompts, num_blocks=64, block_size=4):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(8, 1024), bm)
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"q{i}", p, SamplingParams(max_tokens=4), 4)
        sched.add(seq)
        seqs.append(seq)
    sched.schedule()
    return bm, sched, seqs


def test_summary_uses_the_engine_hash_so_the_router_finds_cached_prefixes():
    p = prompt(7, 40)  # 10 blocks of 4
    bm, sched, _ = _bm_with([p])
    summary = summarize_prefix_hashes(bm, limit=100)
    assert set(hash_prefix_blocks(p, 4)) == summary == set(bm.hash_to_block)
    s = build_replica_stats("x", sched, NOW)
    r = RouteRequest(p[:30] + prompt(8, 9), 8)  # shares 7 full blocks
    assert s.block_size == 4 and s.num_running == 1
    from cluster.pending import EMPTY
    from cluster.policy import prefix_hit_blocks
    assert prefix_hit_blocks(r.hashes(4), s.prefix_hashes, EMPTY) == 7


def test_bounded_summary_keeps_blocks_in_use_then_the_most_recently_freed():
    a, b, c = prompt(10, 16), prompt(11, 16), prompt(12, 16)  # 4 blocks each
    bm, sched, seqs = _bm_with([a, b, c])
    sched.finish(seqs[0])  # freed first: evicted first
    sched.finish(seqs[2])
    in_use = set(hash_prefix_blocks(b, 4))
    assert summarize_prefix_hashes(bm, limit=4) == in_use
    six = summarize_prefix_hashes(bm, limit=6)
    assert in_use < six and six - in_use <= set(hash_prefix_blocks(c, 4))  # c was freed last
    assert len(summarize_prefix_hashes(bm, limit=2)) == 2


def test_reserved_blocks_count_growth_to_max_tokens():
    bm, sched, seqs = _bm_with([prompt(13, 10)])  # 3 blocks held, 10 + 4 tokens need 4
    s = build_replica_stats("x", sched, NOW)
    assert s.num_reserved_blocks == 1 and s.headroom_blocks == s.num_free_blocks - 1
    sched.add(Sequence("w", prompt(14, 12), SamplingParams(max_tokens=4), 4))
    assert build_replica_stats("x", sched, NOW).num_reserved_blocks == 1 + 4
    assert build_replica_stats("x", sched, NOW).waiting_prefill_tokens == 12


def test_bad_policy_config_is_rejected():
    with pytest.raises(ValueError):
        KVPolicyConfig(reserve_weight=2)
    with pytest.raises(ValueError):
        RouteRequest(None, 4)


# -- prefix tree and the peer policies (cluster/prefix_tree.py, cluster/peers.py) ------------------------
from cluster.peers import (CacheAwareConfig, HashRing, PrefixAffinityConfig, choose_cache_aware,  # noqa: E402
                           choose_session, prefix_affinity_candidates)
from cluster.policy import ROUTERS, choose_held, make_router  # noqa: E402
from cluster.prefix_tree import PrefixTree, token_key  # noqa: E402


def test_prefix_tree_splits_counts_and_matches_by_tenant():
    t = PrefixTree()
    t.insert("hello world", "a", 1.0)
    t.insert("help me", "b", 2.0)
    t.insert("hello there", "a", 3.0)
    assert t.size == {"a": 16, "b": 7}  # "hel" + "lo " + "world" + "there"; "hel" + "p me"
    assert t.match("hello wo") == (8, ["a"])  # stops inside "world"
    assert t.match("help") == (4, ["b"])
    assert t.match("xyz") == (0, ["a", "b"])  # the root: every tenant
    assert t.match("hello", ["b"]) == (3, ["b"])  # only b's nodes are walked
    assert t.smallest_tenants() == ["b"]
    t.remove_tenant("a")
    assert t.size == {"b": 7} and t.match("hello") == (3, ["b"]) and list(t.root.children["h"].children) == ["p"]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text("ab", max_size=12), st.sampled_from("xyz")), max_size=25), st.text("ab", max_size=12))
def test_prefix_tree_match_is_the_longest_common_prefix_with_any_inserted_string(inserts, query):
    t = PrefixTree()
    for text, tenant in inserts:
        t.insert(text, tenant, 0.0)
    common = [(len(os.path.commonprefix([text, query])), tenant) for text, tenant in inserts]
    best = max((n for n, _ in common), default=0)
    n, owners = t.match(query)
    assert n == best
    if best:
        assert set(owners) == {tenant for m, tenant in common if m == best}
    for tenant in "xyz":  # a tenant's size: the characters of the union of its strings' paths
        prefixes = {text[:k] for text, who in inserts if who == tenant for k in range(1, len(text) + 1)}
        assert t.size.get(tenant, 0) == len(prefixes)


def test_prefix_affinity_follows_ray_serve_llm_rules():
    t = PrefixTree()
    for rid in "abc":
        t.add_tenant(rid)
    t.insert("system prompt one, user: hi", "a", 1.0)
    t.insert("x" * 100, "b", 2.0)
    balanced = {"a": 3, "b": 0, "c": 10}  # spread 10: balanced (strictly above 10 is imbalanced)
    assert prefix_affinity_candidates("system prompt one, user: bye", t, balanced) == ["a"]
    # below a 10% match: the replicas holding the least text (c holds none)
    assert prefix_affinity_candidates("s" + "q" * 20, t, balanced) == ["c"]
    assert prefix_affinity_candidates("system prompt one", t, {"a": 0, "b": 0, "c": 11}) == []  # pow2
    # the wrapper: shortest open queue among the candidates, pow2 when there are none
    router = make_router("prefix_affinity", seed=0)
    view = dict.fromkeys("ab")
    first = router.choose(RouteRequest([1, 2, 3], 8), view, {}, NOW, {"a": 0, "b": 0})
    router.routed(RouteRequest([1, 2, 3], 8), first, NOW)
    assert router.choose(RouteRequest([1, 2, 3, 4], 8), view, {}, NOW, {"a": 1, "b": 1}) == first
    assert router.choose(RouteRequest([1, 2, 3, 4], 8), view, {}, NOW, {"a": 4, "b": 4}, max_ongoing=4) is None


def test_cache_aware_follows_sgl_router_rules():
    t = PrefixTree()
    t.insert(token_key(range(100)), "b", 1.0)
    loads = {"a": 0, "b": 5}
    assert choose_cache_aware(token_key(range(40)), t, loads) == "b"  # 100% of the prompt matched
    assert choose_cache_aware(token_key(list(range(30)) + [999] * 70), t, loads) == "a"  # 30%: not above 0.3
    assert choose_cache_aware(token_key(list(range(31)) + [999] * 69), t, loads) == "b"
    # imbalanced needs both: max - min > 64 and max > 1.5 * min
    assert choose_cache_aware(token_key(range(40)), t, {"a": 150, "b": 215}) == "b"  # 65 > 64, 215 < 1.5 * 150
    assert choose_cache_aware(token_key(range(40)), t, {"a": 10, "b": 75}) == "a"
    assert choose_cache_aware(token_key(range(40)), t, {"a": 10, "b": 74}) == "b"
    with pytest.raises(ValueError):
        CacheAwareConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        PrefixAffinityConfig(match_rate_threshold=2)


def test_session_hashing_is_sticky_and_moves_only_the_keys_of_a_removed_replica():
    ids = [f"r{i}" for i in range(8)]
    ring, rng = HashRing(ids), random.Random(0)
    before = {f"s{k}": choose_session(f"s{k}", ring, ids, rng) for k in range(400)}
    assert len(set(before.values())) == 8 and all(choose_session(k, ring, ids, rng) == v for k, v in before.items())
    after = {k: choose_session(k, ring, ids[1:], rng) for k in before}
    assert {k for k in before if before[k] != after[k]} == {k for k, v in before.items() if v == "r0"}
    assert {choose_session(None, ring, ids, rng) for _ in range(100)} == set(ids)  # no key: random


def test_every_policy_is_selectable_and_routes():
    assert set(ROUTERS) == {"kv", "pow2", "round_robin", "prefix_affinity", "cache_aware", "session"}
    view = {rid: stats(rid) for rid in "ab"}
    for name in ROUTERS:
        router = make_router(name, seed=1)
        rid = router.choose(req(), view, {}, NOW, {"a": 0, "b": 0}, 64)
        assert rid in view, name
        router.routed(req(), rid, NOW)
        assert ROUTERS[name].serve_router.split(":")[0] in ("cluster.serve_router", "ray.serve._private.request_router")


# -- held requests past saturation ----------------------------------------------------------------------
def test_held_room_goes_to_the_overdue_then_the_resident_prefix_then_who_can_meet_the_slo():
    s = stats("a", hashes=cached(PREFIX))
    cold = [(0.0, RouteRequest(prompt(50, 300), 64)), (1.0, RouteRequest(prompt(51, 300), 64))]
    warm = (2.0, req())
    assert choose_held(cold + [warm], "a", s, EMPTY, 3.0) == 2  # its 32 blocks are cached on a
    assert choose_held(cold, "a", s, EMPTY, 1.5) == 0  # no prefix anywhere, both can meet the SLO: the oldest
    assert choose_held(cold, "a", s, EMPTY, 2.5) == 1  # the oldest can no longer meet the 2 s SLO
    assert choose_held(cold + [warm], "a", s, EMPTY, 5.5) == 0  # the oldest has waited max_hold_s
    assert choose_held(cold + [warm], "a", s, EMPTY, 3.0, KVPolicyConfig(held_order="fifo")) == 0
    tight = stats("a", free=10, hashes=cached(PREFIX))  # 7 new blocks fit next to the cached prefix
    assert choose_held(cold + [warm], "a", tight, EMPTY, 5.5) == 2  # the overdue ones do not fit here
    assert choose_held(cold + [warm], "a", tight, EMPTY, 10.5) is None  # held 2 x max_hold_s: nobody passes it
    assert choose_held([], "a", s, EMPTY, 3.0) is None


def test_chat_turns_stay_home_and_new_chats_spread():
    system = PREFIX[:256]  # 16 blocks every chat of this app starts with
    context = PREFIX  # one chat's 32 blocks so far
    home = stats("home", hashes=cached(context), running=3)
    other = stats("other", hashes=cached(system), running=1)
    turn = RouteRequest(context + prompt(60, 40), 64)
    # home holds 16 more blocks; the other replica is 2 requests lighter: the turn stays home
    assert choose_kv(turn, {"home": home, "other": other}, {}, NOW) == "home"
    # a brief queue reported 0.4 s ago has drained since (prefill_rate): still home
    busy = stats("home", hashes=cached(context), running=3, waiting=1, waiting_prefill=600, timestamp=NOW - 0.4)
    assert choose_kv(turn, {"home": busy, "other": other}, {}, NOW) == "home"
    # a new chat with the system prompt: a replica 40 requests busier loses it to an idle one with
    # the same system prompt (the in-flight cost), though not for a difference within stay_margin
    new_chat = RouteRequest(system + prompt(61, 500), 64)
    crowded = stats("a", hashes=cached(system), running=45)
    assert choose_kv(new_chat, {"a": crowded, "b": stats("b", hashes=cached(system))}, {}, NOW) == "b"
    assert choose_kv(new_chat, {"a": crowded, "b": stats("b", hashes=cached(system[:128]), running=40)}, {},
                     NOW) == "a"
    with pytest.raises(ValueError):
        KVPolicyConfig(stay_margin=-1)


def test_a_new_session_places_its_chat_away_from_a_crowded_cache():
    """A session's first request weighs each request in flight at session_weight: it decides where
    the whole chat's context will live. 20 running requests cost a 552-token prompt 20 x 16.6
    tokens as a single request (the cached 512 and stay_margin win), 20 x 55.2 as a new chat (an
    idle replica wins)."""
    from cluster.policy import KVRouter, SeenSessions

    crowded = stats("a", hashes=cached(PREFIX), running=20)
    view = {"a": crowded, "b": stats("b")}
    assert choose_kv(req(), view, {}, NOW) == "a"
    assert choose_kv(req(), view, {}, NOW, new_session=True) == "b"
    assert choose_kv(req(), view, {}, NOW, KVPolicyConfig(session_weight=20, session_share=0.03), True) == "a"
    router = KVRouter()
    chat = RouteRequest(PREFIX + prompt(3, 40), 64, session="chat-1")
    assert router.choose(chat, view, {}, NOW) == "b"
    router.routed(chat, "b", NOW)
    assert router.choose(chat, view, {}, NOW) == "a"  # its next turn is no longer a new session
    assert router.choose(req(), view, {}, NOW) == "a"  # nor is a request without a session
    seen = SeenSessions(capacity=2)
    for sid in ("x", "y", "x", "z"):
        seen.add(sid)
    assert not seen.is_new("x") and not seen.is_new("z") and seen.is_new("y") and not seen.is_new(None)
    with pytest.raises(ValueError):
        KVPolicyConfig(session_weight=-1)
