"""WorkerGroupExecutor: the engine's Executor for tensor_parallel_size > 1.

Process layout: the engine process (scheduler, detokenizer) is not a rank. All N ranks are Ray
actors of one WorkerGroup, symmetric, each with its shard of the weights and KV cache; rank 0 is
also the sampling rank:

    engine process ──StepMessage (deltas)──────────> rank 0 ┐ gloo / NCCL all-reduce inside the
        scheduler  ──StepMessage (deltas)──────────> rank 1 ├ model; the lm_head gathers the
                   <──Draws (token ids, logprobs)── rank 0 ┘ logits to rank 0, which samples

Why not make the engine process rank 0 (vLLM's driver worker)? Keeping torch.distributed out of
the engine process means a dead or stuck rank can never wedge it inside a collective: the engine
only waits on Ray futures, sees a dead actor at once, and can tear the group down and build a new
one in the same process. It also lets the engine run where there is no GPU (a Serve replica with
zero GPUs) while every GPU rank sits in one placement group.

Rank 0 samples with the engine's own SequenceSampler (workers/sampling.py) and keeps each
sequence's sampling record (params and prompt, sent once; the tokens it drew; its seeded
generator), so seeds, penalties, stop rules and n > 1 forks are the tp=1 code path unchanged,
and only token ids, plus the logprobs a request asked for, come back each step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import ray
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.executor import ModelInfo, load_model_info, resolve_dtype
from engine.lora_request import LoRARequest
from engine.model_source import model_name
from engine.outputs import PromptLogprob
from engine.pooling import Pooled
from engine.sampler import SampleResult
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.structured.bitmask import GrammarMask
from workers.group import WorkerGroup, WorkerGroupConfig, WorkerGroupError
from workers.messages import Draws, StepEncoder
from workers.rank import RankWorker

logger = logging.getLogger(__name__)

__all__ = ["WorkerGroupExecutor", "WorkerGroupError"]


def _ensure_ray() -> bool:
    """Start a local Ray instance unless one is already up (tests, Serve); True if we started it."""
    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    return True


@dataclass
class RankDraws:
    """What the sampling rank drew for a step, handed to the engine's post-step path."""
    draws: Draws
    encoder: StepEncoder

    @property
    def sampled(self) -> list[int]:
        return self.draws.sampled

    @property
    def prompt_logprobs(self) -> dict[int, list[PromptLogprob]]:
        return self.draws.prompt_logprobs

    @property
    def pooled_rows(self) -> dict[int, tuple[list, int]]:
        return self.draws.pooled_rows

    def sample(self, rows: list[int], seqs: list[Sequence]) -> list[SampleResult]:
        """The rank forked and drew for the same children the engine has just forked; tell the
        encoder their seq ids, so that the next message names them."""
        d = self.draws
        if rows != d.rows:
            raise RuntimeError(f"the engine samples rows {rows}, the sampling rank drew rows {d.rows}")
        parent_of: dict[int, int] = {}  # row -> seq id of the sequence that owns it
        results = []
        # before the engine appends: the tokens each record then holds (a draw with drafts: several)
        self.encoder.drawn = [(seq, seq.num_output_tokens + (len(t) if isinstance(t, list) else
                                                             0 if isinstance(t, Pooled) else 1))
                              for seq, t in zip(seqs, d.token_ids)]
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if row in parent_of:
                self.encoder.add_fork(parent_of[row], seq)
            else:
                parent_of[row] = seq.seq_id
            token = d.token_ids[i]
            if isinstance(token, Pooled):  # a pooling request's vector (engine.pooling)
                results.append(token)
                continue
            if isinstance(token, list):  # a draw with drafts (engine.speculative): the tokens it keeps
                asked = d.logprobs.get(i) or [(None, None, None)] * len(token)
                results.append([SampleResult(t, *lp) for t, lp in zip(token, asked)])
                continue
            logprob, top, rank = d.logprobs.get(i, (None, None, None))
            results.append(SampleResult(token, logprob, top, rank))
        return results


class WorkerGroupExecutor:
    def __init__(self, config: EngineConfig, group_config: WorkerGroupConfig | None = None,
                 worker_cls: type = RankWorker) -> None:
        t0 = time.perf_counter()
        spec = load_model_info(config)
        spec.arch.check_tp(config.tensor_parallel_size)  # before any actor starts or any weight is read
        self._owns_ray = _ensure_ray()
        # the ranks build the model this resolved runner asks for (no head where it pools): the
        # folder is read for it once, here
        ranks = dataclasses.replace(config, runner="pooling" if spec.pooler is not None else "generate")
        try:
            self.group = WorkerGroup(ranks, str(spec.model_dir), spec.eos_token_ids,
                                     group_config or WorkerGroupConfig(), worker_cls)
        except BaseException:
            if self._owns_ray:
                ray.shutdown()
            raise
        self.encoder = StepEncoder()
        self.info = ModelInfo(spec.model_dir, spec.tokenizer, spec.eos_token_ids, spec.arch.vocab_size,
                              spec.arch.max_position_embeddings, self.group.num_blocks, torch.device("cpu"),
                              resolve_dtype(config.dtype, torch.device(self.group.device)), spec.pooler)
        self.startup_s = time.perf_counter() - t0
        logger.info("tp=%d worker group for %s up in %.1fs; KV cache %d blocks x %d tokens",
                    config.tensor_parallel_size, model_name(config, spec.model_dir), self.startup_s, self.group.num_blocks,
                    config.block_size)

    def execute(self, batch: ScheduledBatch, grammar_mask: GrammarMask | None = None) -> RankDraws:
        msg = self.encoder.encode(batch)
        if grammar_mask is not None:  # the constrained rows' masks go to the sampling rank with its part
            msg = dataclasses.replace(msg, sampling=dataclasses.replace(msg.sampling, grammar_mask=grammar_mask))
        return RankDraws(self.group.execute(msg), self.encoder)

    def add_lora(self, lora: LoRARequest) -> None:
        """Every rank loads its shard of the adapter (engine.lora); InvalidRequestError for one
        that does not fit the model, the ranks that took it unloading it again."""
        refusals = [why for why in self.group.call_all("add_lora", lora) if why is not None]
        if refusals:
            self.remove_lora(lora.lora_int_id)
            raise InvalidRequestError("model", refusals[0])

    def remove_lora(self, lora_int_id: int) -> None:
        self.group.call_all("remove_lora", lora_int_id)

    @property
    def healthy(self) -> bool:
        return self.group.healthy

    def check_health(self) -> None:
        self.group.check_health()

    def stats(self) -> dict:
        """Start-up time, and per rank: bytes read from storage, received, parameters, KV, peak memory."""
        return dict(startup_s=self.startup_s, group_startup_s=self.group.startup_s, num_blocks=self.group.num_blocks,
                    ranks=self.group.reports)

    def shutdown(self) -> None:
        self.group.shutdown()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
