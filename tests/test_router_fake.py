"""The real Ray + Serve stack with `tests.fake_engine.FakeEngine` behind it: the rows of the error
list that need an engine to misbehave on cue (500, a full queue), readiness while engines load,
draining on shutdown, and the engine replica's metrics as Ray's Prometheus export shows them.
"""
import functools
import json
import threading
import time

import httpx
import pytest

from tests.fake_engine import FAIL_TOKEN_ID, SECRET, FakeEngine
from tests.local_serve import running_server

FAKE = "tests.fake_engine:FakeEngine"
# Workers push recorded metrics to Ray's Prometheus exporter every metrics_report_interval_ms
# (10 s by default; Ray's floor is 1 s).
RAY_OPTIONS = {"_system_config": {"metrics_report_interval_ms": 1000}}


@pytest.fixture(scope="module")
def server():
    # Two requests run at once (max_num_seqs -> max_ongoing_requests); one more may wait.
    args = dict(engine_cls=FAKE, max_model_len=512, max_num_seqs=2, max_queued_requests=1, retry_after_s=3,
                num_gpu_blocks_override=64, graceful_shutdown_timeout_s=30)
    with running_server(args, ray_options=RAY_OPTIONS) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_internal_error(text: str) -> None:
    assert SECRET not in text and "Traceback" not in text and "RuntimeError" not in text


