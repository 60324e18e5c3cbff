"""Prompt logprobs from the prefill that fills the KV cache: each prompt token's logprob given the
tokens before it, its rank, and the top-k alternatives.

    position    0    1          2             ...  P-2
    logits of   t0   t0 t1      t0 t1 t2           t0 .. t(P-2)
    score       t1   t2         t3                 t(P-1)      (t0 has no context: None)

`ModelRunner` keeps the hidden rows a step owes (`Sequence.prompt_logprob_positions`) as
`PromptRows`, and this turns their logits into `PromptLogprob`s where the logits are: in the
engine process at tp=1, on the sampling rank at tp > 1, whose record of the sequence holds its
prompt. Only those numbers leave the sampling rank, never a logits row.

The logits go through PROMPT_LOGITS_BYTES at a time: a step's prompt rows all at once would take
tokens x vocab x 4 bytes, and as much again for the log-softmax (2,048 x 128k float32 is 1 GiB),
a peak the KV pool's sizing cannot foresee. (vLLM's own OOMs with prompt logprobs came from that.)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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


PROMPT_LOGITS_BYTES = 256 << 20  # float32 logits of prompt rows at once, at most


@dataclass
class PromptRows:
    """A step's hidden rows whose logits score prompt tokens, in the spans' order."""
    hidden: torch.Tensor  # (M, hidden)
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None]  # the model's: float32, None off the sampling rank
    vocab_size: int

    def logits(self) -> Iterator[torch.Tensor | None]:
        """Their logits, a chunk of rows at a time ((n, V) float32, or None off the sampling rank).
        Every rank of a group iterates them: at tp > 1 each chunk is a collective."""
        rows = max(1, PROMPT_LOGITS_BYTES // (4 * self.vocab_size))
        for start in range(0, self.hidden.shape[0], rows):
            with torch.inference_mode():  # not across the yield
                chunk = self.compute_logits(self.hidden[start:start + rows])
            yield chunk


@torch.inference_mode()  # the logits are inference tensors, updated in place
def prompt_logprobs(chunks: Iterable[torch.Tensor], spans: list[PromptSpan],
                    seqs: list) -> dict[int, list[PromptLogprob]]:
    """chunks: (n, V) float32 logits of the spans' rows, in order (PromptRows.logits); each is
    overwritten (with logprobs). seqs[i], the sequence of spans[i], has `params.prompt_logprobs` and
    `prompt_token_ids`. -> span index -> one PromptLogprob per row."""
    targets = [t for span, seq in zip(spans, seqs, strict=True)
               for t in seq.prompt_token_ids[span.start + 1:span.start + 1 + span.num_rows]]
    k = max(seq.params.prompt_logprobs for seq in seqs)
    target, parts, m = None, [[], [], [], []], 0  # token lp, rank, top lp, top ids
    for logits in chunks:
        if target is None:
            target = to_device(targets, torch.long, logits.device)
        logprobs = logits.sub_(logits.logsumexp(dim=-1, keepdim=True))  # (n, V), in place
        token_lp = logprobs.gather(1, target[m:m + logprobs.shape[0]].unsqueeze(1))  # (n, 1)
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())  # (n, k)
        for part, x in zip(parts, (token_lp.squeeze(1), (logprobs > token_lp).sum(dim=-1) + 1, top_lp, top_ids)):
            part.append(x.double().flatten())
        m += logprobs.shape[0]
    assert m == len(targets), (m, len(targets))
    # One copy back; float64 holds every id, rank and float32 logprob exactly.
    packed = torch.cat([torch.cat(part) for part in parts]).tolist()
    top_lp, top_ids = packed[2 * m:2 * m + m * k], packed[2 * m + m * k:]
    out, row = {}, 0
    for span, seq in zip(spans, seqs):
        n = seq.params.prompt_logprobs
        out[span.index] = [PromptLogprob(targets[r], packed[r], int(packed[m + r]),
                                         tuple(zip(map(int, top_ids[r * k:r * k + n]), top_lp[r * k:r * k + n])))
                           for r in range(row, row + span.num_rows)]
        row += span.num_rows
    return out
