"""Turn a scheduled batch into flat tensors, run the model, return logits of rows to sample."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from engine.model.llama import LlamaModel
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.num_zeroed_blocks = 0  # blocks [0, n) have been zeroed (see _zero_new_blocks)

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """-> input_ids (T,), positions (T,), attention metadata, flat rows whose logits are sampled."""
        bs = self.block_size
        ids, pos, slots, sample_rows = [], [], [], []
        decodes: dict[int, list[tuple[int, Sequence, int]]] = {}  # num blocks -> (row, seq, ctx)
        prefills = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.extend(self._slot(seq, p) for p in range(start, end))
            if n == 1:
                decodes.setdefault(-(-end // bs), []).append((row, seq, end))
            else:
                key_slots = self._tensor([self._slot(seq, p) for p in range(end)])
                prefills.append(PrefillChunk(row, n, key_slots, end))
            if end == seq.num_tokens:
                sample_rows.append(row + n - 1)
        groups = [self._decode_group(nb, members) for nb, members in decodes.items()]
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), decode_groups=groups, prefills=prefills)
        return self._tensor(ids), self._tensor(pos), meta, sample_rows

    def _decode_group(self, nb: int, members: list[tuple[int, Sequence, int]]) -> DecodeGroup:
        tables = torch.tensor([seq.block_table[:nb] for _, seq, _ in members], dtype=torch.long, device=self.device)
        ctx = [c for _, _, c in members]
        mask = None
        if any(c != nb * self.block_size for c in ctx):
            mask = torch.arange(nb * self.block_size, device=self.device)[None, :] < self._tensor(ctx)[:, None]
        return DecodeGroup(self._tensor([row for row, _, _ in members]), tables, mask)

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
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """-> logits (N, vocab) float32 for the N sequences that finished their prefill or decode,
        and their indices into batch.seqs."""
        self._zero_new_blocks(batch)
        self._copy_blocks(batch.copies)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)])
        ends = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(batch.seqs, batch.num_new_tokens)]
        return logits, [i for i, e in enumerate(ends) if e]
