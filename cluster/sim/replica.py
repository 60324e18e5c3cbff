"""One simulated engine replica: the engine's real Scheduler and BlockManager, no model.

`schedule()` is `LLMEngine.step`'s first half (the scheduler's decision); `complete(batch)` is its
bookkeeping after the model ran, through the same `Scheduler.update_from_output`, with the
sampling order the model runner uses (`ScheduledBatch.sampled`). Only the sampled token ids are
invented (`token_fn`) and sequences stop only at max_tokens or max_model_len; with n = 1 and
ignore_eos nothing the scheduler decides depends on the token values, which
tests/test_cluster_sim.py checks by replaying one trace through this class and through a real
LLMEngine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.stats import ReplicaStats
from engine.outputs import EngineStats
from engine.snapshot import DEFAULT_PREFIX_LIMIT, snapshot
from engine.block_manager import BlockManager, kv_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence


@dataclass(frozen=True)
class ReplicaConfig:
    # Defaults: an 8B model on a 24 GB GPU: ~5.6 GB of KV at 128 KB/token = 2800 blocks of 16 tokens.
    num_blocks: int = 2800
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        sizes = (self.num_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
        if min(sizes) < 1:
            raise ValueError(f"every ReplicaConfig field must be >= 1, got {self}")


@dataclass
class StepResult:
    first_token: list[Sequence] = field(default_factory=list)  # sampled their first output token
    finished: list[Sequence] = field(default_factory=list)


def default_token(seq: Sequence) -> int:
    return (seq.seq_id * 7919 + seq.num_tokens) & 0x7FFF


class SimReplica:
    def __init__(self, replica_id: str, config: ReplicaConfig = ReplicaConfig(),
                 token_fn: Callable[[Sequence], int] = default_token) -> None:
        self.replica_id = replica_id
        self.config = config
        self.token_fn = token_fn
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.block_manager, clock=lambda: self.clock)
        self.busy = False  # a step is in flight (between schedule and complete)
        self.clock = 0.0  # simulated time of the last report

    def add(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Sequence:
        n = len(prompt_token_ids)
        if n >= self.config.max_model_len or n + max_tokens > self.config.max_model_len:
            raise ValueError(f"request {request_id}: {n} + {max_tokens} tokens exceed max_model_len")
        if self.block_manager.blocks_for(kv_tokens(n, max_tokens)) > self.config.num_blocks:
            raise ValueError(f"request {request_id} can never fit in {self.config.num_blocks} blocks")
        seq = Sequence(request_id, prompt_token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)
        self.scheduler.add(seq)
        return seq

    def prewarm(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Leave `token_ids`' full blocks in the prefix cache, as if a request with that prompt had
        run and finished here, at no simulated time (the free blocks are evicted as usual)."""
        seq = Sequence(f"prewarm-{len(token_ids)}", list(token_ids), SamplingParams(max_tokens=1), 1)
        if self.block_manager.allocate_slots(seq, len(token_ids)):
            self.block_manager.free(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def complete(self, batch: ScheduledBatch, seconds: float = 0.0) -> StepResult:
        """LLMEngine.step after executor.execute, for n = 1 and ignore_eos; the step took `seconds`
        of simulated time."""
        self.scheduler.stats.record_step(batch.has_prefill, seconds, batch.num_prompt_tokens, batch.num_tokens)
        out = StepResult()
        max_len = self.config.max_model_len

        def append(seq: Sequence, token: int) -> bool:
            seq.token_ids.append(token)
            if seq.num_output_tokens == 1:
                out.first_token.append(seq)
            return seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_len

        out.finished = self.scheduler.update_from_output(
            batch, batch.sampled(self.config.block_size), lambda rows, seqs: [self.token_fn(s) for s in seqs], append)
        return out

    # -- engine.protocol.EngineState (the simulated clock stamps the snapshots) ------------------
    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def stats(self) -> EngineStats:
        return snapshot(self.scheduler, now=self.clock)

    def routing_snapshot(self, prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> EngineStats:
        return snapshot(self.scheduler, prefix_limit, now=self.clock)

    def report(self, now: float, prefix_limit: int = DEFAULT_PREFIX_LIMIT) -> ReplicaStats:
        """What this replica tells the routers at simulated time `now`."""
        self.clock = now
        return ReplicaStats.of(self.routing_snapshot(prefix_limit), self.replica_id)
