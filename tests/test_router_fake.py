"""The real Ray + Serve stack with `router.testing.FakeEngine` behind it: the rows of the error
list that need an engine to misbehave on cue (500, a full queue), readiness while engines load,
and draining on shutdown.
"""
import functools
import json
import threading
import time

import httpx
import pytest

from router.testing import FAIL_TOKEN_ID, SECRET, FakeEngine, running_server

FAKE = "router.testing:FakeEngine"


@pytest.fixture(scope="module")
def server():
    # Two requests run at once (max_num_seqs -> max_ongoing_requests); one more may wait.
    args = dict(engine_cls=FAKE, max_model_len=512, max_num_seqs=2, max_queued_requests=1, retry_after_s=3,
                num_gpu_blocks_override=64, graceful_shutdown_timeout_s=30)
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_internal_error(text: str) -> None:
    assert SECRET not in text and "Traceback" not in text and "RuntimeError" not in text


def test_internal_error_is_a_bare_500(http):
    r = http.post("/v1/completions", json={"prompt": [FAIL_TOKEN_ID, 1, 2], "max_tokens": 5})
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "The server had an error while processing your request.",
                                  "type": "server_error", "param": None, "code": "internal_error"}}
    assert_internal_error(r.text)


def test_internal_error_mid_stream_is_one_error_event_then_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": [1, FAIL_TOKEN_ID, 2], "max_tokens": 5,
                                                      "stream": True}) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "internal_error"
    assert len(data) == 4  # two tokens, the error, [DONE]
    assert_internal_error("\n".join(data))


def test_full_queue_is_503_with_retry_after(server, http):
    body = {"prompt": [1, 2, 3], "max_tokens": 150, "stream": True}  # ~3 s each
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
        time.sleep(1.0)  # the third request now waits in the ingress's queue, which holds one
        r = http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "3"
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_overloaded"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    waiter.join(60)
    assert queued["r"].status_code == 200  # the queued one ran once a slot freed


def test_no_api_key_configured_means_no_auth(http):
    assert http.get("/v1/models").status_code == 200


def test_ready_only_once_every_engine_replica_has_loaded(server):
    from ray import serve

    from cluster.app import build_app

    slow = functools.partial(FakeEngine, load_delay_s=8.0)
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
