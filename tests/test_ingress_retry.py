"""The ingress's engine calls (router.ingress.HandleReplicaClient.generate), without Serve, each
try scripted: the retry of a request whose engine replica died before it started, and the wait of
an admitted call for room in a full queue."""
import asyncio
import logging

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

import router.ingress as ingress
from engine.errors import EngineDeadError
from engine.outputs import StepOutput
from router.errors import OpenAIError
from router.settings import RouterSettings

OUT = StepOutput("r", [], finished=True, num_cached_tokens=0)


def _wrapped(e: BaseException) -> BaseException:
    """As the replica's error reaches the ingress through a Serve handle."""
    try:
        raise e
    except BaseException as raised:
        return RayTaskError("generate", "traceback", raised).as_instanceof_cause()


def _client() -> ingress.HandleReplicaClient:
    client = object.__new__(ingress.HandleReplicaClient)
    client._settings, client.room_waiters = RouterSettings("m", retry_after_s=3), 0
    return client


def _run(tries: list, monkeypatch) -> tuple[int, object]:
    """Serves one request whose n-th replica call raises tries[n] before its first output (or
    succeeds when tries[n] is None) -> (calls made, the output or the HTTP error's status)."""
    monkeypatch.setattr(ingress, "RETRY_BACKOFF_S", 0.0)
    client = _client()
    calls = []

    async def once(request_id, prompt_token_ids, params):
        error = tries[len(calls)]
        calls.append(error)
        if error is not None:
            raise error
        yield OUT

    client._generate_once = once

    async def go():
        try:
            return [s async for s in client.generate("r", [1, 2], None)][-1]
        except OpenAIError as e:
            return e.status

    result = asyncio.run(go())
    return len(calls), result


def test_a_request_that_reached_a_dead_engine_is_retried_on_up_to_two_others(monkeypatch):
    dead = _wrapped(EngineDeadError("engine loop failed: gone"))  # not admitted: it cannot be the cause
    assert _run([dead, dead, None], monkeypatch) == (3, OUT)
    assert _run([dead, dead, dead], monkeypatch) == (3, 503)


@pytest.mark.parametrize("death", [
    _wrapped(EngineDeadError("engine loop failed: boom", admitted=True)),  # it was in the engine
    ActorDiedError(),  # the replica's process died: nothing says what it was running
], ids=["admitted", "actor-died"])
def test_a_request_that_may_have_killed_its_engine_is_retried_once(monkeypatch, death):
    assert _run([death, None], monkeypatch) == (2, OUT)  # a replica killed under it: served elsewhere
    # A query of death: a second engine dies with it inside; it takes no third one down.
    assert _run([death, death, None], monkeypatch) == (2, 503)
    # A death it may have caused and one it cannot have: the third try still runs.
    dead = _wrapped(EngineDeadError("engine loop failed: gone"))
    assert _run([death, dead, None], monkeypatch) == (3, OUT)


def test_engine_dead_error_keeps_admitted_across_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(EngineDeadError("gone", admitted=True)))
    assert (str(e), e.admitted) == ("gone", True)
    assert pickle.loads(pickle.dumps(EngineDeadError("gone"))).admitted is False


FULL = BackPressureError(num_queued_requests=1, max_queued_requests=1)


def test_an_admitted_call_waits_for_room_and_new_requests_are_refused_meanwhile():
    """Clients retrying a refused request fast could otherwise take every place in the queue
    that a request already running waits for (one of its prompts, a beam round)."""
    client, tries = _client(), []
    room = asyncio.Event()

    async def once(request_id, prompt_token_ids, params):
        tries.append(request_id)
        if request_id == "sibling" and not room.is_set():
            raise FULL
        yield OUT

    client._generate_once = once

    async def newcomer():
        try:
            return [s async for s in client.generate("new", [1], None)][-1]
        except OpenAIError as e:
            return e.status, e.body()["error"]["code"], e.headers["Retry-After"]

    async def go():
        sibling = asyncio.create_task(anext(aiter(client.generate("sibling", [1], None, admitted=True))))
        await asyncio.sleep(0.1)
        waiting = client.room_waiters
        refused = await newcomer()
        room.set()
        served = await sibling
        return waiting, refused, served, client.room_waiters, await newcomer()

    waiting, refused, served, after, later = asyncio.run(go())
    assert waiting == 1 and tries.count("sibling") >= 3  # asked again, backing off
    assert refused == (503, "queue_full", "3") and "new" not in tries[:tries.index("sibling") + 3]
    assert served is OUT and after == 0 and later is OUT


def test_an_admitted_call_waits_as_long_as_it_takes():
    """Every wait is a short one, the first ones shorter, however many refusals came before (the
    1024th once overflowed the backoff and failed its request with a 500)."""
    waits = [ingress.room_backoff(k) for k in (0, 1, 2, 3, 1023, 1024, 10**6)]
    assert waits == [0.02, 0.04, 0.08, ingress.MAX_ROOM_BACKOFF_S, *[ingress.MAX_ROOM_BACKOFF_S] * 3]


