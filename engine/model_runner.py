"""Turn a scheduled batch into flat tensors, run the model, return logits of rows to sample (and
of the rows that score prompt tokens for prompt logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, DecodeGroup, NativeDecodes, PrefillChunk
from engine.decode_step import NativeDecodeStep
from engine.device_copy import to_device
from engine.lora import adapters_of
from engine.model.llama import LlamaModel
from engine.prompt_logprobs import PromptRows, PromptSpan
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, new_token_ids


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # (T,) the batch's new tokens, flat in row order
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    # flat rows whose logits are sampled: each sampling sequence's last (its first, where it has
    # drafts), then the rows of the drafts, by sequence
    sample_rows: list[int]
    sampled: list[int]  # indices into batch.seqs of those sequences, same order (batch.sampled)
    prompt_rows: list[int] = field(default_factory=list)  # flat rows whose logits score prompt tokens
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # whose they are, same order


@dataclass
class RunnerOutput:
    """One step's logits, on the sampling rank (None elsewhere at tp > 1)."""
    logits: torch.Tensor | None  # (len(sampled) + drafts, vocab) float32: PreparedBatch.sample_rows'
    sampled: list[int]  # indices into batch.seqs of the sequences that sample, in row order
    prompt_rows: PromptRows | None = None  # whose logits score prompt tokens (sum of span rows), when spans
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    pooled: torch.Tensor | list | None = None  # a pooling model's (engine.pooling): (len(sampled), hidden or
    # num_labels), or a token classifier's list of (tokens, num_labels) ones; float32, no logits


