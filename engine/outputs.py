"""What the engine hands back per request and step."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, from the prefill's logits (raw, before
    any sampling parameter)."""
    token_id: int
    logprob: float
    rank: int  # 1 + how many tokens the model found more likely
    top: tuple[tuple[int, float], ...]  # the params.prompt_logprobs most likely (token id, logprob), highest first

    def entry(self) -> dict[int, float]:
        """The top tokens plus this one: the shape of a generated token's logprobs."""
        return {**dict(self.top), self.token_id: self.logprob}


PromptLogprobs = list[PromptLogprob | None]  # one per prompt token; the first has no context: None


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's, as the offline `LLM` hands logprobs out (`{token id: Logprob}` per token): the
    logprob, the token's rank in the vocabulary (1: the most likely) and its text (None with
    detokenize=False)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str = ""  # full text so far (stop strings cut)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None  # per token: top-k (+ sampled) token -> logprob (LLM: a Logprob)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (its grammar failed)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; for "error", why
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float]] | None = None
    ranks: list[int | None] | None = None  # with logprobs: each sampled token's rank (in process only)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> CompletionOutput:
        """A shallow copy: copy.copy's result at a quarter of its cost (1 instead of 4.5 us; the
        engine takes one per streaming request per step)."""
        out = object.__new__(CompletionOutput)
        out.__dict__.update(self.__dict__)
        return out


@dataclass
class RequestStateStats:
    """vLLM's RequestOutput.metrics: a finished request's timeline. arrival_time is the wall
    clock (time.time()); the *_ts instants are time.monotonic() (0.0: not reached)."""
    num_generation_tokens: int = 0  # its samples' together
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0  # seconds from arrival to the first token
    is_corrupted: bool = False


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # when params.prompt_logprobs is set (LLM: vLLM's dicts of Logprob)
    # time.monotonic() on the engine's host when the engine first scheduled the request (vLLM V0's
    # RequestMetrics.first_scheduled_time): where its queue time ends and its prefill starts
    first_scheduled_time: float | None = None
    # vLLM's: the request's timeline once it finished, with metrics on (LLM(disable_log_stats=False));
    # else None, as vLLM's
    metrics: RequestStateStats | None = None
    lora_request: object = None  # the request's engine.lora_request.LoRARequest, as vLLM's
    pooled: list[float] | None = None  # a pooling request's vector (engine.pooling), in its finished output
    num_preemptions: int = 0  # times the request's sequences were preempted so far (for its metrics)


@dataclass
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    """vLLM's: one prompt's pooled vector, as a torch tensor."""
    data: object


