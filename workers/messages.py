"""The per-step message from the engine to every rank: deltas, not whole sequences.

The engine process keeps, per live sequence, the block table it last sent; a step carries only
what changed. Each rank keeps the same mirror and rebuilds from it the few fields that
`ModelRunner.prepare` reads from a Sequence:

    engine  seq 7  block_table [3, 9, 4]       sent last step [3, 9]     -> keep=2, new_blocks=[4]
    engine  seq 8  block_table [3, 9, 12]  (copy-on-write replaced 5)    -> keep=2, new_blocks=[12]
    rank    mirror[7] = mirror[7][:keep] + new_blocks                    == [3, 9, 4]

A sequence that is no longer running (finished, aborted or preempted) is listed in `freed` once
and both sides drop its mirror; if it runs again later it is sent whole, like a new one.

The sampling rank also keeps a sampling record per sequence (workers/sampling.py). It gets a
sequence's params and prompt once, the first step the sequence runs, and never its output
tokens, which it drew itself; the record lives until the sequence finishes (preemption keeps
it, with its seeded generator). It answers each step with `Draws`: token ids, and logprobs
(of drawn tokens, of prompt tokens) only where asked. Pure Python: no torch, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import PromptLogprob
from engine.pooling import Pooled
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, SequenceStatus, new_token_ids

if TYPE_CHECKING:  # the mask holds a tensor; this module stays free of torch
    from engine.structured.bitmask import GrammarMask


@dataclass(frozen=True, slots=True)
class SeqDelta:
    seq_id: int
    start: int  # num_computed_tokens before this step: position of token_ids[0]
    token_ids: list[int]  # the tokens computed this step (a prefill chunk, or a decode token and its drafts)
    num_tokens: int  # the sequence's known tokens: start + len(token_ids) >= num_tokens -> sample it (past it: drafts)
    keep: int  # leading block-table entries still valid on the ranks
    new_blocks: list[int]  # entries after them
    scored: tuple[int, int] | None = None  # positions [a, b) whose logits score prompt tokens (prompt logprobs)
    lora: int | None = None  # the LoRA adapter it runs with (engine.lora), by id


@dataclass(frozen=True, slots=True)
class NewSample:
    """What the sampling rank needs to sample a sequence; sent once, the first step it runs."""
    seq_id: int
    index: int  # which of its request's n samples: seeds its generator with params.seed + index
    params: SamplingParams
    prompt_token_ids: list[int]  # for the repetition penalty
    forks: int  # children to fork at its first draw (n - 1 for a request's first sequence)


@dataclass(frozen=True, slots=True)
class SamplingDelta:
    """The sampling rank's part of a step message, applied in field order."""
    forked: list[tuple[int, int, int]]  # (parent seq id, index, child seq id): children drawn for last step
    finished: list[int]  # seq ids whose sampling records to drop
    # (seq id, output tokens): records one draw ahead of the engine's sequence, whose append a
    # step that raised never reached (the engine drew it again), cut back to that many
    rewound: list[tuple[int, int]]
    new: list[NewSample]
    grammar_mask: GrammarMask | None = None  # this step's constrained rows' allowed tokens (~6 KB a row),
    # set by the executor on the encoded message


@dataclass(frozen=True, slots=True)
class StepMessage:
    step: int
    seqs: list[SeqDelta]
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    freed: list[int] = field(default_factory=list)  # seq ids whose mirrors to drop (applied first)
    sampling: SamplingDelta | None = None  # for the sampling rank only


@dataclass(frozen=True, slots=True)
class Draws:
    """The sampling rank's answer to a step: one draw per sampling sequence, in the order of the
    engine's post-step path (each sampling row, then the children its parent forks there)."""
    sampled: list[int]  # indices into StepMessage.seqs of the rows that sampled, in row order
    rows: list[int]  # per draw: its row (forked children repeat their parent's)
    # per draw; a sequence with drafts (engine.speculative): the tokens it keeps (its kept drafts
    # and the draw after them), and its logprobs are a list of as many; a pooling request
    # (engine.pooling): its vector
    token_ids: list[int | list[int] | Pooled]
    # draw -> (its logprob, top logprobs, its rank), if asked
    logprobs: dict[int, tuple[float, list[tuple[int, float]], int] | list[tuple[float, list[tuple[int, float]], int]]]
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)  # msg.seqs index -> its prompt logprobs
    # msg.seqs index -> a pooling request's rows: MEAN's sum (ALL's rows), count
    pooled_rows: dict[int, tuple[list, int]] = field(default_factory=dict)


