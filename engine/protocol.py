"""The engine contract: what a Serve replica, the router's tests and the simulator rely on.

    EngineState   max_model_len, stats(), routing_snapshot()      met by LLMEngine, AsyncEngine,
                                                                  the simulator's SimReplica and
                                                                  the tests' FakeEngine
    EngineClient  + generate(), abort(), check_health(), shutdown()   AsyncEngine, FakeEngine

`stats()` is cheap and may be read often (metrics, autoscaling); `routing_snapshot()` adds the
prefix-hash summary a global scheduler routes on. Both are one consistent snapshot: every field
from the same moment between two engine steps.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams


@runtime_checkable
class EngineState(Protocol):
    @property
    def max_model_len(self) -> int: ...  # prompt + output tokens one sequence may hold

    def stats(self) -> EngineStats: ...

    def routing_snapshot(self) -> EngineStats: ...


@runtime_checkable
class EngineClient(EngineState, Protocol):
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """One RequestOutput per step that produced something for the request, the last with
        finished=True. Closing the iterator early aborts the request and frees its KV blocks.
        Raises `engine.errors.InvalidRequestError` for a request that can never run."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def check_health(self) -> None:
        """Raises when the engine can no longer serve (its loop or a worker died)."""
        ...

    async def shutdown(self) -> None: ...
