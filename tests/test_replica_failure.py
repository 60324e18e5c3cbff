"""An engine replica killed under load (SIGKILL, as an OOM kill or a lost node would): /ready
turns 503 within seconds, streams it was serving end with a 503-style `unavailable` error event,
requests it had not started go to the other replica, and the deployment recovers by itself.
The times are printed for docs/reliability.md."""
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.local_serve import in_background, running_server, stream_events, wait_ready

FAKE = "tests.fake_engine:FakeEngine"


@pytest.fixture(scope="module")
def server():
    args = dict(engine_cls=FAKE, num_replicas=2, max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=256,
                health_check_period_s=1.0)
    with running_server(args, num_cpus=4) as url:
        yield url


def _engine_replica_pids() -> list[int]:
    """This test's engine replicas: among the processes of the Ray it started (its descendants),
    not another server's on the same machine."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.cmdline())
            if "ServeReplica" in cmd and "EngineServer" in cmd:
                found.append(p.pid)
    return found


def _stream(url: str, i: int, started: threading.Event, out: list) -> None:
    body = {"prompt": [40 + i, 6, 7, 8], "max_tokens": 150, "stream": True}  # FAIL_TOKEN_ID (13) nowhere
    out[i] = stream_events(url, body, started, timeout_s=60)


def test_a_killed_replica_is_reported_retried_around_and_replaced(server):
    assert wait_ready(server, 200, 60) is not None
    pids = _engine_replica_pids()
    assert len(pids) == 2, pids
    results: list = [None] * 8
    started = [threading.Event() for _ in range(8)]
    threads = [threading.Thread(target=_stream, args=(server, i, started[i], results)) for i in range(8)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)  # every stream is under way (a token every 20 ms, 150 of them)
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    unready = in_background(wait_ready, server, 503, 30)  # timed from the kill, apart from the requests below
    # Requests sent right after the kill, before anyone knows: none is lost.
    after = [httpx.post(f"{server}/v1/completions", json={"prompt": [20, 21, 30 + i], "max_tokens": 3}, timeout=60)
             for i in range(4)]
    unready_at = unready.result(60)
    recovered_at = wait_ready(server, 200, 90)
    for t in threads:
        t.join(60)

    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
    cut, whole = 0, 0
    for events in results:
        assert isinstance(events, list) and events[-1] == "[DONE]", events
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["code"] == "unavailable" and last["error"]["type"] == "server_error"
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            whole += 1
    assert cut >= 1 and whole >= 1, (cut, whole)  # both replicas had streams
    assert unready_at is not None and recovered_at is not None
    print(f"\nreplica kill: /ready 503 after {unready_at - killed_at:.2f}s, 200 again after "
          f"{recovered_at - killed_at:.2f}s; {cut} streams cut with `unavailable`, {whole} finished, "
          f"4/4 requests sent after the kill served")
    assert unready_at - killed_at < 3.0
    assert len(_engine_replica_pids()) == 2  # Serve started a replacement
