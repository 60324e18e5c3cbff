"""Sampling on the sampling rank: a record per sequence, kept from the step messages' sampling
deltas, and each step's draws made by the engine's own SequenceSampler on the gathered logits.

    engine (StepEncoder)                       sampling rank (RankSampler)
    a sequence runs for the first time  ---->  record: index, params, prompt, outputs = []
    each step                                  draws from the logits; each record appends its token
                                               (with drafts: the drafts it keeps, and the draw after)
                                        <----  Draws: token ids (+ logprobs where asked)
                                               a parent's first draw forks n - 1 child records,
                                               named (parent id, index), and draws for them too
    the engine forked the same children ---->  renamed to the children's seq ids
    a sequence finished or was aborted  ---->  its record (and seeded generator) dropped
    a step raised before an append      ---->  that record cut back to the engine's tokens

Records mirror, at tp > 1, what the engine's Sequences are to the sampler at tp=1, so the draws
(seeds, penalties, min_tokens, forks) are the same.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.outputs import PromptLogprob
from engine.pooling import pool
from engine.prompt_logprobs import PromptSpan, prompt_logprobs
from engine.sampler import SequenceSampler
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import GrammarMask
from workers.messages import Draws, SamplingDelta


class SampleRecord:
    """What SequenceSampler reads of a sequence (as engine.Sequence offers it)."""

    __slots__ = ("index", "params", "prompt_token_ids", "output_token_ids", "forks", "spec_token_ids", "__weakref__")

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int],
                 output_token_ids: list[int], forks: int = 0) -> None:
        self.index = index
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids
        self.forks = forks  # children still to fork at the next draw
        self.spec_token_ids: list[int] = []  # this step's drafts (engine.speculative), while it draws


class RankSampler:
    def __init__(self, seed: int, eos_token_ids: list[int], logprobs_mode: str = "raw_logprobs") -> None:
        self.sampler = SequenceSampler(seed, eos_token_ids, logprobs_mode)
        self.records: dict[int | tuple[int, int], SampleRecord] = {}

    def apply(self, delta: SamplingDelta) -> None:
        for parent, index, child in delta.forked:
            self.records[child] = self.records.pop((parent, index))
        for seq_id in delta.finished:
            self.records.pop(seq_id, None)
        for seq_id, kept in delta.rewound:
            if (record := self.records.get(seq_id)) is not None:
                del record.output_token_ids[kept:]
        for s in delta.new:
            self.records[s.seq_id] = SampleRecord(s.index, s.params, s.prompt_token_ids, [], s.forks)

    def draw(self, logits: torch.Tensor, sampled: list[int], seq_ids: list[int],
             grammar_mask: GrammarMask | None = None, drafts: list[list[int]] | None = None,
             pooled: bool = False) -> Draws:
        """logits: (R, vocab), row i for sequence seq_ids[i] (the batch's `sampled` sequences),
        then the rows of their drafts (engine.model_runner.PreparedBatch.sample_rows), drafts[i]
        being seq_ids[i]'s; `grammar_mask` rows name the same rows. `pooled`: the rows are a
        pooling model's final hidden states, and each sequence draws its vector (engine.pooling)."""
        rows, seqs = [], []
        for row, seq_id in enumerate(seq_ids):
            parent = self.records[seq_id]
            parent.spec_token_ids = drafts[row] if drafts else []
            rows.append(row)
            seqs.append(parent)
            for index in range(1, parent.forks + 1):  # as Scheduler.update_from_output forks
                child = SampleRecord(index, parent.params, parent.prompt_token_ids, list(parent.output_token_ids))
                self.records[(seq_id, index)] = child
                rows.append(row)
                seqs.append(child)
            parent.forks = 0
        if pooled:
            return Draws(sampled, rows, pool(logits, rows), {})
        results = self.sampler.sample(logits, rows, seqs, grammar_mask)
        token_ids, logprobs = [], {}
        for i, (seq, result) in enumerate(zip(seqs, results)):
            if isinstance(result, list):  # with drafts: the draws the output keeps (SequenceSampler.sample)
                seq.spec_token_ids = []
                token_ids.append([r.token_id for r in result])
                seq.output_token_ids.extend(token_ids[-1])
                if result[0].logprob is not None:
                    logprobs[i] = [(r.logprob, r.top_logprobs, r.rank) for r in result]
                continue
            token_ids.append(result.token_id)
            seq.output_token_ids.append(result.token_id)
            if result.logprob is not None:
                logprobs[i] = (result.logprob, result.top_logprobs, result.rank)
        return Draws(sampled, rows, token_ids, logprobs)

    def prompt_logprobs(self, chunks: Iterable[torch.Tensor], spans: list[PromptSpan],
                        seq_ids: list[int]) -> dict[int, list[PromptLogprob]]:
        """chunks: (n, vocab) logits of the spans' rows, in order (PromptRows.logits); spans[i] of
        sequence seq_ids[i], whose record holds its prompt. -> span index -> its prompt logprobs."""
        return prompt_logprobs(chunks, spans, [self.records[s] for s in seq_ids])