def kvserve_samples() -> dict[str, list[tuple[dict, float]]]:
    """Every ray_kvserve_* sample on this (only) node's Prometheus export: name -> [(labels, value)]."""
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    (node,) = ray.nodes()
    text = httpx.get(f"http://127.0.0.1:{node['MetricsExportPort']}/metrics", timeout=5).text
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_kvserve_"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    """The sum over the series of `name` whose labels include `labels`; None when there is none."""
    hits = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    return sum(hits) if hits else None


def settled_samples() -> dict[str, list[tuple[dict, float]]]:
    """The export once two reads a report interval and more apart agree: nothing still in flight."""
    deadline, last = time.monotonic() + 30, None
    while (samples := kvserve_samples()) != last:
        assert time.monotonic() < deadline, "Ray's metrics export never settled"
        last = samples
        time.sleep(1.5)
    return samples


def test_engine_metrics_reach_rays_prometheus_export(http):
    """One request moves each counter and histogram by exactly its own share. Measured against the
    settled export before it, so whatever ran on the server earlier does not count."""
    from engine.metrics import (DECODE_TIME, E2E, INFERENCE_TIME, ITL, PARAMS_MAX_TOKENS, PARAMS_N, PREFILL_TIME,
                                QUEUE_TIME, REQUEST_GENERATION_TOKENS, REQUEST_PROMPT_TOKENS, REQUEST_TPOT, TTFT)

    counted = ("ray_kvserve_request_success_total", "ray_kvserve_prompt_tokens_total",
               "ray_kvserve_generation_tokens_total", f"ray_{TTFT}_count", f"ray_{ITL}_count", f"ray_{E2E}_count",
               *(f"ray_{p}_count" for p in (QUEUE_TIME, PREFILL_TIME, DECODE_TIME, INFERENCE_TIME)))
    buckets = [(TTFT, 0.01), (TTFT, 10), (ITL, 0.01), (ITL, 10), (E2E, 0.1), (E2E, 10), (REQUEST_PROMPT_TOKENS, 2),
               (REQUEST_PROMPT_TOKENS, 5), (REQUEST_GENERATION_TOKENS, 5), (REQUEST_GENERATION_TOKENS, 10),
               (QUEUE_TIME, 10), (PREFILL_TIME, 0.01), (PREFILL_TIME, 10), (DECODE_TIME, 0.05), (DECODE_TIME, 10),
               (INFERENCE_TIME, 0.1), (INFERENCE_TIME, 10), (REQUEST_TPOT, 0.01), (REQUEST_TPOT, 10), (PARAMS_N, 1),
               (PARAMS_MAX_TOKENS, 5), (PARAMS_MAX_TOKENS, 10)]

    def read(samples: dict) -> dict:
        ours = {"application": "kvserve"}  # not the stale series described below
        got = {k: value(samples, k, **ours) or 0.0 for k in counted}
        got["length"] = value(samples, "ray_kvserve_request_success_total", finished_reason="length", **ours) or 0.0
        for name, le in buckets:  # observations <= le (Ray exports sums as bucket midpoints)
            got[(name, le)] = sum(v for lab, v in samples.get(f"ray_{name}_bucket", [])
                                  if float(lab["le"]) == le and lab.get("application") == "kvserve")
        return got

    before = read(settled_samples())
    r = http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 6})
    assert r.status_code == 200
    usage = r.json()["usage"]
    # The fake engine sleeps 20 ms before each of the 6 tokens.
    delta = {"ray_kvserve_request_success_total": 1.0, "ray_kvserve_prompt_tokens_total": usage["prompt_tokens"],
             "ray_kvserve_generation_tokens_total": usage["completion_tokens"], f"ray_{TTFT}_count": 1.0,
             f"ray_{ITL}_count": usage["completion_tokens"] - 1, f"ray_{E2E}_count": 1.0, "length": 1.0,
             (TTFT, 0.01): 0.0, (TTFT, 10): 1.0, (ITL, 0.01): 0.0, (ITL, 10): 5.0, (E2E, 0.1): 0.0, (E2E, 10): 1.0,
             (REQUEST_PROMPT_TOKENS, 2): 0.0, (REQUEST_PROMPT_TOKENS, 5): 1.0,  # 5 prompt tokens
             (REQUEST_GENERATION_TOKENS, 5): 0.0, (REQUEST_GENERATION_TOKENS, 10): 1.0,  # 6 generated
             **{(f"ray_{p}_count"): 1.0 for p in (QUEUE_TIME, PREFILL_TIME, DECODE_TIME, INFERENCE_TIME)},
             # scheduled at once; 20 ms to the first token, 100 to the last, 120 in the engine
             (QUEUE_TIME, 10): 1.0, (PREFILL_TIME, 0.01): 0.0, (PREFILL_TIME, 10): 1.0, (DECODE_TIME, 0.05): 0.0,
             (DECODE_TIME, 10): 1.0, (INFERENCE_TIME, 0.1): 0.0, (INFERENCE_TIME, 10): 1.0,
             (REQUEST_TPOT, 0.01): 0.0, (REQUEST_TPOT, 10): 1.0, (PARAMS_N, 1): 1.0,  # 20 ms a token; n=1
             (PARAMS_MAX_TOKENS, 5): 0.0, (PARAMS_MAX_TOKENS, 10): 1.0}  # max_tokens 6
    expected = {k: before[k] + d for k, d in delta.items()}
    deadline, samples = time.monotonic() + 30, {}
    while read(samples) != expected:
        assert time.monotonic() < deadline, (read(samples), expected)
        time.sleep(0.5)
        samples = kvserve_samples()
    for name in ("ray_kvserve_kv_cache_usage_perc", "ray_kvserve_num_requests_running",
                 "ray_kvserve_num_requests_waiting"):
        # This app's one engine replica. Series without Serve's tags may be there too: metric
        # objects an earlier test module made in this (driver) process outlive its Ray and are
        # exported by the next one (seen in full runs: model_name "my-model").
        ((labels, v),) = [(lab, v) for lab, v in samples[name] if lab.get("application") == "kvserve"]
        assert 0 <= v <= 1, name
        assert labels["model_name"] == "SmolLM2-135M-Instruct" and labels["deployment"] == "EngineServer"
        assert labels["replica"], labels


def test_api_ports_metrics_page_has_the_same_engine_series(http):
    """GET /metrics on the API port (where vLLM users scrape) serves the ray_kvserve_* series of
    the nodes' exports, names, labels and values unchanged, and each again under vLLM's name."""
    from prometheus_client.parser import text_string_to_metric_families

    def page_samples() -> dict:
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        out, as_vllm = {}, {}
        for family in text_string_to_metric_families(r.text):
            assert family.name.startswith(("ray_kvserve_", "vllm:")), family.name
            for sample in family.samples:
                into = out if sample.name.startswith("ray_kvserve_") else as_vllm
                into.setdefault(sample.name.replace("vllm:", "ray_kvserve_", 1), []).append((sample.labels, sample.value))
        assert as_vllm == out
        return out

    assert http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # the two reads agree once the export is settled (the page is at most 1 s old)
        exported = settled_samples()
        time.sleep(1.1)
        if page_samples() == exported or time.monotonic() > deadline:
            break
    assert page_samples() == exported
    assert value(exported, "ray_kvserve_request_success_total", application="kvserve") >= 1


def test_internal_error_is_a_bare_500(http):
    r = http.post("/v1/completions", json={"prompt": [FAIL_TOKEN_ID, 1, 2], "max_tokens": 5})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "The server had an error while processing your request.",
                                  "type": "server_error", "param": None, "code": "internal_error"}}
    assert_internal_error(r.text)


@pytest.mark.parametrize("options", [{}, {"stream_options": {"include_usage": True}}], ids=["plain", "usage"])
def test_internal_error_mid_stream_is_one_error_event_then_done(http, options):
    # With include_usage too: a failed stream has no usage chunk (as vLLM's).
    with http.stream("POST", "/v1/completions", json={"prompt": [1, FAIL_TOKEN_ID, 2], "max_tokens": 5,
                                                      "stream": True, **options}) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "internal_error"
    assert len(data) == 4  # two tokens, the error, [DONE]
    assert_internal_error("\n".join(data))


def test_full_queue_is_503_with_retry_after(server, http):
    body = {"prompt": [1, 2, 3], "max_tokens": 500, "stream": True}  # ~10 s each (the test closes them)
    streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(2)]
    readers = []  # dropping a reader closes its connection, which would cancel its request
    try:
        for s in streams:  # both running: the replica is at max_ongoing_requests
            response = s.__enter__()
            assert response.status_code == 200
            readers.append(response.iter_lines())
            next(readers[-1])
        queued = {}
        waiter = threading.Thread(target=lambda: queued.setdefault(
            "r", httpx.post(f"{server}/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=60)))
        waiter.start()
        time.sleep(3.0)  # the third request now waits in the ingress's queue, which holds one (a loaded
        # host may take a while to get it there; the streams run on for several seconds more)
        r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "3"
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_overloaded"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    waiter.join(60)
    assert queued["r"].status_code == 200  # the queued one ran once a slot freed


def test_a_request_is_let_in_by_its_first_engine_call_not_refused_by_its_own_fan_out(http):
    # Four prompts are four engine calls, more than the replica runs at once (2) plus the queue
    # (1): Serve's queue counts calls, so the request used to refuse itself on an idle server.
    # Its later calls wait for room instead.
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 3})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3] and all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 12


def test_no_api_key_configured_means_no_auth(http):
    assert http.get("/v1/models").status_code == 200


def test_ready_only_once_every_engine_replica_has_loaded(server):
    from ray import serve

    from cluster.app import build_app

    slow = functools.partial(FakeEngine, load_delay_s=30.0)  # the new ingress answers before, however loaded the host
    app = build_app(dict(engine_cls=slow, max_model_len=512, num_replicas=2, cpu_threads=1))
    serve._run(app, name="slow", route_prefix="/slow", _blocking=False)
    seen = []
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1] is not True:
            assert time.monotonic() < deadline, seen
            try:
                r = httpx.get(f"{server}/slow/ready", timeout=5)
                if r.headers.get("content-type", "").startswith("application/json") and "ready" in r.json():
                    assert r.status_code == (200 if r.json()["ready"] else 503)
                    seen.append(r.json()["ready"])
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert False in seen  # the ingress answered while the engines were still loading
        assert httpx.get(f"{server}/slow/health", timeout=5).status_code == 200
    finally:
        serve.delete("slow")


def test_requests_still_running_when_the_drain_runs_out_are_ended_with_an_error_not_cut(server):
    """What `kvserve serve` does at --graceful-shutdown-timeout-s: the ingress's `cut` ends every
    request in flight with a 503 `unavailable` error (an error event in a stream, then [DONE];
    Responses' typed error event), rather than a connection dropped mid-stream, and the engine
    frees the requests' KV blocks."""
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(dict(engine_cls=FAKE, max_model_len=1024, cpu_threads=1, num_gpu_blocks_override=256)),
              name="cut", route_prefix="/cut")
    url = f"{server}/cut/v1"
    long = {"prompt": [1, 2, 3], "max_tokens": 900}  # ~18 s at the fake's 20 ms a token
    got: dict[str, object] = {}

    def stream(name: str, path: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/{path}", json=body, timeout=60) as r:
            got[name] = [line for line in r.iter_lines() if line]

    def whole() -> None:
        got["whole"] = httpx.post(f"{url}/completions", json=long, timeout=60)

    threads = [threading.Thread(target=stream, args=("completions", "completions", {**long, "stream": True})),
               threading.Thread(target=stream, args=("responses", "responses", {
                   "input": "hi", "max_output_tokens": 900, "stream": True})),
               threading.Thread(target=whole)]
    for t in threads:
        t.start()
    app = serve.get_app_handle("cut")
    engine = serve.get_deployment_handle("EngineServer", app_name="cut")
    try:
        deadline = time.monotonic() + 30
        while engine.stats.remote().result().num_running < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # every request has streamed some tokens
        # as `kvserve serve`: drain first (a long poll: still 3 when its wait runs out)
        assert app.drain.remote(exclude=[], wait_s=0.3).result()["in_flight"] == 3
        assert app.cut.remote(exclude=[]).result()["in_flight"] == 3
        for t in threads:
            t.join(30)
        data = sse_data(got["completions"])
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "unavailable", data[-3:]
        assert "graceful shutdown timeout" in json.loads(data[-2])["error"]["message"]
        assert len(data) > 3 and "choices" in json.loads(data[0])  # tokens came before the error
        error = json.loads(got["responses"][-3].removeprefix("data: "))
        assert got["responses"][-4] == "event: error" and error["code"] == "unavailable", got["responses"][-4:]
        assert got["responses"][-2] == "event: response.failed"
        assert got["whole"].status_code == 503 and got["whole"].json()["error"]["code"] == "unavailable"
        deadline = time.monotonic() + 10
        while (info := engine.stats.remote().result()).num_running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info.num_running == 0 and info.num_free_blocks == info.num_total_blocks  # nothing leaked
    finally:
        serve.delete("cut")


def test_graceful_shutdown_drains_in_flight_streams(server):
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(dict(engine_cls=FAKE, max_model_len=512, cpu_threads=1)), name="drain",
              route_prefix="/drain")
    body = {"prompt": [1, 2, 3], "max_tokens": 250, "stream": True}  # ~5 s
    with httpx.stream("POST", f"{server}/drain/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        serve.delete("drain", _blocking=False)
        data = sse_data(lines)
    assert data[-1] == "[DONE]"
    finishes = [json.loads(d)["choices"][0]["finish_reason"] for d in data[:-1]]
    assert len(finishes) == 249 and finishes[-1] == "length"  # the first chunk was read above
