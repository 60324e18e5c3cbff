"""Speculative decoding by n-gram prompt lookup: vLLM's speculative_config {"method": "ngram"}.

A decoding sequence whose last tokens occurred earlier in its own tokens (prompt and output)
proposes the tokens that followed them there, up to num_speculative_tokens (`propose_ngram`).
The scheduler runs those drafts in the same step, right after the sequence's last token, so one
pass over the model gives the logits at every draft position; each position then samples as a
decode would (engine.sampler), and the drafts are kept for as long as they equal what was
sampled (engine.scheduler.Scheduler.update_from_output). The first one that differs is replaced
by the token drawn there; when all are kept, the position after the last adds one more. So a
step yields 1 to k + 1 tokens, and the KV of the drafts that were kept is already written.

Greedy output is the same, token for token. A sampled token is drawn from the model's
distribution given the tokens before it, as without speculation: drawing x from p and keeping the
draft d only when x == d is rejection sampling with a one-hot proposal (d is kept with
probability p(d); otherwise x follows p without d, renormalized).

A draft's row reads the drafts before it as output (penalties, min_tokens, bad words of several
tokens: engine.sampler), and a grammar's mask of the matcher having taken them
(engine.structured.matchers). A grammar held behind its reasoning gate decodes one token per step,
as do all requests while more than disable_by_batch_size run; num_speculative_tokens_per_batch_size
sets the drafts by the number running.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from engine.sequence import Sequence
from engine.vllm_args import json_dict

METHODS = ("ngram",)
# vLLM's methods that need a draft model or heads (none of which kvserve runs)
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # drafts per step, at most (required)
    prompt_lookup_min: int | None = None  # shortest n-gram matched (default: prompt_lookup_max, or 5)
    prompt_lookup_max: int | None = None  # longest n-gram matched (default: prompt_lookup_min, or 5)
    disable_by_batch_size: int | None = None  # no drafts while more requests than this run (older vLLM's)
    # vLLM's dynamic speculation: [(first, last, k), ...], inclusive ranges of running requests
    # (sequences: vLLM runs each of n samples as a request) and the drafts each may take there;
    # a gap or the tail after the last range keeps the k before it; never more than num_speculative_tokens
    num_speculative_tokens_per_batch_size: tuple | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"speculative_config: {msg}")

        need(self.method in METHODS, f"method {self.method!r} is not supported: kvserve speculates by n-gram "
             "prompt lookup only (method 'ngram'); " + ("it runs no draft model or heads" if self.method in
                                                          MODEL_METHODS else f"methods: {', '.join(METHODS)}"))
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and not isinstance(value, bool)),
                 f"{name} must be an integer, got {value!r}")
        need(self.num_speculative_tokens is not None, "num_speculative_tokens is required (drafts per step)")
        need(self.num_speculative_tokens >= 1, f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        need(lo >= 1, f"prompt_lookup_min must be >= 1, got {lo}")
        need(hi >= lo, f"prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})")
        need(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if self.num_speculative_tokens_per_batch_size is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size",
                               _batch_schedule(self.num_speculative_tokens_per_batch_size, need))

    def k_at(self, batch_size: int) -> int:
        """The drafts a sequence may take while `batch_size` run (num_speculative_tokens_per_batch_size)."""
        k = self.num_speculative_tokens
        for first, _, at in self.num_speculative_tokens_per_batch_size or ():
            if first > batch_size:
                break
            k = min(at, self.num_speculative_tokens)
        return k

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """vLLM's forms: a dict (LLM(speculative_config=...)), its JSON (--speculative-config), or
        None / {} (no speculation); the legacy "model": "[ngram]" names the method too."""
        if value is None or isinstance(value, cls):
            return value
        value = json_dict("speculative_config", value)
        if not value:
            return None
        value = dict(value)
        model = value.pop("model", None)
        if model is not None and value.get("method", "ngram") == "ngram":  # (another method: refused below)
            if model != "[ngram]":
                raise ValueError(f"speculative_config: model {model!r} is not supported: kvserve runs no draft "
                                 "model; it speculates by n-gram prompt lookup (method 'ngram')")
            value.setdefault("method", "ngram")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(map(repr, unknown))} not supported here "
                             f"(taken: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config needs a method (kvserve's: 'ngram')")
        return cls(**value)


def _batch_schedule(value, need) -> tuple[tuple[int, int, int], ...]:
    """num_speculative_tokens_per_batch_size as vLLM checks it: a non-empty list of (first, last,
    k), first <= last, positive, k >= 0, the ranges apart and the first from 1; sorted."""
    shape = "a non-empty list of [first, last, num_speculative_tokens] entries"
    need(isinstance(value, (list, tuple)) and len(value) > 0, f"num_speculative_tokens_per_batch_size must be {shape}")
    entries = []
    for entry in value:
        need(isinstance(entry, (list, tuple)) and len(entry) == 3
             and all(isinstance(x, int) and not isinstance(x, bool) for x in entry),
             f"num_speculative_tokens_per_batch_size must be {shape} (integers), got {entry!r}")
        first, last, k = entry
        need(0 < first <= last and k >= 0, f"num_speculative_tokens_per_batch_size: {list(entry)} needs "
                                           "0 < first <= last and num_speculative_tokens >= 0")
        entries.append((first, last, k))
    entries.sort()
    need(entries[0][0] == 1, "num_speculative_tokens_per_batch_size: the first range must start at 1, so that "
                             "every batch size has its count")
    for (_, last, _), (first, _, _) in zip(entries, entries[1:]):
        need(first > last, "num_speculative_tokens_per_batch_size: the ranges must not overlap")
    return tuple(entries)


def propose_ngram(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the earliest earlier occurrence of the longest suffix of
    `token_ids` between min_n and max_n tokens long (vLLM's rule); [] when there is none.

    One pass finds every earlier place where the last token occurred; each longer suffix keeps
    the places whose token before also matches, so the whole search reads the sequence once."""
    length = len(token_ids)
    if k <= 0 or length <= min_n:
        return []
    tokens = np.asarray(token_ids)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where a match ends; a token follows each
    found = None
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
        if not len(ends):
            break
        if n >= min_n:
            found = int(ends[0])
    if found is None:
        return []
    return tokens[found + 1:found + 1 + k].tolist()


