"""An engine's Prometheus metrics, named as vLLM names its own (`vllm:x` -> `kvserve_x`), and
what records them: `EngineMetrics` turns engine snapshots and each request's timeline
(`RequestTimer`) into updates of sinks with Ray's metric interface. A Serve replica's sinks are
Ray's own (workers.metrics), which its Ray node exports; the offline `LLM`'s are in memory
(engine.metric_sinks), read by `LLM.get_metrics()`. Every series carries `model_name`.

    name                                   kind       source
    kvserve_num_requests_running           gauge      EngineStats (a replica's every second, the offline
                                                      engine's at get_metrics())
    kvserve_num_requests_waiting           gauge        "
    kvserve_num_requests_waiting_by_reason gauge        "   by reason: deferred (its LoRA adapter cannot run
                                                            yet) | capacity (the rest)
    kvserve_kv_cache_usage_perc            gauge        "   (fraction of KV blocks in use, 0..1)
    kvserve_num_preemptions                counter      "   (the engine's cumulative counters, as deltas)
    kvserve_prefix_cache_queries           counter      "   (prompt tokens looked up)
    kvserve_prefix_cache_hits              counter      "   (of those, found cached)
    kvserve_engine_steps                   counter      "   by kind: prefill (computed prompt tokens) | decode
    kvserve_engine_step_seconds            counter      "   wall time of those steps, by kind (their ratio:
                                                            the mean step time, which a busy host stretches)
    kvserve_iteration_tokens_total         histogram    "   tokens each step computed, prompt and decode
    kvserve_cache_config_info              gauge        "   and the config: labels block_size, num_gpu_blocks
                                                            (KV blocks, on any device), enable_prefix_caching,
                                                            cache_dtype, gpu_memory_utilization; value 1
    kvserve_prompt_tokens                  counter    RequestTimer: once its prefill is done
    kvserve_prompt_tokens_cached           counter      "   of those, served from the prefix cache
    kvserve_generation_tokens              counter      "   every FLUSH_PERIOD_S and at the end
    kvserve_time_to_first_token_seconds    histogram    "   arrival (at the replica, or add_request offline)
                                                            -> first token
    kvserve_inter_token_latency_seconds    histogram    "   gap before each later engine step
    kvserve_e2e_request_latency_seconds    histogram    "   arrival -> end, whatever the end
    kvserve_request_queue_time_seconds     histogram    "   arrival -> first scheduled by the engine
    kvserve_request_prefill_time_seconds   histogram    "   first scheduled -> first token
    kvserve_request_decode_time_seconds    histogram    "   first token -> last token
    kvserve_request_inference_time_seconds histogram    "   first scheduled -> last token
    kvserve_request_time_per_output_token_seconds  "    "   its decode time / its steps after the first
    kvserve_request_params_n               histogram    "   the request's n
    kvserve_request_max_num_generation_tokens  "    "   the most tokens one of its samples generated
    kvserve_request_params_max_tokens      histogram    "   its max_tokens (resolved: the model's room if unset)
    kvserve_request_prefill_kv_computed_tokens  "   "   prompt tokens its prefill computed (not cached)
    kvserve_request_num_preemptions        histogram    "   times its sequences were preempted
    kvserve_request_success                counter      "   by finished_reason: stop|length|abort|error
    kvserve_lora_requests_info             gauge      EngineStats, with enable_lora: labels running_lora_adapters,
                                                      waiting_lora_adapters (names, comma-separated) and max_lora;
                                                      the value is when it was recorded (vLLM's)
    kvserve_spec_decode_num_drafts         counter    EngineStats, with speculative_config (vLLM's names): steps a
                                                      sequence ran drafts in
    kvserve_spec_decode_num_draft_tokens   counter      "   drafts run
    kvserve_spec_decode_num_accepted_tokens counter     "   drafts kept
    kvserve_spec_decode_num_accepted_tokens_per_pos counter  "  drafts kept, by position (0: a step's first draft)

A request's `RequestTimer` lives with the request (the replica's generator frame, the offline
engine's table of requests), so nothing outlives the request. Per engine step it reads the clock
and appends one gap; the sinks see the gaps and the token count only when they are flushed.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.outputs import ITERATION_TOKENS_BUCKETS, EngineStats, RequestStateStats

FLUSH_PERIOD_S = 1.0  # a long request's gaps and tokens reach the sinks at least this often


def _buckets(lo_exp: int, hi_exp: int, mantissas: tuple[float, ...]) -> tuple[float, ...]:
    """mantissa x 10^e for e in lo_exp..hi_exp-1, then 10^hi_exp: (-1, 1, (1, 5)) -> 0.1 0.5 1 5 10."""
    return tuple(round(m * 10.0 ** e, 6) for e in range(lo_exp, hi_exp) for m in mantissas) + (10.0 ** hi_exp,)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "Gauge" | "Counter" | "Histogram": the ray.serve.metrics class
    description: str
    buckets: tuple[float, ...] = ()  # histogram bucket bounds (seconds)
    tag_keys: tuple[str, ...] = ()  # besides model_name

    @property
    def exported_names(self) -> tuple[str, ...]:
        """The series names Ray's Prometheus export gives this metric."""
        base = f"ray_{self.name}"
        if self.kind == "Counter":
            return (f"{base}_total",)
        if self.kind == "Histogram":
            return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
        return (base,)


