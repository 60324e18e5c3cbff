"""What the engine hands back per request and step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str = ""  # full text so far (stop strings cut)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: top-k (+ sampled) token -> logprob
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    waiting_prefill_tokens: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
