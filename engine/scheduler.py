"""Iteration-level continuous batching under one token budget per step.

Every step: running sequences first (decodes and unfinished prefill chunks, FCFS), then waiting
ones, each advancing `num_computed_tokens` toward its length. When the KV pool runs dry the
newest running sequence is preempted by recompute: its blocks are freed and it goes back to the
front of the queue with all its tokens (prompt + output so far), so nothing is lost or reordered.
Under the "priority" policy (vLLM's), both queues are kept in (priority, arrival) order instead:
the best waiting request is admitted first, and the worst running one is the one preempted.
After the model ran, `update_from_output` is the one post-step path (advance, fork, append the
sampled tokens, finish) for the engine, the cluster simulator and the tests alike.
Pure Python: the cluster simulator runs this same code.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.block_manager import BlockManager
from engine.outputs import ITERATION_TOKENS_BUCKETS
from engine.sequence import Sequence, SequenceStatus, num_kept

T = TypeVar("T")  # what the caller samples per sequence: a token id, or the sampler's result


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority": engine.config.EngineConfig.scheduling_policy
    max_loras: int | None = None  # LoRA adapters running at once (EngineConfig.max_loras, with enable_lora)
    # vLLM's: with chunked prefill, a prompt chunk takes at most this many tokens a step while
    # other requests wait or run (0: no cap); adaptive: never below the budget's fair share
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # parallel to seqs
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)  # blocks entered in the prefix cache for this step
    forks: list[Sequence] = field(default_factory=list)  # children forked after this step's draws
    _row_orders: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens this step computes (an output token recomputed after a preemption is none)."""
        return sum(max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
                   for s, n in zip(self.seqs, self.num_new_tokens))

    @property
    def has_prefill(self) -> bool:
        """Whether the step computes prompt tokens (a prefill chunk), not only decodes (with or
        without drafts)."""
        return self.num_tokens - sum(len(s.spec_token_ids) for s in self.seqs) > len(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_prefill_chunks(self) -> int:
        """Sequences that run as prefill chunks (more than one new token, not drafts): the first
        ones of row_order."""
        return sum(1 for s, n in zip(self.seqs, self.num_new_tokens) if n > 1 and not s.spec_token_ids)

    def row_order(self, block_size: int) -> list[int]:
        """Indices into seqs in the model's flat row order: prefill chunks first, then decodes
        stably sorted by their LoRA adapter (none first) and their number of full context blocks,
        so that each decode group, and each adapter's decodes, is a contiguous slice of rows (an
        adapter's delta then reads and writes a view, engine.lora). A decode with drafts
        (engine.speculative) is a run of decode rows, one per token, each seeing one more token of
        context than the one before (all write their KV before any attends). Read before
        num_computed_tokens advances.

        Sequences sample in this order, so they finish and free their blocks in it, which sets
        the LRU order in which freed prefix blocks are evicted."""
        order = self._row_orders.get(block_size)  # the engine and the runner each ask once a step
        if order is None:
            prefill = [i for i, n in enumerate(self.num_new_tokens) if n > 1 and not self.seqs[i].spec_token_ids]
            decode = [i for i, n in enumerate(self.num_new_tokens) if n == 1 or self.seqs[i].spec_token_ids]
            decode.sort(key=lambda i: (self.seqs[i].lora_int_id or 0, self.seqs[i].num_computed_tokens // block_size))
            order = self._row_orders[block_size] = prefill + decode
        return order

    def sampled(self, block_size: int) -> list[int]:
        """The indices of row_order whose new tokens reach the sequence's end: they sample (one
        with drafts at each of its rows)."""
        return [i for i in self.row_order(block_size)
                if self.seqs[i].num_computed_tokens + self.num_new_tokens[i] >= self.seqs[i].num_tokens]


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # The engine's steps over these batches (LLMEngine.step times them): see EngineStats.
    prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    prompt_tokens: int = 0  # computed by the steps (cached ones are not)
    generation_tokens: int = 0  # sampled by the steps, every sequence's
    # Speculative decoding (engine.speculative), vLLM's counters: steps a sequence ran drafts in,
    # the drafts, those kept, and those kept by their place (0: the first draft of a step).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # [steps, tokens] per bucket of ITERATION_TOKENS_BUCKETS, and one past the last bound
    iteration_tokens: list[list[int]] = field(default_factory=lambda: [[0, 0] for _ in range(len(ITERATION_TOKENS_BUCKETS) + 1)])

    def record_step(self, prefill: bool, seconds: float, prompt_tokens: int = 0, tokens: int = 0) -> None:
        """`tokens`: all the step computed, prompt and decode (and draft) tokens."""
        self.prompt_tokens += prompt_tokens
        entry = self.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)]
        entry[0] += 1
        entry[1] += tokens
        if prefill:
            self.prefill_steps += 1
            self.prefill_step_seconds += seconds
        else:
            self.decode_steps += 1
            self.decode_step_seconds += seconds

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_drafts += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for k in range(num_accepted):
            per_pos[k] += 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic,
                 propose: Callable[[Sequence, int], list[int]] | None = None) -> None:
        """`clock`: what stamps a sequence's first admission (the simulator's is its own time);
        `propose(seq, budget)`: a decoding sequence's drafts for this step, at most `budget` of
        them (engine.speculative.NgramDrafter); None: no speculation."""
        self.config = config
        self.clock = clock
        self.propose = propose
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=_rank)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        cap = self._prefill_cap()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens, cap)
        if not batch.preempted:  # under memory pressure, admit nobody new
            self._schedule_waiting(batch, budget, cap)
        batch.copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
        batch.registered, self.block_manager.registered = self.block_manager.registered, []
        return batch

    def roll_back(self, batch: ScheduledBatch) -> None:
        """The model did not run `batch` (its step raised), so the KV it was to write does not exist:
        the blocks it entered in the prefix cache leave it (a later prompt would hit them and read
        unwritten KV, silently), and its sequences start over, as preempted ones do (one admitted
        this step may hold such a block as a hit), with the children forked from them (a step that
        raised after its draws: those that took a token keep it). The engine may then go on, or
        abort them."""
        self.block_manager.forget(batch.registered)
        ours = {id(s) for s in batch.seqs} | {id(s) for s in batch.forks}
        for seq in reversed([s for s in self.running if id(s) in ours]):  # the first ends up first in line again
            self.running.remove(seq)
            self._requeue(seq)

    def _prefill_cap(self) -> int | None:
        """The most tokens a prompt chunk takes this step (long_prefill_token_threshold), or None:
        no cap, for a request alone, as vLLM's (it starves nobody)."""
        c = self.config
        eligible = len(self.running) + len(self.waiting)
        if not (c.long_prefill_token_threshold > 0 and c.enable_chunked_prefill and eligible > 1):
            return None
        if c.long_prefill_token_threshold_adaptive:
            return max(c.long_prefill_token_threshold, c.max_num_batched_tokens // eligible)
        return c.long_prefill_token_threshold

    def _schedule_running(self, batch: ScheduledBatch, budget: int, cap: int | None = None) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, cap or budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # newest; never one already scheduled (those are < i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        if self.propose is not None and not batch.preempted:
            budget = self._add_drafts(batch, budget)
        return budget

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> int:
        """Give the running sequences that decode one token this step their drafts, from the budget
        and the free blocks every running sequence left: nobody is preempted for drafts. Not to a
        sequence that forks after this token (its children would copy the parent's drafts' state)."""
        for j, seq in enumerate(batch.seqs):
            if budget <= 0:
                break
            if batch.num_new_tokens[j] != 1 or seq.num_tokens - seq.num_computed_tokens != 1 or seq.pending_forks:
                continue
            drafts = self.propose(seq, budget)
            if drafts and self.block_manager.allocate_slots(seq, 1 + len(drafts)):
                seq.spec_token_ids = drafts
                batch.num_new_tokens[j] += len(drafts)
                budget -= len(drafts)
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int, cap: int | None = None) -> None:
        bm = self.block_manager
        # Sequences that will fork after their prefill already hold seats for their siblings.
        seats = len(self.running) + sum(s.pending_forks for s in self.running)
        max_loras = self.config.max_loras
        loras = {s.lora_int_id for s in self.running} - {None} if max_loras else set()
        skipped = 0  # waiting sequences passed over, first in line: their adapter cannot run yet
        while len(self.waiting) > skipped and budget > 0:
            seq = self.waiting[skipped]
            if seats + 1 + seq.pending_forks > self.config.max_num_seqs:
                break
            adapter = seq.lora_int_id
            if max_loras and adapter is not None and adapter not in loras and len(loras) >= max_loras:
                skipped += 1  # as vLLM: later requests of the running adapters (or none) go ahead
                continue
            hits = bm.get_computed_blocks(seq)
            num_cached = len(hits) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if cap is not None:
                num_new = min(num_new, cap)
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not bm.allocate_slots(seq, num_new, hits):
                break
            del self.waiting[skipped]
            if adapter is not None:
                loras.add(adapter)
            if seq.first_scheduled is None:  # its first admission (not after a preemption or roll_back)
                seq.num_cached_tokens = num_cached
                seq.first_scheduled = self.clock()  # its queue time ends (vLLM's scheduled_ts)
            self.stats.prefix_query_tokens += seq.num_tokens
            self.stats.prefix_hit_tokens += num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            if self.config.policy == "priority":  # the last one is the one to preempt
                bisect.insort(self.running, seq, key=_rank)
            else:
                self.running.append(seq)
            seats += 1 + seq.pending_forks
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Back to waiting, first in line, holding no blocks: it recomputes from its first token."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        if self.config.policy == "priority":
            bisect.insort(self.waiting, seq, key=_rank)
        else:
            self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add a sibling that shares the parent's blocks (n > 1), running right after it."""
        self.block_manager.fork(parent, child)
        self.running.insert(self.running.index(parent) + 1, child)

    def update_from_output(self, batch: ScheduledBatch, sampled: list[int],
                           sample: Callable[[list[int], list[Sequence]], list[T]],
                           append: Callable[[Sequence, T], bool],
                           on_fork: Callable[[Sequence], None] = lambda child: None) -> list[Sequence]:
        """The bookkeeping after the model ran `batch`; returns the sequences that finished.

        Every scheduled sequence moves past its new tokens. `sampled` are the indices into
        batch.seqs whose logits rows the model returned, in its row order (batch.sampled); a
        parent among them that just finished its prefill forks its n - 1 children here (each
        reported to `on_fork`), and they sample the parent's row. `sample(rows, seqs)` returns one
        result per sequence, rows[i] being seqs[i]'s row; `append(seq, result)` records it and
        says whether seq stops. Stopped sequences are finished in row order, as the engine
        sampled them: the simulator must free blocks in the same order to evict the same ones.

        A sequence with k drafts (engine.speculative) gets k + 1 results, one per row of its
        drafts' step: the drafts equal to what their rows drew are kept, then the draw after the
        last kept one; each is appended in turn (up to one that stops the sequence), and the
        drafts not kept leave its computed tokens."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        parents = [batch.seqs[i] for i in sampled]
        pending, children = [p.pending_forks for p in parents], []
        try:  # the draws (at tp=1 the host waits for the device here): undone whole if they fail
            rows, seqs = self._fork_sampled(parents, children)
            results = sample(rows, seqs)
        except BaseException:
            for child in children:
                self.finish(child)
            for parent, forks in zip(parents, pending):
                parent.pending_forks = forks
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens -= n
            raise
        batch.forks = children
        for child in children:
            on_fork(child)
        finished = []
        for seq, result in zip(seqs, results, strict=True):
            for draw in (self._kept_draws(seq, result) if seq.spec_token_ids else (result,)):
                self.stats.generation_tokens += seq.params.pooling is None  # a pooled vector is no token
                if append(seq, draw):
                    self.finish(seq)
                    finished.append(seq)
                    break
        return finished

    def _kept_draws(self, seq: Sequence, draws: list[T]) -> list[T]:
        """Of a speculating sequence's k + 1 draws, those its output takes: the drafts drawn as
        proposed, and the draw after them. The drafts after the first one drawn otherwise leave
        its computed tokens (their KV slots are written over later)."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        kept = num_kept(drafts, [_token_id(d) for d in draws])
        seq.num_computed_tokens -= len(drafts) - kept
        self.stats.record_drafts(len(drafts), kept)
        return draws[:kept + 1]

    def _fork_sampled(self, seqs: list[Sequence], children: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """-> the row each sequence samples, and the sequences with every fork right after its
        parent; the forks are added to `children` as they are made."""
        rows, out = [], []
        for row, seq in enumerate(seqs):
            rows.append(row)
            out.append(seq)
            for k in range(seq.pending_forks):
                child = seq.fork(index=k + 1)
                self.fork(seq, child)
                children.append(child)
                rows.append(row)
                out.append(child)
            seq.pending_forks = 0
        return rows, out

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:  # (a Ctrl-C may abort one never queued)
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.running)
        assert all(not s.block_table for s in self.waiting), "a waiting sequence holds blocks"
        if self.config.policy == "priority":
            for queue in (self.waiting, self.running):
                ranks = [_rank(s) for s in queue]
                assert ranks == sorted(ranks), "a queue out of (priority, arrival) order"


def _token_id(draw) -> int:
    """The token of a draw: a sampler's result (engine.sampler.SampleResult), or a bare id."""
    return draw if isinstance(draw, int) else draw.token_id


def _rank(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order: lower priority values first, then earlier requests."""
    return seq.params.priority, seq.arrival
