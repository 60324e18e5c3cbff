"""Paged KV block manager: ref counts, a free queue, prefix caching and copy-on-write.

    token position p of a sequence lives in  block_table[p // block_size], slot p % block_size

    seq A  [blk 7: full, hash h1][blk 2: full, hash h2][blk 9: partial]
    seq B  [blk 7               ][blk 2               ][blk 4: partial]   <- shared prefix, ref 2

Free blocks sit in an LRU queue. A freed full block keeps its hash (and stays findable in
`hash_to_block`) until the queue hands it out again: lazy eviction. Pure Python, no torch.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.hashing import hash_block
from engine.sequence import Sequence


def kv_tokens(num_prompt_tokens: int, max_tokens: int) -> int:
    """The most tokens a request's sequence holds KV for: all but its last, which is sampled and
    never fed back."""
    return num_prompt_tokens + max_tokens - 1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None  # with token_ids, guards against hash collisions
        self.token_ids: tuple[int, ...] | None = None  # kept to guard against hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, drained by the runner
        self.num_registered: dict[int, int] = {}  # seq_id -> leading blocks already hashed and cached
        # Blocks hashed since the scheduler last took the list (ScheduledBatch.registered): a block
        # is findable once allocated, before its step writes its KV, so a step that fails forgets them.
        self.registered: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- block-level primitives -------------------------------------------------------------
    def _pop_free(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached content now that it is reused
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, None
        block.ref_count = 1
        return block_id

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None  # most recently used end

    # -- prefix cache -----------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.root_hash
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of `seq` within its `max_cached_tokens` (the
        last token is always left to compute)."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], seq.root_hash
        for i, h in enumerate(self._block_hashes(seq, seq.max_cached_tokens // bs)):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(block_id)
            parent = h
        return hits

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Enter the blocks the sequence's first `num_tokens` fill in the prefix cache; drafts
        (engine.speculative) past its tokens are not its tokens yet."""
        start = self.num_registered.get(seq.seq_id, 0)
        end = min(num_tokens, seq.num_tokens) // self.block_size
        if not self.enable_prefix_caching or end <= start:
            return
        bs = self.block_size
        hashes = self._block_hashes(seq, end)
        for i in range(start, end):
            h, block = hashes[i], self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                block.parent_hash = hashes[i - 1] if i else seq.root_hash
                self.hash_to_block[h] = block.block_id
                self.registered.append(block.block_id)
        self.num_registered[seq.seq_id] = end

    def forget(self, block_ids: list[int]) -> None:
        """Take blocks out of the prefix cache: their KV was never written."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, None

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's reset_prefix_cache: after new weights, cached KV is
        stale). Only when no block is in use; False, changing nothing, otherwise."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash, block.parent_hash, block.token_ids = None, None, None
        self.hash_to_block.clear()
        return True

    # -- sequence-level API -----------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Grow `seq`'s block table to hold its computed tokens (+ `computed_blocks` prefix hits
        on admission) plus `num_new_tokens`. All or nothing: returns False, changing nothing,
        when the free queue is too short."""
        bs = self.block_size
        if not computed_blocks:  # most steps of a decode: the new tokens fit its last block, not shared
            num_computed = seq.num_computed_tokens
            if (num_computed + num_new_tokens <= len(seq.block_table) * bs
                    and not self._needs_cow(seq, num_computed)):
                self._register_full_blocks(seq, num_computed + num_new_tokens)
                return True
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        total_blocks = self.blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, total_blocks - len(seq.block_table) - len(computed_blocks))
        cow = self._needs_cow(seq, num_computed)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + cow + revived > len(self.free_ids):
            return False
        for block_id in computed_blocks:
            self._share(block_id)
        seq.block_table.extend(computed_blocks)
        if cow:
            idx = num_computed // bs
            old, new = seq.block_table[idx], self._pop_free()
            self.pending_copies.append((old, new))
            self._release(old)
            seq.block_table[idx] = new
        seq.block_table.extend(self._pop_free() for _ in range(num_new_blocks))
        self._register_full_blocks(seq, num_computed + num_new_tokens)
        return True

    def _needs_cow(self, seq: Sequence, num_computed: int) -> bool:
        """Writing into a partial block that a forked sibling also holds needs a private copy."""
        idx = num_computed // self.block_size
        return (num_computed % self.block_size != 0 and idx < len(seq.block_table)
                and self.blocks[seq.block_table[idx]].ref_count > 1)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._share(block_id)
        self.num_registered[child.seq_id] = self.num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks reach the LRU end first and are evicted first.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        self.num_registered.pop(seq.seq_id, None)

    def check_integrity(self, seqs: list[Sequence] = ()) -> None:
        """free + used == total; every ref count equals the number of block tables holding it."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for block_id in seq.block_table:
                refs[block_id] += 1
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(self.free_ids) == self.num_blocks, f"free {len(self.free_ids)} + used {used} != {self.num_blocks}"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count} but held by {refs[block.block_id]} tables"
            assert (block.ref_count == 0) == (block.block_id in self.free_ids), f"block {block.block_id} free-queue mismatch"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"hash index points at block {block_id} with another hash"
        assert set(self.num_registered) <= {s.seq_id for s in seqs}, "registration kept for a freed sequence"
