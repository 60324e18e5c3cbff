"""The ingress's retry of a request whose engine replica died before it started
(router.ingress.HandleReplicaClient.generate), without Serve: each try is scripted."""
import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

import router.ingress as ingress
from engine.errors import EngineDeadError
from engine.outputs import StepOutput
from router.errors import OpenAIError

OUT = StepOutput("r", [], finished=True, num_cached_tokens=0)


def _wrapped(e: BaseException) -> BaseException:
    """As the replica's error reaches the ingress through a Serve handle."""
    try:
        raise e
    except BaseException as raised:
        return RayTaskError("generate", "traceback", raised).as_instanceof_cause()


def _run(tries: list, monkeypatch) -> tuple[int, object]:
    """Serves one request whose n-th replica call raises tries[n] before its first output (or
    succeeds when tries[n] is None) -> (calls made, the output or the HTTP error's status)."""
    monkeypatch.setattr(ingress, "RETRY_BACKOFF_S", 0.0)
    client = object.__new__(ingress.HandleReplicaClient)
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
