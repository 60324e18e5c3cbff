"""One step's inputs for the Triton runner, built on the host once per step and copied to the
device in two transfers (pinned memory, non_blocking on CUDA). The buffers are allocated once,
so a CUDA graph captured on their device side reads each step's values in place.

    int64 buffer:  [ input ids : n ][ positions : n ][ slots : n ][ logit rows : r ]
    int32 buffer:  [ seq lens : B ][ query start : B + 1 ][ block tables : B x W ]
                   (n = the step's tokens, r = its logit rows, B = max sequences,
                    W = max blocks a sequence holds)

The int64 rows are staged at fixed places on the host (up to T = max tokens a step holds each)
and packed into the pinned buffer by the upload, so a step copies 3n + r of them, not 5T (a
decode step of 256 sequences at a 16k-token budget: 8 KiB, not 640). The offsets depend on n
only, so a CUDA graph, captured at one n, finds its inputs where each replay puts them. The int32
copy stops after the block-table rows the step uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.prompt_logprobs import PromptSpan
from engine.scheduler import ScheduledBatch
from engine.sequence import new_token_ids
from engine.triton_attention import TritonAttentionMetadata


@dataclass
class StepLayout:
    """Where one step's rows are; the device tensors live in StepInputs' buffers."""
    num_tokens: int  # T rows the model runs (padding rows included)
    num_seqs: int  # B sequences the attention sees (padding sequences included)
    num_chunk_seqs: int  # the first sequences, which have more than one new token (0: a decode-only step)
    num_chunk_tokens: int  # their rows, the first ones
    # the first sample_rows logit rows are the sampling sequences' last rows (their first, where
    # they have drafts), then their drafts' rows (engine.model_runner.PreparedBatch.sample_rows)
    sample_rows: int
    sampled: list[int]  # indices into batch.seqs of those sequences, same order
    prompt_rows: int = 0  # then this many rows score prompt tokens
    prompt_spans: list[PromptSpan] = field(default_factory=list)


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, max_blocks_per_seq
        self.block_size = block_size
        pin = device.type == "cuda"
        t, b = max_tokens, max_seqs
        self.host64 = torch.zeros(5 * t, dtype=torch.int64, pin_memory=pin)  # packed by upload()
        self.host32 = torch.zeros(2 * b + 1 + b * self.width, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        # Recorded after each upload: the host buffers are not rewritten before the copy has read
        # them (a rank that does not sample never waits on the device otherwise).
        self.uploaded = torch.cuda.Event() if pin else None
        h64, h32 = np.zeros(5 * t, dtype=np.int64), self.host32.numpy()  # h64: the staging rows
        self.ids, self.positions, self.slots, self.rows = h64[:t], h64[t:2 * t], h64[2 * t:3 * t], h64[3 * t:]
        self.seq_lens, self.query_start = h32[:b], h32[b:2 * b + 1]
        self.tables = h32[2 * b + 1:].reshape(b, self.width)
        # Block tables kept as int32 rows between steps (see _table_row): 2 * max_seqs rows hold the
        # last step's and this step's; id(list) -> (the list, its row, entries written, the last one).
        self._store = np.zeros((2 * b, self.width), dtype=np.int32)
        self._free_rows = list(range(2 * b))
        self._last_tables: dict[int, tuple[list[int], int, int, int]] = {}
        self._step_tables: dict[int, tuple[list[int], int, int, int]] = {}

    def fill(self, batch: ScheduledBatch, pad_to: int | None = None) -> StepLayout:
        """Host side of the step, in batch.row_order. `pad_to`: a decode-only batch padded with
        empty sequences (slot -1, no context) to a CUDA graph's batch size."""
        self._wait_upload()
        bs, order = self.block_size, batch.row_order(self.block_size)
        num_rows = len(order) + sum(len(s.spec_token_ids) for s in batch.seqs)  # a draft is a decode row
        if num_rows > self.max_seqs or batch.num_tokens > self.max_tokens:
            raise ValueError(f"step of {num_rows} sequences / {batch.num_tokens} tokens exceeds the "
                             f"runner's {self.max_seqs} / {self.max_tokens}")
        if self._step_tables:  # a fill that raised: its rows go back, its tables are written whole again
            self._free_rows.extend(entry[1] for entry in self._step_tables.values())
            self._step_tables = {}
        seqs, num_new = batch.seqs, batch.num_new_tokens
        num_chunks = batch.num_prefill_chunks  # row_order puts them first
        t, last_row, prompt_rows, spans, table_rows, width, draft_rows = 0, {}, [], [], [], 0, {}
        self.query_start[0] = 0
        for r, i in enumerate(order[:num_chunks]):  # prefill chunks: arrays per sequence
            seq, n = seqs[i], num_new[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            pos = np.arange(start, end)
            self.ids[t:t + n] = seq.token_ids[start:end]
            self.positions[t:t + n] = pos
            self.slots[t:t + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            self.seq_lens[r] = end
            table_rows.append(self._table_row(table, False))
            width = max(width, len(table))
            scored = seq.prompt_logprob_positions(n)
            if scored:
                prompt_rows.extend(t + p - start for p in scored)
                spans.append(PromptSpan(i, scored.start, len(scored)))
            t += n
            self.query_start[r + 1] = t
            last_row[i] = t - 1
        # Single-token rows (decodes, or a prompt's last token): scalars into lists, written at once.
        ids, positions, slots = [], [], []
        for i in order[num_chunks:]:
            seq, n = seqs[i], num_new[i]
            start, table = seq.num_computed_tokens, seq.block_table
            row = self._table_row(table, True)
            last_row[i] = t + len(ids)
            if n == 1:
                ids.append(seq.token_ids[start:start + 1][0])  # a slice: a rank's Sequence holds only this step's
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                table_rows.append(row)
            else:  # a decode with drafts (engine.speculative): a row per token, the same table
                ids += new_token_ids(seq, n)
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                table_rows += [row] * n
                draft_rows[i] = range(last_row[i] + 1, t + len(ids))
            if len(table) > width:
                width = len(table)
            scored = seq.prompt_logprob_positions(1)
            if scored:
                prompt_rows.append(last_row[i])
                spans.append(PromptSpan(i, scored.start, 1))
        k, chunk_tokens = len(ids), t
        b = num_chunks + k
        if k:
            self.ids[t:t + k] = ids
            self.positions[t:t + k] = positions
            self.slots[t:t + k] = slots
            self.seq_lens[num_chunks:b] = self.positions[t:t + k] + 1
            self.query_start[num_chunks + 1:b + 1] = np.arange(t + 1, t + k + 1)
            t += k
        self.tables[:b, :width] = self._store[table_rows, :width]
        self._release_tables()
        if pad_to is not None and pad_to > b:
            self._pad(b, pad_to)
            t = b = pad_to
        sampled = batch.sampled(bs)
        rows = [last_row[i] for i in sampled] + [r for i in sampled for r in draft_rows.get(i, ())]
        num_sample_rows = len(rows)
        rows += prompt_rows
        self.rows[:len(rows)] = rows
        return StepLayout(t, b, num_chunks, chunk_tokens, num_sample_rows, sampled, len(prompt_rows), spans)

    def _table_row(self, table: list[int], decoding: bool) -> int:
        """The store row holding the sequence's block table, kept from the step before where a list
        would be converted whole every step. A decoding sequence's table (the same list as last
        step) only grows at its end, and the one entry changed in place, a copy-on-write, is its
        partial last block: from the entry last written on is rewritten when it grew or changed.
        Anything else (a new sequence, a prefill chunk, a table rebuilt after preemption) is
        written whole."""
        entry = self._last_tables.pop(id(table), None)
        n = len(table)
        if entry is None:
            row = self._free_rows.pop()
            self._store[row, :n] = table
        else:
            _, row, written, last = entry
            if not (decoding and 0 < written <= n):
                self._store[row, :n] = table
            elif written < n or table[written - 1] != last:
                self._store[row, written - 1:n] = table[written - 1:]
        self._step_tables[id(table)] = (table, row, n, table[-1] if n else -1)  # the list is held: its id stays its own
        return row

    def _release_tables(self) -> None:
        """Last step's tables that this step did not use give their rows back."""
        self._free_rows.extend(entry[1] for entry in self._last_tables.values())
        self._last_tables, self._step_tables = self._step_tables, {}

    def _wait_upload(self) -> None:
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def fill_profile(self, num_tokens: int, max_len: int) -> StepLayout:
        """The largest step there can be, to measure its memory: num_tokens prompt tokens in as few
        sequences of at most max_len tokens (positions the model has) as there can be, every block
        id 0, nothing written to the pool."""
        self._wait_upload()
        per_seq = min(num_tokens, self.width * self.block_size, max_len)
        n = min(-(-num_tokens // per_seq), self.max_seqs)
        num_tokens = min(num_tokens, n * per_seq)
        self.ids[:num_tokens] = 0
        self.positions[:num_tokens] = np.arange(num_tokens) % per_seq
        self.slots[:num_tokens] = -1
        self.tables[:n] = 0
        self.query_start[:n + 1] = np.minimum(np.arange(n + 1) * per_seq, num_tokens)
        self.seq_lens[:n] = np.diff(self.query_start[:n + 1])
        rows = min(num_tokens, self.max_seqs)
        self.rows[:rows] = np.arange(rows)
        return StepLayout(num_tokens, n, n, num_tokens, rows, list(range(rows)))

    def fill_padding(self, size: int) -> None:
        """`size` padding sequences only (what a CUDA graph is captured on)."""
        self._wait_upload()
        self.query_start[0] = 0
        self._pad(0, size)

    def _pad(self, b: int, size: int) -> None:
        self.ids[b:size] = 0
        self.positions[b:size] = 0
        self.slots[b:size] = -1
        self.seq_lens[b:size] = 0
        self.query_start[b + 1:size + 1] = np.arange(b + 1, size + 1)

    def upload(self, layout: StepLayout) -> None:
        """Host -> device, two copies, non_blocking from pinned memory on CUDA."""
        n, r = layout.num_tokens, layout.sample_rows + layout.prompt_rows
        packed = self.host64.numpy()  # the last upload has read it: fill() waited for it
        packed[:n], packed[n:2 * n], packed[2 * n:3 * n] = self.ids[:n], self.positions[:n], self.slots[:n]
        packed[3 * n:3 * n + r] = self.rows[:r]
        used64, used32 = 3 * n + r, 2 * self.max_seqs + 1 + layout.num_seqs * self.width
        self.dev64[:used64].copy_(self.host64[:used64], non_blocking=True)
        self.dev32[:used32].copy_(self.host32[:used32], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()

    # --- device views (fixed addresses: a CUDA graph reads them) ---

    def input_ids(self, n: int) -> torch.Tensor:
        return self.dev64[:n]

    def positions_dev(self, n: int) -> torch.Tensor:
        return self.dev64[n:2 * n]

    def logit_rows(self, layout: StepLayout, first: int, count: int) -> torch.Tensor:
        """Logit rows first .. first + count of the step `layout` describes."""
        start = 3 * layout.num_tokens + first
        return self.dev64[start:start + count]

    def attention(self, layout: StepLayout) -> TritonAttentionMetadata:
        b, w = self.max_seqs, self.width
        n, s = layout.num_tokens, layout.num_seqs
        return TritonAttentionMetadata(
            slot_mapping=self.dev64[2 * n:3 * n],
            block_tables=self.dev32[2 * b + 1:2 * b + 1 + s * w].view(s, w),
            seq_lens=self.dev32[:s],
            query_start=self.dev32[b:b + s + 1],
            num_chunk_seqs=layout.num_chunk_seqs, num_chunk_tokens=layout.num_chunk_tokens)
