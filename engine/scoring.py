"""Scores (vLLM's score and rerank APIs on a `--runner pooling` engine), from either model kind:

    embedding model   each text is embedded on its own, and a pair scores the cosine similarity
                      of its two vectors (`pair_scores`)
    cross-encoder     a sequence classifier with one label (engine.classifier) reads each pair
                      as one prompt (`pair_prompts`) and scores it with its head

    score_pairs   which first input meets which second one: 1:1, 1:N (one query, many
                  documents) or N:N (the i-th with the i-th), vLLM's rule and words
    pair_scores   each pair's cosine similarity, in float64 from the float32 vectors the engine
                  returns, every vector's norm taken once
    pair_prompts  each pair's prompt for a cross-encoder, as vLLM builds it, and where its
                  second text's token type begins
    templated_prompts  each pair's prompt rendered by a score template (vLLM's --chat-template
                  on a cross-encoder: Qwen3-Reranker's instruction, query and document format)"""
from __future__ import annotations

import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import check_truncation, truncated

EPS = 1e-8  # torch's CosineSimilarity clamps the norms' product at it: a zero vector scores 0


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """(index into the first inputs, index into the second ones) of each scored pair, in order;
    ValueError where the counts do not pair up."""
    if num_first == 0:
        raise ValueError("At least one text element must be given")
    if num_second == 0:
        raise ValueError("At least one text_pair element must be given")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError("Input lengths must be either 1:1, 1:N or N:N")
    return [(i, i) for i in range(num_first)]


def pair_prompts(tokenizer, pairs: list[tuple[str, str]], use_pad_token: bool = True,
                 max_length: int | None = None) -> tuple[list[list[int]], list[int | None]]:
    """A cross-encoder's prompt for each (first, second) text pair: the tokenizer's pair encoding
    (its separators and special tokens, as the model was trained on them), or, where the model's
    config sets use_pad_token false (an LLM converted into a reranker), the two texts joined.
    `max_length` (pair_length's): at most that many tokens, the longer text cut first, as vLLM
    truncates a pair, so that neither side is lost whole. With the prompts, each one's
    `token_type_start` (PoolingParams'): where the tokenizer's token_type_ids turn to 1 (BERT's
    second text), None where they do not (RoBERTa's, a joined pair's)."""
    if not pairs:
        return [], []
    least = tokenizer.num_special_tokens_to_add(pair=use_pad_token) + (2 if use_pad_token else 1)
    if max_length is not None and max_length < least:  # the tokenizer would leave such a pair uncut
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens ({max_length}) must keep at "
                                  f"least {least} tokens of a pair: its special tokens and one of each text")
    cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
    firsts, seconds = map(list, zip(*pairs))
    if not use_pad_token:
        prompts = tokenizer([a + b for a, b in pairs], **cut)["input_ids"]
        return prompts, [None] * len(prompts)
    enc = tokenizer(firsts, text_pair=seconds, return_token_type_ids=True, **cut)
    return enc["input_ids"], [types.index(1) if 1 in types else None for types in enc["token_type_ids"]]


def templated_prompts(tokenizer, pairs: list[tuple[str, str]], template: str,
                      variables: dict | None = None) -> list[list[int]]:
    """Each (query, document) pair rendered by a score template, as vLLM renders it: the template
    gets `messages` [{"role": "query", ...}, {"role": "document", ...}] and `variables` (a
    request's chat_template_kwargs: its `instruction`), and the text is tokenized with the
    tokenizer's special tokens. InvalidRequestError where the template rejects a pair."""
    texts = []
    for first, second in pairs:
        messages = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        try:
            texts.append(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                       **(variables or {})))
        except Exception as e:  # jinja raises on what its template rejects (or on its own fault)
            raise InvalidRequestError(None, f"the score template could not render this pair: "
                                            f"{type(e).__name__}: {e}") from None
    return tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []


def cut_pair(ids: list[int], type_start: int | None, keep: int, max_model_len: int, side: str,
             ends: tuple[int, int] | None) -> tuple[list[int], int | None]:
    """A pair's prompt cut to `keep` tokens on `side` (truncated's, an encoder's framing kept),
    and where its second text's token type then begins."""
    # cut the positions as the ids would be cut (framed the same way): which tokens stay
    framed = ends is not None and len(ids) > 1 and (ids[0], ids[-1]) == ends
    kept = truncated(list(range(len(ids))), keep, max_model_len, side=side, ends=(0, len(ids) - 1) if framed else None)
    start = None if type_start is None else next((i for i, at in enumerate(kept) if at >= type_start), None)
    return [ids[i] for i in kept], start


def cut_document(ids: list[int], max_tokens: int, ends: tuple[int, int] | None = None) -> list[int]:
    """Cohere's max_tokens_per_doc for a document embedded on its own: its first `max_tokens`
    tokens; an encoder's (`ends`, its framing special tokens) keeps them around those."""
    if ends is None or len(ids) < 2 or (ids[0], ids[-1]) != ends:
        return ids[:max_tokens]
    return ids if len(ids) <= max_tokens + 2 else truncated(ids, max_tokens + 2, len(ids), side="right", ends=ends)


def pair_length(keep: int | None, max_model_len: int) -> int | None:
    """The tokens a pair's prompt may keep under truncate_prompt_tokens `keep` (-1: max_model_len;
    None: all); InvalidRequestError for a value no prompt can keep."""
    if keep is None:
        return None
    check_truncation(keep, max_model_len)
    return max_model_len if keep == -1 else keep


def pair_scores(firsts: list[list[float]], seconds: list[list[float]]) -> list[float]:
    """The cosine similarity of each pair score_pairs makes of the two sides' vectors."""
    a, b = torch.tensor(firsts, dtype=torch.float64), torch.tensor(seconds, dtype=torch.float64)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"vectors of {a.shape[1]} and {b.shape[1]} dimensions cannot be compared")
    i, j = map(torch.tensor, zip(*score_pairs(len(a), len(b))))
    norms = a.norm(dim=1)[i] * b.norm(dim=1)[j]
    return ((a[i] * b[j]).sum(dim=1) / norms.clamp_min(EPS)).tolist()
