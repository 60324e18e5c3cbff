"""Command-line flags for `engine.config.EngineConfig`, shared by `kvserve generate` and `serve`.

Flag names follow vLLM's. Each flag's dest is the EngineConfig field of the same name, and a
flag that was not given is left out of the parsed namespace (argparse.SUPPRESS), so the
dataclass defaults stay the single source of truth. Nothing heavy is imported here, so that
`kvserve --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

from engine.config import LOAD_FORMATS, LOGPROBS_MODES, QUANTIZATION_NAMES

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '4GiB', '2g' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use bytes, or a K/M/G/T suffix)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_tokens(text: str) -> int:
    """vLLM's human-readable token counts: '2048', '2k' (2,000), '2K' (2,048), '25.6k', '1m'/'1M'.
    Lower-case suffixes are decimal, upper-case binary (whole numbers only)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kmgtKMGT]?)\s*", text)
    if not m or (m.group(2).isupper() and "." in m.group(1)):
        raise argparse.ArgumentTypeError(f"invalid token count {text!r} (e.g. 2048, 2k = 2,000, 2K = 2,048)")
    power = "kmgt".find(m.group(2).lower()) + 1
    n = float(m.group(1)) * ((1024 if m.group(2).isupper() else 1000) ** power if m.group(2) else 1)
    if n != int(n):
        raise argparse.ArgumentTypeError(f"invalid token count {text!r}: not a whole number of tokens")
    return int(n)


def _shown_default(dest: str) -> str | None:
    """EngineConfig's default for a flag's help, as the flag takes it; None where it has none."""
    from engine.config import EngineConfig  # a dataclass module: no torch

    value = next((f.default for f in dataclasses.fields(EngineConfig) if f.name == dest), None)
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value >> 30}G" if dest.endswith("_bytes") else str(value)


