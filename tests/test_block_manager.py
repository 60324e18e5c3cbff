"""BlockManager unit tests: ref counts, all-or-nothing allocation, prefix hits, lazy LRU
eviction, copy-on-write for forks, and the integrity check itself."""
import pytest

from engine import block_manager as bm_module
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(tokens, max_tokens=16):
    return Sequence("r", list(tokens), SamplingParams(), max_tokens)


def prefill(bm, seq):
    """Admit `seq` like the scheduler does (prefix hits + the rest in one chunk) and compute it."""
    hits = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = seq.num_tokens
    return hits


def decode(bm, seq, token):
    """Sample one token (the engine appends it), then give it a slot."""
    seq.token_ids.append(token)
    assert bm.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1


def snapshot(bm, *seqs):
    return (list(bm.free_ids), [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks], dict(bm.hash_to_block),
            list(bm.pending_copies), dict(bm.num_registered), [list(s.block_table) for s in seqs])


def refs(bm, block_ids):
    return [bm.blocks[b].ref_count for b in block_ids]


# ---- allocation and free ------------------------------------------------------------------


def test_allocate_and_free_restores_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    seqs = [make_seq(range(i * 10, i * 10 + n)) for i, n in enumerate([1, 4, 5, 9])]
    for s in seqs:
        prefill(bm, s)
    assert [len(s.block_table) for s in seqs] == [1, 1, 2, 3]
    assert bm.num_free_blocks == 10 - 7
    assert len({b for s in seqs for b in s.block_table}) == 7
    bm.check_integrity(seqs)
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_integrity([])


def test_allocate_grows_block_table_only_when_a_block_fills():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = make_seq([1, 2, 3])
    prefill(bm, s)
    assert len(s.block_table) == 1
    decode(bm, s, 4)  # position 3: still block 0
    assert len(s.block_table) == 1
    decode(bm, s, 5)  # position 4: a second block
    assert len(s.block_table) == 2
    bm.check_integrity([s])


def test_allocate_fails_without_changing_anything():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(12))
    prefill(bm, a)  # 3 of 4 blocks
    b = make_seq(range(100, 105))  # needs 2
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 5)
    assert snapshot(bm, a, b) == before
    assert bm.allocate_slots(b, 4)  # exactly the one free block is fine
    assert bm.num_free_blocks == 0
    bm.check_integrity([a, b])


def test_allocate_with_hits_fails_atomically_when_revived_blocks_leave_too_few():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4])
    prefill(bm, a)
    bm.free(a)  # both full blocks stay cached in the free queue
    filler = make_seq([9, 9])
    prefill(bm, filler)  # takes the never-used block: 2 free, both cached
    b = make_seq([1, 2, 3, 4, 5, 6, 7])
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    before = snapshot(bm, b)
    # 2 revived + 2 new blocks needed, only 2 free
    assert not bm.allocate_slots(b, 3, hits)
    assert snapshot(bm, b) == before
    assert all(bm.blocks[h].hash is not None for h in hits)


# ---- prefix caching ----------------------------------------------------------------------