RUNNING = "kvserve_num_requests_running"
WAITING = "kvserve_num_requests_waiting"
WAITING_BY_REASON = "kvserve_num_requests_waiting_by_reason"
REASON = "reason"
KV_USAGE = "kvserve_kv_cache_usage_perc"
PREEMPTIONS = "kvserve_num_preemptions"
PREFIX_QUERIES = "kvserve_prefix_cache_queries"
PREFIX_HITS = "kvserve_prefix_cache_hits"
PROMPT_TOKENS = "kvserve_prompt_tokens"
PROMPT_TOKENS_CACHED = "kvserve_prompt_tokens_cached"
PREFILL_KV_COMPUTED = "kvserve_request_prefill_kv_computed_tokens"
REQUEST_PREEMPTIONS = "kvserve_request_num_preemptions"
ITERATION_TOKENS = "kvserve_iteration_tokens_total"
CACHE_INFO = "kvserve_cache_config_info"
CACHE_INFO_TAGS = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype", "gpu_memory_utilization")
GENERATION_TOKENS = "kvserve_generation_tokens"
TTFT = "kvserve_time_to_first_token_seconds"
ITL = "kvserve_inter_token_latency_seconds"
E2E = "kvserve_e2e_request_latency_seconds"
REQUEST_SUCCESS = "kvserve_request_success"
REQUEST_PROMPT_TOKENS = "kvserve_request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "kvserve_request_generation_tokens"
QUEUE_TIME = "kvserve_request_queue_time_seconds"
PREFILL_TIME = "kvserve_request_prefill_time_seconds"
DECODE_TIME = "kvserve_request_decode_time_seconds"
INFERENCE_TIME = "kvserve_request_inference_time_seconds"
REQUEST_TPOT = "kvserve_request_time_per_output_token_seconds"
PARAMS_N = "kvserve_request_params_n"
MAX_SAMPLE_TOKENS = "kvserve_request_max_num_generation_tokens"
PARAMS_MAX_TOKENS = "kvserve_request_params_max_tokens"
ENGINE_STEPS = "kvserve_engine_steps"
LORA_INFO = "kvserve_lora_requests_info"
LORA_TAGS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
ENGINE_STEP_SECONDS = "kvserve_engine_step_seconds"
SPEC_DRAFTS = "kvserve_spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "kvserve_spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "kvserve_spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "kvserve_spec_decode_num_accepted_tokens_per_pos"
POSITION = "position"
FINISHED_REASON = "finished_reason"
STEP_KIND = "kind"
STEP_KINDS = ("prefill", "decode")
MODEL_NAME = "model_name"

PHASE_BUCKETS = _buckets(-3, 4, (1, 2, 5))  # 1 ms .. 10,000 s: a GPU's queue and prefill times are milliseconds

