"""Snapshots of a scheduler's KV and queue state: the engine's stats and what it tells a router.

The global scheduler compares a request's prefix-block hashes (`engine.hashing.hash_prefix_blocks`,
the block manager's own function) with `prefix_hashes`, a bounded summary of the blocks still
held in the prefix cache:

    hash_to_block (every cached full block)      summary, at most `limit` hashes
    in use (ref_count > 0)   ------------------>  all of them first: they cannot be evicted
    free but cached, LRU ... MRU  ------------>   then the most recently freed: evicted last

Everything here reads the scheduler and block manager without changing them, and must run
between steps (the engine's step thread, or with the step thread idle) so that every field
comes from the same moment.
"""
from __future__ import annotations

import time

from engine.block_manager import BlockManager, kv_tokens
from engine.outputs import EngineStats
from engine.scheduler import Scheduler

DEFAULT_PREFIX_LIMIT = 4096  # hashes per report: 64k tokens of prefix at block_size 16, ~40 KB pickled


def summarize_prefix_hashes(block_manager: BlockManager, limit: int = DEFAULT_PREFIX_LIMIT) -> frozenset[int]:
    """At most `limit` cached prefix-block hashes: all of them when they fit, else the blocks in
    use first and then free cached blocks from the most recently freed (the last to be evicted)."""
    cached = block_manager.hash_to_block  # hash -> block id
    if len(cached) <= limit:
        return frozenset(cached)
    blocks = block_manager.blocks
    hot = [h for h, b in cached.items() if blocks[b].ref_count > 0]
    if len(hot) >= limit:
        return frozenset(hot[:limit])
    out = set(hot)
    for block_id in reversed(block_manager.free_ids):  # MRU first
        h = blocks[block_id].hash
        if h is not None and cached.get(h) == block_id:
            out.add(h)
            if len(out) >= limit:
                break
    return frozenset(out)


def reserved_blocks(scheduler: Scheduler) -> int:
    """Worst-case blocks still to allocate: running sequences growing to prompt + max_tokens, and
    queued ones in full (their prefix hits are not known until admission)."""
    bm = scheduler.block_manager
    total = 0
    for seq in scheduler.running:
        total += max(0, bm.blocks_for(kv_tokens(seq.num_prompt_tokens, seq.max_tokens)) - len(seq.block_table))
    for seq in scheduler.waiting:
        total += bm.blocks_for(kv_tokens(seq.num_prompt_tokens, seq.max_tokens))
    return total


def running_prefill_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens admitted sequences have still to prefill (a decoding one has 1 token to go)."""
    return sum(left for s in scheduler.running if (left := s.num_tokens - s.num_computed_tokens) > 1)


def snapshot(scheduler: Scheduler, prefix_limit: int = 0, now: float | None = None) -> EngineStats:
    """The scheduler's state now; with `prefix_limit` > 0 also up to that many prefix hashes."""
    bm = scheduler.block_manager
    st = scheduler.stats
    return EngineStats(
        num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, block_size=bm.block_size,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_preemptions=st.num_preemptions, prefix_query_tokens=st.prefix_query_tokens,
        prefix_hit_tokens=st.prefix_hit_tokens,
        waiting_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in scheduler.waiting),
        num_reserved_blocks=reserved_blocks(scheduler), max_num_seqs=scheduler.config.max_num_seqs,
        running_prefill_tokens=running_prefill_tokens(scheduler),
        prefill_steps=st.prefill_steps, prefill_step_seconds=st.prefill_step_seconds,
        decode_steps=st.decode_steps, decode_step_seconds=st.decode_step_seconds,
        prompt_tokens=st.prompt_tokens, generation_tokens=st.generation_tokens,
        spec_drafts=st.spec_drafts, spec_draft_tokens=st.spec_draft_tokens, spec_accepted_tokens=st.spec_accepted_tokens,
        spec_accepted_per_pos=tuple(st.spec_accepted_per_pos),
        iteration_tokens=tuple((steps, tokens) for steps, tokens in st.iteration_tokens),
        num_waiting_deferred=deferred_waiting(scheduler),
        prefix_hashes=summarize_prefix_hashes(bm, prefix_limit) if prefix_limit > 0 else frozenset(),
        running_lora_adapters=_adapter_names(scheduler.running), waiting_lora_adapters=_adapter_names(scheduler.waiting),
        max_lora=scheduler.config.max_loras or 0, timestamp=time.time() if now is None else now)


def deferred_waiting(scheduler: Scheduler) -> int:
    """Waiting sequences whose LoRA adapter cannot run now: max_loras other adapters are running
    (the scheduler passes over them, engine.scheduler)."""
    max_loras = scheduler.config.max_loras
    if not max_loras:
        return 0
    running = {s.lora_int_id for s in scheduler.running} - {None}
    if len(running) < max_loras:
        return 0
    return sum(1 for s in scheduler.waiting if s.lora_int_id is not None and s.lora_int_id not in running)


def _adapter_names(seqs) -> tuple[str, ...]:
    """The LoRA adapters `seqs` run with, by name, sorted."""
    return tuple(sorted({s.params.lora_request.lora_name for s in seqs if s.params.lora_request is not None}))