def test_a_refused_newcomer_is_503_and_a_cancelled_wait_leaves_no_waiter():
    """A newcomer asks twice (Serve counts a call being assigned a free replica as queued, for a
    few ms) before its 503."""
    client, tries = _client(), []

    async def once(request_id, prompt_token_ids, params):
        tries.append(request_id)
        raise FULL
        yield

    client._generate_once = once

    async def go():
        try:
            await anext(aiter(client.generate("new", [1], None)))
        except OpenAIError as e:
            refused = e.status, e.body()["error"]["code"]
        waiter = asyncio.create_task(anext(aiter(client.generate("sibling", [1], None, admitted=True))))
        await asyncio.sleep(0.05)
        waiting = client.room_waiters
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return refused, waiting, client.room_waiters

    assert asyncio.run(go()) == ((503, "queue_full"), 1, 0)
    assert tries.count("new") == 1 + ingress.NEWCOMER_RETRIES == 2


def test_serves_backpressure_warnings_are_dropped_while_admitted_calls_wait_and_else_one_a_second():
    client, now = _client(), [100.0]
    quiet = ingress._QuietBackpressure(client, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.WARNING, "router.py", 1, msg, None, None)

    assert [quiet.filter(record(FULL.message)) for _ in range(3)] == [True, False, False]  # a flood's
    assert all(quiet.filter(record("replica died")) for _ in range(3))  # other lines: all of them
    now[0] += ingress.BACKPRESSURE_LOG_INTERVAL_S
    later = record(FULL.message)
    assert quiet.filter(later) and later.getMessage().endswith("(2 more since the last such line, not logged)")
    now[0] += 10
    client.room_waiters = 1
    assert not quiet.filter(record(FULL.message)) and quiet.filter(record("replica died"))
    client.room_waiters = 0
    plain = record(FULL.message)
    assert quiet.filter(plain) and plain.getMessage() == FULL.message  # the waits' lines are not counted


@pytest.mark.parametrize("error, status, code", [
    (FULL, 503, "queue_full"),
    (ActorDiedError(), 503, "unavailable"),
], ids=["queue-full", "replica-died"])
def test_a_failed_ask_for_the_engines_limits_is_an_openai_error(error, status, code):
    """A fresh ingress asks the engine's limits before its first request: a refusal is an error
    reply (with Retry-After), not Serve's plain-text 503."""
    class Handle:
        class info:
            @staticmethod
            async def remote():
                raise error

    client = _client()
    client._info_handle = Handle()
    with pytest.raises(OpenAIError) as e:
        asyncio.run(client.info())
    assert (e.value.status, e.value.body()["error"]["code"]) == (status, code) and "Retry-After" in e.value.headers


class _Handle:
    """A Serve handle that says whether its request router was started (`.options()` starts it)."""

    def __init__(self, deployment_name: str = "EngineServer", app_name: str = "kvserve") -> None:
        self.deployment_name, self.app_name, self.started = deployment_name, app_name, False

    def options(self, **kwargs) -> "_Handle":
        self.started = True
        return self


def test_every_handle_the_ingress_calls_has_its_router_started_when_the_replica_is_built(monkeypatch):
    """A router started at its first call can miss its config for good (router.ingress.started):
    on CI an ingress replica's first request hung past 60 s in the engine-limits call."""
    made = []
    monkeypatch.setattr(ingress, "DeploymentHandle", lambda *a: made.append(_Handle(*a)) or made[-1])
    engine, store = _Handle(), _Handle("ResponseStore")
    client = ingress.HandleReplicaClient(engine, RouterSettings("m"))
    ingress.HandleResponseStore(store)
    assert engine.started and store.started
    assert [(h.deployment_name, h.app_name, h.started) for h in made] == [("EngineServer", "kvserve", True)]
    assert client._info_handle is made[0]


def test_the_ingress_stops_its_background_runs_and_stands_a_failed_init():
    """Serve calls an ingress replica's __del__ when it stops it, and also when its __init__
    raised: the runs end (router.background.BackgroundRuns.shutdown), and a replica that never
    got as far as having them stops without an error of its own."""
    stopped = []

    class Runs:
        async def shutdown(self):
            stopped.append(True)

    class Replica(ingress.OpenAIIngress):
        def __del__(self):  # Python's own, when the test lets go of it: Serve awaits the real one
            pass

    stop = ingress.OpenAIIngress.__del__
    asyncio.run(stop(Replica.__new__(Replica)))
    made = Replica.__new__(Replica)
    made._serving = type("Serving", (), {"background": Runs()})()
    asyncio.run(stop(made))
    assert stopped == [True]
