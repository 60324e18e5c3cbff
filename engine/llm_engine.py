"""The synchronous engine core: add requests, step, abort. No threads, no Ray, no HTTP."""
from __future__ import annotations

import dataclasses
import logging
import time

from engine.block_manager import BlockManager, kv_tokens
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.inputs import unwrapped_prompt
from engine.executor import Executor, make_executor
from engine.lora import LoadedAdapters
from engine.lora_request import lora_id
from engine.metric_sinks import MemorySinks, Metric
from engine.metrics import EngineMetrics, RequestTimer
from engine.outputs import EngineStats, RequestOutput
from engine.pooling import Pooled, PoolerConfig
from engine.request import Request
from engine.sampler import SampleResult
from engine.sampling_params import SamplingParams, framing_tokens, priority_refusal, truncated
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.snapshot import DEFAULT_PREFIX_LIMIT, snapshot
from engine.speculative import NgramDrafter
from engine.st_dense import Projection, read_dense_modules
from engine.structured.compiler import CompiledGrammar, GrammarCompiler
from engine.structured.matchers import STOP, GrammarMatchers
from engine.token_bans import bad_words_token_ids

logger = logging.getLogger(__name__)


def encoder_config(config: EngineConfig, max_position_embeddings: int) -> EngineConfig:
    """An encoder's prompts run whole (a token's state depends on the tokens after it): no chunked
    prefill, no prefix caching, as vLLM runs encoder-only models, and a step budget that holds a
    max_model_len prompt (bge-m3's 8,192 tokens), raised to it where it is less."""
    model_len = config.model_len(max_position_embeddings)
    if config.enable_chunked_prefill or config.enable_prefix_caching:
        logger.info("an encoder model: chunked prefill and prefix caching are off (each prompt runs whole)")
    budget = max(config.max_num_batched_tokens, model_len)
    if budget > config.max_num_batched_tokens:
        logger.info("an encoder model: max_num_batched_tokens raised from %d to max_model_len, %d (a step holds "
                    "a whole prompt)", config.max_num_batched_tokens, budget)
    return dataclasses.replace(config, enable_chunked_prefill=False, enable_prefix_caching=False,
                               max_num_batched_tokens=budget)


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or make_executor(config)
        info = self.executor.info
        self.pooler: PoolerConfig | None = getattr(info, "pooler", None)  # a pooling engine's (engine.pooling)
        if self.pooler is not None and self.pooler.encoder:
            config = self.config = encoder_config(config, info.max_position_embeddings)
        self.tokenizer = info.tokenizer
        # an encoder's [CLS] and [SEP]: truncation keeps them (engine.sampling_params.truncated)
        self._ends = framing_tokens(self.tokenizer, self.pooler)
        # a sentence-transformers folder's Dense modules, applied to each pooled vector (engine.st_dense)
        dense = read_dense_modules(info.model_dir) if self.pooler is not None else []
        self._project = Projection(dense) if dense else None
        self.eos_token_ids = set(info.eos_token_ids)
        self.max_model_len = config.model_len(info.max_position_embeddings)
        self._check_room(info.num_blocks)
        self.block_manager = BlockManager(info.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   config.enable_chunked_prefill, config.scheduling_policy,
                                                   config.max_loras if config.enable_lora else None,
                                                   config.long_prefill_token_threshold,
                                                   config.long_prefill_token_threshold_adaptive),
                                   self.block_manager, propose=self._drafter(config))
        self.adapters = LoadedAdapters(self.executor, config.max_cpu_loras or config.max_loras)
        self.requests: dict[str, Request] = {}
        # Requests that finished in a step that raised after their last token: their outputs go
        # out with the next step's (they stay in `requests` until then, so has_unfinished says so).
        self._held: list[Request] = []
        # Grammars compile on their own thread (AsyncEngine waits for them before queueing a
        # request); matchers live here, whatever the tensor parallelism, and masks travel.
        self.structured = GrammarMatchers(GrammarCompiler(self.tokenizer, info.vocab_size, info.eos_token_ids))
        # vLLM's stat logging (LLM(disable_log_stats=False)): each request's timeline, read by get_metrics()
        self.metrics: EngineMetrics | None = None
        self._timers: dict[str, RequestTimer] = {}

    def _drafter(self, config: EngineConfig) -> NgramDrafter | None:
        """With speculative_config, what proposes drafts (engine.speculative); not for a grammar
        held behind its reasoning gate (the gate reads one token at a time)."""
        if config.speculative_config is None:
            return None
        return NgramDrafter(config.speculative_config, self.max_model_len,
                            lambda seq: seq.seq_id not in self.structured.gates, lambda: len(self.scheduler.running))

    def _check_room(self, num_blocks: int) -> None:
        """A pool sized from memory must hold one max_model_len sequence (all but its last token),
        as vLLM refuses to start otherwise: every request left to run to max_model_len would be
        refused. --num-gpu-blocks-override is taken as given."""
        capacity = num_blocks * self.config.block_size
        if self.config.num_gpu_blocks_override is None and capacity < self.max_model_len - 1:
            self.executor.shutdown()
            raise ValueError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than one sequence "
                             f"of max_model_len {self.max_model_len} needs: give it more memory (--kv-cache-memory; "
                             f"--gpu-memory-utilization on a GPU, --cpu-kv-cache-fraction on CPU), or lower "
                             f"--max-model-len to at most {capacity + 1}")

    # -- admission -----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """A text prompt gets the tokenizer's special tokens (a BOS where the model has one), as
        vLLM's `LLM.generate` and `tokenizer(prompt)` before HF `generate` give it."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, fit_model_len: bool = False) -> int:
        """Raise InvalidRequestError for a request that can never run; returns its resolved
        max_tokens. `fit_model_len`: a max_tokens that would run past max_model_len is cut to
        fit (the request ends "length" there, as vLLM's offline `LLM`), not refused (the server's 400)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "prompt is empty")
        vocab = self.executor.info.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError("prompt", f"prompt token ids must be in [0, {vocab})")
        params.check_token_ids(vocab)
        params.within_logprobs_cap(self.config.max_logprobs, vocab)  # more than --max-logprobs: raises
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequestError("priority", priority_refusal(params.priority))
        if params.lora_request is not None and not self.config.enable_lora:
            raise InvalidRequestError("lora_request", f"LoRA adapter {params.lora_request.lora_name!r}: LoRA is not "
                                      "enabled (start the engine with enable_lora, --enable-lora)")
        if params.pooling is not None or self.pooler is not None:
            return self._validate_pooling(n, params)
        if n >= self.max_model_len:
            raise InvalidRequestError("prompt", f"prompt has {n} tokens; max_model_len is {self.max_model_len} "
                                      "(the prompt must leave room for at least one generated token)",
                                      code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if fit_model_len:
            max_tokens = min(max_tokens, self.max_model_len - n)
        if n + max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                                      f"max_model_len ({self.max_model_len})", code="context_length_exceeded")
        need = self.block_manager.blocks_for(kv_tokens(n, max_tokens))
        if need > self.block_manager.num_blocks:
            raise InvalidRequestError("max_tokens", f"request needs {need} KV blocks but the cache has only "
                                      f"{self.block_manager.num_blocks}; it can never be scheduled")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError("n", f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        return max_tokens

    def _validate_pooling(self, n: int, params: SamplingParams) -> int:
        """A pooling request on a pooling engine (each kind only on its own, as vLLM's runners):
        its prompt may fill max_model_len, since nothing is generated after it."""
        if self.pooler is None:
            raise InvalidRequestError("model", "the model is served for generation, not embeddings: start it with "
                                      "--runner pooling (LLM(..., runner='pooling')) to embed")
        if params.pooling is None and self.pooler.classifier is not None:
            raise InvalidRequestError("model", "the model is served for classification (--runner pooling; a sequence "
                                      "classifier): it does not generate; use LLM.classify, LLM.score or /classify")
        if params.pooling is None:
            raise InvalidRequestError("model", "the model is served for embeddings (--runner pooling): it does not "
                                      "generate; use LLM.embed or /v1/embeddings")
        p = params  # built by PoolingParams.sampling(); one made by hand may ask what a vector has not
        for name, asked in (("n", p.n != 1), ("max_tokens", p.max_tokens != 1), ("logprobs", p.logprobs is not None),
                            ("prompt_logprobs", p.prompt_logprobs is not None),
                            ("structured_outputs", p.structured_outputs is not None)):
            if asked:
                raise InvalidRequestError(name, f"a pooling request has no {name}: give PoolingParams "
                                                "(LLM.embed / LLM.encode)")
        if n > self.max_model_len:
            raise InvalidRequestError("prompt", f"prompt has {n} tokens; max_model_len is {self.max_model_len}",
                                      code="context_length_exceeded")
        need = self.block_manager.blocks_for(n)
        if need > self.block_manager.num_blocks:
            raise InvalidRequestError("prompt", f"request needs {need} KV blocks but the cache has only "
                                      f"{self.block_manager.num_blocks}; it can never be scheduled")
        return 1  # one draw: the vector

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    grammar: CompiledGrammar | None = None, fit_model_len: bool = False) -> None:
        """`grammar`: params.structured_outputs compiled ahead (else compiled here, blocking);
        `fit_model_len`: as `validate`'s."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, dict):  # vLLM's {"prompt": text} or {"prompt_token_ids": ids}, maybe a cache_salt
            prompt, salt = unwrapped_prompt(prompt)
            if salt is not None:
                params = dataclasses.replace(params, cache_salt=salt)
        text, ids = self.tokenize(prompt)
        # The request's own copy: what the engine caches on it (engine.token_bans) stays its own,
        # whatever the caller later does with the object it passed.
        params = dataclasses.replace(params).within_logprobs_cap(self.config.max_logprobs,
                                                                  self.executor.info.vocab_size)  # -1: all
        if params.pooling is not None and self.pooler is not None:  # the engine's defaults, and its checks
            params.pooling = self.pooler.resolved(params.pooling)
        if params.truncate_prompt_tokens is not None:
            pooled = params.pooling is not None  # vLLM's pooling runner cuts on the right: the first tokens
            ids = truncated(ids, params.truncate_prompt_tokens, self.max_model_len, 0 if pooled else params.max_tokens,
                            side="right" if pooled else None, ends=self._ends)
        max_tokens = self.validate(ids, params, fit_model_len)
        gate = self.structured.gate(params.structured_outputs) if params.structured_outputs is not None else None
        if params.structured_outputs is not None and grammar is None:
            grammar = self.structured.compiler.compile(params.structured_outputs)
        if params.bad_words and params.bad_words_token_ids is None:
            vocab = self.executor.info.vocab_size  # a word the model cannot write needs no ban
            words = [w for w in bad_words_token_ids(self.tokenizer, params.bad_words) if max(w) < vocab]
            params = dataclasses.replace(params, bad_words_token_ids=words)
        if params.lora_request is not None:  # loaded now, or refused: an adapter that does not fit the model
            self.adapters.use(params.lora_request, {lora_id(r.params) for r in self.requests.values()})
        req = Request(request_id, text, ids, params, max_tokens, self.tokenizer)
        self.requests[request_id] = req
        if grammar is not None:
            self.structured.add(req.seqs[0], grammar, gate)
        self.scheduler.add(req.seqs[0])
        if self.metrics is not None:
            self._timers[request_id] = self.metrics.start_request(len(ids), params.n, max_tokens)

    def abort(self, request_id: str, refused: bool = False) -> RequestOutput | None:
        """`refused`: the caller takes back a request that never ran (a batch refused as a whole
        at admission), which the metrics do not count, as the server does not count a refused one."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
            self.structured.drop(seq)
        ended = req.finished  # one held since a step that raised: it ended as it ended
        req.abort()
        self._request_ended(req, counted=not refused, aborted=not ended)
        return req.take_output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- vLLM's LLMEngine names, for scripts that drive `llm.llm_engine` --------------------------
    def has_unfinished_requests(self) -> bool:
        return self.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort(request_id)

    def get_tokenizer(self):
        return self.tokenizer

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        held = [req for req in self._held if self.requests.get(req.request_id) is req]  # not aborted since
        batch = self.scheduler.schedule()
        outputs = []
        if batch.seqs:
            prompt_tokens, tokens = batch.num_prompt_tokens, batch.num_tokens  # before the step advances them
            try:
                outputs = self._run(batch)
            finally:  # a step that raised took its time too
                self.scheduler.stats.record_step(batch.has_prefill, time.perf_counter() - start, prompt_tokens, tokens)
        self._held = []
        return [self._finished_output(req) for req in held] + outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        try:
            mask = self.structured.mask([batch.seqs[i] for i in batch.sampled(self.config.block_size)]) \
                if self.structured else None
            out = self.executor.execute(batch, mask)  # which sequences sample, and their draws
        except BaseException:  # Ctrl-C, out of memory: the offline LLM goes on after it
            self.scheduler.roll_back(batch)
            raise
        for i, scored in out.prompt_logprobs.items():  # before any output of theirs is taken, and forks
            seq = batch.seqs[i]
            self.requests[seq.request_id].add_prompt_logprobs(seq, scored)
        for i, (rows_sum, num_rows) in out.pooled_rows.items():  # before the last row finishes the request
            seq = batch.seqs[i]
            self.requests[seq.request_id].add_pooled_rows(seq, rows_sum, num_rows)
        touched: dict[str, Request] = {}
        counts: dict[str, int] | None = {} if self.metrics is not None else None  # tokens per request

        def append(seq: Sequence, result: SampleResult) -> bool:
            req = touched.setdefault(seq.request_id, self.requests[seq.request_id])
            if isinstance(result, Pooled):  # a pooling request's vector: it is done
                if (timer := self._timers.get(seq.request_id)) is not None:
                    timer.scheduled(seq.first_scheduled, seq.num_cached_tokens)
                    timer.pooled()
                return req.finish_pooled(seq, result, self._project)
            verdict = self.structured.accept(seq, result.token_id) if self.structured else None
            done = req.append_token(seq, result, self.eos_token_ids, self.max_model_len)
            if verdict is not None:
                done = self._end_constrained(req, seq, verdict, done)
            if counts is not None:  # kept: an append that raised is drawn again
                counts[seq.request_id] = counts.get(seq.request_id, 0) + 1
            return done

        try:  # a failed draw is undone (Scheduler.update_from_output), and then the step as above
            self.scheduler.update_from_output(batch, out.sampled, out.sample, append, on_fork=self._add_fork)
        except BaseException:  # in the draws, or in an append: the sequences it reached keep their tokens
            self.scheduler.roll_back(batch)
            self._held += [req for req in touched.values() if req.finished]
            raise
        finally:
            if counts:
                self._tokens_made(touched, counts)
        outputs = []
        for req in touched.values():
            if req.finished:
                outputs.append(self._finished_output(req))
            elif req.output_due(self.config.stream_interval):
                outputs.append(req.take_output())
        return outputs

    def _finished_output(self, req: Request) -> RequestOutput:
        del self.requests[req.request_id]
        for seq in req.seqs:
            self.structured.drop(seq)
        timer = self._request_ended(req)
        out = req.take_output()
        if timer is not None:  # vLLM's RequestOutput.metrics, with metrics on
            out.metrics = timer.state_stats()
        return out

    # -- metrics (on with enable_metrics) -------------------------------------------------------
    def enable_metrics(self, model_name: str) -> None:
        """Record vLLM's request and engine metrics from now on, for get_metrics()."""
        if self.metrics is None:
            self.metrics = EngineMetrics(MemorySinks(model_name), cache_config=self.config)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: every metric series now (engine.metric_sinks), the gauges read at this call."""
        if self.metrics is None:
            raise RuntimeError("metrics are not recorded: create the engine with LLM(..., disable_log_stats=False), "
                               "as vLLM's get_metrics() needs")
        self.metrics.record_stats(self.stats())
        return self.metrics.sinks.read()

    def _tokens_made(self, touched: dict[str, Request], counts: dict[str, int]) -> None:
        for request_id, n in counts.items():
            timer = self._timers.get(request_id)
            if timer is not None:
                req = touched[request_id]
                timer.scheduled(req.seqs[0].first_scheduled, req.seqs[0].num_cached_tokens)
                timer.tokens(n, longest=max(s.num_output_tokens for s in req.seqs))

    def _request_ended(self, req: Request, counted: bool = True, aborted: bool = False) -> RequestTimer | None:
        """Its timeline goes to the metrics (unless not `counted`), with why it ended: abort,
        error, or (n > 1, one request as the server counts it) the last sample's reason. -> its
        timer, None with metrics off."""
        timer = self._timers.pop(req.request_id, None)
        if timer is not None:
            reasons = [c.finish_reason for c in req.completions]
            timer.scheduled(req.seqs[0].first_scheduled, req.seqs[0].num_cached_tokens)
            timer.preempted(sum(s.num_preemptions for s in req.seqs))
            timer.finish(None if not counted else "abort" if aborted else "error" if "error" in reasons
                         else reasons[-1])
        return timer

    def _end_constrained(self, req: Request, seq: Sequence, verdict: str, done: bool) -> bool:
        """A complete grammar stops its sequence (no eos needed); one that failed ends it with an
        error, whatever else ended it, and only it: the engine goes on."""
        if verdict != STOP:
            p = seq.params
            bans = [name for name, on in (("allowed_token_ids", p.allowed_token_ids is not None),
                                          ("bad_words", bool(p.bad_words or p.bad_words_token_ids)),
                                          ("logit_bias", bool(p.logit_bias))) if on]
            if bans:  # a token the grammar allows but the request ruled out: no token was left to draw
                verdict += f" (the request's {' and '.join(bans)} may leave no token the grammar allows)"
            logger.warning("request %s: %s", req.request_id, verdict)
            done = req.finish(seq, "error", verdict)
        elif not done:
            done = req.finish(seq, "stop")
        return done

    def _add_fork(self, child: Sequence) -> None:
        """A parent that just finished its prefill became n sequences: its request streams each
        (a constrained parent's children get copies of its matcher, not yet advanced)."""
        req = self.requests[child.request_id]
        req.add_fork(child)
        self.structured.fork(req.seqs[0], child)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix block (stale after new weights). Only between
        requests: False, changing nothing, while a request holds blocks."""
        if not self.block_manager.reset_prefix_cache():
            logger.warning("the prefix cache was not reset: %d KV blocks are still in use",
                           self.block_manager.num_blocks - self.block_manager.num_free_blocks)
            return False
        return True

    def stats(self) -> EngineStats:
        """Counters and queue state, without prefix hashes (cheap enough for every step)."""
        return snapshot(self.scheduler)

    def routing_snapshot(self, prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> EngineStats:
        """`stats()` plus the summary of cached prefix-block hashes a global scheduler routes on."""
        return snapshot(self.scheduler, prefix_limit)
