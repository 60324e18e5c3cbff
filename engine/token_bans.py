"""vLLM's `allowed_token_ids` and `bad_words`: tokens a row may not sample, as -inf logits.

    allowed_token_ids  every token but these is banned, at every step
    bad_words          a word's last token is banned where the output so far ends with the rest
                       of the word's tokens (a one-token word: always)

A word is banned as the tokenizer writes it alone and after a space (" word"), since a
tokenizer that marks word starts spells the two with different tokens. Applied after logit_bias
and before the penalties, like vLLM's logits processors; logprobs stay those of the raw logits.
"""
from __future__ import annotations

import torch

from engine.device_copy import host_to_device, to_device


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each word's token sequences: alone and after a space; no duplicates, none empty."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def reads_output(params) -> bool:
    """Whether a bad word longer than one token needs the row's output tokens."""
    return any(len(word) > 1 for word in params.bad_words_token_ids or ())


def _allowed_ids(params) -> torch.Tensor:
    """params.allowed_token_ids as a host tensor, made on the request's first step (a list may hold
    the whole vocabulary; this runs every step). Kept on the params, which are the request's own
    copy (LLMEngine.add_request)."""
    ids = params.__dict__.get("_allowed_ids_tensor")
    if ids is None:
        ids = params.__dict__["_allowed_ids_tensor"] = torch.tensor(params.allowed_token_ids, dtype=torch.long)
    return ids


def apply_token_bans(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """(B, V) logits with each row's banned tokens at -inf; `logits` itself when no row bans any."""
    banning = [i for i, r in enumerate(rows) if r.params.allowed_token_ids or r.params.bad_words_token_ids]
    if not banning:  # the common case, in one pass (this runs every step)
        return logits
    allowed = [(i, rows[i].params) for i in banning if rows[i].params.allowed_token_ids]
    banned = [(i, word[-1]) for i in banning for word in rows[i].params.bad_words_token_ids or ()
              if _completes(rows[i].output_token_ids, word[:-1])]
    if not allowed and not banned:
        return logits
    out = logits.clone()
    device = out.device
    if allowed:
        ids = [_allowed_ids(params) for _, params in allowed]
        keep_rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(t) for t in ids]))
        keep = torch.zeros(len(allowed), out.shape[1], dtype=torch.bool, device=device)
        # A device scalar: a Python one would be copied up with a blocking (synchronizing) copy.
        keep.index_put_((host_to_device(keep_rows, device), host_to_device(torch.cat(ids), device)),
                        keep.new_ones(()))
        index = to_device([i for i, _ in allowed], torch.long, device)
        out[index] = out[index].masked_fill(~keep, float("-inf"))
    if banned:
        out.index_put_((to_device([i for i, _ in banned], torch.long, device),
                        to_device([t for _, t in banned], torch.long, device)), out.new_full((), float("-inf")))
    return out


def _completes(output: list[int], prefix: list[int]) -> bool:
    """Whether the next token would complete a word whose other tokens are `prefix`."""
    return not prefix or (len(output) >= len(prefix) and output[-len(prefix):] == prefix)
