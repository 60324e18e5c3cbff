"""Where model steps run: in-process for tensor_parallel_size == 1, a worker group otherwise."""
from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.encoder_runner import EncoderRunner, encoder_blocks
from engine.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from engine.lora import LoRAState, attach, load_adapter
from engine.lora_request import LoRARequest
from engine.model.llama import ModelArch
from engine.model.loader import build_model, load_arch
from engine.model.quantized import check_method
from engine.model_source import ENCODER_NAMES, load_tokenizer, model_dir as find_model_dir, model_name, tokenizer_dir
from engine.outputs import PromptLogprob
from engine.pooling import Pooled, PoolerConfig, pool, pooler_config, prompt_rows
from engine.prompt_logprobs import prompt_logprobs
from engine.runners import make_runner, step_bytes
from engine.sampler import SampleResult, SequenceSampler
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.structured.bitmask import GrammarMask

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    model_dir: Path
    tokenizer: object
    eos_token_ids: list[int]
    vocab_size: int
    max_position_embeddings: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    pooler: PoolerConfig | None = None  # how a pooling engine pools (engine.pooling); None: it generates


class StepDraws(Protocol):
    """One executed step, as the engine's post-step path (Scheduler.update_from_output) reads it."""

    sampled: list[int]  # indices into batch.seqs of the sequences that sample, in row order
    prompt_logprobs: dict[int, list[PromptLogprob]]  # index into batch.seqs -> this step's prompt logprobs
    pooled_rows: dict[int, tuple[list, int]]  # index -> a pooling request's rows: MEAN's sum (ALL's rows), count

    def sample(self, rows: list[int], seqs: list[Sequence]) -> list[SampleResult]:
        """One draw per sequence, seqs[i] from row rows[i]; a parent's freshly forked children
        follow it and share its row."""
        ...


class Executor(Protocol):
    info: ModelInfo

    def execute(self, batch: ScheduledBatch, grammar_mask: GrammarMask | None = None) -> StepDraws:
        """Run the model on `batch`. Sampling happens where the logits are: here at tp=1, on the
        sampling rank at tp > 1 (then only token ids and asked-for logprobs come back), with the
        constrained rows' `grammar_mask` (rows in `sampled` order) applied first."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class LocalDraws:
    """tp=1: the logits stay in this process and are sampled when the engine asks."""
    logits: torch.Tensor  # (len(sampled), vocab) float32
    sampled: list[int]
    sampler: SequenceSampler
    grammar_mask: GrammarMask | None = None
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)
    pooled: torch.Tensor | None = None  # a pooling engine's: the sampled rows' final hidden states, not logits
    pooled_rows: dict[int, tuple[list, int]] = field(default_factory=dict)

    def sample(self, rows: list[int], seqs: list[Sequence]) -> list[SampleResult | Pooled]:
        if self.pooled is not None:
            return pool(self.pooled, rows)
        return self.sampler.sample(self.logits, rows, seqs, self.grammar_mask)


def resolve_device(name: str) -> torch.device:
    """The device to run on; a CUDA one with its index (torch.cuda.set_device refuses bare "cuda")."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name}: no CUDA device is available here (torch {torch.__version__})")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def eos_token_ids(model_dir: Path, hf_config, tokenizer) -> list[int]:
    """The ids HF generate stops on: generation_config.json's, else the model config's."""
    from transformers import GenerationConfig

    eos = None
    if (model_dir / "generation_config.json").exists():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@dataclass(frozen=True)
class ModelSpec:
    """The model as its directory describes it, read before any weight is loaded."""
    model_dir: Path
    arch: ModelArch
    tokenizer: object
    eos_token_ids: list[int]
    device: torch.device
    pooler: PoolerConfig | None = None