def _common_prefix(a: list[int], b: list[int]) -> int:
    if len(a) <= len(b) and b[:len(a)] == a:  # the usual case: only appended
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StepEncoder:
    """Engine side: turns a ScheduledBatch into a StepMessage against what the ranks hold."""

    def __init__(self) -> None:
        self.live: dict[int, Sequence] = {}
        self.sent: dict[int, list[int]] = {}  # seq_id -> block table as the ranks have it
        self.sampling: dict[int, Sequence] = {}  # seq_id -> sequence the sampling rank keeps a record of
        self.forked: list[tuple[int, int, int]] = []  # (parent id, index, child id) not yet sent
        # Each sequence the sampling rank drew for last step, and the output tokens its record then
        # holds: the engine's sequence holds as many unless the step raised before its append.
        self.drawn: list[tuple[Sequence, int]] = []
        self.step = 0

    def encode(self, batch: ScheduledBatch) -> StepMessage:
        freed = [sid for sid, s in self.live.items() if s.status is not SequenceStatus.RUNNING]
        for sid in freed:
            del self.live[sid], self.sent[sid]
        deltas = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, table = seq.num_computed_tokens, seq.block_table
            old = self.sent.get(seq.seq_id, [])
            keep = _common_prefix(old, table)
            scored = seq.prompt_logprob_positions(n)
            deltas.append(SeqDelta(seq.seq_id, start, new_token_ids(seq, n), seq.num_tokens,
                                   keep, table[keep:], (scored.start, scored.stop) if scored else None,
                                   seq.lora_int_id))
            self.live[seq.seq_id] = seq
            self.sent[seq.seq_id] = list(table)
        self.step += 1
        return StepMessage(self.step, deltas, list(batch.copies), freed, self._sampling_delta(batch))

    def _sampling_delta(self, batch: ScheduledBatch) -> SamplingDelta:
        finished = [sid for sid, s in self.sampling.items() if s.is_finished]
        for sid in finished:
            del self.sampling[sid]
        new = []
        for seq in batch.seqs:
            if seq.seq_id not in self.sampling:
                self.sampling[seq.seq_id] = seq
                new.append(NewSample(seq.seq_id, seq.index, seq.params, seq.prompt_token_ids, seq.pending_forks))
        forked, self.forked = self.forked, []
        rewound = [(s.seq_id, s.num_output_tokens) for s, held in self.drawn
                   if s.num_output_tokens != held and not s.is_finished]
        self.drawn = []
        return SamplingDelta(forked, finished, rewound, new)

    def add_fork(self, parent_id: int, child: Sequence) -> None:
        """The sampling rank forked `child` from its parent and drew for it under the name
        (parent_id, child.index); the next message gives it the child's seq id."""
        self.forked.append((parent_id, child.index, child.seq_id))
        self.sampling[child.seq_id] = child


class _Window:
    """`token_ids` as ModelRunner.prepare reads it: only this step's slice [start:start + n]."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        if s.start != self.start or s.stop != self.start + len(self.ids):
            raise IndexError(f"rank holds tokens [{self.start}:{self.start + len(self.ids)}], asked {s}")
        return self.ids


@dataclass(slots=True)
class SeqView:
    """The fields of a Sequence that ModelRunner.prepare reads, rebuilt on a rank."""
    seq_id: int
    token_ids: _Window
    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    scored: range = range(0)
    lora_int_id: int | None = None
    spec_token_ids: list[int] = field(default_factory=list)  # its drafts (engine.speculative): its tokens past num_tokens

    def prompt_logprob_positions(self, num_new: int) -> range:
        """As Sequence's: the engine worked it out and sent it."""
        return self.scored


class RankMirror:
    """Rank side: applies StepMessages in order and yields the batch ModelRunner executes."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.step = 0

    def apply(self, msg: StepMessage) -> ScheduledBatch:
        if msg.step != self.step + 1:
            raise RuntimeError(f"step message {msg.step} arrived after step {self.step}: the rank is out of sync")
        self.step = msg.step
        for sid in msg.freed:
            self.tables.pop(sid, None)
        views = []
        for d in msg.seqs:
            table = self.tables.setdefault(d.seq_id, [])
            del table[d.keep:]
            table.extend(d.new_blocks)
            views.append(SeqView(d.seq_id, _Window(d.start, d.token_ids), d.start, d.num_tokens, table,
                                 range(*d.scored) if d.scored else range(0), d.lora,
                                 d.token_ids[max(0, d.num_tokens - d.start):]))
        return ScheduledBatch(seqs=views, num_new_tokens=[len(d.token_ids) for d in msg.seqs],
                              copies=list(msg.copies))
