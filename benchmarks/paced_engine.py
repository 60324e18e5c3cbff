"""A model-free engine that steps at a fixed pace: the serving path's own cost, without the model.

Every `KVSERVE_PACED_STEP_S` seconds (default 0.1, about a 16-sequence decode step of SmolLM2 on
2 CPU cores) every running request gets one token, as in a continuous-batching engine's decode
step; so the Serve proxy, the ingress and the replica carry the message rate a real engine makes
them carry, and what they cost per token can be read from /proc without model compute (and its
noise) on the same cores. A FINAL_ONLY request (a reply not streamed) gets its first output and
its last, which holds the tokens in between, as the real engine hands them out. Built by Serve as
`PacedEngine(EngineConfig)` from the string "benchmarks.paced_engine:PacedEngine"
(benchmarks/serving_overhead.py).
"""
from __future__ import annotations

import asyncio
import os

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class PacedEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.max_model_len = config.max_model_len or 2048
        self.block_size = config.block_size
        self.step_s = float(os.environ.get("KVSERVE_PACED_STEP_S", "0.1"))
        self._running: dict[str, asyncio.Event] = {}
        self._tick: asyncio.Event | None = None
        self._clock: asyncio.Task | None = None

    async def _run_clock(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()

    async def _next_step(self) -> None:
        if self._clock is None:
            self._tick = asyncio.Event()
            self._clock = asyncio.create_task(self._run_clock())
        await self._tick.wait()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams):
        max_tokens = params.max_tokens or 16
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self._running[request_id] = asyncio.Event()
        pending: list[int] = []  # tokens made and not handed out yet
        try:
            for step in range(max_tokens):
                await self._next_step()
                pending.append(prompt[step % len(prompt)])
                last = step == max_tokens - 1
                if final_only and 0 < step < max_tokens - 1:
                    continue
                outs = [CompletionOutput(index=i, delta_text="".join(f"{t} " for t in pending),
                                         delta_token_ids=list(pending), finish_reason="length" if last else None)
                        for i in range(params.n)]
                pending = []
                yield RequestOutput(request_id, None, prompt, outs, finished=last)
        finally:
            self._running.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        pass  # closing the stream ends it

    def stats(self) -> EngineStats:
        return EngineStats(num_total_blocks=1 << 16, num_free_blocks=1 << 16, block_size=self.block_size,
                           num_running=len(self._running), num_waiting=0, num_preemptions=0, prefix_query_tokens=0,
                           prefix_hit_tokens=0, waiting_prefill_tokens=0)

    def routing_snapshot(self) -> EngineStats:
        return self.stats()

    def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