class NgramDrafter:
    """What the scheduler asks of each decoding sequence (engine.scheduler.Scheduler's `propose`):
    its drafts for this step, within the step's token budget."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, eligible: Callable[[Sequence], bool],
                 num_running: Callable[[], int]) -> None:
        """`eligible(seq)`: whether seq's requests may speculate; `num_running()`: the requests
        running now (disable_by_batch_size)."""
        self.config = config
        self.max_model_len = max_model_len
        self.eligible = eligible
        self.num_running = num_running

    def __call__(self, seq: Sequence, budget: int) -> list[int]:
        c = self.config
        running = self.num_running()
        if c.disable_by_batch_size is not None and running > c.disable_by_batch_size:
            return []
        # Room: k at this batch size; the step's budget; max_tokens (every draft kept, plus the
        # token after them, must fit); max_model_len (the last draft's position).
        room = min(c.k_at(running), budget, seq.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens)
        if room <= 0 or not self.eligible(seq):
            return []
        return propose_ngram(token_array(seq), c.prompt_lookup_min, c.prompt_lookup_max, room)


def token_array(seq: Sequence) -> np.ndarray:
    """seq's token ids as an int64 array, kept on the sequence and grown by the tokens appended
    since (token ids only ever grow): converting the whole list each step cost 35 us at 1,500
    tokens, against 3 us for the search itself."""
    n = seq.num_tokens
    buf, have = seq.token_array or (np.empty(0, dtype=np.int64), 0)
    if have != n:
        if have > n:  # never expected; rebuilt rather than trusted
            have = 0
        if len(buf) < n:
            grown = np.empty(max(n, 2 * len(buf), 64), dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        buf[have:n] = seq.token_ids[have:n]
        seq.token_array = (buf, n)
    return buf[:n]
