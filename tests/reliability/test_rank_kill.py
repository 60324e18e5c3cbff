"""A tensor-parallel rank SIGKILLed mid-stream (as an OOM kill would), against a real
`kvserve serve -tp 2`: the streams it was serving end with an `unavailable` error event and
[DONE], the engine replica is replaced with a new worker group, and requests succeed again; the
recovery time is measured.

The replica-level kill (the whole engine replica process) is tests/test_replica_failure.py, and
the graceful drain on SIGTERM is tests/test_cli.py::test_sigterm_drains_streams_in_flight_and_refuses_new_requests.

The server also runs with --enable-log-requests: the positive control of
test_bad_input_security.py::test_prompts_never_reach_the_logs (with the flag, prompt ids are logged,
and the log search finds them).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from tests.local_serve import stream_events
from tests.reliability.harness import ServeProcess, count

pytestmark = pytest.mark.reliability

KILL_STREAMS = count("kill_streams", 4, 8)
AFTER_REQUESTS = count("kill_after_requests", 4, 20)
RECOVERY_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-tp2") / "serve.log"
    # 512 blocks: room for every stream's 405 tokens at once, so all run when the rank dies
    args = ["--model", str(tiny_model), "-tp", "2", "--max-model-len", "512", "--num-gpu-blocks-override", "512",
            "--max-num-seqs", "8", "--enable-log-requests"]
    with ServeProcess(args, log) as srv:
        yield srv


def test_enable_log_requests_logs_prompt_ids(server, smollm2_path, figures):
    """The positive control of the log search: with the flag, a request's prompt ids are logged."""
    from transformers import AutoTokenizer

    canary = f"canary {uuid.uuid4().hex} quokka"
    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(canary, add_special_tokens=False)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": canary, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    id_text = ", ".join(map(str, ids[1:-1]))
    hits: list[str] = []
    for _ in range(20):  # Ray's log monitor forwards worker lines about once a second
        hits = server.logs_containing(id_text)
        if hits:
            break
        time.sleep(0.5)
    figures(canary_id_hits=len(hits))
    assert hits, "--enable-log-requests logged no prompt ids where the log search looks"


def _stream(url: str, i: int, results: list, started: threading.Event) -> None:
    body = {"prompt": [100 + i, 200, 300, 400, 500], "max_tokens": 400, "ignore_eos": True, "stream": True}
    results[i] = stream_events(url, body, started)


def test_a_killed_rank_ends_its_streams_unavailable_and_the_replica_is_replaced(server, figures):
    assert server.wait_ready(200, 60) is not None
    replicas, ranks = server.engine_replicas(), server.rank_workers()
    assert len(replicas) == 1 and len(ranks) == 2, (replicas, ranks)
    old_pids = {p.pid for p in replicas + ranks}

    results: list = [None] * KILL_STREAMS
    started = [threading.Event() for _ in range(KILL_STREAMS)]
    threads = [threading.Thread(target=_stream, args=(server.url, i, results, started[i]), daemon=True)
               for i in range(KILL_STREAMS)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started), "the streams never started"
    time.sleep(0.5)
    assert all(t.is_alive() for t in threads), "a stream ended before the kill: the test proves nothing for it"
    killed_at = time.monotonic()
    os.kill(ranks[1].pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    streams_ended_s = time.monotonic() - killed_at

    # /ready watched every 0.1 s from the kill on; meanwhile a request every 0.2 s until one
    # succeeds: until then, 503 + Retry-After and nothing else.
    ready_log: list[tuple[float, int]] = []
    stop_watch = threading.Event()

    def watch_ready() -> None:
        while not stop_watch.is_set() and time.monotonic() < killed_at + RECOVERY_TIMEOUT_S:
            try:
                status = httpx.get(f"{server.url}/ready", timeout=10).status_code
            except httpx.HTTPError:
                status = 0
            ready_log.append((time.monotonic() - killed_at, status))
            time.sleep(0.1)
    watcher = threading.Thread(target=watch_ready, daemon=True)
    watcher.start()
    during: list[tuple[float, int]] = []
    recovered_s = None
    while time.monotonic() < killed_at + RECOVERY_TIMEOUT_S:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 4}, timeout=120)
        during.append((round(time.monotonic() - killed_at, 2), r.status_code))
        if r.status_code == 200:
            recovered_s = time.monotonic() - killed_at
            break
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.text[:300])
        assert r.json()["error"]["code"] in ("unavailable", "queue_full"), r.text[:300]
        time.sleep(0.2)
    ready_again = server.wait_ready(200, 60)
    stop_watch.set()
    watcher.join(15)
    unready = [t for t, status in ready_log if status == 503]
    unready_s = unready[0] if unready else None
    after = [httpx.post(f"{server.url}/v1/completions", json={"prompt": [7, 8, 9 + i], "max_tokens": 8}, timeout=120)
             for i in range(AFTER_REQUESTS)]
    new_replicas, new_ranks = server.engine_replicas(), server.rank_workers()

    cut = whole = 0
    for events in results:
        assert isinstance(events, list) and events and events[-1] == "[DONE]", events
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "unavailable" and last["error"]["type"] == "server_error", last
            cut += 1
        else:
            whole += 1
    figures(streams=KILL_STREAMS, cut_unavailable=cut, finished=whole, streams_ended_s=round(streams_ended_s, 2),
            ready_503_after_s=None if unready_s is None else round(unready_s, 2),
            recovered_s=None if recovered_s is None else round(recovered_s, 2),
            ready_200_after_s=None if ready_again is None else round(ready_again - killed_at, 2),
            responses_until_recovered=during, after_ok=sum(r.status_code == 200 for r in after),
            after=AFTER_REQUESTS)
    assert cut == KILL_STREAMS, f"{whole} of {KILL_STREAMS} streams outlived the rank that served them"
    assert recovered_s is not None, f"no request succeeded within {RECOVERY_TIMEOUT_S:g}s: {during}"
    assert ready_again is not None
    assert [r.status_code for r in after] == [200] * AFTER_REQUESTS, [r.text[:200] for r in after]
    assert len(new_replicas) == 1 and len(new_ranks) == 2, (new_replicas, new_ranks)
    assert not old_pids & {p.pid for p in new_replicas + new_ranks}, "the old replica or ranks live on"