METRICS = (
    MetricSpec(RUNNING, "Gauge", "Requests in the engine's running batch."),
    MetricSpec(WAITING, "Gauge", "Requests queued in the engine, waiting to be scheduled."),
    MetricSpec(WAITING_BY_REASON, "Gauge", "Waiting requests by reason: deferred (their LoRA adapter cannot run "
               "yet) or capacity (waiting for room); together they are the waiting requests.", tag_keys=(REASON,)),
    MetricSpec(KV_USAGE, "Gauge", "Fraction of KV cache blocks in use (0..1)."),
    MetricSpec(PREEMPTIONS, "Counter", "Sequences preempted to free KV blocks."),
    MetricSpec(PREFIX_QUERIES, "Counter", "Prompt tokens looked up in the prefix cache."),
    MetricSpec(PREFIX_HITS, "Counter", "Prompt tokens found in the prefix cache."),
    MetricSpec(ENGINE_STEPS, "Counter", "Engine steps, by kind: prefill (computed prompt tokens) or decode (only decodes).",
               tag_keys=(STEP_KIND,)),
    MetricSpec(ENGINE_STEP_SECONDS, "Counter", "Wall-clock seconds of the engine's steps, by kind (prefill, decode).",
               tag_keys=(STEP_KIND,)),
    MetricSpec(ITERATION_TOKENS, "Histogram", "Tokens each engine step computed, prompt and decode.",
               tuple(float(b) for b in ITERATION_TOKENS_BUCKETS)),
    MetricSpec(CACHE_INFO, "Gauge", "The KV cache's configuration (labels); the value is 1.", tag_keys=CACHE_INFO_TAGS),
    MetricSpec(PROMPT_TOKENS, "Counter", "Prompt tokens of requests whose prefill completed."),
    MetricSpec(PROMPT_TOKENS_CACHED, "Counter", "Of those prompt tokens, the ones served from the prefix cache."),
    MetricSpec(GENERATION_TOKENS, "Counter", "Generated tokens, all samples of a request together."),
    MetricSpec(TTFT, "Histogram", "Seconds from a request's arrival at the replica to its first token.",
               _buckets(-3, 3, (1, 2, 5))),
    MetricSpec(ITL, "Histogram", "Seconds between successive engine steps that gave a request tokens.",
               _buckets(-3, 1, (1, 1.5, 2, 3, 5, 7.5)) + (20.0, 50.0)),
    MetricSpec(E2E, "Histogram", "Seconds from a request's arrival at the replica to its end.",
               _buckets(-2, 4, (1, 2, 5))),
    MetricSpec(REQUEST_SUCCESS, "Counter", "Requests that ended, by finished_reason (stop, length, abort, error).",
               tag_keys=(FINISHED_REASON,)),
    MetricSpec(REQUEST_PROMPT_TOKENS, "Histogram", "Prompt tokens of each request that ended.",
               _buckets(0, 6, (1, 2, 5))),
    MetricSpec(REQUEST_GENERATION_TOKENS, "Histogram", "Tokens each request that ended generated, its samples together.",
               _buckets(0, 6, (1, 2, 5))),
    MetricSpec(QUEUE_TIME, "Histogram", "Seconds from a request's arrival at the replica until the engine first "
               "scheduled it.", PHASE_BUCKETS),
    MetricSpec(PREFILL_TIME, "Histogram", "Seconds from the engine first scheduling a request to its first token.",
               PHASE_BUCKETS),
    MetricSpec(DECODE_TIME, "Histogram", "Seconds from a request's first token to its last.", PHASE_BUCKETS),
    MetricSpec(INFERENCE_TIME, "Histogram", "Seconds from the engine first scheduling a request to its last token.",
               PHASE_BUCKETS),
    MetricSpec(REQUEST_TPOT, "Histogram", "Each request's mean seconds per output token after its first (0 for one token).",
               _buckets(-3, 1, (1, 1.5, 2, 3, 5, 7.5)) + (20.0, 50.0)),
    MetricSpec(PARAMS_N, "Histogram", "The n of each request that ended.", (1.0, 2.0, 5.0, 10.0, 20.0)),
    MetricSpec(MAX_SAMPLE_TOKENS, "Histogram", "The most tokens one sample of each request that ended generated "
               "(its only one's for n 1).", _buckets(0, 6, (1, 2, 5))),
    MetricSpec(PARAMS_MAX_TOKENS, "Histogram", "The max_tokens of each request that ended (unset: what the model had room for).",
               _buckets(0, 6, (1, 2, 5))),
    MetricSpec(PREFILL_KV_COMPUTED, "Histogram", "Prompt tokens the prefill of each request that ended computed "
               "(those the prefix cache did not hold).", _buckets(0, 6, (1, 2, 5))),
    MetricSpec(REQUEST_PREEMPTIONS, "Histogram", "Times the sequences of each request that ended were preempted.",
               (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)),
    MetricSpec(LORA_INFO, "Gauge", "The LoRA adapters of running and waiting requests (labels, comma-separated), and "
               "max_lora; the value is the Unix time it was recorded.", tag_keys=LORA_TAGS),
    MetricSpec(SPEC_DRAFTS, "Counter", "Speculative decoding: steps a sequence ran drafts in."),
    MetricSpec(SPEC_DRAFT_TOKENS, "Counter", "Speculative decoding: draft tokens run."),
    MetricSpec(SPEC_ACCEPTED, "Counter", "Speculative decoding: draft tokens kept."),
    MetricSpec(SPEC_ACCEPTED_PER_POS, "Counter", "Speculative decoding: draft tokens kept, by their position in "
               "their step (0: the first).", tag_keys=(POSITION,)),
)


