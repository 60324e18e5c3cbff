"""kvserve's cluster layer inside Ray Serve, end to end: the KV-aware router against Serve's
power-of-two-choices router on a prefix-sharing workload, KV-pressure autoscaling 1 -> 2 -> 1,
and the `kvserve serve` flags that select them.

One local Ray for the module (shut down afterwards); the engine replicas run a tiny random Llama.
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster.app import engine_deployment_options, split_args
from cluster.cli import main as kvserve_main
from cluster.serve_router import ROUTER_CLASSES
from tests.local_serve import free_port, init_ray_as_kvserve_serve
from tests.tiny_llama import make_tiny_llama

ENGINE = "EngineServer"
INGRESS = "OpenAIIngress"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", tokenizer_dir=smollm2_path, kind="gqa"))


@pytest.fixture(scope="module")
def serve_url():
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    port = free_port()
    init_ray_as_kvserve_serve(num_cpus=4, include_dashboard=False)  # Serve's gRPC transport, as deployed
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _deploy(tiny_model: str, name: str, route_prefix: str, **args):
    from ray import serve

    from cluster.app import build_app

    args = dict(model=tiny_model, served_model_name="tiny", max_model_len=512, device="cpu", **args)
    serve.run(build_app(args), name=name, route_prefix=route_prefix)


def _replica_counts(app: str, deployment: str = ENGINE) -> dict[str, int]:
    from ray import serve

    dep = serve.status().applications[app].deployments[deployment]
    return {getattr(k, "value", str(k)): v for k, v in dep.replica_states.items() if v}


def _per_replica_stats(app: str, want: int, timeout_s: float = 30.0) -> dict[str, dict]:
    """record_routing_stats of every replica, asked of each replica actor as Serve's controller asks
    it (a handle call would land wherever Serve's router sends it, on either transport)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{ENGINE}#"
    deadline = time.monotonic() + timeout_s
    names: list[str] = []
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
        if len(names) >= want:
            break
        time.sleep(0.2)
    assert len(names) == want, f"found {len(names)} of {want} replicas"
    stats = ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names], timeout=10)
    return {s["replica_id"]: s for s in stats}


