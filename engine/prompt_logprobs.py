"""Prompt logprobs from the prefill that fills the KV cache: each prompt token's logprob given the
tokens before it, its rank, and the top-k alternatives.

    position    0    1          2             ...  P-2
    logits of   t0   t0 t1      t0 t1 t2           t0 .. t(P-2)
    score       t1   t2         t3                 t(P-1)      (t0 has no context: None)

`ModelRunner` keeps the logits of the rows a step owes (`Sequence.prompt_logprob_positions`),
chunk by chunk, and this turns them into `PromptLogprob`s where the logits are: in the engine
process at tp=1, on the sampling rank at tp > 1, whose record of the sequence holds its prompt.
Only those numbers leave the sampling rank, never a logits row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_copy import to_device
from engine.outputs import PromptLogprob


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Rows of one sequence whose logits score its prompt, consecutive in the step's logits."""
    index: int  # into the step's batch.seqs
    start: int  # position of the first row: it scores prompt token start + 1
    num_rows: int


@torch.inference_mode()  # the logits are an inference tensor, updated in place
def prompt_logprobs(logits: torch.Tensor, spans: list[PromptSpan], seqs: list) -> dict[int, list[PromptLogprob]]:
    """logits: (M, V) float32, the spans' rows in order; overwritten (with logprobs). seqs[i], the
    sequence of spans[i], has `params.prompt_logprobs` and `prompt_token_ids`.
    -> span index -> one PromptLogprob per row."""
    targets = [t for span, seq in zip(spans, seqs, strict=True)
               for t in seq.prompt_token_ids[span.start + 1:span.start + 1 + span.num_rows]]
    assert len(targets) == logits.shape[0], (len(targets), tuple(logits.shape))
    logprobs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))  # (M, V), in place
    target = to_device(targets, torch.long, logits.device)
    token_lp = logprobs.gather(1, target.unsqueeze(1))  # (M, 1)
    rank = (logprobs > token_lp).sum(dim=-1) + 1  # (M,)
    k = max(seq.params.prompt_logprobs for seq in seqs)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())  # (M, k)
    # One copy back; float64 holds every id, rank and float32 logprob exactly.
    packed = torch.cat([token_lp.squeeze(1).double(), rank.double(), top_lp.double().flatten(),
                        top_ids.double().flatten()]).tolist()
    m = len(targets)
    top_lp, top_ids = packed[2 * m:2 * m + m * k], packed[2 * m + m * k:]
    out, row = {}, 0
    for span, seq in zip(spans, seqs):
        n = seq.params.prompt_logprobs
        out[span.index] = [PromptLogprob(targets[r], packed[r], int(packed[m + r]),
                                         tuple(zip(map(int, top_ids[r * k:r * k + n]), top_lp[r * k:r * k + n])))
                           for r in range(row, row + span.num_rows)]
        row += span.num_rows
    return out
