"""Causal attention for a whole ragged batch, reading K/V from the paged pool through block tables.

One launch per layer covers every sequence of a step: prefill chunks (with or without a cached
prefix before them) and single-token decodes alike. Sequence i owns the query rows
query_start[i] .. query_start[i + 1] and a context of seq_lens[i] tokens, whose last q_len are
its new tokens (already written to the pool):

    context  0 ........................ seq_len - q_len ............ seq_len
             [ cached / earlier chunks  |  this step's q_len tokens ]
    query j (0-based within the sequence) sees keys 0 .. seq_len - q_len + j

Program (tile, kv_head) takes BLOCK_Q consecutive query tokens of one sequence and all G query
heads sharing that KV head, packed as BLOCK_M = BLOCK_Q * G rows (rounded up to a power of two,
so a few trailing rows may idle), and streams the context in TILE_N-key tiles with an online
softmax. Tiles are numbered per sequence from a host-free formula, so the grid depends only on
(num tokens, num seqs), which a CUDA graph keeps fixed:

    first tile of sequence i = query_start[i] // BLOCK_Q + i       (an upper bound on the tiles
    grid = num_tokens // BLOCK_Q + num_seqs                         before it; spare ones exit)

A program finds its sequence by binary search over that formula.

Split-KV decoding (flash-decoding): a decode-only step with few sequences gives too few programs
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
def _find_seq(query_start_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile is <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])  # one compiled kernel for every batch size
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr,  # (T, H, num_splits[, HEAD_DIM]) float32, num_splits > 1
        num_seqs, num_splits, scale_log2,
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
    seq = _find_seq(query_start_ptr, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    first_q = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence
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
        part = (q_rows * (tl.num_programs(1) * G) + head) * num_splits + split  # (BLOCK_M,)
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows with no keys (padding) come out 0
        tl.store(out_ptr + q_rows[:, None] * out_stride_t + head[:, None] * out_stride_h + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits, out_stride_t, out_stride_h,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (token, head): the splits' outputs rescaled to their common max and summed."""
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
    tl.store(out_ptr + t * out_stride_t + head * out_stride_h + dims, acc.to(out_ptr.dtype.element_ty), mask=dim_ok)


def tile_rows(num_heads: int, num_kv_heads: int, decode_only: bool) -> tuple[int, int]:
    """-> (BLOCK_Q query tokens, BLOCK_M rows) per program. Decodes have one token per sequence,
    so their tiles stay at the 16 rows a tensor-core dot needs; prefill tiles take more tokens."""
    g = num_heads // num_kv_heads
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(g))
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
                    seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, decode_only: bool,
                    out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q: (T, H, D) with head dim contiguous; caches: (num_blocks, block_size, KVH, D) contiguous,
    already holding this step's keys/values; block_tables: (B, W) int32; seq_lens: (B,) int32
    context lengths including the new tokens; query_start: (B + 1,) int32 row offsets into q;
    decode_only: every sequence has exactly one query (smaller tiles); num_splits: of each decode
    program's context (default: decode_splits; 1 where not decode_only). -> (T, H, D)."""
    t, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert h % kvh == 0, f"{h} query heads do not share {kvh} KV heads evenly"
    out = torch.empty_like(q) if out is None else out
    num_seqs = block_tables.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    block_q, block_m = tile_rows(h, kvh, decode_only)
    tile_n = 64 if d <= 64 else 32
    if not decode_only:
        num_splits = 1
    elif num_splits is None:
        num_splits = decode_splits(num_seqs, kvh, q.device)
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    part_acc, part_max, part_sum = split_scratch(q.device, t * h, d, num_splits)
    grid = (t // block_q + num_seqs, kvh, num_splits)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start, part_acc, part_max, part_sum,
        num_seqs, num_splits, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        G=h // kvh, HEAD_DIM=d, HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2, enable_fp_fusion=True)  # allclose, not bitwise, to torch
    if num_splits > 1:
        _merge_splits_kernel[(t, h)](out, part_acc, part_max, part_sum, num_splits, out.stride(0), out.stride(1),
                                     HEAD_DIM=d, HEAD_DIM_PAD=max(16, triton.next_power_of_2(d)),
                                     SPLITS_PAD=MAX_SPLITS, num_warps=2)
    return out