def _complete(http: httpx.Client, prefix: str, ids: list[int], max_tokens: int) -> dict:
    r = http.post(f"{prefix}/v1/completions",
                  json={"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()


# -- a) kv routing beats pow2 on prefix-cache hits ---------------------------------------------------
GROUPS, PER_GROUP, PREFIX_LEN, SUFFIX_LEN = 4, 6, 64, 8


def _prefix_workload(seed: int = 0) -> list[list[list[int]]]:
    """Waves of GROUPS requests (one per prefix group): 64 shared tokens + 8 unique ones each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(PREFIX_LEN)] for _ in range(GROUPS)]
    return [[prefixes[g] + [rng.randrange(3, 500) for _ in range(SUFFIX_LEN)] for g in range(GROUPS)]
            for _ in range(PER_GROUP)]


def _hit_rate_with(routing: str, url: str, tiny_model: str) -> tuple[float, dict]:
    from ray import serve

    app, prefix = f"hits_{routing}", f"/{routing}"
    _deploy(tiny_model, app, prefix, routing=routing, num_replicas=2, num_gpu_blocks_override=64,
            max_num_seqs=8, routing_stats_period_s=0.2)
    try:
        with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(GROUPS) as pool:
            for wave in _prefix_workload():
                for out in pool.map(lambda ids: _complete(http, prefix, ids, 4), wave):
                    assert out["usage"]["completion_tokens"] == 4
                time.sleep(0.25)  # let the next report carry this wave's cached prefixes
        stats = _per_replica_stats(app, 2)
        hit = sum(s["prefix_hit_tokens"] for s in stats.values())
        query = sum(s["prefix_query_tokens"] for s in stats.values())
        assert query >= GROUPS * PER_GROUP * PREFIX_LEN
        per_replica = {rid[-8:]: (s["prefix_hit_tokens"], s["prefix_query_tokens"]) for rid, s in stats.items()}
        return hit / query, per_replica
    finally:
        serve.delete(app)


def test_kv_routing_gets_more_prefix_cache_hits_than_pow2(serve_url, tiny_model):
    kv, kv_detail = _hit_rate_with("kv", serve_url, tiny_model)
    pow2, pow2_detail = _hit_rate_with("pow2", serve_url, tiny_model)
    print(f"\nprefix-cache hit rate: kv {kv:.3f} {kv_detail}  pow2 {pow2:.3f} {pow2_detail}")
    # kv: each prefix is computed once (1 miss of 6 per group, 64 of 72 tokens cacheable) -> ~0.74
    assert kv > pow2
    assert kv >= 0.6


# -- a') multi-turn chat: kv's prefix-cache hit rate against the peers' ---------------------------------
SESSIONS, TURNS, SYSTEM_LEN, USER_LEN, ANSWER_LEN = 6, 4, 48, 12, 8
PEERS = ("prefix_affinity", "cache_aware", "session")


def _chat(app: str, seed: int = 0) -> None:
    """SESSIONS concurrent chats of TURNS turns (two system prompts), straight to the engine
    deployment (so that each call carries its Serve session_id, which the session router keys
    on): every turn's prompt is the previous prompt + the tokens the replica answered + a new user
    message."""
    from ray import serve

    from engine.sampling_params import SamplingParams

    handle = serve.get_deployment_handle(ENGINE, app_name=app)
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(SYSTEM_LEN)] for _ in range(2)]

    def session(k: int) -> None:
        srng = random.Random(seed * 100 + k)
        prompt = systems[k % 2] + [srng.randrange(3, 500) for _ in range(USER_LEN)]
        time.sleep(0.2 * k)  # users do not start in lockstep
        for t in range(TURNS):
            stream = handle.options(stream=True, session_id=f"chat-{k}").generate.remote(
                request_id=f"{app}-{k}-{t}", prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=ANSWER_LEN, temperature=0, ignore_eos=True))
            answer = [tok for step in stream for c in step.choices for tok in c.token_ids]
            assert len(answer) == ANSWER_LEN
            prompt = prompt + answer + [srng.randrange(3, 500) for _ in range(USER_LEN)]
            # The user reads, for less time than a loaded host may take to deliver the next report
            # (every 0.2 s), so the router must place some turns on reports older than the answer.
            time.sleep(0.3)

    with ThreadPoolExecutor(SESSIONS) as pool:
        list(pool.map(session, range(SESSIONS)))


def _multi_turn_hit_rate(routing: str, url: str, tiny_model: str) -> float:
    from ray import serve

    app = f"chat_{routing}"
    _deploy(tiny_model, app, f"/{app}", routing=routing, num_replicas=2, num_gpu_blocks_override=64,
            max_num_seqs=8, routing_stats_period_s=0.2)
    try:
        _chat(app)
        stats = _per_replica_stats(app, 2)
        hit = sum(s["prefix_hit_tokens"] for s in stats.values())
        query = sum(s["prefix_query_tokens"] for s in stats.values())
        assert query >= SESSIONS * TURNS * SYSTEM_LEN
        return hit / query
    finally:
        serve.delete(app)


def test_kv_routing_hits_the_prefix_cache_at_least_as_often_as_the_peers_on_multi_turn_chat(serve_url, tiny_model):
    rates = {}
    for routing in ("kv",) + PEERS:
        t0 = time.monotonic()
        rates[routing] = _multi_turn_hit_rate(routing, serve_url, tiny_model)
        print(f"\n{routing}: hit rate {rates[routing]:.3f} in {time.monotonic() - t0:.0f}s", flush=True)
    print("\nmulti-turn prefix-cache hit rate on 2 replicas: " + ", ".join(f"{k} {v:.3f}" for k, v in rates.items()))
    assert rates["kv"] >= max(rates[p] for p in PEERS)
    assert rates["kv"] >= 0.6


def test_session_routing_over_http_keeps_each_session_on_one_replica(serve_url, tiny_model):
    """`--routing session` over HTTP: the X-Session-ID header (else the body's `user`) reaches
    Serve's session id, so a session's requests all land on one replica; requests without one
    spread (a replica's prefix_query_tokens grows by each prompt it serves)."""
    app = "sessions"
    _deploy(tiny_model, app, "/sessions", routing="session", num_replicas=2, num_gpu_blocks_override=64,
            max_num_seqs=8)

    def queried() -> dict[str, int]:
        return {rid: s["prefix_query_tokens"] for rid, s in _per_replica_stats(app, 2).items()}

    def grown(send, n: int) -> list[int]:
        before = queried()
        for k in range(n):
            send(k)
        after = queried()
        return sorted(after[r] - before[r] for r in after)

    rng = random.Random(7)
    try:
        with httpx.Client(base_url=serve_url, timeout=60) as http:
            def post(k: int, headers: dict | None = None, **extra) -> None:
                ids = [rng.randrange(3, 500) for _ in range(20)]
                r = http.post("/sessions/v1/completions", headers=headers,
                              json={"model": "tiny", "prompt": ids, "max_tokens": 2, **extra})
                r.raise_for_status()

            for session in ("alice", "bob"):
                spread = grown(lambda k: post(k, headers={"X-Session-ID": session}), 6)
                assert spread[0] == 0 and spread[1] >= 6 * 16, (session, spread)
            spread = grown(lambda k: post(k, user="carol"), 6)
            assert spread[0] == 0 and spread[1] >= 6 * 16, spread
            spread = grown(post, 16)  # no session: random, both replicas serve
            assert spread[0] > 0, spread
    finally:
        from ray import serve

        serve.delete(app)


def test_routing_stats_are_replica_stats(serve_url, tiny_model):
    """What the KV router parses: a ReplicaStats keyed by this replica's full id, plus the engine's counters."""
    from ray import serve

    from cluster.stats import ReplicaStats

    _deploy(tiny_model, "stats", "/stats", num_replicas=1, num_gpu_blocks_override=64)
    try:
        raw = _per_replica_stats("stats", 1)
        (rid, s), = raw.items()
        parsed = ReplicaStats.from_dict(s)
        assert parsed.replica_id == rid and "#" in rid and parsed.num_total_blocks == 64
        assert s["kv_usage"] == 0.0 and "prefix_hit_rate" in s
        auto = serve.get_deployment_handle(ENGINE, app_name="stats").record_autoscaling_stats.remote().result()
        assert set(auto) == {"kvserve_kv_usage", "kvserve_waiting_prefill_tokens", "kvserve_preemptions_per_s"}
    finally:
        serve.delete("stats")


# -- b) KV-pressure autoscaling 1 -> 2 -> 1 --------------------------------------------------------------
def _wait_for_running(app: str, n: int, timeout_s: float, deployment: str = ENGINE) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        counts = _replica_counts(app, deployment)
        if counts.get("RUNNING", 0) == n and sum(counts.values()) == n:
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"{app}: wanted {n} running {deployment} replicas within {timeout_s}s, "
                         f"have {_replica_counts(app, deployment)}")


def test_kv_pressure_scales_up_and_back_down(serve_url, tiny_model):
    from ray import serve

    app, prefix = "autoscale", "/autoscale"
    # 32 blocks x 16 tokens: two 96 + 150 token requests fill a replica's KV cache.
    _deploy(tiny_model, app, prefix, num_gpu_blocks_override=32, max_num_seqs=8, autoscale="kv",
            min_replicas=1, max_replicas=2, upscale_delay_s=1, downscale_delay_s=4, target_kv_usage=0.3,
            look_back_period_s=2, metrics_interval_s=0.5)
    try:
        assert _replica_counts(app) == {"RUNNING": 1}
        from ray.serve.context import _get_global_client

        details = _get_global_client().get_serve_details()  # what Serve actually deployed
        scale = details["applications"][app]["deployments"][ENGINE]["deployment_config"]["autoscaling_config"]
        assert scale["policy"]["policy_function"] == "cluster.autoscale:KVPressurePolicy"
        stop = threading.Event()
        errors: list[BaseException] = []

        def load(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=serve_url, timeout=60) as http:
                while not stop.is_set():
                    try:
                        _complete(http, prefix, [rng.randrange(3, 500) for _ in range(96)], 150)
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append(e)
                        return

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        try:
            up_s = _wait_for_running(app, 2, timeout_s=60)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors[:1]
        down_s = _wait_for_running(app, 1, timeout_s=60)
        print(f"\nautoscale: 1 -> 2 replicas after {up_s:.1f}s of load, 2 -> 1 {down_s:.1f}s after it stopped")
    finally:
        serve.delete(app)


def test_the_ingress_scales_on_the_streams_it_holds(serve_url, tiny_model):
    """ingress_autoscaling_config: Serve's ongoing-requests autoscaling of the ingress, whose
    ongoing requests are the replies it relays (here 3 at a time against a target of 1 each)."""
    from ray import serve

    app, prefix = "ingress-scale", "/ingress-scale"
    _deploy(tiny_model, app, prefix, engine_cls="tests.fake_engine:FakeEngine",
            ingress_autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                        "upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_period_s": 1,
                                        "metrics_interval_s": 0.5})
    try:
        assert _replica_counts(app, INGRESS) == {"RUNNING": 1}
        stop, errors = threading.Event(), []

        def load() -> None:  # 64 echoed tokens at the fake engine's 0.02 s each: ~1.3 s a reply
            with httpx.Client(base_url=serve_url, timeout=60) as http:
                while not stop.is_set():
                    try:
                        assert len(_complete(http, prefix, list(range(100, 164)), 64)["choices"][0]["text"]) > 0
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append(e)
                        return

        threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            up_s = _wait_for_running(app, 2, timeout_s=60, deployment=INGRESS)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not errors, errors[:1]
        down_s = _wait_for_running(app, 1, timeout_s=60, deployment=INGRESS)
        print(f"\ningress: 1 -> 2 replicas after {up_s:.1f}s of load, 2 -> 1 {down_s:.1f}s after it stopped")
    finally:
        serve.delete(app)


# -- c) the flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--routing", "random"], "kvserve: error: argument --routing: invalid choice: 'random'"),
    (["--autoscale", "cpu"], "kvserve: error: argument --autoscale: invalid choice: 'cpu'"),
    (["--max-replicas", "two"], "kvserve: error: argument --max-replicas: invalid int value: 'two'"),
])
def test_bad_flag_values_are_one_line_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        kvserve_main(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--autoscale", "kv"], "kvserve: error: autoscale kv needs max_replicas"),
    (["--autoscale", "kv", "--min-replicas", "3", "--max-replicas", "2"],
     "kvserve: error: need 0 <= min_replicas <= max_replicas"),
    (["--autoscale", "kv", "--max-replicas", "2", "--target-kv-usage", "1.5"],
     "kvserve: error: target_kv_usage must be in (0, 1]"),
    (["--autoscale", "requests", "--max-replicas", "2", "--upscale-delay-s", "-1"],
     "kvserve: error: upscale_delay_s and downscale_delay_s must be >= 0"),
    (["--routing-stats-period-s", "0"], "kvserve: error: routing_stats_period_s must be > 0"),
    (["--api-server-count", "0"], "kvserve: error: num_ingress_replicas (--api-server-count) must be >= 1, got 0"),
    (["--num-replicas", "0"], "kvserve: error: num_replicas must be >= 1, got 0"),
    (["--autoscale", "kv", "--num-replicas", "2"], "kvserve: error: autoscale kv needs max_replicas"),
    (["--autoscale", "kv", "--max-replicas", "2", "--num-replicas", "3"],
     "kvserve: error: with autoscale, num_replicas (the initial count) must be within min_replicas..max_replicas"),
    (["--max-replicas", "2"], "kvserve: error: max_replicas: for autoscale kv|requests (--autoscale); without it"),
    (["--min-replicas", "0", "--target-kv-usage", "0.5"],
     "kvserve: error: min_replicas, target_kv_usage: for autoscale kv|requests (--autoscale); without it"),
    (["--target-ongoing-requests", "4"], "kvserve: error: target_ongoing_requests: for autoscale kv|requests"),
    (["--graceful-shutdown-timeout-s", "-5"], "kvserve: error: graceful_shutdown_timeout_s must be >= 0, got -5.0"),
])
def test_bad_flag_combinations_fail_in_one_line_before_ray(capsys, tiny_model, argv, message):
    assert kvserve_main(["serve", "--model", tiny_model, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    ({"ingress_autoscaling_config": {"max_replica": 4}}, "ingress_autoscaling_config: unknown field(s) max_replica"),
    ({"ingress_autoscaling_config": {"min_replicas": 3, "max_replicas": 2}},
     "ingress_autoscaling_config: max_replicas (2) must be greater than or equal to min_replicas (3)"),
    ({"ingress_autoscaling_config": {"target_ongoing_requests": "many"}},
     "ingress_autoscaling_config.target_ongoing_requests: Input should be a valid number"),
    ({"ingress_autoscaling_config": [2]}, "ingress_autoscaling_config=[2]: Input should be a valid dictionary"),
    ({"ingress_autoscaling_config": {"max_replicas": 4}, "num_ingress_replicas": 2},
     "give num_ingress_replicas or an ingress_autoscaling_config, not both"),
    ({"autoscaling_config": {"max_replica": 4}}, "autoscaling_config: unknown field(s) max_replica"),
    ({"autoscaling_config": {"max_replicas": 2, "policy": {"policy_function": "nope:policy"}}},
     "autoscaling_config.policy: cannot import its policy_function (No module named 'nope')"),
    ({"health_check_period_s": 0}, "health_check_period_s must be > 0, got 0"),
    ({"served_model_name": []}, "served_model_name must be a name or a non-empty list of names"),
])
def test_a_raw_autoscaling_config_is_checked_before_it_deploys(args, message):
    """What Serve would refuse only when deploying (or ignore: a misspelt key) is a ValueError
    naming the argument, as every other app argument's."""
    with pytest.raises(ValueError) as e:
        split_args(args)
    assert str(e.value).startswith(message), e.value