def test_prefix_hit_shares_the_first_sequences_full_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(10))  # blocks: full, full, partial
    prefill(bm, a)
    b = make_seq(list(range(8)) + [50, 51, 52])
    hits = prefill(bm, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert refs(bm, a.block_table) == [2, 2, 1]
    assert bm.num_free_blocks == 10 - 4
    bm.check_integrity([a, b])
    bm.free(a)
    assert refs(bm, b.block_table) == [1, 1, 1]
    bm.check_integrity([b])


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: a salted request neither hits another salt's (or no salt's) blocks nor
    leaves its own to them; requests with the same salt share as any others do."""
    bm = BlockManager(num_blocks=20, block_size=4)

    def salted(salt):
        return Sequence("r", list(range(10)), SamplingParams(cache_salt=salt), 16)

    prefill(bm, make_seq(range(10)))
    a = salted("tenant-a")
    assert prefill(bm, a) == []
    assert bm.get_computed_blocks(salted("tenant-b")) == []
    assert bm.get_computed_blocks(salted("tenant-a")) == a.block_table[:2]
    assert bm.get_computed_blocks(make_seq(range(10))) != a.block_table[:2]


def test_a_divergent_block_stops_the_hit_chain():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(13))
    prefill(bm, a)
    tokens = list(range(13))
    tokens[5] = 99  # second block differs, third block is equal again
    assert bm.get_computed_blocks(make_seq(tokens)) == a.block_table[:1]


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_last_prompt_token_is_always_left_to_compute(extra):
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(8))
    prefill(bm, a)
    assert len(bm.hash_to_block) == 2  # both blocks full, both cached
    b = make_seq(list(range(8)) + list(range(100, 100 + extra)))
    hits = bm.get_computed_blocks(b)
    # a fully cached prompt still recomputes its last block so the model yields logits
    assert len(hits) * 4 <= b.num_tokens - 1
    assert hits == a.block_table[:1 if extra == 0 else 2]


def test_output_tokens_are_cached_too():
    bm = BlockManager(num_blocks=10, block_size=2)
    a = make_seq([1, 2, 3])
    prefill(bm, a)
    decode(bm, a, 4)  # block 1 = [3, 4] is full now
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(b) == a.block_table[:2]


def test_hash_collision_between_different_blocks_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, token_ids, extra_keys=(): 42)
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(9))
    prefill(bm, a)
    assert bm.hash_to_block == {42: a.block_table[0]}
    assert bm.get_computed_blocks(make_seq(range(100, 109))) == []
    # the first block really is equal; the second collides with it and is rejected
    assert bm.get_computed_blocks(make_seq(list(range(4)) + list(range(200, 205)))) == a.block_table[:1]
    b = make_seq(range(100, 109))
    prefill(bm, b)
    assert set(b.block_table).isdisjoint(a.block_table)
    bm.check_integrity([a, b])


def test_collision_guard_checks_the_prefix_not_just_the_block(monkeypatch):
    """BUG: only the hit block's own token ids are compared. When block i's hash collides with a
    cached block holding the same tokens after a *different* prefix, that block is reused, and its
    KV (computed under the other prefix) is wrong for this sequence."""
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, token_ids, extra_keys=(): hash(tuple(token_ids)))
    bm = BlockManager(num_blocks=10, block_size=2)
    a = make_seq([1, 2, 3, 4, 0])  # [1 2][3 4]: block [3 4] after prefix [1 2]
    c = make_seq([5, 6, 7, 8, 0])  # [5 6][7 8]
    prefill(bm, a)
    prefill(bm, c)
    b = make_seq([5, 6, 3, 4, 0])  # [5 6] is really cached (c); [3 4] after [5 6] is not
    assert bm.get_computed_blocks(b) == c.block_table[:1]


# ---- lazy LRU eviction -------------------------------------------------------------------


def test_freed_cached_blocks_are_hit_until_reused_tail_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    a = make_seq(tokens)
    prefill(bm, a)
    head, mid, tail = a.block_table
    bm.free(a)
    assert list(bm.free_ids) == [tail, mid, head]  # tail blocks are evicted first
    probe = tokens + [7]
    assert bm.get_computed_blocks(make_seq(probe)) == [head, mid, tail]
    other = make_seq([9, 9])
    prefill(bm, other)  # pops one block: a's tail
    assert other.block_table == [tail]
    assert bm.get_computed_blocks(make_seq(probe)) == [head, mid]
    decode(bm, other, 9)
    decode(bm, other, 9)  # a third token needs a second block: a's middle
    assert other.block_table == [tail, mid]
    assert bm.get_computed_blocks(make_seq(probe)) == [head]
    bm.check_integrity([other])


def test_reset_prefix_cache_forgets_every_block_but_only_between_requests():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    before = snapshot(bm, a)
    assert not bm.reset_prefix_cache() and snapshot(bm, a) == before  # a holds blocks: nothing changes
    bm.free(a)
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5])) != []
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5])) == [] and not bm.hash_to_block
    prefill(bm, b := make_seq([1, 2, 3, 4, 5]))  # cached afresh
    bm.free(b)
    assert len(bm.get_computed_blocks(make_seq([1, 2, 3, 4, 5]))) == 2
    bm.check_integrity()


def test_reviving_a_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    cached = a.block_table[:2]
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 6])
    assert prefill(bm, b) == cached
    assert refs(bm, cached) == [1, 1]
    assert not set(cached) & set(bm.free_ids)
    assert bm.num_free_blocks == 1
    bm.check_integrity([b])


def test_never_used_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3])
    prefill(bm, a)
    cached = a.block_table[0]
    bm.free(a)
    b = make_seq([7, 8, 9, 10, 11])  # 3 blocks: the 2 never used + a's partial tail (no hash)
    prefill(bm, b)
    assert cached not in b.block_table
    assert bm.get_computed_blocks(make_seq([1, 2, 3])) == [cached]


def test_no_hits_when_prefix_caching_is_disabled():
    bm = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    a = make_seq(range(9))
    prefill(bm, a)
    b = make_seq(range(9))
    assert bm.get_computed_blocks(b) == []
    prefill(bm, b)
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.hash_to_block == {} and all(blk.hash is None for blk in bm.blocks)
    bm.free(a)
    assert bm.get_computed_blocks(make_seq(range(9))) == []
    bm.check_integrity([b])


# ---- fork and copy-on-write ---------------------------------------------------------------


def forked_pair(bm, prompt):
    """Parent prefilled; both it and its child sampled a (different) first token, like the engine."""
    parent = make_seq(prompt)
    prefill(bm, parent)
    child = parent.fork(index=1)
    bm.fork(parent, child)
    parent.token_ids.append(100)
    child.token_ids.append(200)
    return parent, child


def test_fork_shares_every_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = forked_pair(bm, range(6))
    assert child.block_table == parent.block_table
    assert refs(bm, parent.block_table) == [2, 2]
    assert bm.num_free_blocks == 8
    bm.check_integrity([parent, child])


def test_writing_a_shared_partial_block_copies_it_once():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = forked_pair(bm, range(6))  # block 1 holds positions 4, 5 and is shared
    full, partial = parent.block_table
    assert bm.allocate_slots(parent, 1)
    copy = parent.block_table[1]
    assert parent.block_table == [full, copy] and copy != partial
    assert bm.pending_copies == [(partial, copy)]
    assert refs(bm, [full, partial, copy]) == [2, 1, 1]
    assert bm.allocate_slots(child, 1)  # the sibling is now the only owner: writes in place
    assert child.block_table == [full, partial]
    assert bm.pending_copies == [(partial, copy)]
    bm.check_integrity([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 10
    bm.check_integrity([])


def test_full_shared_blocks_are_never_copied():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = forked_pair(bm, range(8))  # two full blocks, the next token starts block 2
    shared = list(parent.block_table)
    assert bm.allocate_slots(parent, 1)
    assert bm.allocate_slots(child, 1)
    assert bm.pending_copies == []
    assert parent.block_table[:2] == child.block_table[:2] == shared
    assert parent.block_table[2] != child.block_table[2]
    assert refs(bm, shared) == [2, 2]
    bm.check_integrity([parent, child])


def test_copy_on_write_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent, child = forked_pair(bm, range(6))
    assert bm.num_free_blocks == 0
    before = snapshot(bm, parent, child)
    assert not bm.allocate_slots(parent, 1)  # needs a block for the copy
    assert snapshot(bm, parent, child) == before
    bm.free(child)
    assert bm.allocate_slots(parent, 1)  # sole owner again: no copy needed
    assert bm.pending_copies == []
    bm.check_integrity([parent])


def test_forked_siblings_cache_their_own_full_blocks():
    bm = BlockManager(num_blocks=10, block_size=2)
    parent, child = forked_pair(bm, [1, 2, 3])  # block 1 = [3, sampled]
    assert bm.allocate_slots(parent, 1)
    assert bm.allocate_slots(child, 1)
    parent.num_computed_tokens = child.num_computed_tokens = 4
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 100, 0])) == parent.block_table
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 200, 0])) == child.block_table
    bm.check_integrity([parent, child])


# ---- the integrity check ------------------------------------------------------------------


def test_check_integrity_catches_a_corrupted_ref_count():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(range(5))
    prefill(bm, a)
    bm.check_integrity([a])
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity([a])


def test_check_integrity_catches_a_table_holding_a_free_block():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_seq(range(5))
    prefill(bm, a)
    stale = list(a.block_table)
    bm.free(a)
    a.block_table = stale  # a use-after-free
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


def test_check_integrity_catches_a_lost_free_block():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.free_ids.popitem()
    with pytest.raises(AssertionError):
        bm.check_integrity([])