def sampled_output(model: LlamaModel, hidden: torch.Tensor, sampled: list[int]) -> RunnerOutput:
    """The output for the sampled rows' final hidden states: their logits, or a pooling model's
    rows themselves."""
    if model.pooling:
        return RunnerOutput(None, sampled, pooled=model.pooled(hidden))
    return RunnerOutput(model.compute_logits(hidden), sampled)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_zeroed_blocks = 0  # blocks [0, n) have been zeroed (see _zero_new_blocks)
        k_cache = kv_caches[0][0]
        self.native_decode = cpu_kernels.supports_decode_attention(device, k_cache.dtype, k_cache.shape[-1])
        # On a GPU one padded group beats many exact ones: decode steps are launch-bound, and mixed
        # lengths split a large batch into a dozen or more groups, each its own attention launch.
        self.one_decode_group = device.type == "cuda"
        # Small decode-only steps in one native call (float32 CPU, tp 1); None elsewhere.
        self.native_step = NativeDecodeStep.build(model, kv_caches, block_size) if self.native_decode else None

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return to_device(data, torch.long, self.device)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        """Flat layout in batch.row_order: prefill chunks first, then decodes sorted by their number
        of context blocks, so each decode group is a contiguous slice of rows and of the gathered
        blocks."""
        bs = self.block_size
        order = batch.row_order(bs)
        ids, pos, slots, last_row, prompt_rows, spans, draft_rows = [], [], [], {}, [], [], {}
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            scored = seq.prompt_logprob_positions(n)
            if scored:
                prompt_rows.extend(len(ids) + p - start for p in scored)
                spans.append(PromptSpan(i, scored.start, len(scored)))
            ids.extend(new_token_ids(seq, n))
            pos.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            last_row[i] = len(ids) - 1 - len(seq.spec_token_ids)
            if seq.spec_token_ids:
                draft_rows[i] = range(last_row[i] + 1, len(ids))
        num_prefill = batch.num_prefill_chunks
        chunks, row = [], 0
        for i in order[:num_prefill]:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            end = seq.num_computed_tokens + n
            chunks.append(PrefillChunk(row, n, self._tensor(seq.block_table[:-(-end // bs)]), end))
            row += n
        # decode rows: (block table, context length), a sequence's drafts one row each after its own
        decodes = [(seq.block_table, seq.num_computed_tokens + j + 1) for i in order[num_prefill:]
                   for seq in (batch.seqs[i],) for j in range(batch.num_new_tokens[i])]
        if self.native_decode:
            native = self._native_decodes(decodes, row) if decodes else None
            meta = AttentionMetadata(self._tensor(slots), self._tensor([]), [], chunks, native)
        else:
            groups, block_ids = self._decode_groups(decodes, row)
            meta = AttentionMetadata(self._tensor(slots), self._tensor(block_ids), groups, chunks)
        sampled = batch.sampled(bs)
        sample_rows = [last_row[i] for i in sampled] + [r for i in sampled for r in draft_rows.get(i, ())]
        return PreparedBatch(self._tensor(ids), self._tensor(pos), meta, sample_rows, sampled, prompt_rows, spans)

    def _decode_groups(self, rows: list[tuple[list[int], int]],
                       first_row: int) -> tuple[list[DecodeGroup], list[int]]:
        """Consecutive decode rows (block table, context length) with the same number of context
        blocks form one group; with `one_decode_group`, all of them do, each padded to the longest
        with its own first block (live, so finite) under the mask."""
        bs, groups, block_ids, i = self.block_size, [], [], 0

        def blocks(row: tuple[list[int], int]) -> int:
            return -(-row[1] // bs)

        while i < len(rows):
            j = i + 1
            while j < len(rows) and (self.one_decode_group or blocks(rows[j]) == blocks(rows[i])):
                j += 1
            nb = max(blocks(r) for r in rows[i:j])  # a run of drafts may end a block further than the next row
            for r in rows[i:j]:
                own = r[0][:blocks(r)]
                block_ids.extend(own + [own[0]] * (nb - len(own)))
            ctx = [c for _, c in rows[i:j]]
            mask = None
            if any(c != nb * bs for c in ctx):
                mask = torch.arange(nb * bs, device=self.device)[None, :] < self._tensor(ctx)[:, None]
            groups.append(DecodeGroup(first_row + i, j - i, len(block_ids) - (j - i) * nb, nb, mask))
            i = j
        return groups, block_ids

    def _native_decodes(self, rows: list[tuple[list[int], int]], first_row: int) -> NativeDecodes:
        lens = [c for _, c in rows]
        width = -(-max(lens) // self.block_size)
        tables = [t[:width] + [0] * (width - len(t[:width])) for t, _ in rows]
        return NativeDecodes(first_row, self._tensor(tables), self._tensor(lens))

    def _zero_new_blocks(self, batch: ScheduledBatch) -> None:
        """Zero pool memory before a block's first use. The pools start as torch.empty (on CPU
        untouched pages cost nothing) and may hold NaN bit patterns; attention multiplies the
        masked tail of a last block by 0, which must stay 0. Any block in use has appeared in an
        earlier batch, so everything below the high-water mark is already live or stale-but-finite."""
        top = max((max(s.block_table) for s in batch.seqs if s.block_table), default=-1)
        top = max([top] + [d for _, d in batch.copies]) + 1
        if top > self.num_zeroed_blocks:
            for k, v in self.kv_caches:
                k[self.num_zeroed_blocks:top].zero_()
                v[self.num_zeroed_blocks:top].zero_()
            self.num_zeroed_blocks = top

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = self._tensor([s for s, _ in copies]), self._tensor([d for _, d in copies])
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """-> logits (N + D, vocab) float32 for the N sequences that finished their prefill or decode
        and their D drafts (PreparedBatch.sample_rows), the sequences' indices into batch.seqs, and
        the logits of the rows that score prompt tokens.
        Those come from this same pass, in a second lm_head call so that the sampled rows' logits
        are computed exactly as without them."""
        self._zero_new_blocks(batch)
        self._copy_blocks(batch.copies)
        p = self.prepare(batch)
        adapters, adapted = adapters_of(self.model, batch, self.block_size, self.device)
        with adapters:  # the native step knows no adapters
            if not adapted and self.native_step is not None and self.native_step.runs(p.attn, p.input_ids.shape[0]):
                hidden = self.native_step.forward(p.input_ids, p.positions, p.attn)
            else:
                hidden = self.model(p.input_ids, p.positions, self.kv_caches, p.attn)
        out = sampled_output(self.model, hidden.index_select(0, self._tensor(p.sample_rows)), p.sampled)
        if p.prompt_rows:
            out.prompt_rows = self._prompt_rows(hidden.index_select(0, self._tensor(p.prompt_rows)))
            out.prompt_spans = p.prompt_spans
        return out

    def _prompt_rows(self, hidden: torch.Tensor) -> PromptRows:
        return PromptRows(hidden, self.model.compute_logits, self.model.arch.vocab_size)
