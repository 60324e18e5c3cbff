"""Scheduler tests against a fake engine loop.

`FakeEngine` steps the scheduler as LLMEngine.step does, through the same
`Scheduler.update_from_output` (advance, fork at the end of a prefill, append one token per
sampled row, finish), with deterministic fake tokens and stops at max_tokens only. It also
models the KV pool: every slot remembers which prefix its KV was computed for, copies are
applied before the step's writes, and every scheduled sequence must then read the right KV for
all of its context. A wrong prefix hit, a missed copy-on-write or a block reused while still
needed shows up as a read of the wrong KV.
"""
import itertools

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus

MAX_MODEL_LEN = 100  # prompts 1..80 + max_tokens 1..20


def token_for(seq):
    """The deterministic "sample" at the next position: recompute after preemption gives the same."""
    # a tuple of ints hashes the same in every process (no PYTHONHASHSEED), so examples replay
    return (hash((int(seq.request_id[1:]), seq.index, seq.num_tokens)) >> 3) % 3


def append_token(seq, token):
    seq.token_ids.append(token)
    return seq.num_output_tokens >= seq.max_tokens


class FakeEngine:
    def __init__(self, num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                 enable_chunked_prefill=True, enable_prefix_caching=True, policy="fcfs"):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy)
        self.sched = Scheduler(self.config, self.bm)
        self.seqs = []  # every sequence ever created (forks included)
        self.aborted = set()  # request ids
        self.kv = {}  # slot -> prefix key of the KV written there
        self.prefix_keys = {}  # seq_id -> prefix key of every position
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------
    def add(self, prompt, max_tokens=4, n=1, priority=0):
        params = SamplingParams(n=n, max_tokens=max_tokens, priority=priority)
        seq = Sequence(f"r{next(self._ids)}", list(prompt), params, max_tokens)
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def abort(self, request_id):
        """Like LLMEngine.abort: finish every unfinished sequence of the request."""
        self.aborted.add(request_id)
        for seq in self.seqs:
            if seq.request_id == request_id and not seq.is_finished:
                self.sched.finish(seq)

    def live(self):
        return [s for s in self.seqs if not s.is_finished]

    # -- the step ---------------------------------------------------------------------------
    def step(self):
        running_before = list(self.sched.running)
        batch = self.sched.schedule()
        self.check_batch(batch, running_before)
        self.run_kv(batch)
        self.sched.update_from_output(batch, batch.sampled(self.bm.block_size),
                                      lambda rows, seqs: [token_for(s) for s in seqs], append_token,
                                      on_fork=self.seqs.append)
        self.check()
        return batch

    def drain(self, max_steps=50_000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            batch = self.step()
            # the scheduler is deterministic: a step that changes nothing repeats forever
            assert batch.seqs or batch.preempted, f"hang: running={self.sched.running} waiting={list(self.sched.waiting)}"
        pytest.fail(f"livelock: not drained in {max_steps} steps: running={self.sched.running} "
                    f"waiting={list(self.sched.waiting)}")

    # -- the fake KV pool -------------------------------------------------------------------
    def key(self, seq, pos):
        keys = self.prefix_keys.setdefault(seq.seq_id, [])
        while len(keys) <= pos:
            keys.append(hash((keys[-1] if keys else 0, seq.token_ids[len(keys)])))
        return keys[pos]

    def slot(self, seq, pos):
        bs = self.bm.block_size
        return seq.block_table[pos // bs] * bs + pos % bs

    def run_kv(self, batch):
        bs = self.bm.block_size
        for src, dst in batch.copies:  # copy-on-write happens before anything is written
            for off in range(bs):
                self.kv[dst * bs + off] = self.kv.get(src * bs + off)
        writes = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                slot = self.slot(seq, pos)
                assert slot not in writes, f"two sequences write slot {slot} in one step"
                writes[slot] = self.key(seq, pos)
        self.kv.update(writes)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # attention reads the whole context
            for pos in range(seq.num_computed_tokens + n):
                assert self.kv.get(self.slot(seq, pos)) == self.key(seq, pos), \
                    f"{seq} reads wrong KV at position {pos}"

    # -- invariants -------------------------------------------------------------------------
    def check_batch(self, batch, running_before):
        cfg = self.config
        assert len(batch.seqs) == len(batch.num_new_tokens)
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs), "a sequence scheduled twice"
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
            assert seq.status is SequenceStatus.RUNNING and seq in self.sched.running
            assert len(seq.block_table) >= self.bm.blocks_for(seq.num_computed_tokens + n)
            if not cfg.enable_chunked_prefill and seq not in running_before:
                assert seq.num_computed_tokens + n == seq.num_tokens, "prompt chunked with chunking off"
        for seq in batch.preempted:
            assert seq not in batch.seqs and seq.status is SequenceStatus.WAITING and seq.block_table == []
        if batch.preempted:
            assert all(s in running_before for s in batch.seqs), "admitted a sequence in a step that preempted"
        bs = self.bm.block_size
        for src, dst in batch.copies:  # only the partial block being written is ever copied
            owner = next(s for s in batch.seqs if dst in s.block_table)
            assert owner.block_table.index(dst) == owner.num_computed_tokens // bs
            assert owner.num_computed_tokens % bs != 0

    def check(self):
        self.sched.check_integrity()
        bs = self.bm.block_size
        for seq in self.seqs:
            assert len(seq.block_table) <= -(-seq.num_tokens // bs)
            if seq.is_finished:
                assert seq.block_table == []
        assert len({s.seq_id for s in self.sched.running} | {s.seq_id for s in self.sched.waiting}) == \
            len(self.sched.running) + len(self.sched.waiting)
        assert set(s.seq_id for s in self.live()) == \
            {s.seq_id for s in self.sched.running} | {s.seq_id for s in self.sched.waiting}
        assert len(self.sched.running) <= self.config.max_num_seqs
        if self.config.policy == "priority":  # its order: Scheduler.check_integrity
            return
        # FCFS: preempted sequences wait ahead of new ones, new ones in arrival order
        waiting = list(self.sched.waiting)
        fresh = [s for s in waiting if s.num_preemptions == 0]
        assert waiting[len(waiting) - len(fresh):] == fresh, "a preempted sequence waits behind a new one"
        assert fresh == sorted(fresh, key=lambda s: s.seq_id), "new sequences out of arrival order"

    def check_drained(self):
        assert not self.sched.running and not self.sched.waiting
        assert self.bm.num_free_blocks == self.bm.num_blocks, "leaked blocks"
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        for seq in self.seqs:
            assert seq.is_finished
            if seq.request_id in self.aborted:
                continue
            assert seq.num_output_tokens == seq.max_tokens
            expected = []
            probe = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, seq.max_tokens, seq.index)
            for _ in range(seq.max_tokens):
                expected.append(token_for(probe))
                probe.token_ids.append(expected[-1])
            assert seq.output_token_ids == expected, f"{seq} lost or changed output tokens"


# ---- admission and budgets ----------------------------------------------------------------


def test_admission_is_first_come_first_served():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_seqs=2)
    a, b, c = eng.add([1] * 5), eng.add([2] * 5), eng.add([3] * 5)
    batch = eng.step()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [5, 5]
    assert list(eng.sched.waiting) == [c]
    eng.drain()
    eng.check_drained()


