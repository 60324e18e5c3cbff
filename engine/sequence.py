"""Per-sequence state shared by the scheduler, block manager and model runner."""
from __future__ import annotations

import enum
import itertools

from engine.hashing import request_root
from engine.lora_request import lora_id
from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One token stream. A request with n > 1 forks into n sequences after its prefill.

    `num_computed_tokens` is how many of `token_ids` already have KV in the cache; the scheduler
    advances it toward len(token_ids) under the step's token budget (prefill chunks and decodes
    alike), which is what makes chunked prefill and recompute-preemption uniform.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.arrival = self.seq_id  # its request's order of arrival: a fork keeps its parent's
        self.request_id = request_id
        self.index = index  # which of the request's n samples this is
        self.params = params
        self.max_tokens = max_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, filled lazily
        self.root_hash = request_root(params)  # the first block's parent: its salt's and adapter's (engine.hashing)
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.num_prompt_logprobs = 0  # prompt positions [0, k) whose logits gave token k's logprob (or were pooled)
        self.first_scheduled: float | None = None  # the scheduler's clock when it first admitted it
        # Tokens guessed to follow token_ids, computed this step after them (engine.speculative);
        # the scheduler sets them when it schedules the sequence and clears them after the step.
        self.spec_token_ids: list[int] = []
        # (buffer, n): token_ids[:n] as an int64 array, grown as they are (engine.speculative.token_array;
        # None until the sequence drafts)
        self.token_array = None

    @property
    def lora_int_id(self) -> int | None:
        """The LoRA adapter it runs with (engine.lora), by id; None: the base model."""
        return lora_id(self.params)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether prompt rows before the last are still owed: for prompt logprobs, or to a
        mean-pooling request (engine.pooling), which sums them."""
        p = self.params
        return ((p.prompt_logprobs is not None or (p.pooling is not None and p.pooling.pools_every_row))
                and self.num_prompt_logprobs < self.num_prompt_tokens - 1)

    @property
    def max_cached_tokens(self) -> int:
        """Leading tokens the prefix cache may supply: all but the last (its logits are sampled),
        and while prompt logprobs are owed, none past them: a cached token's logits are gone."""
        if self.owes_prompt_logprobs:
            return self.num_prompt_logprobs
        return self.num_tokens - 1

    def prompt_logprob_positions(self, num_new: int) -> range:
        """The positions among this step's `num_new` whose logits score the next prompt token for
        its prompt logprob (position p's logits give token p + 1's); empty when none are owed."""
        if not self.owes_prompt_logprobs:
            return range(0)
        start = max(self.num_computed_tokens, self.num_prompt_logprobs)  # a recompute skips what it has
        return range(start, max(start, min(self.num_computed_tokens + num_new, self.num_prompt_tokens - 1)))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int) -> "Sequence":
        """A sibling sharing everything computed so far (the block manager shares the blocks)."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params, self.max_tokens, index)
        child.arrival = self.arrival
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_prompt_logprobs = self.num_prompt_logprobs
        child.first_scheduled = self.first_scheduled
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")


def new_token_ids(seq, n: int) -> list[int]:
    """The `n` tokens a step computes of `seq` (a Sequence, or a rank's view of one), from its
    first without KV: its own, then its drafts."""
    start = seq.num_computed_tokens
    ids = seq.token_ids[start:start + n]
    if len(ids) < n:
        ids = list(ids) + list(seq.spec_token_ids[:n - len(ids)])
    return ids


def num_kept(drafts: list[int], token_ids: list[int]) -> int:
    """How many of a step's drafts (engine.speculative) the output keeps: those equal to what
    their rows drew (token_ids, one per row from the sequence's own on), up to the first that is not."""
    kept = 0
    while kept < len(drafts) and token_ids[kept] == drafts[kept]:
        kept += 1
    return kept
