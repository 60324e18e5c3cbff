"""Engine configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass, fields

# What logprobs report (vLLM's --logprobs-mode; engine.sampler computes them)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# vLLM's --quantization values for the checkpoints engine.model.quantized reads (its kernels' names too)
QUANTIZATION_NAMES = ("gptq", "awq", "compressed-tensors", "gptq_marlin", "awq_marlin", "auto_gptq", "auto_awq")
# vLLM's --load-format values taken here: safetensors (auto), or dummy random weights (engine.model.loader)
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    # A local HF-style dir with safetensors, or a repository id found in the local Hugging Face cache
    # (never downloaded); None = the embedded SmolLM2.
    model: str | None = None
    revision: str | None = None  # the cached repository's branch, tag or commit (default: main)
    download_dir: str | None = None  # the Hugging Face cache to look in (default: HF_HUB_CACHE)
    tokenizer: str | None = None  # a directory or cached repository id; defaults to the model's
    tokenizer_revision: str | None = None  # the tokenizer repository's revision (default: main)
    trust_remote_code: bool = False  # let a tokenizer run the code its directory ships (transformers' auto_map)
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    block_size: int = 16  # tokens per KV block
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (wins over the rest)
    kv_cache_memory: int | None = None  # bytes for the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV
    cpu_kv_cache_fraction: float = 0.25  # CPU: fraction of available RAM for the KV cache, capped below
    max_cpu_kv_cache_bytes: int = 2 << 30
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 128  # running sequences per step
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's --long-prefill-token-threshold: a prompt chunk takes at most this many tokens a step
    # while other requests run or wait (0: no cap); --long-prefill-token-threshold-adaptive: the
    # cap is never below max_num_batched_tokens / the requests running and waiting
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    # vLLM's --scheduling-policy: "fcfs", or "priority" (waiting requests by their priority, lower
    # first, then arrival; the lowest-priority running sequence is the one preempted).
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    # What runs the ranks when tensor_parallel_size > 1: "ray" (workers.executor's Ray worker group),
    # or "package.module:Class" of an Executor built as Class(config).
    distributed_executor_backend: str = "ray"
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (vLLM's --enforce-eager)
    # CUDA: the decode step sizes (rows) graphs are captured at (vLLM's --cudagraph-capture-sizes),
    # else engine.cuda_graphs' buckets up to max_cudagraph_capture_size (default: max_num_seqs, or
    # with speculative decoding the rows of a step with drafts, up to 512)
    cudagraph_capture_sizes: tuple | None = None
    max_cudagraph_capture_size: int | None = None
    stream_interval: int = 1  # a running request's output every N tokens (the first and the last at once)
    # Logprobs a request may ask per token (logprobs, prompt_logprobs), vLLM's --max-logprobs: its
    # default is OpenAI's top_logprobs bound; -1: no cap (a request's -1 asks the whole vocabulary).
    max_logprobs: int = 20
    # What logprobs report, vLLM's --logprobs-mode (LOGPROBS_MODES): raw_logprobs,
    # raw_logits, processed_logprobs, processed_logits (after penalties, bias, temperature, top_k...).
    logprobs_mode: str = "raw_logprobs"
    # LoRA adapters (vLLM's flags; engine.lora): a request names its adapter (LLM.generate's
    # lora_request, the server's model name); at most max_loras adapters run in one step, of rank
    # at most max_lora_rank, and max_cpu_loras stay loaded (default: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's speculative decoding config (engine.speculative): a dict, its JSON or None; kvserve's
    # method is n-gram prompt lookup, {"method": "ngram", "num_speculative_tokens": k, ...}.
    speculative_config: object = None
    # Pooling (engine.pooling; vLLM's --runner, --convert, --pooler-config): "pooling" turns each
    # prompt into its embedding instead of generating; "auto" pools a sentence-transformers folder
    # or an embedding architecture. pooler_config: a dict or its JSON (pooling_type, use_activation,
    # dimensions).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: object = None
    # vLLM's: config.json fields set over the model folder's (a dict or its JSON; engine.hf_overrides),
    # e.g. a causal-LM reranker made a classifier with classifier_from_token
    hf_overrides: object = None
    # vLLM's --quantization: a GPTQ, AWQ or compressed-tensors checkpoint's method
    # (engine.model.quantized), which its config.json gives when None; given, it must be that one
    quantization: str | None = None
    # vLLM's --load-format: "dummy" fills the weights at random (vLLM's uniform +-1e-3) instead of
    # reading them, so a folder with a config.json and a tokenizer alone serves, for benchmarks
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) and str(self.dtype).startswith("torch."):  # a torch.dtype, as vLLM takes
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype in DTYPE_ALIASES:  # vLLM's names
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for f in fields(self):  # bool and int fields: numpy's too, stored as Python's; nothing else
            value = getattr(self, f.name)
            if value is None and f.type.endswith("| None"):
                continue
            if f.type == "bool":
                need(isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"),
                     f"{f.name} must be True or False, got {value!r}")
                object.__setattr__(self, f.name, bool(value))
            elif f.type in ("int", "int | None"):
                need(isinstance(value, numbers.Integral) and not isinstance(value, bool),  # numpy's bools are not Integral
                     f"{f.name} must be an integer, got {value!r}")
                object.__setattr__(self, f.name, int(value))
        if self.distributed_executor_backend in ("mp", "uni") and self.tensor_parallel_size == 1:
            object.__setattr__(self, "distributed_executor_backend", "ray")  # vLLM's names; one rank runs in process

        need(self.quantization is None or self.quantization in QUANTIZATION_NAMES,
             f"quantization must be one of {', '.join(QUANTIZATION_NAMES)} (a quantized checkpoint's method), "
             f"got {self.quantization!r}")
        need(self.load_format in LOAD_FORMATS,
             f"load_format must be {'|'.join(LOAD_FORMATS)}, got {self.load_format!r}")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), f"block_size must be a power of two <= 128, got {self.block_size}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 2,
             f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be > 0 bytes")
        need(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
             f"device must be auto|cpu|cuda|cuda:N, got {self.device!r}")
        need(0.0 < self.cpu_kv_cache_fraction <= 1.0,
             f"cpu_kv_cache_fraction must be in (0, 1], got {self.cpu_kv_cache_fraction}")
        need(0.0 < self.gpu_memory_utilization <= 1.0, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto|float32|bfloat16|float16 (or half|float), got {self.dtype!r}")
        need(self.max_logprobs >= -1, f"max_logprobs must be >= 0, or -1 for no cap, got {self.max_logprobs}")
        need(self.logprobs_mode in LOGPROBS_MODES,
             f"logprobs_mode must be {'|'.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("model", "revision", "tokenizer", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, str) and value != ""), f"{name} must be a non-empty string")
        if self.tokenizer_revision is None and self.tokenizer is not None and self.revision is not None:
            object.__setattr__(self, "tokenizer_revision", self.revision)  # vLLM's default
        need(self.scheduling_policy in ("fcfs", "priority"),
             f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        need(self.stream_interval >= 1, f"stream_interval must be >= 1, got {self.stream_interval}")
        need(self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_capture_sizes(need)
        need(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        need(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.speculative_config is not None:
            from engine.speculative import SpeculativeConfig  # numpy: only when asked for

            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        from engine.pooling import CONVERTS, RUNNERS, parse_pooler_config

        need(self.runner in RUNNERS, f"runner must be {'|'.join(RUNNERS)}, got {self.runner!r}")
        need(self.convert in CONVERTS, f"convert must be {'|'.join(CONVERTS)}, got {self.convert!r}")
        need(not (self.runner == "generate" and self.convert == "embed"),
             "convert 'embed' makes a pooling model: it needs runner 'pooling' (or 'auto')")
        if self.pooler_config is not None:
            parse_pooler_config(self.pooler_config)  # raises for what is not taken, before any model loads
        from engine.hf_overrides import parse_hf_overrides

        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides) or None)  # {}: None
        need(self.distributed_executor_backend == "ray" or ":" in self.distributed_executor_backend,
             f"distributed_executor_backend must be 'ray' or 'package.module:Class' (vLLM's 'mp' and 'uni' "
             f"only with tensor_parallel_size 1), got {self.distributed_executor_backend!r}")

    def _check_capture_sizes(self, need) -> None:
        sizes, largest = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        need(largest is None or largest >= 1, f"max_cudagraph_capture_size must be >= 1, got {largest}")
        if sizes is None:
            return
        need(isinstance(sizes, (list, tuple)) and all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                                      and s >= 1 for s in sizes),
             f"cudagraph_capture_sizes must be a list of integers >= 1, got {sizes!r}")
        sizes = tuple(sorted({int(s) for s in sizes}))
        if sizes and largest is not None:
            need(largest == sizes[-1], f"max_cudagraph_capture_size ({largest}) must be the largest of "
                                       f"cudagraph_capture_sizes ({sizes[-1]})")
        object.__setattr__(self, "cudagraph_capture_sizes", sizes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def model_len(self, max_position_embeddings: int) -> int:
        """Tokens one sequence may hold: max_model_len, by default the model's positions. The
        engine, the runners and the step profile all use this one figure. More than the model's
        positions is refused, as vLLM does: the rotary tables and the model stop there; so is a step
        budget that could never hold a whole prompt when prompts are not chunked."""
        if self.max_model_len is not None and self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} is more than the model's "
                             f"{max_position_embeddings} positions (max_position_embeddings, or the "
                             "attention window or sentence-transformers max_seq_length where the checkpoint "
                             "has a shorter one)")
        model_len = self.max_model_len or max_position_embeddings
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({model_len})")
        return model_len