def test_head_of_line_blocks_later_requests_that_would_fit():
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = eng.add(range(10, 22), max_tokens=4)  # 3 blocks
    big, small = eng.add(range(30, 38)), eng.add([1])
    batch = eng.step()
    assert batch.seqs == [a]  # big needs 2 blocks, 1 is free; small must not jump the queue
    assert list(eng.sched.waiting) == [big, small]
    eng.drain()
    eng.check_drained()


def test_budget_and_max_num_seqs_are_respected_every_step():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(8):
        eng.add([i % 3] * (3 + 4 * i), max_tokens=3 + i % 4)
    for _ in range(500):
        if not eng.sched.has_unfinished():
            break
        batch = eng.step()
        assert batch.num_tokens <= 10
        assert len(eng.sched.running) <= 3
        assert len(batch) <= 3
    eng.check_drained()


def test_a_full_budget_is_used_when_there_is_work():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    eng.add(range(30))
    eng.add(range(50, 80))
    assert eng.step().num_new_tokens == [10]
    assert eng.step().num_new_tokens == [10]


def test_chunked_prefill_splits_a_long_prompt_and_mixes_in_decodes():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    short = eng.add([1, 2, 3], max_tokens=10)
    long = eng.add(range(100, 120), max_tokens=2)
    b1 = eng.step()
    assert list(zip(b1.seqs, b1.num_new_tokens)) == [(short, 3), (long, 5)]
    b2 = eng.step()
    assert list(zip(b2.seqs, b2.num_new_tokens)) == [(short, 1), (long, 7)]  # decode + chunk
    b3 = eng.step()
    assert list(zip(b3.seqs, b3.num_new_tokens)) == [(short, 1), (long, 7)]
    assert long.num_computed_tokens == 19 and long.num_output_tokens == 0
    b4 = eng.step()
    assert list(zip(b4.seqs, b4.num_new_tokens)) == [(short, 1), (long, 1)]
    assert long.num_output_tokens == 1  # the last chunk produced the first token
    eng.drain()
    eng.check_drained()


