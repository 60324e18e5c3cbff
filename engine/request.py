"""A request's state in the engine: its n sequences and their text streams."""
from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer, decoder
from engine.outputs import CompletionOutput, PromptLogprob, PromptLogprobs, RequestOutput
from engine.pooling import Pooled, pooled_vector
from engine.sampler import SampleResult
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sequence import Sequence


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, max_tokens: int, tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.stream = params.output_kind != RequestOutputKind.FINAL_ONLY
        self._stop_token_ids = frozenset(params.stop_token_ids)  # looked up after every sampled token
        self._decode = decoder(tokenizer)
        self.seqs: list[Sequence] = [Sequence(request_id, prompt_token_ids, params, max_tokens)]
        self.completions: list[CompletionOutput] = [self._completion(0)]
        self.detoks: list[IncrementalDetokenizer] = [self._detokenizer()]
        self.aborted = False
        self.num_outputs = 0  # snapshots taken so far
        # The first prompt token has no context; the rest arrive with the prefill chunks' steps.
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.pooled: list | None = None  # a pooling request's vector (a token_embed one's: one per token), once drawn
        self._rows_sum: list[float] | None = None  # a mean-pooling request's rows so far (float64 sums)
        self._rows: list[list[float]] = []  # a token_embed request's rows so far (ALL)

    def output_due(self, stream_interval: int) -> bool:
        """Whether this step should hand out a snapshot: always the first (time to first token), the
        last, and one where a sample finished; otherwise once some sample has `stream_interval`
        tokens not yet handed out. FINAL_ONLY: the first and the last only."""
        if not self.stream:
            return self.num_outputs == 0 or self.finished
        if self.params.n == 1:  # the same test, for the common case, without the lists (it runs per request per step)
            return (self.num_outputs == 0 or self.finished
                    or len(self.completions[0].delta_token_ids) >= stream_interval)
        pending = [len(c.delta_token_ids) for c in self.completions]
        return (self.num_outputs == 0 or self.finished or max(pending) >= stream_interval
                or any(n and c.finish_reason for n, c in zip(pending, self.completions)))

    def _completion(self, index: int) -> CompletionOutput:
        asked = self.params.logprobs is not None
        return CompletionOutput(index=index, logprobs=[] if asked else None, cumulative_logprob=0.0 if asked else None,
                                ranks=[] if asked else None)

    def _detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, self.params, self._decode)

    def add_fork(self, child: Sequence) -> None:
        self.seqs.append(child)
        self.completions.append(self._completion(child.index))
        self.detoks.append(self._detokenizer())

    def add_prompt_logprobs(self, seq: Sequence, scored: list[PromptLogprob]) -> None:
        """The logprobs of the prompt tokens after the ones seq already has, from this step's rows."""
        self.prompt_logprobs.extend(scored)
        seq.num_prompt_logprobs += len(scored)

    def append_token(self, seq: Sequence, result: SampleResult, eos_ids: set[int], max_model_len: int) -> bool:
        """Record a sampled token; returns True when this sequence is now finished."""
        seq.token_ids.append(result.token_id)
        comp, p = self.completions[seq.index], self.params
        comp.delta_token_ids.append(result.token_id)
        if comp.logprobs is not None:
            entry = dict(result.top_logprobs or [])
            entry[result.token_id] = result.logprob
            comp.logprobs.append(entry)
            comp.delta_logprobs = (comp.delta_logprobs or []) + [entry]
            comp.cumulative_logprob += result.logprob
            comp.ranks.append(result.rank)
        tok, n_out = result.token_id, seq.num_output_tokens
        eos = n_out >= p.min_tokens and not p.ignore_eos and tok in eos_ids
        stop_token = n_out >= p.min_tokens and tok in self._stop_token_ids
        # A token that ends the sequence stays in its token ids but not in its text, unless
        # include_stop_str_in_output (vLLM's rule: `<|im_end|>` with skip_special_tokens=False).
        shown = [] if (eos or stop_token) and not p.include_stop_str_in_output else [tok]
        stop_str = self.detoks[seq.index].update(shown)
        if stop_str is not None:
            comp.finish_reason, comp.stop_reason = "stop", stop_str
        elif eos:
            comp.finish_reason = "stop"
        elif stop_token:
            comp.finish_reason, comp.stop_reason = "stop", tok
        elif n_out >= seq.max_tokens or seq.num_tokens >= max_model_len:
            comp.finish_reason = "length"
        return comp.finish_reason is not None

    def add_pooled_rows(self, seq: Sequence, rows: list, num_rows: int) -> None:
        """A pooling request's prompt rows of this step (engine.pooling.prompt_rows: MEAN's sum,
        ALL's rows), after the ones seq already has."""
        if self.params.pooling.every_token:
            self._rows.extend(rows)
        else:
            self._rows_sum = rows if self._rows_sum is None else [a + b for a, b in zip(self._rows_sum, rows)]
        seq.num_prompt_logprobs += num_rows

    def finish_pooled(self, seq: Sequence, result: Pooled, project=None) -> bool:
        """A pooling request's last row (engine.pooling): it ends with its vector (`project`:
        pooled_vector's). A decoder's token_embed request adds its last row to the ones it took;
        an encoder gives every row at once."""
        data = result.data
        if self.params.pooling.every_token and data and not isinstance(data[0], list):
            data = self._rows + [data]
        self.pooled = pooled_vector(data, self.params.pooling, self._rows_sum, seq.num_prompt_logprobs, project)
        return self.finish(seq, "stop")

    def finish(self, seq: Sequence, reason: str, stop_reason: str | None = None) -> bool:
        """End `seq` for a reason the engine found (a complete or failed grammar): True."""
        comp = self.completions[seq.index]
        comp.finish_reason, comp.stop_reason = reason, stop_reason
        return True

    def abort(self) -> None:
        self.aborted = True
        for comp in self.completions:
            if comp.finish_reason is None:
                comp.finish_reason = "abort"

    @property
    def finished(self) -> bool:
        if self.params.n == 1:  # the common case without the generator (it runs twice per request per step)
            return self.aborted or self.completions[0].finish_reason is not None
        return self.aborted or (len(self.completions) == self.params.n
                                and all(c.finish_reason for c in self.completions))

    def take_output(self) -> RequestOutput:
        """Snapshot with deltas since the last snapshot, then reset the deltas."""
        self.num_outputs += 1
        outs = []
        for comp, detok, seq in zip(self.completions, self.detoks, self.seqs):
            comp.delta_text = detok.get_delta(finished=comp.finished())
            comp.text = detok.output_text
            comp.token_ids = seq.output_token_ids
            outs.append(comp.snapshot())
            comp.delta_token_ids, comp.delta_logprobs = [], None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.seqs[0].num_cached_tokens, self.prompt_logprobs, self.seqs[0].first_scheduled,
                             lora_request=self.params.lora_request, pooled=self.pooled,
                             num_preemptions=sum(s.num_preemptions for s in self.seqs))
