"""A fake engine for the router's tests: the real Serve + HTTP stack without a model.

It meets `engine.protocol.EngineClient`; Serve builds it from the string "tests.fake_engine:FakeEngine".

It echoes the prompt's token ids back, one per `token_delay_s`, and accounts KV blocks as the
real engine does (reserved on admission, freed on finish or abort), so queueing, cancellation
and errors can be driven precisely. A prompt containing FAIL_TOKEN_ID makes it raise an error
whose message must never reach a client: at once when it is the first token, else after two
tokens (mid-stream).
"""
from __future__ import annotations

import asyncio
import time

from engine.block_manager import kv_tokens
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

FAIL_TOKEN_ID = 13
SECRET = "secret-internal-detail /srv/weights"


class FakeEngine:
    def __init__(self, config: EngineConfig, token_delay_s: float = 0.02, load_delay_s: float = 0.0) -> None:
        time.sleep(load_delay_s)  # a slow model load, to watch readiness
        self.max_model_len = config.max_model_len or 2048
        self.block_size = config.block_size
        self.num_blocks = config.num_gpu_blocks_override or 1024
        self.token_delay_s = token_delay_s
        self._blocks: dict[str, int] = {}
        self._aborted: set[str] = set()

    def _validate(self, ids: list[int], params: SamplingParams) -> int:
        limit = self.max_model_len
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty")
        if len(ids) >= limit:
            raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; max_model_len is {limit}",
                                      code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if len(ids) + max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                                      f"max_model_len ({limit})", code="context_length_exceeded")
        if -(-kv_tokens(len(ids), max_tokens) // self.block_size) > self.num_blocks:
            raise InvalidRequestError("max_tokens", "request needs more KV blocks than the cache has; "
                                      "it can never be scheduled")
        return max_tokens

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams):
        ids = list(prompt)
        max_tokens = self._validate(ids, params)
        self._blocks[request_id] = -(-(len(ids) + max_tokens) // self.block_size) * params.n
        scheduled = time.monotonic()  # no queue: scheduled at once
        try:
            for step in range(max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if request_id in self._aborted:
                    return
                if FAIL_TOKEN_ID in ids and step == (0 if ids[0] == FAIL_TOKEN_ID else 2):
                    raise RuntimeError(f"fake engine failure: {SECRET}")
                yield self._output(request_id, ids, params, step, last=step == max_tokens - 1, scheduled=scheduled)
        finally:
            self._blocks.pop(request_id, None)
            self._aborted.discard(request_id)

    def _output(self, request_id: str, ids: list[int], params: SamplingParams, step: int, last: bool,
                scheduled: float) -> RequestOutput:
        tok = ids[step % len(ids)]
        outs = [CompletionOutput(index=i, text="", token_ids=[], delta_text=f"{tok} ", delta_token_ids=[tok],
                                 delta_logprobs=[{tok: -0.5}] if params.logprobs is not None else None,
                                 finish_reason="length" if last else None)
                for i in range(params.n)]
        return RequestOutput(request_id, None, ids, outs, finished=last, first_scheduled_time=scheduled)

    async def abort(self, request_id: str) -> None:
        if request_id in self._blocks:
            self._aborted.add(request_id)

    def stats(self) -> EngineStats:
        used = sum(self._blocks.values())
        return EngineStats(num_total_blocks=self.num_blocks, num_free_blocks=self.num_blocks - used,
                           block_size=self.block_size, num_running=len(self._blocks), num_waiting=0,
                           num_preemptions=0, prefix_query_tokens=0, prefix_hit_tokens=0, waiting_prefill_tokens=0)

    def routing_snapshot(self) -> EngineStats:
        return self.stats()  # no prefix cache

    def check_health(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass
