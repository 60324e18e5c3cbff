"""The ingress's /ready decision (router.ingress.OpenAIIngress.ready) on what Serve's status says,
without Ray: a pod's readiness follows it (cluster.probe), so a state in which the app can serve
must read ready, and one in which it cannot must not."""
from __future__ import annotations

import asyncio
import types

import pytest

from router import ingress
from router.errors import unavailable


class Client:
    def __init__(self, answers: bool, delay_s: float = 0.0) -> None:
        self.answers, self.delay_s, self.asked = answers, delay_s, 0

    async def info(self) -> dict:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        if not self.answers:
            raise unavailable("no replica")
        return {"max_model_len": 16}


def _ready(monkeypatch, deployments: dict | None, client: Client) -> tuple[bool, dict]:
    apps = {} if deployments is None else {"kvserve": types.SimpleNamespace(deployments=deployments)}
    monkeypatch.setattr(ingress.serve, "status", lambda: types.SimpleNamespace(applications=apps))
    monkeypatch.setattr(ingress.serve, "get_replica_context", lambda: types.SimpleNamespace(app_name="kvserve"))
    monkeypatch.setattr(ingress, "READY_INFO_TIMEOUT_S", 0.2)
    me = types.SimpleNamespace(_engine_name="EngineServer", _client=client)
    me._engine_answers = lambda: ingress.OpenAIIngress._engine_answers(me)
    return asyncio.run(ingress.OpenAIIngress.ready(me))


def engine(status: str, **states: int) -> dict:
    return {"EngineServer": types.SimpleNamespace(status=status, replica_states=states)}


@pytest.mark.parametrize("deployment, ready", [
    (engine("HEALTHY", RUNNING=2), True),
    (engine("UPSCALING", RUNNING=1, STARTING=1), False),  # every replica loaded, for /ready itself
    (engine("HEALTHY"), True),  # scaled to zero: a request starts a replica
    (engine("UPSCALING", STARTING=1), False),  # coming up from zero: not yet
    (engine("UNHEALTHY"), False),  # no replica, and Serve says why
    (engine("DEPLOY_FAILED", RUNNING=1), False),
])
def test_ready_follows_the_engine_deployments_replicas(monkeypatch, deployment, ready):
    client = Client(answers=True)
    ok, detail = _ready(monkeypatch, deployment, client)
    assert ok is ready and client.asked == 0  # Serve's status decides; no engine is asked
    assert detail.get("scaled_to_zero", False) is (ready and not deployment["EngineServer"].replica_states)


def test_a_failed_config_update_keeps_ready_while_the_running_engine_answers(monkeypatch):
    """Serve lists none of an app's deployments after an update fails to build, while its running
    replicas serve on: /ready asks an engine, rather than take every pod out of its Service."""
    assert _ready(monkeypatch, {}, Client(answers=True)) == (True, {"replicas": {}})
    assert _ready(monkeypatch, {}, Client(answers=False))[0] is False
    assert _ready(monkeypatch, {}, Client(answers=True, delay_s=5))[0] is False  # not within the timeout
    assert _ready(monkeypatch, None, Client(answers=False))[0] is False  # no app at all
