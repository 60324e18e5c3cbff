"""An engine core killed under Serve (ProcessEngine: the core is a process of its own, which an
OOM kill can take while its replica lives on): the streams it was serving end with a 503-style
`unavailable` error event, requests sent after the kill are served by the other replica, the
replica's health check fails so /ready turns 503, Serve replaces the replica with one that
starts a core of its own, and no core outlives the server. A replica whose engine died exits
(workers.server._EngineReplica), which the unit tests at the end check over a fake engine."""
import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.sampling_params import SamplingParams
from tests.fake_engine import FAIL_TOKEN_ID, FakeEngine
from tests.local_serve import in_background, running_server, stream_events, wait_ready
from tests.tiny_llama import make_tiny_llama

# Python calls a collected replica's __del__, Serve's async stop hook, and drops its coroutine.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine '_EngineReplica.__del__' was never awaited")

MAX_TOKENS = 480  # the tiny model streams it in seconds: long enough to be cut mid-way
SEEN: dict[int, psutil.Process] = {}  # every core _cores() found, to check none outlives the server


def _cores() -> list[int]:
    """The engine cores of this server's replicas (not other ProcessEngines on the machine)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "engine.core_process" in (p.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                if "EngineServer" in " ".join(p.parent().cmdline()):
                    found.append(p.pid)
                    SEEN.setdefault(p.pid, p)
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    model = make_tiny_llama(tmp_path_factory.mktemp("core_failure"), smollm2_path)
    args = dict(model=str(model), engine_cls="engine.process_engine:ProcessEngine", num_replicas=2,
                max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=512, device="cpu",
                health_check_period_s=1.0, routing="round_robin")  # the streams split 4 / 4
    with running_server(args, num_cpus=4) as url:
        yield url
    _cores()
    gone, alive = psutil.wait_procs(list(SEEN.values()), timeout=30)
    assert len(SEEN) >= 3 and not alive, f"engine cores outlived their server: {alive}"


def _stream(url: str, i: int, started: threading.Event, out: list) -> None:
    body = {"prompt": [40 + i, 6, 7, 8], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out[i] = stream_events(url, body, started)


def _gone_at(process: psutil.Process) -> float:
    with contextlib.suppress(psutil.TimeoutExpired):
        process.wait(timeout=30)
    return time.monotonic()


def test_a_killed_engine_core_cuts_its_streams_and_its_replica_is_replaced(server):
    assert wait_ready(server, 200, 60) is not None
    cores = _cores()
    assert len(cores) == 2, cores
    n = 8
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(server, i, started[i], results)) for i in range(n)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    replica = psutil.Process(cores[0]).parent()
    killed_at = time.monotonic()
    os.kill(cores[0], signal.SIGKILL)
    gone, unready = in_background(_gone_at, replica), in_background(wait_ready, server, 503, 30)
    # Requests sent right after the kill: the dead core's replica refuses them before they start,
    # and the ingress sends them to the other replica.
    after = [httpx.post(f"{server}/v1/completions", json={"prompt": [20, 21, 30 + i], "max_tokens": 3}, timeout=60)
             for i in range(4)]
    replica_gone_at, unready_at = gone.result(60), unready.result(60)
    recovered_at = wait_ready(server, 200, 90)
    for t in threads:
        t.join(120)

    assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
    cut = whole = 0
    for events in results:
        assert isinstance(events, list) and events[-1] == "[DONE]", events
        chunks = [json.loads(e) for e in events[:-1]]
        if "error" in chunks[-1]:  # no usage chunk after an error (as vLLM)
            error = chunks[-1]["error"]
            assert error["code"] == "unavailable" and error["type"] == "server_error", error
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
            assert 1 <= len(chunks) - 1 < MAX_TOKENS  # cut short
            cut += 1
        else:
            *chunks, usage = chunks
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert usage["usage"]["completion_tokens"] == MAX_TOKENS
            whole += 1
    assert cut >= 1 and whole >= 1, (cut, whole)  # both replicas had streams
    assert unready_at is not None and recovered_at is not None
    print(f"\nengine core kill: its replica exited after {replica_gone_at - killed_at:.2f}s, "
          f"/ready 503 after {unready_at - killed_at:.2f}s, 200 again after "
          f"{recovered_at - killed_at:.2f}s; {cut} streams cut with `unavailable`, {whole} finished, "
          f"4/4 requests sent after the kill served")
    assert replica_gone_at - killed_at < 2.0  # not the 3 failed health checks Serve waits for
    assert unready_at - killed_at < 5.0
    new = _cores()
    assert len(new) == 2 and cores[0] not in new and cores[1] in new, (cores, new)  # a new core, in a new replica
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


# -- the replica's exit, over a fake engine ---------------------------------------------------------

class _DyingEngine(FakeEngine):
    """Dies (check_health raises from then on) at a request whose first prompt id is DIE."""
    DIE = 99

    dead = False

    async def generate(self, request_id, prompt, params):
        async for out in super().generate(request_id, prompt, params):
            if prompt[0] == self.DIE:
                self.dead = True
                raise EngineDeadError("engine loop failed: gone")
            yield out

    def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("engine loop failed: gone")


@pytest.fixture
def exits(monkeypatch):
    """The replica's os._exit calls, recorded instead of made."""
    import workers.server

    calls = []
    monkeypatch.setattr(workers.server.os, "_exit", calls.append)
    return calls


async def _drain(replica, prompt: list[int]) -> Exception | None:
    try:
        async for _ in replica.generate("r", prompt, SamplingParams(max_tokens=3)):
            pass
    except Exception as e:
        return e
    return None


def _replica():
    from workers.server import _EngineReplica

    return _EngineReplica(EngineConfig(max_model_len=64, num_gpu_blocks_override=64),
                          lambda config: _DyingEngine(config, token_delay_s=0.001))


def test_a_replica_exits_once_after_its_engine_died(exits):
    async def main():
        replica = _replica()
        assert await _drain(replica, [5, 6]) is None and not exits
        assert isinstance(await _drain(replica, [FAIL_TOKEN_ID, 6]), RuntimeError)  # the request's error
        await asyncio.sleep(2 * replica.EXIT_AFTER_S)
        assert not exits  # the engine lives on: so does the replica
        assert isinstance(await _drain(replica, [_DyingEngine.DIE, 6]), EngineDeadError)
        with pytest.raises(EngineDeadError):
            await replica.check_health()
        assert not exits  # after the error went out
        await asyncio.sleep(2 * replica.EXIT_AFTER_S)
        return exits

    assert asyncio.run(main()) == [1]


def test_an_idle_replica_whose_engine_died_exits_at_its_health_check(exits):
    async def main():
        replica = _replica()
        replica.engine.dead = True
        with pytest.raises(EngineDeadError):
            await replica.check_health()
        await asyncio.sleep(2 * replica.EXIT_AFTER_S)

    asyncio.run(main())
    assert exits == [1]


def test_a_replica_being_stopped_does_not_exit(exits):
    async def main():
        replica = _replica()
        await replica.__del__()  # Serve stops it; a stopped engine may read as dead
        replica.engine.dead = True
        with pytest.raises(EngineDeadError):
            await replica.check_health()
        await asyncio.sleep(2 * replica.EXIT_AFTER_S)

    asyncio.run(main())
    assert exits == []
