"""Scores from an embedding model (vLLM's score and rerank APIs on a `--runner pooling` engine):
each text is embedded on its own, and a pair scores the cosine similarity of its two vectors.

    score_pairs   which first input meets which second one: 1:1, 1:N (one query, many
                  documents) or N:N (the i-th with the i-th), vLLM's rule and words
    cosine        the similarity, in float64 from the float32 vectors the engine returns

Cross-encoders (one forward pass over the pair, a classifier head on top) are another model
kind; kvserve serves decoder embedding models only, so every score here is a cosine."""
from __future__ import annotations

import math
import operator


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


def cosine(a: list[float], b: list[float], eps: float = 1e-8) -> float:
    """Cosine similarity; a zero vector scores 0 (torch's CosineSimilarity clamps the norms' product at eps)."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} dimensions cannot be compared")
    dot = math.fsum(map(operator.mul, a, b))
    return dot / max(math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(x * x for x in b)), eps)