FINISHED_REASONS = ("stop", "length", "abort", "error")
ZERO_TAGS = {REQUEST_SUCCESS: [{FINISHED_REASON: r} for r in FINISHED_REASONS],  # series a counter starts with
             ENGINE_STEPS: [{STEP_KIND: k} for k in STEP_KINDS],
             ENGINE_STEP_SECONDS: [{STEP_KIND: k} for k in STEP_KINDS],
             SPEC_ACCEPTED_PER_POS: [{POSITION: "0"}]}



class EngineMetrics:
    """Turns an engine's observations into metric updates. `sinks` maps each METRICS name to an
    object with Ray's interface: gauges `set(v)`, counters `inc(v, tags)`, histograms `observe(v)`."""

    def __init__(self, sinks: Mapping[str, object], clock: Callable[[], float] = time.monotonic,
                 cache_config: object = None) -> None:
        """`cache_config`: the engine's EngineConfig, for kvserve_cache_config_info (None: not recorded)."""
        self.sinks = sinks
        self.clock = clock
        # (counter, its tag) -> the engine's total seen so far
        self._totals: dict[tuple[str, tuple[str, str] | None], float] = {}
        self._iteration_tokens: tuple[tuple[int, int], ...] = ()  # the last snapshot's
        self._cache_tags = None if cache_config is None else {
            "enable_prefix_caching": str(cache_config.enable_prefix_caching), "cache_dtype": "auto",
            "gpu_memory_utilization": str(cache_config.gpu_memory_utilization)}

    def start_request(self, num_prompt_tokens: int, n: int = 1, max_tokens: int | None = None) -> RequestTimer:
        """`n`, `max_tokens`: the request's parameters, for their histograms (max_tokens None: not recorded)."""
        return RequestTimer(self, num_prompt_tokens, self.clock(), n, max_tokens)

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges from one snapshot; the engine's cumulative counters become increments."""
        self.sinks[RUNNING].set(stats.num_running)
        self.sinks[WAITING].set(stats.num_waiting)
        self.sinks[WAITING_BY_REASON].set(stats.num_waiting_deferred, {REASON: "deferred"})
        self.sinks[WAITING_BY_REASON].set(stats.num_waiting - stats.num_waiting_deferred, {REASON: "capacity"})
        self.sinks[KV_USAGE].set(stats.kv_usage)
        if self._cache_tags is not None:
            self.sinks[CACHE_INFO].set(1, {"block_size": str(stats.block_size),
                                           "num_gpu_blocks": str(stats.num_total_blocks), **self._cache_tags})
        self._observe_steps(stats.iteration_tokens)
        if stats.max_lora:
            self.sinks[LORA_INFO].set(stats.timestamp, dict(zip(LORA_TAGS, (
                ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters), str(stats.max_lora)))))
        # (counter, its tag, the engine's total): a tag is (key, value), or None
        counts = [(PREEMPTIONS, None, stats.num_preemptions), (PREFIX_QUERIES, None, stats.prefix_query_tokens),
                  (PREFIX_HITS, None, stats.prefix_hit_tokens),
                  (ENGINE_STEPS, (STEP_KIND, "prefill"), stats.prefill_steps),
                  (ENGINE_STEP_SECONDS, (STEP_KIND, "prefill"), stats.prefill_step_seconds),
                  (ENGINE_STEPS, (STEP_KIND, "decode"), stats.decode_steps),
                  (ENGINE_STEP_SECONDS, (STEP_KIND, "decode"), stats.decode_step_seconds)]
        if stats.spec_draft_tokens:
            counts += [(SPEC_DRAFTS, None, stats.spec_drafts), (SPEC_DRAFT_TOKENS, None, stats.spec_draft_tokens),
                       (SPEC_ACCEPTED, None, stats.spec_accepted_tokens)]
            counts += [(SPEC_ACCEPTED_PER_POS, (POSITION, str(k)), n) for k, n in enumerate(stats.spec_accepted_per_pos)]
        for name, tag, total in counts:
            self._inc(name, total - self._totals.get((name, tag), 0), dict([tag]) if tag else None)
            self._totals[name, tag] = total

    def _observe_steps(self, totals: tuple[tuple[int, int], ...]) -> None:
        """The steps since the last snapshot into the tokens-per-step histogram. The snapshot has
        each bucket's steps and tokens, not each step's: a bucket's new steps are observed at their
        mean, which lies in that bucket, so the counts and the sum come out as the steps' own."""
        last = self._iteration_tokens or ((0, 0),) * len(totals)
        observe = self.sinks[ITERATION_TOKENS].observe
        for (steps, tokens), (steps0, tokens0) in zip(totals, last):
            for _ in range(steps - steps0):
                observe((tokens - tokens0) / (steps - steps0))
        self._iteration_tokens = totals

    # -- what RequestTimer reports ---------------------------------------------------------------
    def first_token(self, ttft_s: float, num_prompt_tokens: int, num_cached_tokens: int = 0) -> None:
        self.sinks[TTFT].observe(ttft_s)
        self._inc(PROMPT_TOKENS, num_prompt_tokens)
        self._inc(PROMPT_TOKENS_CACHED, num_cached_tokens)

    def tokens_generated(self, gaps_s: list[float], num_tokens: int) -> None:
        observe = self.sinks[ITL].observe
        for gap in gaps_s:
            observe(gap)
        self._inc(GENERATION_TOKENS, num_tokens)

    def request_finished(self, t: RequestTimer, reason: str, end: float) -> None:
        """One ended request's timeline, split as vLLM splits it: queue (arrival -> first scheduled),
        prefill (-> first token), decode (-> last token), inference (first scheduled -> last token).
        Recorded whatever the end; a phase the request never reached is not."""
        self.sinks[E2E].observe(end - t.arrival)
        self.sinks[REQUEST_SUCCESS].inc(1, {FINISHED_REASON: reason})
        self.sinks[REQUEST_PROMPT_TOKENS].observe(t.num_prompt_tokens)
        self.sinks[REQUEST_GENERATION_TOKENS].observe(t.generated)
        self.sinks[PARAMS_N].observe(t.n)
        self.sinks[MAX_SAMPLE_TOKENS].observe(t.longest if t.n > 1 else t.generated)
        if t.max_tokens is not None:
            self.sinks[PARAMS_MAX_TOKENS].observe(t.max_tokens)
        self.sinks[REQUEST_PREEMPTIONS].observe(t.num_preemptions)
        first, last = t.first, t.last
        if first is not None:
            self.sinks[PREFILL_KV_COMPUTED].observe(t.num_prompt_tokens - t.num_cached_tokens)
        if t.scheduled_at is not None:
            # the engine's clock and this one are the host's monotonic clock; the hop between
            # them can put the engine's instant a hair outside the replica's interval
            scheduled = min(max(t.scheduled_at, t.arrival), first if first is not None else end)
            self.sinks[QUEUE_TIME].observe(scheduled - t.arrival)
            if first is not None:
                self.sinks[PREFILL_TIME].observe(first - scheduled)
                self.sinks[INFERENCE_TIME].observe(last - scheduled)
        if first is not None:
            self.sinks[DECODE_TIME].observe(last - first)
            self.sinks[REQUEST_TPOT].observe((last - first) / t.num_gaps if t.num_gaps else 0.0)

    def _inc(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:  # Ray's Counter rejects 0
            self.sinks[name].inc(value, tags)


class RequestTimer:
    """One request's timeline at the replica: arrival, when the engine first scheduled it, each
    engine step with tokens, its end. EngineMetrics.request_finished reads the public fields."""
    __slots__ = ("_metrics", "num_prompt_tokens", "n", "max_tokens", "arrival", "scheduled_at", "first", "last",
                 "num_gaps", "generated", "longest", "num_cached_tokens", "num_preemptions", "_gaps", "_tokens",
                 "_flushed", "_done")

    def __init__(self, metrics: EngineMetrics, num_prompt_tokens: int, now: float, n: int = 1,
                 max_tokens: int | None = None) -> None:
        self._metrics = metrics
        self.num_prompt_tokens, self.n, self.max_tokens = num_prompt_tokens, n, max_tokens
        self.arrival = now
        self.scheduled_at: float | None = None  # when the engine first scheduled it (its clock: time.monotonic)
        self.first: float | None = None  # when its first token arrived
        self.last: float | None = None  # when the latest step with tokens arrived
        self.num_gaps = 0  # engine steps with tokens after the first
        self.generated = 0  # all the request's generated tokens
        self.longest = 0  # n > 1: the most tokens one of its samples generated so far (tokens' `longest`)
        self.num_cached_tokens = 0  # its prompt tokens the prefix cache held (`scheduled`)
        self.num_preemptions = 0  # times its sequences were preempted, so far (`preempted`)
        self._gaps: list[float] = []  # inter-token gaps not observed yet
        self._tokens = 0  # generated tokens not counted yet
        self._flushed = now
        self._done = False

    def tokens(self, n: int, steps: int = 1, longest: int = 0) -> None:
        """An engine output gave this request `n` new tokens (its samples together), made over
        `steps` engine steps (more than one with a stream interval: the gap since the previous
        output is shared out evenly over them). `longest` (n > 1): the most tokens one of its
        samples has now."""
        self.longest = max(self.longest, longest)
        if not n:
            return
        now = self._metrics.clock()
        if self.last is None:
            self.first = now
            self._metrics.first_token(now - self.arrival, self.num_prompt_tokens, self.num_cached_tokens)
        else:
            steps = max(steps, 1)
            self._gaps.extend([(now - self.last) / steps] * steps)
            self.num_gaps += steps
        self.last = now
        self._tokens += n
        self.generated += n
        if now - self._flushed >= FLUSH_PERIOD_S:
            self._flush(now)

    def pooled(self) -> None:
        """A pooling request's vector arrived (engine.pooling): its prefill is done, counted as a
        first token's would be (its prompt tokens, the time to it), and nothing is generated."""
        if self.last is None:
            self.first = self.last = self._metrics.clock()
            self._metrics.first_token(self.first - self.arrival, self.num_prompt_tokens, self.num_cached_tokens)

    def scheduled(self, at: float | None, num_cached_tokens: int = 0) -> None:
        """When the engine first scheduled the request (RequestOutput.first_scheduled_time, on the
        metrics' clock), or None from an engine that does not say; and how many of its prompt
        tokens the prefix cache held then (RequestOutput.num_cached_tokens)."""
        if at is not None and self.scheduled_at is None:
            self.scheduled_at = at
            self.num_cached_tokens = num_cached_tokens

    def preempted(self, count: int) -> None:
        """The times its sequences have been preempted so far (RequestOutput.num_preemptions)."""
        self.num_preemptions = max(self.num_preemptions, count)

    def finish(self, reason: str | None) -> None:
        """The request ended: stop | length | abort | error, or None: refused before it ran (not
        counted). Later calls do nothing."""
        if self._done:
            return
        self._done = True
        now = self._metrics.clock()
        self._flush(now)
        if reason is not None:
            self._metrics.request_finished(self, reason, now)

    def state_stats(self) -> RequestStateStats:
        """The timeline as vLLM's RequestOutput.metrics gives it (the metrics' clock is monotonic)."""
        return RequestStateStats(
            num_generation_tokens=self.generated, num_preemptions=self.num_preemptions,
            arrival_time=time.time() - (self._metrics.clock() - self.arrival), queued_ts=self.arrival,
            scheduled_ts=self.scheduled_at or 0.0, first_token_ts=self.first or 0.0, last_token_ts=self.last or 0.0,
            first_token_latency=self.first - self.arrival if self.first is not None else 0.0)

    def _flush(self, now: float) -> None:
        self._metrics.tokens_generated(self._gaps, self._tokens)
        self._gaps, self._tokens, self._flushed = [], 0, now
