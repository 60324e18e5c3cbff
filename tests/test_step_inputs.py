"""The CUDA runner's host-side pieces, without a GPU: the graph batch-size buckets and the step
inputs' flat layout (padding rows for a graph, the profile step)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.config import EngineConfig  # noqa: E402
from engine.cuda_graphs import capture_sizes, graph_batch_sizes  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ScheduledBatch  # noqa: E402
from engine.sequence import Sequence  # noqa: E402
from engine.step_inputs import StepInputs  # noqa: E402


def test_graph_buckets():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert graph_batch_sizes(100)[-3:] == [80, 96, 100]  # the last bucket is max_num_seqs itself


def test_capture_sizes_follow_vllms_flags():
    assert capture_sizes(None, None, 8, 8) == [1, 2, 4, 8]  # the buckets up to max_num_seqs
    assert capture_sizes(None, None, 8, 24) == [1, 2, 4, 8, 16, 24]  # with drafts: every decode step's rows
    assert capture_sizes(None, None, 256, 1024)[-2:] == [496, 512]  # ... up to 512 by default, as vLLM's
    assert capture_sizes(None, 24, 8, 24) == [1, 2, 4, 8, 16, 24]  # past it: a step with drafts has more rows
    assert capture_sizes(None, 24, 8, 20) == [1, 2, 4, 8, 16]  # never more rows than a step holds
    assert capture_sizes((12, 3, 3, 1, 40), None, 8, 24) == [1, 3, 12]  # as given, those a step can hold
    assert capture_sizes((), None, 8, 8) == []  # an empty list: none captured, every step eager
    config = EngineConfig(cudagraph_capture_sizes=[8, 1, 4, 4], max_cudagraph_capture_size=8)
    assert config.cudagraph_capture_sizes == (1, 4, 8)
    with pytest.raises(ValueError, match=r"max_cudagraph_capture_size \(16\) must be the largest of "
                                         r"cudagraph_capture_sizes \(8\)"):
        EngineConfig(cudagraph_capture_sizes=[1, 8], max_cudagraph_capture_size=16)
    for bad in ([0, 2], [1.5], "8"):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a list of integers >= 1"):
            EngineConfig(cudagraph_capture_sizes=bad)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be >= 1"):
        EngineConfig(max_cudagraph_capture_size=0)


def _seq(n_tokens: int, computed: int, table: list[int]) -> Sequence:
    s = Sequence("r", list(range(100, 100 + n_tokens)), SamplingParams(max_tokens=4), 4)
    s.num_computed_tokens = computed
    s.block_table = table
    return s


def test_fill_lays_out_prefill_then_decodes_and_pads_for_a_graph():
    inputs = StepInputs(max_tokens=32, max_seqs=8, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"))
    decode = _seq(10, 9, [7, 3, 5])  # position 9: block 5, offset 1 -> slot 21
    chunk = _seq(9, 2, [1, 2, 6])  # positions 2..8 of 9: a chunk after 2 computed tokens
    batch = ScheduledBatch([decode, chunk], [1, 7])
    layout = inputs.fill(batch)
    assert (layout.num_tokens, layout.num_seqs, layout.num_chunk_seqs, layout.num_chunk_tokens) == (8, 2, 1, 7)
    assert inputs.ids[:8].tolist() == list(range(102, 109)) + [109]  # the chunk's rows come first
    assert inputs.positions[:8].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert inputs.slots[:8].tolist() == [6, 7, 8, 9, 10, 11, 24, 21]  # blocks 1, 2, 6; then 5
    assert inputs.query_start[:3].tolist() == [0, 7, 8] and inputs.seq_lens[:2].tolist() == [9, 10]
    assert inputs.tables[0, :3].tolist() == [1, 2, 6] and inputs.tables[1, :3].tolist() == [7, 3, 5]
    assert layout.sampled == [1, 0] and inputs.rows[:2].tolist() == [6, 7]  # both reach their end
    inputs.dev64.fill_(-7)
    inputs.upload(layout)  # packed: 3 x 8 token rows, then the 2 logit rows; nothing past them
    assert inputs.input_ids(8).tolist() == inputs.ids[:8].tolist()
    assert inputs.positions_dev(8).tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert inputs.attention(layout).slot_mapping.tolist() == [6, 7, 8, 9, 10, 11, 24, 21]
    assert inputs.logit_rows(layout, 0, 2).tolist() == [6, 7] and inputs.logit_rows(layout, 1, 1).tolist() == [7]
    assert set(inputs.dev64[26:].tolist()) == {-7}

    padded = inputs.fill(ScheduledBatch([decode], [1]), pad_to=4)
    assert (padded.num_tokens, padded.num_seqs, padded.num_chunk_seqs, padded.sample_rows) == (4, 4, 0, 1)
    assert inputs.slots[:4].tolist() == [21, -1, -1, -1]  # padding rows write nothing
    assert inputs.seq_lens[:4].tolist() == [10, 0, 0, 0] and inputs.query_start[:5].tolist() == [0, 1, 2, 3, 4]
    inputs.upload(padded)
    meta = inputs.attention(padded)
    assert meta.block_tables.shape == (4, 4) and meta.slot_mapping.tolist() == [21, -1, -1, -1]
    assert (meta.num_chunk_seqs, meta.num_chunk_tokens) == (0, 0)


def test_profile_step_fills_the_token_budget_in_sequences_the_tables_can_hold():
    inputs = StepInputs(max_tokens=40, max_seqs=8, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"))
    layout = inputs.fill_profile(40, max_len=16)  # sequences of at most 16 tokens: 16 + 16 + 8
    assert (layout.num_tokens, layout.num_seqs) == (40, 3)
    assert inputs.query_start[:4].tolist() == [0, 16, 32, 40] and inputs.seq_lens[:3].tolist() == [16, 16, 8]
    assert set(inputs.slots[:40].tolist()) == {-1}
    # a max_model_len short of the tables' last block: no position past it (RoPE has none there)
    layout = inputs.fill_profile(40, max_len=14)
    assert (layout.num_tokens, layout.num_seqs) == (40, 3) and inputs.seq_lens[:3].tolist() == [14, 14, 12]
    assert inputs.positions[:40].max() == 13


def test_block_tables_stay_right_as_they_grow_change_and_move_between_rows():
    """The int32 rows of block tables kept between steps (StepInputs._table_row) against the
    lists themselves, over decode steps where tables grow, a partial block is replaced in place
    (copy-on-write), a sequence's table is rebuilt (preemption: a new list, or the same list
    refilled and recomputed as a chunk), sequences finish and join, and the rows they land in
    shuffle."""
    import random

    rng = random.Random(0)
    inputs = StepInputs(max_tokens=512, max_seqs=8, max_blocks_per_seq=16, block_size=4, device=torch.device("cpu"))
    next_block = iter(range(10_000))
    seqs = []
    for step in range(300):
        while len(seqs) < 6:  # new sequences join with a few blocks
            n = rng.randrange(1, 30)
            seqs.append(_seq(n + 1, n, [next(next_block) for _ in range(-(-(n + 1) // 4))]))
        new_tokens = {}
        for s in seqs:
            s.token_ids.append(7)  # one more token to decode
            s.num_computed_tokens = s.num_tokens - 1
            new_tokens[id(s)] = 1
            if len(s.block_table) * 4 < s.num_tokens:  # a new block at a block boundary
                s.block_table.append(next(next_block))
            if rng.random() < 0.05:  # copy-on-write of the partial last block
                s.block_table[-1] = next(next_block)
            if rng.random() < 0.02:  # preempted and recomputed: a new list
                s.block_table = [next(next_block) for _ in s.block_table]
            elif rng.random() < 0.02 and s.num_tokens > 8:  # the same list, refilled for a recompute
                s.num_computed_tokens = 4  # its first block came from the prefix cache
                new_tokens[id(s)] = s.num_tokens - 4
                s.block_table[:] = [s.block_table[0]] + [next(next_block) for _ in s.block_table[1:]]
        seqs = [s for s in seqs if s.num_tokens < 60 and rng.random() > 0.05]  # some finish
        rng.shuffle(seqs)  # rows move between steps
        batch = ScheduledBatch(seqs, [new_tokens[id(s)] for s in seqs])
        layout = inputs.fill(batch)
        order = batch.row_order(4)
        for r, i in enumerate(order):
            s, table = seqs[i], seqs[i].block_table
            assert inputs.tables[r, :len(table)].tolist() == table, (step, r)
            first, end = inputs.query_start[r], inputs.query_start[r + 1]
            positions = list(range(s.num_computed_tokens, s.num_tokens))
            assert inputs.positions[first:end].tolist() == positions
            assert inputs.ids[first:end].tolist() == s.token_ids[s.num_computed_tokens:]
            assert inputs.slots[first:end].tolist() == [table[p // 4] * 4 + p % 4 for p in positions]
            assert inputs.seq_lens[r] == s.num_tokens
        assert layout.num_seqs == len(seqs) and inputs.query_start[len(seqs)] == layout.num_tokens


def test_a_fill_that_raises_gives_its_table_rows_back():
    """The tables a failed fill stored go back to the store; else each failure would keep a row
    and the store (2 x max_seqs rows) would run out."""
    inputs = StepInputs(max_tokens=64, max_seqs=2, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"))
    good = _seq(6, 5, [3, 4])
    for _ in range(10):  # each time the second sequence's table lacks the block its token goes to
        with pytest.raises(IndexError):
            inputs.fill(ScheduledBatch([good, _seq(9, 8, [1, 2])], [1, 1]))
    inputs.fill(ScheduledBatch([good, _seq(9, 8, [1, 2, 9])], [1, 1]))
    assert inputs.tables[0, :2].tolist() == [3, 4] and inputs.tables[1, :3].tolist() == [1, 2, 9]
