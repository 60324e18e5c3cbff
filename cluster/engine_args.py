"""Command-line flags for `engine.config.EngineConfig`, shared by `kvserve generate` and `serve`.

Flag names follow vLLM's. Each flag's dest is the EngineConfig field of the same name, and a
flag that was not given is left out of the parsed namespace (argparse.SUPPRESS), so the
dataclass defaults stay the single source of truth. Nothing heavy is imported here, so that
`kvserve --help` stays fast.
"""
from __future__ import annotations

import argparse
import functools
import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '4GiB', '2g' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (use bytes, or a K/M/G/T suffix)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("engine")
    add = functools.partial(g.add_argument, default=argparse.SUPPRESS)
    add("--model", metavar="PATH",
        help="local Llama-family model directory with config.json and *.safetensors "
             "(default: the embedded SmolLM2-135M-Instruct)")
    add("--tokenizer", metavar="PATH", help="tokenizer directory (default: the model directory)")
    add("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    add("--device", help="auto, cpu or cuda (auto: cuda when available)")
    add("--seed", type=int, help="random seed")
    add("-tp", "--tensor-parallel-size", type=int, metavar="N", help="ranks that shard the model")
    add("--distributed-executor-backend", metavar="BACKEND",
        help="what runs the ranks when -tp > 1: ray (default), or package.module:Class")
    add("--block-size", type=int, metavar="TOKENS", help="tokens per KV cache block")
    add("--num-gpu-blocks-override", type=int, metavar="N",
        help="exact number of KV cache blocks (wins over the memory settings)")
    add("--kv-cache-memory", type=parse_bytes, metavar="BYTES",
        help="memory for the KV cache, e.g. 2G (default: derived from device memory)")
    add("--gpu-memory-utilization", type=float, metavar="FRACTION",
        help="CUDA: fraction of device memory for weights + KV cache")
    add("--cpu-kv-cache-fraction", type=float, metavar="FRACTION",
        help="CPU: fraction of available RAM for the KV cache")
    add("--max-cpu-kv-cache-bytes", type=parse_bytes, metavar="BYTES", help="CPU: cap on the KV cache")
    add("--max-model-len", type=int, metavar="TOKENS",
        help="longest prompt + completion (default: the model's max_position_embeddings)")
    add("--max-num-seqs", type=int, metavar="N", help="running sequences per engine step")
    add("--max-num-batched-tokens", type=int, metavar="N",
        help="token budget per engine step (prefill chunks + decodes)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse KV blocks of identical prompt prefixes")
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
        help="split long prompts across engine steps")
    add("--enforce-eager", action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (captured at start-up per "
             "batch-size bucket)")
    add("--stream-interval", type=int, metavar="TOKENS",
        help="stream a request's tokens every N tokens rather than every step, so fewer messages "
             "carry them; the first token and the last are sent at once (default: 1)")
    return parser


def engine_config_from_args(ns: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the flags that were given (model included)."""
    from engine.config import EngineConfig

    return {k: v for k, v in vars(ns).items() if k in EngineConfig.field_names()}
