"""One tensor-parallel rank: a Ray actor holding its shard of the model and of the KV cache.

Lifecycle, each step driven (and timed out) by `workers.group.WorkerGroup`:

    open_store (rank 0) -> connect (ranks > 0) -> init_collective -> load -> allocate_kv
    -> execute(StepMessage) ... -> killed with the group

The rank keeps a mirror of every running sequence's block table (`RankMirror`); each step it
applies the message's deltas, runs the same ModelRunner code as the single-process engine on
its shard, and the sampling rank (rank 0), which alone receives the gathered logits, draws the
tokens with the engine's own sampler (workers/sampling.py).
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.executor import resolve_dtype
from engine.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from engine.lora import LoRAState, attach, load_adapter
from engine.lora_request import LoRARequest
from engine.model.layers import SAMPLING_RANK, TPContext
from engine.model.llama import LlamaModel, ModelArch
from engine.model.loader import dummy_weights, float_parameters, held_weight_bytes, load_arch, prepare_cpu_weights
from engine.model_runner import ModelRunner
from engine.pooling import prompt_rows
from engine.runners import make_runner, step_bytes
from workers.messages import Draws, RankMirror, StepMessage
from workers.sampling import RankSampler
from workers.weights import LoadStats, load_sharded

HOST = "127.0.0.1"  # the group is STRICT_PACKed on one node, so the rendezvous stays on loopback
# Pings and reports run in their own thread so that a rank answers a health check while a long
# step runs; everything else (and so every torch call) stays on one thread, in order.
CONCURRENCY_GROUPS = {"control": 1}
control = ray.method(concurrency_group="control")


def model_fingerprint(arch: ModelArch, dtype: torch.dtype) -> str:
    return f"{arch!r} dtype={dtype}"


def local_gpu_index(ray_gpu_ids: list, visible: str | None) -> int:
    """This actor's GPU as torch numbers it. Ray assigns each rank its GPU id and narrows
    CUDA_VISIBLE_DEVICES to it, so that it is torch's cuda:0; under
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES it leaves the variable as it was, and cuda:0 would
    be the same GPU for every rank (NCCL then refuses to start)."""
    if not ray_gpu_ids:
        return 0
    gpu = str(ray_gpu_ids[0])
    if visible is None:
        return int(gpu)
    shown = [d.strip() for d in visible.split(",")]
    return shown.index(gpu) if gpu in shown else 0


class RankWorker:
    def __init__(self, rank: int, world_size: int, config: EngineConfig, model_dir: str, device: str,
                 eos_token_ids: list[int]) -> None:
        self.rank, self.world_size = rank, world_size
        self.config = config
        self.model_dir = model_dir
        if device == "cuda":  # which of the node's GPUs is this rank's: Ray knows
            device = f"cuda:{local_gpu_index(ray.get_gpu_ids(), os.environ.get('CUDA_VISIBLE_DEVICES'))}"
        self.device = torch.device(device)
        self.store = None
        self.tp: TPContext | None = None
        self.arch: ModelArch | None = None
        self.dtype: torch.dtype | None = None
        self.model: LlamaModel | None = None
        self.runner: ModelRunner | None = None
        self.mirror = RankMirror()
        self.sampler = RankSampler(config.seed, eos_token_ids, config.logprobs_mode) if rank == SAMPLING_RANK else None

    # -- start-up ------------------------------------------------------------------------------
    @control
    def pid(self) -> int:
        return os.getpid()

    def open_store(self, timeout_s: float) -> int:
        """Rank 0: the rendezvous store on a free loopback port (port 0: no race for a port)."""
        self.store = dist.TCPStore(HOST, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))
        return self.store.port

    def connect(self, port: int, timeout_s: float) -> int:
        self.store = dist.TCPStore(HOST, port, self.world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        return self.rank

    def init_collective(self, timeout_s: float) -> str:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # ranks share the node's cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.world_size))
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.tp = TPContext(self.rank, self.world_size, dist.group.WORLD)
        return backend

    def _load_arch(self) -> ModelArch:
        return load_arch(self.model_dir)[0]

    def _check_same_model(self, arch: ModelArch, dtype: torch.dtype) -> None:
        mine = model_fingerprint(arch, dtype)
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.tp.group)
        for r, other in enumerate(everyone):
            if other != everyone[0]:
                raise ValueError(f"rank {r} loaded a different model config or dtype than rank 0 "
                                 f"({other} != {everyone[0]}); every rank must load the same model")

    def load(self) -> dict:
        """Collective: agree on the model, receive this rank's weight shards, size the KV cache."""
        t0 = time.perf_counter()
        arch = self._load_arch()
        dtype = resolve_dtype(self.config.dtype, self.device)
        self._check_same_model(arch, dtype)
        pooling = self.config.runner == "pooling"  # resolved by the driver (WorkerGroupExecutor): no head
        with torch.device(self.device):
            model = LlamaModel(arch, dtype, self.tp, pooling)  # raises "cannot split" before any weight moves
        if self.config.load_format == "dummy":
            dummy_weights(model)
            stats = LoadStats()
        else:
            stats = load_sharded(model, self.model_dir if self.rank == 0 else None, self.tp)
        weight_codes = prepare_cpu_weights(model, self.device, dtype)
        if self.config.enable_lora:
            attach(model, LoRAState())
        self.model, self.arch, self.dtype = model.eval(), arch, dtype
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a freed one's too
        kv_heads = arch.local_kv_heads(self.world_size)
        block_bytes = bytes_per_block(arch.num_layers, self.config.block_size, kv_heads, arch.head_dim, dtype)
        # The largest step measured on every rank (no graphs across ranks): its all-reduces and the
        # sampling rank's logits are allocated now, before the pool takes what is left.
        step = step_bytes(model, self.config, self.config.model_len(arch.max_position_embeddings), kv_heads,
                          self.device, graphs=False)
        return dict(rank=self.rank, max_blocks=num_kv_blocks(self._kv_config(), block_bytes, self.device, step),
                    block_bytes=block_bytes, param_bytes=param_bytes,
                    held_bytes=held_weight_bytes(model), bytes_read=stats.bytes_read,
                    bytes_received=stats.bytes_received, files_opened=stats.files_opened, weight_codes=weight_codes,
                    load_s=time.perf_counter() - t0, memory_after_load=self.memory())

    def _kv_config(self) -> EngineConfig:
        # CPU ranks share one host's RAM: split the RAM-derived budget between them. An explicit
        # --kv-cache-memory, like GPU memory, is per rank.
        if self.device.type != "cpu":
            return self.config
        c = self.config
        return dataclasses.replace(c, cpu_kv_cache_fraction=c.cpu_kv_cache_fraction / self.world_size,
                                   max_cpu_kv_cache_bytes=c.max_cpu_kv_cache_bytes // self.world_size)

    def allocate_kv(self, num_blocks: int) -> dict:
        kv = allocate_kv_cache(self.arch.num_layers, num_blocks, self.config.block_size,
                               self.arch.local_kv_heads(self.world_size), self.arch.head_dim, self.dtype, self.device)
        # No CUDA graphs across ranks: a captured step would hold the NCCL all-reduces too.
        max_model_len = self.config.model_len(self.arch.max_position_embeddings)
        self.runner = make_runner(self.model, kv, self.config, max_model_len, self.device, graphs=False)
        return dict(rank=self.rank, kv_bytes=sum(k.numel() * k.element_size() * 2 for k, _ in kv))

    # -- serving -------------------------------------------------------------------------------
    def execute(self, msg: StepMessage) -> Draws | None:
        """-> the sampling rank: the step's draws (token ids, asked-for logprobs and prompt logprobs);
        other ranks: None."""
        batch = self.mirror.apply(msg)
        if self.sampler is not None:
            self.sampler.apply(msg.sampling)
        out = self.runner.execute(batch)  # logits: (len(sampled), vocab) on the sampling rank
        if self.sampler is None:
            if out.prompt_rows is not None and out.pooled is None:
                for _ in out.prompt_rows.logits():  # each chunk's logits are a collective: take part
                    pass
            return None
        seq_ids = [d.seq_id for d in msg.seqs]
        draws = self.sampler.draw(out.logits if out.pooled is None else out.pooled, out.sampled,
                                  [seq_ids[i] for i in out.sampled], msg.sampling.grammar_mask,
                                  [batch.seqs[i].spec_token_ids for i in out.sampled], pooled=out.pooled is not None)
        if out.prompt_spans and out.pooled is not None:  # a pooling request's rows: MEAN's sums, ALL's rows
            every_token = {s.index for s in out.prompt_spans
                           if self.sampler.records[seq_ids[s.index]].params.pooling.every_token}
            draws = dataclasses.replace(draws, pooled_rows=prompt_rows(out.prompt_rows.hidden, out.prompt_spans,
                                                                       every_token))
        elif out.prompt_spans:  # only their numbers leave the group, never the logits rows
            prompt = self.sampler.prompt_logprobs(out.prompt_rows.logits(), out.prompt_spans,
                                                  [seq_ids[span.index] for span in out.prompt_spans])
            draws = dataclasses.replace(draws, prompt_logprobs=prompt)
        return draws

    def add_lora(self, lora: LoRARequest) -> str | None:
        """Load this rank's shard of an adapter (engine.lora); -> why it cannot be, or None. Not
        raised: a bad adapter is the request's fault, and a rank that raises fails the group."""
        try:
            self.model.lora.adapters[lora.lora_int_id] = load_adapter(lora, self.model, self.config.max_lora_rank)
        except InvalidRequestError as e:
            return e.message
        except Exception as e:  # whatever else a file can make the loader raise: its words, not the group's end
            return f"LoRA adapter {lora.lora_path!r} could not be loaded: {e!r}"
        return None

    def remove_lora(self, lora_int_id: int) -> None:
        self.model.lora.adapters.pop(lora_int_id, None)

    @control
    def ping(self) -> int:
        return self.rank

    @control
    def memory(self) -> dict:
        """CUDA: peak and current bytes allocated by torch. CPU: the process's peak RSS (which
        counts the checkpoint pages rank 0 had mapped) and its anonymous RSS now (tensors,
        interpreter and libraries; no file pages)."""
        if self.device.type == "cuda":
            return dict(peak_bytes=torch.cuda.max_memory_allocated(self.device),
                        current_bytes=torch.cuda.memory_allocated(self.device))
        with open("/proc/self/status") as f:
            anon = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
        return dict(peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, current_bytes=anon)

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (its shards), for tests and debugging."""
        return {n: p.detach().cpu().clone() for n, p in float_parameters(self.model).items()}

    def mirror_tables(self) -> dict[int, list[int]]:
        return {k: list(v) for k, v in self.mirror.tables.items()}

    def sampling_records(self) -> list:
        """The keys of the sampling rank's records (seq ids; (parent id, index) until renamed)."""
        return list(self.sampler.records) if self.sampler is not None else []