def load_model_info(config: EngineConfig) -> ModelSpec:
    model_dir = find_model_dir(config)
    arch, hf_config = load_arch(model_dir)
    check_method(config.quantization, arch.quantization)
    pooler = pooler_config(config.runner, config.convert, config.pooler_config, model_dir, hf_config)
    tokenizer = load_tokenizer(tokenizer_dir(config, model_dir), config.trust_remote_code)
    return ModelSpec(model_dir, arch, tokenizer, eos_token_ids(model_dir, hf_config, tokenizer),
                     resolve_device(config.device), pooler)


class LocalExecutor:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        spec = load_model_info(config)
        model_dir, arch, device = spec.model_dir, spec.arch, spec.device
        if device.type == "cuda":  # Triton launches, graph capture and step events use the current device
            torch.cuda.set_device(device)
        dtype = resolve_dtype(config.dtype, device)
        self.model = build_model(model_dir, dtype, device, pooling=spec.pooler is not None,
                                 dummy=config.load_format == "dummy")
        max_model_len = config.model_len(arch.max_position_embeddings)
        if arch.encoder:  # no KV cache (engine.encoder_runner)
            num_blocks = encoder_blocks(config, max_model_len)
            self.runner = EncoderRunner(self.model, spec.pooler.seq_pooling_type, config.block_size, device)
        else:
            block_bytes = bytes_per_block(arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, dtype)
            num_blocks = num_kv_blocks(config, block_bytes, device,
                                       step_bytes(self.model, config, max_model_len, arch.num_kv_heads, device))
            kv = allocate_kv_cache(arch.num_layers, num_blocks, config.block_size, arch.num_kv_heads, arch.head_dim,
                                   dtype, device)
            self.runner = make_runner(self.model, kv, config, max_model_len, device)
        self.max_lora_rank = config.max_lora_rank
        if config.enable_lora:
            if arch.encoder:
                raise ValueError(f"LoRA adapters are not supported for encoder models ({ENCODER_NAMES})")
            attach(self.model, LoRAState())
        self.sampler = SequenceSampler(config.seed, spec.eos_token_ids, config.logprobs_mode)
        self.info = ModelInfo(model_dir, spec.tokenizer, spec.eos_token_ids, arch.vocab_size,
                              arch.max_position_embeddings, num_blocks, device, dtype, spec.pooler)
        logger.info("loaded %s on %s (%s) in %.1fs; %s", model_name(config, model_dir), device, dtype,
                    time.perf_counter() - t0, "an encoder: no KV cache" if arch.encoder else
                    f"KV cache {num_blocks} blocks x {config.block_size} tokens")

    def execute(self, batch: ScheduledBatch, grammar_mask: GrammarMask | None = None) -> LocalDraws:
        out = self.runner.execute(batch)
        prompt, rows = {}, {}
        if out.prompt_spans and out.pooled is not None:  # a pooling model's prompt rows: MEAN's sums, ALL's rows
            rows = prompt_rows(out.prompt_rows.hidden, out.prompt_spans,
                               {s.index for s in out.prompt_spans if batch.seqs[s.index].params.pooling.every_token})
        elif out.prompt_spans:
            prompt = prompt_logprobs(out.prompt_rows.logits(), out.prompt_spans,
                                     [batch.seqs[s.index] for s in out.prompt_spans])
        return LocalDraws(out.logits, out.sampled, self.sampler, grammar_mask, prompt, out.pooled, rows)

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter (engine.lora) for requests whose params name it; InvalidRequestError
        for one that does not fit the model."""
        self.model.lora.adapters[lora.lora_int_id] = load_adapter(lora, self.model, self.max_lora_rank)

    def remove_lora(self, lora_int_id: int) -> None:
        self.model.lora.adapters.pop(lora_int_id, None)

    def shutdown(self) -> None:
        pass


EXECUTOR_BACKENDS = {"ray": "workers.executor:WorkerGroupExecutor"}


def make_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config)
    # The engine names its multi-rank executor instead of importing it: the engine package stays
    # free of Ray and of our other packages, and a deployment can plug in its own (vLLM's
    # --distributed-executor-backend).
    path = EXECUTOR_BACKENDS.get(config.distributed_executor_backend, config.distributed_executor_backend)
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)(config)
