"""Which model runner a device gets, chosen once at start-up and named in the log:

    CPU   engine.model_runner.ModelRunner: torch attention and the native C kernels
    CUDA  engine.triton_runner.TritonModelRunner: Triton paged attention over the pool in place,
          CUDA graphs for decode steps unless --enforce-eager (or tensor parallel ranks)

The CUDA runner is imported only on CUDA, so CPU hosts need no Triton. KVSERVE_ATTENTION_BACKEND=torch
(as vLLM's VLLM_ATTENTION_BACKEND) keeps a CUDA engine on the torch runner, to compare or bisect.
"""
from __future__ import annotations

import gc
import logging
import os

import torch

from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_cache
from engine.model.llama import LlamaModel
from engine.model_runner import ModelRunner
from engine.prompt_logprobs import PROMPT_LOGITS_BYTES

logger = logging.getLogger(__name__)


def triton_backend(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("KVSERVE_ATTENTION_BACKEND", "triton") != "torch"


def num_speculative_tokens(config: EngineConfig) -> int:
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def triton_runner(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], config: EngineConfig,
                  max_model_len: int, device: torch.device):
    from engine.triton_runner import TritonModelRunner

    return TritonModelRunner(model, kv_caches, config.block_size, device, config.max_num_seqs,
                             config.max_num_batched_tokens, max_model_len, num_speculative_tokens(config),
                             config.cudagraph_capture_sizes, config.max_cudagraph_capture_size)


def make_runner(model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], config: EngineConfig,
                max_model_len: int, device: torch.device, graphs: bool = True) -> ModelRunner:
    if not triton_backend(device):
        logger.info("attention backend: torch%s", " + native CPU kernels" if _native_cpu() else "")
        return ModelRunner(model, kv_caches, config.block_size, device)
    runner = triton_runner(model, kv_caches, config, max_model_len, device)
    sizes = runner.capture_graphs() if graphs and not config.enforce_eager else []
    logger.info("attention backend: triton (paged, in place); CUDA graphs: %s",
                f"decode steps of {', '.join(map(str, sizes))} rows" if sizes else "off (eager)")
    return runner


def step_bytes(model: LlamaModel, config: EngineConfig, max_model_len: int, kv_heads: int, device: torch.device,
               graphs: bool = True) -> int | None:
    """What a pool sized from device memory leaves for a step: measured (cuda_step_bytes) on CUDA
    with the Triton runner; None (kv_cache's fixed share) otherwise, or when the pool's size is
    given. A tensor-parallel rank measures too: every rank decides alike and runs the profile's
    collectives in step."""
    if not triton_backend(device) or config.num_gpu_blocks_override is not None or config.kv_cache_memory is not None:
        return None
    return cuda_step_bytes(model, config, max_model_len, kv_heads, device, graphs)


def cuda_step_bytes(model: LlamaModel, config: EngineConfig, max_model_len: int, kv_heads: int,
                    device: torch.device, graphs: bool = True) -> int:
    """Device memory a step needs beyond the weights and the KV pool: the largest step's peak
    (activations, logits) and the decode graphs' pool, measured on a one-block pool that is freed
    again, so that the real pool can be sized from what is left."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    a = model.arch
    kv = allocate_kv_cache(a.num_layers, 1, config.block_size, kv_heads, a.head_dim, next(model.parameters()).dtype,
                           device)
    runner = triton_runner(model, kv, config, max_model_len, device)
    runner.profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - base
    if graphs and not config.enforce_eager:  # their pool stays reserved beside a step's activations: the sum
        torch.cuda.empty_cache()  # capture empties the cache too: measured from here, its growth is the pool
        reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        runner.capture_graphs()
        torch.cuda.synchronize(device)
        peak += torch.cuda.max_memory_reserved(device) - reserved
    rows = runner.inputs.max_seqs  # a sampled row per sequence, and per draft
    del runner, kv
    gc.collect()
    torch.cuda.empty_cache()
    logits = rows * a.vocab_size * 4
    # The sampler's float32 copies of the logits (probs, noise, ...; the processed logprobs modes
    # keep the drawn-from logits and their log-softmax too), and prompt logprobs' chunk of logits
    # with its log-softmax temporaries.
    copies = 7 if config.logprobs_mode.startswith("processed") else 4
    step = peak + copies * logits + 3 * PROMPT_LOGITS_BYTES
    logger.info("a step needs %.0f MiB beside weights and KV pool (largest step and decode graphs, measured)",
                step / (1 << 20))
    return step


def _native_cpu() -> bool:
    from engine import cpu_kernels
    return cpu_kernels.enabled()