@dataclass
class PoolingRequestOutput:
    """vLLM's, what `LLM.encode` returns per prompt (`LLM.embed`: EmbeddingRequestOutput)."""
    request_id: str
    outputs: PoolingOutput | EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's: `outputs.embedding` is the prompt's embedding."""


@dataclass
class ClassificationOutput:
    """vLLM's: one prompt's class probabilities (engine.classifier)."""
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's, what `LLM.classify` returns per prompt: `outputs.probs`."""


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score (engine.scoring)."""
    score: float


class ScoringRequestOutput(PoolingRequestOutput):
    """vLLM's, what `LLM.score` returns per pair: `outputs.score`; `prompt_token_ids` are the two
    inputs' tokens one after the other (an embedding model's), or the pair's prompt (a cross-encoder's)."""


# Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens buckets); a count past
# the last goes in a last, unbounded one.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of an engine's KV and queue state, taken between two steps.

    `LLMEngine.stats()` leaves `prefix_hashes` empty (cheap, every step);
    `LLMEngine.routing_snapshot()` fills it, for the global scheduler."""
    num_total_blocks: int
    num_free_blocks: int  # in the free queue (free-but-cached blocks count: reuse evicts them)
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative
    prefix_query_tokens: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # cumulative prompt tokens found there
    waiting_prefill_tokens: int  # prompt tokens queued, not yet computed
    num_reserved_blocks: int = 0  # blocks admitted + queued requests still need to reach max_tokens
    max_num_seqs: int = 0
    running_prefill_tokens: int = 0  # prompt tokens of admitted sequences whose chunked prefill is under way
    # Cumulative engine steps and their wall time on the step thread, split by whether the step
    # computed prompt tokens (prefill: prompt chunks, maybe with decodes) or decodes only.
    prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    prompt_tokens: int = 0  # cumulative prompt tokens the steps computed (prefix-cache hits are not)
    generation_tokens: int = 0  # cumulative tokens the steps sampled, all sequences together
    # Cumulative tokens per step (prompt and decode tokens it computed), as a histogram: for each
    # bucket of ITERATION_TOKENS_BUCKETS and the unbounded one after them, (steps, their tokens)
    iteration_tokens: tuple[tuple[int, int], ...] = ()
    # Of num_waiting, those passed over while their LoRA adapter cannot run (max_loras others
    # running): vLLM's "deferred" waiting reason; the rest wait for room ("capacity")
    num_waiting_deferred: int = 0
    # Speculative decoding (engine.speculative), cumulative: steps a sequence ran drafts in, drafts
    # run, drafts kept, and drafts kept by their position in their step
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    prefix_hashes: frozenset[int] = frozenset()  # bounded summary of cached prefix-block hashes
    # LoRA (enable_lora): the adapters of the running and of the waiting requests, by name; and how
    # many may run at once (0: LoRA is off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0
    timestamp: float = 0.0  # when the snapshot was taken (time.time() of the engine's host)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (the one definition: metrics, autoscaling, routing)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def to_dict(self) -> dict:
        """Plain types (frozenset -> list) plus the derived rates, for Serve's stats channels."""
        d = dataclasses.asdict(self)
        d["prefix_hashes"] = list(self.prefix_hashes)
        d["kv_usage"], d["prefix_hit_rate"] = self.kv_usage, self.prefix_hit_rate
        return d

    @classmethod
    def from_dict(cls, d: dict, **extra):
        """The inverse of `to_dict` (derived values dropped), for this class or a subclass."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in {**d, **extra}.items() if k in names}
        return cls(**{**fields, "prefix_hashes": frozenset(d.get("prefix_hashes", ()))})


@dataclass
class ChoiceDelta:
    """What one step added to one of a request's n samples."""
    index: int  # which of the request's n samples
    text: str  # new text since the previous step
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # per new token: top-k (+ sampled) token -> logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error", sent exactly once
    stop_reason: str | int | None = None


@dataclass
class StepOutput:
    """What one engine step produced for one request, as the replica streams it to the ingress:
    only the samples that changed (a RequestOutput without the full texts)."""
    choices: list[ChoiceDelta]
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None  # in a request's first StepOutput only
    pooled: list[float] | None = None  # a pooling request's vector (engine.pooling), in its finished output

    @property
    def finish_reason(self) -> str:
        """Why a finished request ended: its last sample's reason (n > 1: the one that ended last)."""
        return next((c.finish_reason for c in reversed(self.choices) if c.finish_reason), "abort")

    def __reduce__(self):
        """Pickled as plain values: every streamed message of the replica -> ingress hop is one.
        A one-token step pickles in 3.2 us instead of 6.4, unpickles in 3.5 instead of 6.8, and
        takes 83 bytes instead of 254 (pickle; under cloudpickle 10.8 us instead of 18.9)."""
        return _step_output, ([(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                               for c in self.choices], self.num_prompt_tokens, self.num_cached_tokens,
                              self.finished, self.prompt_logprobs, self.pooled)

    @classmethod
    def from_request_output(cls, out: RequestOutput, finished_samples: set[int],
                            first: bool = False) -> "StepOutput":
        """The deltas of `out`; `finished_samples` (updated here) keeps a finished sample from
        being sent again. The prompt logprobs go with the `first` output only."""
        choices = []
        for c in out.outputs:
            if c.index in finished_samples or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                continue
            choices.append(ChoiceDelta(c.index, c.delta_text, list(c.delta_token_ids), c.delta_logprobs,
                                       c.finish_reason, c.stop_reason))
            if c.finish_reason is not None:
                finished_samples.add(c.index)
        return cls(choices, len(out.prompt_token_ids), out.num_cached_tokens, out.finished,
                   out.prompt_logprobs if first else None, out.pooled)


def _step_output(choices: list[tuple], num_prompt_tokens: int, num_cached_tokens: int, finished: bool,
                 prompt_logprobs: PromptLogprobs | None, pooled: list[float] | None = None) -> StepOutput:
    """StepOutput.__reduce__'s inverse."""
    return StepOutput([ChoiceDelta(*c) for c in choices], num_prompt_tokens, num_cached_tokens, finished,
                      prompt_logprobs, pooled)