def absolute_path(text: str) -> str:
    """A directory as an absolute path: a replica resolves it in whatever directory it runs in."""
    return os.path.abspath(os.path.expanduser(text)) if text else text


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("engine")

    def add(*flags: str, **kwargs):
        # The help says the dataclass default where it does not already say one.
        dest = kwargs.get("dest") or next(f for f in flags if f.startswith("--"))[2:].replace("-", "_")
        shown = _shown_default(dest)
        if shown is not None and "default" not in kwargs.get("help", ""):
            kwargs["help"] = f"{kwargs['help']} (default: {shown})"
        return g.add_argument(*flags, default=argparse.SUPPRESS, **kwargs)

    add("--model", metavar="PATH",
        help="the model: a directory with config.json and *.safetensors (Llama, Mistral, Qwen2/3; BERT-style "
             "encoders for pooling), or a repository id "
             "(org/name) already in the local Hugging Face cache, which is never downloaded (default: the "
             "embedded SmolLM2-135M-Instruct)")
    add("--revision", metavar="REV", help="a cached --model repository's branch, tag or commit (default: main)")
    add("--download-dir", metavar="DIR", type=absolute_path,
        help="the Hugging Face cache --model and --tokenizer ids are looked up in (default: HF_HUB_CACHE, "
             "~/.cache/huggingface/hub)")
    add("--tokenizer", metavar="PATH", help="tokenizer directory or cached repository id (default: the model's)")
    add("--tokenizer-revision", metavar="REV", help="a cached --tokenizer repository's revision (default: main)")
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
        help="weight and activation dtype: auto is float32 on CPU and bfloat16 on CUDA; half is "
             "float16 and float is float32, as in vLLM")
    add("--device", help="auto, cpu or cuda; auto is cuda when available")
    add("--seed", type=int, help="random seed")
    add("-tp", "--tensor-parallel-size", type=int, metavar="N", help="ranks that shard the model")
    add("--distributed-executor-backend", metavar="BACKEND",
        help="what runs the ranks when -tp > 1: ray (default), or package.module:Class; vLLM's mp "
             "and uni are taken at -tp 1, where one rank runs in the replica")
    add("--block-size", type=int, metavar="TOKENS", help="tokens per KV cache block")
    add("--num-gpu-blocks-override", type=int, metavar="N",
        help="exact number of KV cache blocks (wins over the memory settings)")
    add("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes, metavar="BYTES",
        help="memory for the KV cache, e.g. 2G (default: derived from device memory)")
    add("--gpu-memory-utilization", type=float, metavar="FRACTION",
        help="CUDA: fraction of device memory for weights + KV cache")
    add("--cpu-kv-cache-fraction", type=float, metavar="FRACTION",
        help="CPU: fraction of available RAM for the KV cache")
    add("--max-cpu-kv-cache-bytes", type=parse_bytes, metavar="BYTES", help="CPU: cap on the KV cache")
    add("--max-model-len", type=parse_tokens, metavar="TOKENS",
        help="longest prompt + completion (default: the model's max_position_embeddings)")
    add("--max-num-seqs", type=int, metavar="N", help="running sequences per engine step")
    add("--max-num-batched-tokens", type=int, metavar="N",
        help="token budget per engine step (prefill chunks + decodes)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse KV blocks of identical prompt prefixes")
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
        help="split long prompts across engine steps")
    add("--long-prefill-token-threshold", type=parse_tokens, metavar="TOKENS",
        help="chunked prefill: a prompt chunk takes at most this many tokens a step while other requests run or "
             "wait, so a long prompt does not hold the step's budget (vLLM's flag; 0: no cap)")
    add("--long-prefill-token-threshold-adaptive", action=argparse.BooleanOptionalAction,
        help="never cap a chunk below --max-num-batched-tokens / the requests running and waiting (vLLM's flag)")
    add("--scheduling-policy", choices=["fcfs", "priority"],
        help="fcfs: first come, first served; priority: waiting requests by their `priority` (lower first), "
             "then arrival, and the lowest-priority running one is preempted first (as in vLLM)")
    add("--trust-remote-code", action="store_true",
        help="load a tokenizer whose directory ships its own Python code (transformers' auto_map), as "
             "vLLM's flag does; the model itself must still be a Llama-family checkpoint")
    add("--enforce-eager", action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (captured at start-up per "
             "batch-size bucket)")
    add("--stream-interval", type=int, metavar="TOKENS",
        help="stream a request's tokens every N tokens rather than every step, so fewer messages "
             "carry them; the first token and the last are sent at once (default: 1)")
    add("--max-logprobs", type=int, metavar="N",
        help="most logprobs a request may ask per token (logprobs, top_logprobs, prompt_logprobs); -1: no "
             "cap, and a request's -1 then asks the whole vocabulary")
    add("--logprobs-mode", choices=list(LOGPROBS_MODES),
        help="what logprobs report (vLLM's flag): raw_logprobs (default) or raw_logits, the model's own; "
             "processed_logprobs or processed_logits, after penalties, logit_bias and, for sampled requests, "
             "temperature, min_p, top_k and top_p (the tokens these drop at -inf)")
    add("--enable-lora", action="store_true",
        help="serve LoRA adapters beside the base weights (PEFT directories: --lora-modules, or the offline "
             "LLM's lora_request)")
    add("--max-loras", type=int, metavar="N", help="LoRA adapters one engine step may run")
    add("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank taken")
    add("--max-cpu-loras", type=int, metavar="N", help="adapters kept loaded (default: --max-loras)")
    add("--speculative-config", metavar="JSON",
        help='speculative decoding by n-gram prompt lookup, as vLLM\'s flag: e.g. {"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; also '
             '"disable_by_batch_size": N (no drafts while more than N requests run). Greedy output is '
             'unchanged; requests with penalties, min_tokens or structured outputs decode without drafts')
    g.add_argument("--spec-method", choices=["ngram"], default=argparse.SUPPRESS,
                   help="vLLM's shorthand for --speculative-config's method")
    g.add_argument("--spec-model", metavar="MODEL", default=argparse.SUPPRESS,
                   help="vLLM's shorthand for --speculative-config's model (only \"[ngram]\": no draft models here)")
    g.add_argument("--spec-tokens", type=int, metavar="K", default=argparse.SUPPRESS,
                   help="vLLM's shorthand for --speculative-config's num_speculative_tokens")
    add("--cudagraph-capture-sizes", type=int, nargs="+", metavar="N",
        help="CUDA: the decode step sizes (rows) to capture graphs at, as vLLM's flag; a step pads to the "
             "next one, and one larger than all runs eagerly (default: 1, 2, 4, 8, then steps of 8 to 64 "
             "and of 16, up to --max-cudagraph-capture-size)")
    add("--max-cudagraph-capture-size", type=int, metavar="N",
        help="CUDA: the largest decode step captured (default: --max-num-seqs; with speculative decoding the "
             "rows of a step with drafts, up to 512)")
    add("--runner", choices=["auto", "generate", "pooling"],
        help="vLLM's: pooling serves embeddings (/v1/embeddings, and /score, /rerank by their cosine) instead of "
             "generating, or a ...ForSequenceClassification checkpoint's classes (/classify; /score, /rerank: a "
             "cross-encoder's); auto pools a sentence-transformers folder, an embedding architecture or a classifier")
    add("--convert", choices=["auto", "none", "embed"],
        help="vLLM's: embed runs a generative checkpoint as an embedding model (--runner pooling)")
    add("--pooler-config", metavar="JSON",
        help='vLLM\'s, for --runner pooling: {"pooling_type": "LAST" or "MEAN", "use_activation": true (L2-normalise), '
             '"dimensions": N (a Matryoshka model\'s default size)}; the model folder\'s sentence-transformers '
             "modules set what it leaves out")
    add("-q", "--quantization", choices=QUANTIZATION_NAMES,
        help="vLLM's: a GPTQ (symmetric, 4/8-bit), AWQ (4-bit) or compressed-tensors (W4A16, W8A16) checkpoint's "
             "method, read from its config.json when not given; the weights are dequantized once at load (on CPU, "
             "decode reads 4-bit ones as codes)")
    add("--load-format", choices=LOAD_FORMATS,
        help="vLLM's: how the weights load: from the folder's safetensors files (auto, safetensors), or "
             "`dummy`: filled at random (vLLM's uniform +-1e-3), so that a folder with a config.json and a tokenizer "
             "alone serves, for benchmarks")
    add("--hf-overrides", metavar="JSON",
        help="vLLM's: config.json fields set over the model folder's, e.g. '{\"architectures\": "
             "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
             "\"is_original_qwen3_reranker\": true}' serves Qwen3-Reranker as a cross-encoder")
    _add_vllm_only_flags(parser)
    return parser


# how the CLI reads each of engine.vllm_args.NO_EFFECT
_NO_EFFECT_KINDS = {"disable_custom_all_reduce": dict(action="store_true"),
                    "max_seq_len_to_capture": dict(type=int, metavar="N"),
                    "swap_space": dict(type=float, metavar="GIB"),
                    "async_scheduling": dict(action=argparse.BooleanOptionalAction),
                    "hf_token": dict(nargs="?", const=True, metavar="TOKEN")}


def _only(name: str):
    """The type of a flag taken only at the values engine.vllm_args allows it."""
    def parse(text: str) -> str:
        from engine.vllm_args import refused

        if (why := refused(name, text)) is not None:
            raise argparse.ArgumentTypeError(why)
        return text
    return parse


def _add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """engine.vllm_args' flags: taken at the values that ask nothing kvserve lacks, or with no
    effect; none of them reaches EngineConfig."""
    from engine.vllm_args import NO_EFFECT, ONLY_AT

    g = parser.add_argument_group("vLLM flags with nothing to set here")
    for name, (values, why) in ONLY_AT.items():
        flags = ["-pp"] if name == "pipeline_parallel_size" else []
        g.add_argument(*flags, "--" + name.replace("_", "-"), type=_only(name), metavar="|".join(values), help=why,
                       default=argparse.SUPPRESS)
    for name, why in NO_EFFECT.items():
        g.add_argument("--" + name.replace("_", "-"), help=f"no effect: {why}", default=argparse.SUPPRESS,
                       **_NO_EFFECT_KINDS[name])


def engine_config_from_args(ns: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the flags that were given (model included); vLLM's
    --spec-* shorthands go into speculative_config (ValueError for a key given twice)."""
    from engine.config import EngineConfig
    from engine.vllm_args import with_spec_shorthands

    return {k: v for k, v in with_spec_shorthands(vars(ns)).items() if k in EngineConfig.field_names()}