def test_long_prefill_token_threshold_caps_chunks_while_others_wait_or_run():
    """vLLM's long_prefill_token_threshold: a prompt chunk takes at most the threshold while
    another request runs or waits; alone, the whole budget (adaptive: never below the budget's
    fair share of the requests there)."""
    import dataclasses

    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    eng.sched.config = dataclasses.replace(eng.config, long_prefill_token_threshold=6)
    long, short = eng.add(range(100, 140), max_tokens=2), eng.add([1, 2, 3], max_tokens=6)
    b1 = eng.step()
    assert list(zip(b1.seqs, b1.num_new_tokens)) == [(long, 6), (short, 3)]  # the short prompt is not held up
    b2 = eng.step()
    assert list(zip(b2.seqs, b2.num_new_tokens)) == [(long, 6), (short, 1)]
    eng.drain()
    eng.check_drained()
    alone = eng.add(range(200, 240), max_tokens=2)
    assert list(zip((b := eng.step()).seqs, b.num_new_tokens)) == [(alone, 32)]  # nobody to starve
    eng.drain()
    eng.sched.config = dataclasses.replace(eng.sched.config, long_prefill_token_threshold_adaptive=True)
    a, b_ = eng.add(range(300, 340), max_tokens=2), eng.add(range(400, 440), max_tokens=2)
    b3 = eng.step()
    assert list(zip(b3.seqs, b3.num_new_tokens)) == [(a, 16), (b_, 16)]  # 32 // 2 requests, above 6
    eng.drain()
    eng.check_drained()


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = eng.add([1] * 6, max_tokens=3), eng.add([2] * 6, max_tokens=3)
    assert eng.step().seqs == [a]
    b2 = eng.step()
    assert list(zip(b2.seqs, b2.num_new_tokens)) == [(a, 1), (b, 6)]
    eng.drain()
    eng.check_drained()


def test_prefix_hits_skip_cached_prompt_tokens():
    eng = FakeEngine(num_blocks=32, block_size=4)
    a = eng.add(range(10), max_tokens=4)
    eng.step()
    b = eng.add(list(range(8)) + [50, 51], max_tokens=2)
    batch = eng.step()
    assert list(zip(batch.seqs, batch.num_new_tokens)) == [(a, 1), (b, 2)]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert eng.sched.stats.prefix_hit_tokens == 8
    eng.drain()
    eng.check_drained()


# ---- preemption ---------------------------------------------------------------------------


