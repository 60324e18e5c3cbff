"""What one engine replica tells the global scheduler about its KV state.

A replica publishes a `ReplicaStats` every few hundred milliseconds (in Serve through
`record_routing_stats`, in the simulator from its report events). The router compares the
request's prefix-block hashes (`engine.hashing.hash_prefix_blocks`, the block manager's own
function) with `prefix_hashes`, a bounded summary of the blocks the replica still holds in its
prefix cache:

    hash_to_block (every cached full block)      summary, at most `limit` hashes
    in use (ref_count > 0)   ------------------>  all of them first: they cannot be evicted
    free but cached, LRU ... MRU  ------------>   then the most recently freed: evicted last

Everything here reads the scheduler and block manager without changing them. In a live engine
the model step runs on another thread, so the containers are first copied with single C-level
calls (`list(...)`, `dict(...)`), which the GIL makes atomic, and only then walked in Python.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler

DEFAULT_PREFIX_LIMIT = 4096  # hashes per report: 64k tokens of prefix at block_size 16, ~40 KB pickled


@dataclass(frozen=True)
class ReplicaStats:
    replica_id: str
    num_free_blocks: int  # in the free queue (free-but-cached blocks count: reuse evicts them)
    num_total_blocks: int
    block_size: int
    num_reserved_blocks: int  # blocks admitted + queued requests still need to reach max_tokens
    num_running: int
    num_waiting: int
    max_num_seqs: int
    waiting_prefill_tokens: int  # prompt tokens queued at the replica, not yet computed
    num_preemptions: int  # cumulative
    prefix_query_tokens: int  # cumulative, the engine's own prefix-cache counters
    prefix_hit_tokens: int
    prefix_hashes: frozenset[int]  # bounded summary of cached prefix-block hashes (see module doc)
    timestamp: float  # when the replica took this snapshot (its clock; seconds)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def headroom_blocks(self) -> int:
        """Free blocks not yet promised to requests the replica already has."""
        return self.num_free_blocks - self.num_reserved_blocks

    def to_dict(self) -> dict:
        """Plain types for Serve's routing-stats channel (frozenset -> list)."""
        d = dataclasses.asdict(self)
        d["prefix_hashes"] = list(self.prefix_hashes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ReplicaStats":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "prefix_hashes": frozenset(d["prefix_hashes"])})


def summarize_prefix_hashes(block_manager: BlockManager, limit: int = DEFAULT_PREFIX_LIMIT) -> frozenset[int]:
    """At most `limit` cached prefix-block hashes: all of them when they fit, else the blocks in
    use first and then free cached blocks from the most recently freed (the last to be evicted)."""
    cached = dict(block_manager.hash_to_block)  # hash -> block id, atomic snapshot
    if len(cached) <= limit:
        return frozenset(cached)
    blocks = block_manager.blocks
    hot = [h for h, b in cached.items() if blocks[b].ref_count > 0]
    if len(hot) >= limit:
        return frozenset(hot[:limit])
    out = set(hot)
    for block_id in reversed(list(block_manager.free_ids)):  # MRU first
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
    for seq in list(scheduler.running):
        total += max(0, bm.blocks_for(seq.num_prompt_tokens + seq.max_tokens) - len(seq.block_table))
    for seq in list(scheduler.waiting):
        total += bm.blocks_for(seq.num_prompt_tokens + seq.max_tokens)
    return total


def build_replica_stats(replica_id: str, scheduler: Scheduler, now: float,
                        prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> ReplicaStats:
    """A snapshot of one replica from its scheduler (used by the engine replica and the simulator)."""
    bm = scheduler.block_manager
    waiting = list(scheduler.waiting)
    return ReplicaStats(
        replica_id=replica_id, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
        block_size=bm.block_size, num_reserved_blocks=reserved_blocks(scheduler),
        num_running=len(scheduler.running), num_waiting=len(waiting), max_num_seqs=scheduler.config.max_num_seqs,
        waiting_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in waiting),
        num_preemptions=scheduler.stats.num_preemptions, prefix_query_tokens=scheduler.stats.prefix_query_tokens,
        prefix_hit_tokens=scheduler.stats.prefix_hit_tokens,
        prefix_hashes=summarize_prefix_hashes(bm, prefix_limit), timestamp=now)


def replica_stats_from_engine(engine, replica_id: str, now: float,
                              prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> ReplicaStats:
    """From an `engine.llm_engine.LLMEngine` (or anything with a `.scheduler`)."""
    return build_replica_stats(replica_id, engine.scheduler, now, prefix_limit)