def test_flags_reach_the_engine_deployment(tiny_model):
    from cluster.serve_cli import app_args_from_cli
    from cluster.cli import build_parser

    ns = build_parser().parse_args(["serve", "--routing", "round_robin", "--routing-stats-period-s", "2",
                                    "--autoscale", "kv", "--min-replicas", "1", "--max-replicas", "3",
                                    "--upscale-delay-s", "5", "--downscale-delay-s", "60",
                                    "--target-kv-usage", "0.6", "--device", "cpu"])
    args = app_args_from_cli(ns)
    opts = engine_deployment_options(*split_args(args))
    router = opts["request_router_config"]
    assert router.request_router_class == ROUTER_CLASSES["round_robin"]
    assert router.request_routing_stats_period_s == 2
    scale = opts["autoscaling_config"]
    assert "num_replicas" not in opts
    assert (scale["min_replicas"], scale["max_replicas"], scale["upscale_delay_s"], scale["downscale_delay_s"]) == \
        (1, 3, 5, 60)
    assert scale["policy"] == {"policy_function": "cluster.autoscale:KVPressurePolicy",
                               "policy_kwargs": {"target_kv_usage": 0.6, "max_waiting_prefill_tokens": 8192,
                                                 "max_preemptions_per_s": 0.5}}

    # The defaults: kv routing, a fixed replica count; Serve's request-count policy on demand.
    opts = engine_deployment_options(*split_args({"device": "cpu", "num_replicas": 2}))
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["request_router_config"].request_router_class == ROUTER_CLASSES["kv"]
    opts = engine_deployment_options(*split_args({"device": "cpu", "autoscale": "requests", "max_replicas": 4,
                                                  "target_ongoing_requests": 8}))
    assert "policy" not in opts["autoscaling_config"] and opts["autoscaling_config"]["target_ongoing_requests"] == 8
    assert "initial_replicas" not in opts["autoscaling_config"]  # Serve starts from min_replicas

    # The text-matching peers get the model's tokenizer (a directory its router process can load).
    for routing in ("prefix_affinity", "cache_aware"):
        opts = engine_deployment_options(*split_args({"device": "cpu", "routing": routing, "model": tiny_model}))
        assert opts["request_router_config"].request_router_kwargs == {"tokenizer": tiny_model}

    # With autoscaling, --num-replicas is where it starts; with a raw autoscaling_config, its own field.
    opts = engine_deployment_options(*split_args({"device": "cpu", "autoscale": "kv", "max_replicas": 4,
                                                  "num_replicas": 2}))
    assert opts["autoscaling_config"]["initial_replicas"] == 2 and "num_replicas" not in opts
    with pytest.raises(ValueError, match="not both"):
        split_args({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})


def test_fake_engine_replica_reports_without_a_block_manager():
    """tests.fake_engine.FakeEngine has no scheduler: the replica reports its EngineStats, no prefixes."""
    import asyncio

    from cluster.stats import ReplicaStats
    from engine.config import EngineConfig
    from workers.server import EngineServer

    server = EngineServer(EngineConfig(max_model_len=256, num_gpu_blocks_override=32), "tests.fake_engine:FakeEngine")
    raw = asyncio.run(server.record_routing_stats())
    parsed = ReplicaStats.from_dict(raw)
    assert parsed.num_total_blocks == 32 and parsed.prefix_hashes == frozenset() and raw["kv_usage"] == 0.0
    auto = asyncio.run(server.record_autoscaling_stats())
    assert auto["kvserve_kv_usage"] == 0.0 and auto["kvserve_preemptions_per_s"] == 0.0