def test_preemption_recomputes_the_newest_sequence_and_keeps_its_tokens():
    eng = FakeEngine(num_blocks=4, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b = eng.add([1, 2, 3], max_tokens=6), eng.add([4, 5, 6], max_tokens=6)
    eng.step()  # both prefilled: 2 blocks each, pool full
    eng.step()  # position 3 still fits the second block
    assert eng.bm.num_free_blocks == 0
    c = eng.add([7])
    outputs_of_b = list(b.output_token_ids)
    batch = eng.step()  # a needs a third block: b, the newest, is preempted
    assert batch.preempted == [b]
    assert batch.seqs == [a]  # and c is not admitted in a step that preempted
    assert list(eng.sched.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == outputs_of_b and b.num_preemptions == 1
    assert eng.sched.stats.num_preemptions == 1
    eng.drain()
    eng.check_drained()  # b resumed and finished with exactly the tokens it would have had


def test_the_newest_sequence_preempts_itself_when_it_is_the_one_short_of_blocks():
    eng = FakeEngine(num_blocks=4, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = eng.add([1, 2, 3], max_tokens=4)  # position 3 still fits its second block
    b = eng.add([4, 5, 6, 7], max_tokens=4)  # position 4 needs a third block
    eng.step()
    a_blocks = list(a.block_table)
    batch = eng.step()
    assert batch.preempted == [b] and batch.seqs == [a]
    assert a.block_table == a_blocks and list(eng.sched.waiting) == [b]
    eng.drain()
    eng.check_drained()


def test_priority_policy_admits_the_best_waiting_request_first():
    """vLLM's --scheduling-policy priority: lower values first, then arrival."""
    eng = FakeEngine(max_num_seqs=1, policy="priority")
    late, urgent, also_urgent = eng.add([1, 2], priority=5), eng.add([3, 4], priority=-1), eng.add([5], priority=-1)
    assert list(eng.sched.waiting) == [urgent, also_urgent, late]
    assert eng.step().seqs == [urgent]
    eng.drain()
    eng.check_drained()
    fcfs = FakeEngine(max_num_seqs=1)  # first come, first served: the priority changes nothing
    first = fcfs.add([1, 2], priority=0)
    fcfs.add([3, 4], priority=0)
    assert fcfs.step().seqs == [first]


def test_priority_policy_preempts_the_lowest_priority_running_sequence():
    eng = FakeEngine(num_blocks=4, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False,
                     policy="priority")
    background = eng.add([1, 2, 3], max_tokens=6, priority=10)  # the older one
    urgent = eng.add([4, 5, 6], max_tokens=6, priority=0)
    eng.step()
    eng.step()  # both hold 2 blocks: the pool is full
    assert eng.sched.running == [urgent, background]
    batch = eng.step()  # both need a third block: the low-priority one goes, though older
    assert batch.preempted == [background] and batch.seqs == [urgent]
    eng.drain()
    eng.check_drained()


def test_preemption_order_is_preserved_in_the_waiting_queue():
    eng = FakeEngine(num_blocks=6, block_size=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    seqs = [eng.add([i] * 3, max_tokens=8) for i in range(3)]  # 2 blocks each: pool full
    eng.step()
    eng.step()
    assert eng.step().preempted == [seqs[2]]  # seqs[0] and seqs[1] need a third block
    assert eng.step().preempted == []  # seqs[2] cannot come back: no free block
    assert eng.step().preempted == [seqs[1]]  # seqs[0] needs a fourth block
    assert list(eng.sched.waiting) == [seqs[1], seqs[2]]  # the older one first
    eng.drain()
    eng.check_drained()


def test_preempted_sequence_hits_its_own_cached_blocks_on_readmission():
    eng = FakeEngine(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    a, b = eng.add([1, 2, 3, 4, 5], max_tokens=3), eng.add([6, 7, 8, 9, 10], max_tokens=8)
    eng.step()
    eng.step()
    old_blocks = list(b.block_table)
    batch = eng.step()  # a needs a 4th block: b is preempted, a takes b's tail block and finishes
    assert batch.preempted == [b] and a.is_finished
    batch = eng.step()
    assert batch.seqs == [b] and batch.num_new_tokens == [3]  # 7 tokens, the first 4 cached
    assert b.block_table[:2] == old_blocks[:2]
    assert b.num_cached_tokens == 0  # only first-admission hits are reported to the user
    assert eng.sched.stats.prefix_hit_tokens == 4
    eng.drain()
    eng.check_drained()


# ---- finish and abort ---------------------------------------------------------------------


def test_finish_frees_running_and_waiting_sequences():
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_seqs=1)
    a, b = eng.add(range(10)), eng.add(range(20, 30))
    eng.step()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    eng.abort(a.request_id)
    assert a.is_finished and a.block_table == [] and a not in eng.sched.running
    assert eng.bm.num_free_blocks == 8
    eng.abort(b.request_id)
    assert b.is_finished and not eng.sched.waiting
    eng.sched.finish(b)  # finishing twice is harmless
    eng.sched.check_integrity()
    assert not eng.sched.has_unfinished() and eng.bm.num_free_blocks == 8


def test_abort_mid_prefill_frees_the_chunk_blocks():
    eng = FakeEngine(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    a = eng.add(range(30))
    eng.step()
    assert len(a.block_table) == 2
    eng.abort(a.request_id)
    eng.check()
    assert eng.bm.num_free_blocks == 8


# ---- forks (n > 1) ------------------------------------------------------------------------


def test_fork_runs_the_child_right_after_its_parent_and_copies_on_write():
    eng = FakeEngine(num_blocks=16, block_size=4)
    other = eng.add([9] * 4, max_tokens=3)
    parent = eng.add([1, 2, 3, 4, 5, 6], max_tokens=3, n=2)
    eng.step()
    child = eng.seqs[-1]
    assert child.index == 1 and eng.sched.running == [other, parent, child]
    assert child.block_table == parent.block_table
    batch = eng.step()  # the parent writes position 6 in the shared partial block: one copy
    assert len(batch.copies) == 1 and batch.copies[0][0] == child.block_table[1]
    eng.drain()
    eng.check_drained()


def test_pending_forks_of_running_sequences_count_against_max_num_seqs():
    """BUG: admission reserves room for the forks of the sequence being admitted, but not for the
    pending forks of sequences already running, so the forks push running past max_num_seqs."""
    eng = FakeEngine(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    eng.add([1] * 5, max_tokens=2, n=2)
    eng.add([2] * 5, max_tokens=2)
    eng.add([3] * 5, max_tokens=2)
    eng.step()
    assert len(eng.sched.running) <= 3


# ---- the post-step path -------------------------------------------------------------------


def test_row_order_puts_prefill_chunks_first_then_decodes_by_context_blocks():
    def seq(computed, num_tokens):
        s = Sequence("r", [0] * num_tokens, SamplingParams(), 4)
        s.num_computed_tokens = computed
        return s

    seqs = [seq(9, 10), seq(0, 40), seq(2, 3), seq(20, 40), seq(5, 6), seq(7, 8)]
    batch = ScheduledBatch(seqs, [1, 8, 1, 20, 1, 1])
    # decodes by full context blocks of 4: 9 -> 2, 2 -> 0, 5 -> 1, 7 -> 1 (stable among equals)
    assert batch.row_order(4) == [1, 3, 2, 4, 5, 0]
    assert batch.sampled(4) == [3, 2, 4, 5, 0]  # the 8-token chunk stops short of the prompt's end


def test_sequences_finish_and_free_their_blocks_in_row_order():
    """Two decodes finishing in one step free their blocks in the model's row order, not the
    batch's: that order decides which cached prefix blocks are evicted first."""
    eng = FakeEngine(num_blocks=16, block_size=4)
    long, short = eng.add(range(10, 19), max_tokens=2), eng.add([1, 2, 3], max_tokens=2)
    eng.step()
    blocks_long, blocks_short = list(long.block_table), list(short.block_table)
    batch = eng.step()  # decodes: long has 2 full context blocks, short none, so short's row is first
    assert batch.seqs == [long, short] and batch.num_new_tokens == [1, 1]
    assert long.is_finished and short.is_finished
    freed = list(eng.bm.free_ids)[-len(blocks_long) - len(blocks_short):]
    assert freed == blocks_short[::-1] + blocks_long[::-1]


def test_update_from_output_forks_children_onto_their_parents_row():
    eng = FakeEngine(num_blocks=16, block_size=4)
    other, parent = eng.add([9] * 4, max_tokens=3), eng.add([1, 2, 3, 4, 5, 6], max_tokens=3, n=3)
    batch = eng.sched.schedule()
    seen, children = [], []

    def sample(rows, seqs):
        seen.append((rows, seqs))
        return [token_for(s) for s in seqs]

    finished = eng.sched.update_from_output(batch, batch.sampled(4), sample, append_token, children.append)
    assert [c.index for c in children] == [1, 2] and not finished
    assert seen == [([0, 1, 1, 1], [other, parent] + children)]
    running = eng.sched.running
    assert running[:2] == [other, parent] and sorted(running[2:], key=lambda s: s.index) == children
    assert all(s.num_output_tokens == 1 for s in [other, parent] + children)


# ---- property-based ----------------------------------------------------------------------

configs = st.fixed_dictionaries({
    "num_blocks": st.one_of(st.integers(8, 12), st.integers(8, 40)),  # tight pools preempt often
    "block_size": st.sampled_from([1, 2, 4, 8, 16]),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 48),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
})

# prompt = base_prompt[:shared] + tail: a small alphabet and a common base share prefixes often;
# short prompts are favoured so that several sequences fit the pool and then outgrow it
add_op = st.tuples(st.just("add"), st.one_of(st.integers(0, 8), st.integers(0, 80)),
                   st.lists(st.integers(0, 2), max_size=40), st.integers(1, 20),
                   st.integers(-2, 2))  # its priority, under the priority policy
ops = st.lists(st.one_of(
    add_op, add_op, add_op,  # weighted: the pool should fill up and preempt
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
), min_size=8, max_size=50)


def run_ops(cfg, base_prompt, operations, n, policy="fcfs"):
    if not cfg["enable_chunked_prefill"]:  # the engine's rule: a whole prompt must fit one step
        cfg = {**cfg, "max_num_batched_tokens": max(cfg["max_num_batched_tokens"], MAX_MODEL_LEN)}
    eng = FakeEngine(**cfg, policy=policy)
    eng.check()
    for op in operations:
        if op[0] == "add":
            _, shared, tail, max_tokens, priority = op
            prompt = (base_prompt[:shared] + tail)[:80] or [0]
            # LLMEngine.validate rejects a request that can never fit the pool: shrink it to fit,
            # up to the last token (never fed back, so it needs no KV): the tightest fit runs too
            capacity = eng.bm.num_blocks * eng.bm.block_size
            prompt = prompt[:max(1, capacity + 1 - max_tokens)]
            max_tokens = min(max_tokens, capacity + 1 - len(prompt))
            assert eng.bm.blocks_for(len(prompt) + max_tokens - 1) <= eng.bm.num_blocks
            if n > 1 and cfg["max_num_seqs"] < n:
                continue
            eng.add(prompt, max_tokens, n=n, priority=priority if policy == "priority" else 0)
        elif op[0] == "step":
            for _ in range(op[1]):
                eng.step()
        else:
            live = eng.live()
            if live:
                eng.abort(live[op[1] % len(live)].request_id)
        eng.check()
    eng.drain()
    eng.check_drained()
    target(float(eng.sched.stats.num_preemptions), label="preemptions")  # steer towards memory pressure


base_prompts = st.lists(st.integers(0, 2), min_size=80, max_size=80)
property_settings = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@property_settings
@given(cfg=configs, base_prompt=base_prompts, operations=ops)
def test_random_workloads_keep_invariants_and_drain(cfg, base_prompt, operations):
    run_ops(cfg, base_prompt, operations, n=1)


@property_settings
@given(cfg=configs, base_prompt=base_prompts, operations=ops, n=st.integers(2, 3))
def test_random_workloads_with_forks_keep_invariants_and_drain(cfg, base_prompt, operations, n):
    """Every request forks n - 1 children at the end of its prefill: copy-on-write under preemption."""
    run_ops(cfg, base_prompt, operations, n=n)


@property_settings
@given(cfg=configs, base_prompt=base_prompts, operations=ops, n=st.integers(1, 3))
def test_random_workloads_under_the_priority_policy_keep_invariants_and_drain(cfg, base_prompt, operations, n):
    """Both queues stay in (priority, arrival) order (check_integrity), forks and preemptions included."""
    run_ops(cfg, base_prompt, operations, n=n, policy="priority")


def test_first_admission_is_stamped_by_the_schedulers_clock_and_kept_through_preemption():
    """The instant a request's queue time ends (workers.metrics), on the clock the scheduler is
    given (the simulator's own time); a recomputed sequence keeps its first one, a fork its parent's."""
    now = [5.0]
    bm = BlockManager(4, 4, False)
    sched = Scheduler(SchedulerConfig(8, 64), bm, clock=lambda: now[0])
    first = Sequence("r0", [1, 2, 3], SamplingParams(max_tokens=4), 4)
    second = Sequence("r1", [4, 5, 6], SamplingParams(max_tokens=4), 4)
    sched.add(first)
    sched.add(second)
    assert first.first_scheduled is None
    sched.schedule()
    assert first.first_scheduled == second.first_scheduled == 5.0
    now[0] = 9.0
    sched.running.remove(second)
    sched._preempt(second)
    sched.schedule()
    assert second.num_preemptions == 1 and second.status is SequenceStatus.RUNNING
    assert second.first_scheduled == 5.0 and first.fork(1).first_scheduled == 5.0
