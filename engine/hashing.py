"""Prefix-block hashing shared by the block manager and the global scheduler.

A full block's hash chains its parent's hash with its own token ids, so equal hashes mean
equal prefixes (up to collisions, which the block manager guards against by comparing the
stored token ids). Python's hash of a tuple of ints is deterministic across processes (it does
not depend on PYTHONHASHSEED), so replicas and the router compute the same values.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

NONE_HASH = 0  # parent hash of a sequence's first block


def root_hash(cache_salt: str | None, lora: tuple[int, str] | None = None) -> int:
    """The parent hash of a sequence's first block: NONE_HASH, or one of the request's cache_salt
    (vLLM's field) and LoRA adapter (its id and directory), so that only requests with the same
    salt and adapter share cached blocks (an adapter's KV is not the base model's, nor another
    adapter's that once had its id). The key is JSON, so that no salt can spell another request's
    key; sha256, not hash(): a string's hash differs between processes."""
    if cache_salt is None and lora is None:
        return NONE_HASH
    key = json.dumps([cache_salt] if lora is None else [cache_salt, *lora])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little", signed=True) or 1


def request_root(params) -> int:
    """root_hash of a request's SamplingParams: its cache_salt and LoRA adapter (lora_request)."""
    lora = getattr(params, "lora_request", None)
    return root_hash(getattr(params, "cache_salt", None), None if lora is None else (lora.lora_int_id, lora.lora_path))


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    return hash((parent_hash, tuple(token_ids), extra_keys))


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                       root: int = NONE_HASH) -> list[int]:
    """Chained hashes of every full block of `token_ids` (at most `max_blocks`), from `root`."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes, parent = [], root
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
