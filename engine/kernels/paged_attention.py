"""Causal attention for a whole ragged batch, reading K/V from the paged pool through block tables.

Per layer, one launch covers a step's prefill chunks (with or without a cached prefix before
them) and one its single-token decodes, each launch every sequence of its kind; either kernel
handles any mix, but a decode's one query fills a fourth of a prefill tile. Sequence i owns the
query rows query_start[i] .. query_start[i + 1] and a context of seq_lens[i] tokens, whose last
q_len are its new tokens (already written to the pool):

    context  0 ........................ seq_len - q_len ............ seq_len
             [ cached / earlier chunks  |  this step's q_len tokens ]
    query j (0-based within the sequence) sees keys 0 .. seq_len - q_len + j

Program (tile, kv_head) of a launch takes BLOCK_Q consecutive query tokens of one sequence and
all G query heads sharing that KV head, packed as BLOCK_M = BLOCK_Q * G rows (rounded up to a
power of two, so a few trailing rows may idle), and streams the context in TILE_N-key tiles with an online
softmax. Tiles are numbered per sequence from a host-free formula, so the grid depends only on
the launch's (num tokens, num seqs), which a CUDA graph keeps fixed. Numbered from the launch's
first sequence s0 (its first row r0 = query_start[s0]):

    first tile of sequence i = (query_start[i] - r0) // BLOCK_Q + i - s0   (an upper bound on the
    grid = num_tokens // BLOCK_Q + num_seqs                                 tiles before it; spare
                                                                            ones exit)
A program finds its sequence by binary search over that formula. The launch's range of sequences
is a runtime argument, not a pointer offset: Triton specializes pointers on their alignment, and
an offset one would compile the kernel again mid-serving.

Split-KV decoding (flash-decoding): a decode launch with few sequences gives too few programs
to fill the GPU (batch 1 of SmolLM2: 3, one per KV head, each walking the whole context), so
each (tile, KV head) program is split over `num_splits` consecutive ranges of the context (grid
axis 2). Each writes its unnormalized output with its running max and sum to a scratch buffer,
and a second launch merges the splits. The ranges come from each sequence's length inside the
kernel, and the number of splits from the batch size only, so a CUDA graph captured at one batch
size replays at any context length; num_splits is a runtime argument, one compile for all.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_ptr, row0, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Of the launch's sequences (query_start_ptr at its first, whose first row is row0), the last
    whose first tile is <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_ptr + mid) - row0) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["seq0", "num_seqs", "num_splits"])  # one compiled kernel for every batch
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr,  # (launch's T, H, num_splits[, HEAD_DIM]) float32, num_splits > 1
        seq0, num_seqs, num_splits, scale_log2,  # the launch's sequences: seq0 .. seq0 + num_seqs - 1
        q_stride_t, q_stride_h, out_stride_t, out_stride_h,
        bt_stride, cache_stride_block, cache_stride_slot,
        G: tl.constexpr,  # query heads per KV head
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per KV block
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        IEEE: tl.constexpr):  # float32 inputs: exact fp32 dots, not TF32
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    query_start_ptr += seq0
    seq_lens_ptr += seq0
    block_tables_ptr += seq0 * bt_stride
    row0 = tl.load(query_start_ptr)
    seq = _find_seq(query_start_ptr, row0, tile, num_seqs, BLOCK_Q)  # within the launch
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    first_q = (tile - ((q_begin - row0) // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # keys before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    q_pos = first_q + rows // G  # (BLOCK_M,) query index within the sequence
    head = kv_head * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (q_pos < q_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_begin + q_pos).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM_PAD)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # The tile's last query sees keys up to prefix + its index; no key past seq_len exists.
    kv_end = tl.minimum(seq_len, prefix + first_q + BLOCK_Q)
    # This split's range: whole tiles, so that splitting only regroups the unsplit kernel's tiles.
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
    kv_begin = split * chunk
    kv_end = tl.minimum(kv_end, kv_begin + chunk)
    keys = tl.arange(0, TILE_N)
    kv_head_off = kv_head * HEAD_DIM
    for start in range(kv_begin, kv_end, TILE_N):
        pos = start + keys  # (TILE_N,) key positions
        pos_ok = pos < kv_end
        block = tl.load(block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_off = block * cache_stride_block + (pos % BLOCK_SIZE) * cache_stride_slot + kv_head_off
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # (TILE_N, D)
        v = tl.load(v_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2  # (BLOCK_M, TILE_N), in log2 units
        visible = (pos[None, :] <= prefix + q_pos[:, None]) & pos_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if num_splits > 1:  # a split with no keys leaves max -inf, sum 0, output 0
        part = ((q_rows - row0) * (tl.num_programs(1) * G) + head) * num_splits + split  # (BLOCK_M,)
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows with no keys (padding) come out 0
        tl.store(out_ptr + q_rows[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["row0", "num_splits"])
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, row0, num_splits, out_stride_t,
                         out_stride_h, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (token t of the launch, head): the splits' outputs rescaled to their common max and
    summed into output row row0 + t."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (t * tl.num_programs(1) + head) * num_splits + splits  # (SPLITS_PAD,)
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for splits with no keys
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                  other=0.0)  # (SPLITS_PAD, HEAD_DIM_PAD)
    total = tl.sum(l * weight, axis=0)
    acc = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # no keys at all: 0
    row = (row0 + t).to(tl.int64)
    tl.store(out_ptr + row * out_stride_t + head * out_stride_h + dims, acc.to(out_ptr.dtype.element_ty), mask=dim_ok)


def tile_rows(num_heads: int, num_kv_heads: int, decode: bool) -> tuple[int, int]:
    """-> (BLOCK_Q query tokens, BLOCK_M rows) per program. Decodes have one token per sequence,
    so their tiles stay at the 16 rows a tensor-core dot needs; prefill tiles take more tokens."""
    g = num_heads // num_kv_heads
    block_m = max(16 if decode else 64, triton.next_power_of_2(g))
    return block_m // g, block_m


MAX_SPLITS = 16
WAVES = 4  # programs per SM a decode launch aims for (not yet tuned on a GPU)


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits per decode program: enough programs for four per SM (a memory-bound loop
    wants several resident programs to hide its loads), from the batch size alone (a CUDA graph
    fixes it per batch size). 1 off CUDA."""
    if device.type != "cuda":
        return 1
    programs = WAVES * _num_sms(torch.cuda.current_device() if device.index is None else device.index)
    return max(1, min(MAX_SPLITS, programs // (num_seqs * num_kv_heads)))


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_NO_SPLITS: dict[torch.device, torch.Tensor] = {}  # device -> the scratch a launch of one split is given


def split_scratch(device: torch.device, rows: int, d: int,
                  num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (rows * splits * d accumulators, rows * splits maxima, rows * splits sums), float32, in one
    allocation (an eager step makes a launch per layer). With one split they are unused (one kept
    per device is given), but float32 all the same and each 16-byte aligned, as Triton
    specializes a pointer on that: one compile whatever the number of splits."""
    if num_splits == 1:
        if device not in _NO_SPLITS:
            _NO_SPLITS[device] = torch.empty(12, dtype=torch.float32, device=device)
        scratch = _NO_SPLITS[device]
        return scratch[0:1], scratch[4:5], scratch[8:9]
    parts = rows * num_splits
    padded = -(-parts // 4) * 4  # floats per view's slot: each view starts on 16 bytes
    scratch = torch.empty(padded * (d + 2), dtype=torch.float32, device=device)
    acc, maxima, sums = (scratch[i * padded:i * padded + n] for i, n in ((0, parts * d), (d, parts), (d + 1, parts)))
    return acc, maxima, sums


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, num_chunk_seqs: int,
                    num_chunk_tokens: int, out: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """q: (T, H, D) with head dim contiguous; caches: (num_blocks, block_size, KVH, D) contiguous,
    already holding this step's keys/values; block_tables: (B, W) int32; seq_lens: (B,) int32
    context lengths including the new tokens; query_start: (B + 1,) int32 row offsets into q.
    The first num_chunk_seqs sequences, query rows 0 .. num_chunk_tokens - 1, take prefill tiles
    (any number of query rows each); the rest have one query row each and take decode tiles, split
    over the context (num_splits, default: decode_splits for their number). -> (T, H, D)."""
    t, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert h % kvh == 0, f"{h} query heads do not share {kvh} KV heads evenly"
    out = torch.empty_like(q) if out is None else out
    num_seqs = block_tables.shape[0]
    num_decodes = num_seqs - num_chunk_seqs
    assert 0 <= num_chunk_seqs <= num_seqs and num_decodes == t - num_chunk_tokens, \
        f"{num_decodes} single-row sequences in {t - num_chunk_tokens} rows"
    if t == 0 or num_seqs == 0:
        return out
    if num_chunk_seqs:
        _launch(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, 0, num_chunk_seqs, 0,
                num_chunk_tokens, False, 1)
    if num_decodes:
        if num_splits is None:
            num_splits = decode_splits(num_decodes, kvh, q.device)
        _launch(out, q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, num_chunk_seqs, num_decodes,
                num_chunk_tokens, num_decodes, True, num_splits)
    return out


def _launch(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, seq0: int,
            num_seqs: int, row0: int, num_rows: int, decode: bool, num_splits: int) -> None:
    """Attention of sequences seq0 .. seq0 + num_seqs - 1, whose query rows are row0 .. row0 + num_rows - 1."""
    _, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    block_q, block_m = tile_rows(h, kvh, decode)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    part_acc, part_max, part_sum = split_scratch(q.device, num_rows * h, d, num_splits)
    d_pad = max(16, triton.next_power_of_2(d))
    grid = (num_rows // block_q + num_seqs, kvh, num_splits)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start, part_acc, part_max, part_sum,
        seq0, num_seqs, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        G=h // kvh, HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=64 if d <= 64 else 32, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2, enable_fp_fusion=True)  # allclose, not bitwise, to torch
    if num_splits > 1:
        _merge_splits_kernel[(num_rows, h)](out, part_acc, part_max, part_sum, row0, num_splits, out.stride(0),
                                            out.stride(1), HEAD_DIM=d, HEAD_DIM_PAD=d_pad, SPLITS_PAD=MAX_SPLITS,
                                            num_warps=2, enable_fp_fusion=True)  # as the tiles' (Triton's default may change)
