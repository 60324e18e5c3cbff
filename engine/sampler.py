"""Batched token sampling: penalties, greedy/random selection and logprobs.

Order per step (vLLM v1 style):
    raw logits -> logprobs (of the raw logits)
               -> logit_bias, banned tokens, penalties, min_tokens mask   (all rows)
               -> greedy rows: argmax
               -> random rows: / temperature -> min_p -> top_k -> top_p -> draw
                  (top_p's mass is of what min_p and top_k kept, renormalized, as vLLM's)
Logprobs are of the raw logits by default; vLLM's --logprobs-mode picks what they report
(LOGPROBS_MODES): raw_logprobs, raw_logits (the values themselves), processed_logprobs or
processed_logits (after the processors, and for random rows after temperature, min_p, top_k and
top_p, the tokens those drop at -inf; a random row then finds its cut-off by a full sort, so its
values are exact).
Random draws use the exponential race, argmax(probs / q) with q ~ Exp(1), which samples from
probs; a seeded row draws its V uniforms for q from its own generator only, so its tokens do not
depend on the rest of the batch.

`Sampler` works on rows; `SequenceSampler` turns sequences into rows (their tokens, their seeded
generators) wherever the logits are: in the engine process at tp=1, on the sampling rank at tp > 1.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import LOGPROBS_MODES
from engine.device_copy import to_device
from engine.sampling_params import SamplingParams
from engine.sequence import num_kept
from engine.structured.bitmask import GrammarMask, apply_grammar_mask
from engine.token_bans import apply_token_bans
from engine.token_bans import reads_output as bans_read_output


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]  # only where reads_prompt(params), else empty
    output_token_ids: list[int]  # generated so far; only where reads_output(params), else empty
    generator: torch.Generator | None  # set when params.seed is set; on the logits' device
    eos_token_ids: list[int]  # masked, with params.stop_token_ids, until min_tokens are generated


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the sampled token, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # params.logprobs (token_id, logprob), highest first
    rank: int | None = None  # of the sampled token, with logprobs: how many tokens are at least as likely (vLLM's)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _occurrences(token_lists: list[list[int]],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (N,) list index, (N,) token id, (N,) float count, one entry per distinct (list, token)."""
    index, tokens, counts = [], [], []
    for i, token_ids in enumerate(token_lists):
        counter = Counter(token_ids)
        index += [i] * len(counter)
        tokens += counter.keys()
        counts += counter.values()
    return (to_device(index, torch.long, device), to_device(tokens, torch.long, device),
            to_device(counts, torch.float32, device))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on (B, V) logits.

    Returns `logits` itself when no row has penalties, else a float32 copy; never modifies `logits`.
      repetition: tokens in prompt + output: logit > 0 -> logit / p, else logit * p
      frequency:  logit -= p * count of the token in the output
      presence:   logit -= p if the token occurs in the output
    Only the logits of tokens that occurred change, so only those are read and written.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
    if not idx:
        return logits
    device = logits.device
    out = logits.to(torch.float32, copy=True)  # (B, V)
    params = [rows[i].params for i in idx]
    batch_row = to_device(idx, torch.long, device)  # penalized row -> row of `out`

    def per_row(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)  # (R,)

    if any(p.repetition_penalty != 1.0 for p in params):
        row, token, _ = _occurrences(
            [rows[i].prompt_token_ids + rows[i].output_token_ids for i in idx], device)
        penalty = per_row([p.repetition_penalty for p in params])[row]  # (N,)
        values = out[batch_row[row], token]  # (N,)
        out[batch_row[row], token] = torch.where(values > 0, values / penalty, values * penalty)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        row, token, count = _occurrences([rows[i].output_token_ids for i in idx], device)
        frequency = per_row([p.frequency_penalty for p in params])[row]  # (N,)
        presence = per_row([p.presence_penalty for p in params])[row]
        out[batch_row[row], token] -= frequency * count + presence
    return out


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Adds each row's params.logit_bias (token id -> bias) to its logits, before the penalties,
    as vLLM does. Returns `logits` itself when no row has a bias, else a float32 copy."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return logits
    row = [i for i, bias in biased for _ in bias]
    token = [t for _, bias in biased for t in bias]
    value = [b for _, bias in biased for b in bias.values()]
    out = logits.to(torch.float32, copy=True)  # (B, V)
    device = out.device
    out[to_device(row, torch.long, device), to_device(token, torch.long, device)] += to_device(
        value, torch.float32, device)
    return out


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Masks eos and stop_token_ids to -inf for rows with fewer than min_tokens outputs.

    Returns `logits` itself when no row is masked, else a new tensor.
    """
    masked = [(i, r.eos_token_ids + r.params.stop_token_ids) for i, r in enumerate(rows)
              if len(r.output_token_ids) < r.params.min_tokens]
    row = [i for i, ids in masked for _ in ids]
    if not row:
        return logits
    token = [t for _, ids in masked for t in ids]
    out = logits.clone()
    # A device scalar: a Python one would be copied up with a blocking (synchronizing) copy.
    out.index_put_((to_device(row, torch.long, out.device), to_device(token, torch.long, out.device)),
                   out.new_full((), float("-inf")))
    return out


NUCLEUS_CANDIDATES = 1024  # top_p looks at this many top tokens first, sorts the row only if short


def _keep_thresholds(probs: torch.Tensor, params: list[SamplingParams],
                     full_sort: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(R, V) probs -> (R, 1) probability below which each row drops tokens, and (R,) whether a
    row's top NUCLEUS_CANDIDATES tokens held less than its top_p mass, so that its cut-off is
    only a bound (None where that cannot happen: no top_p, or `full_sort` of every row).

    top_k, top_p and min_p all keep the tokens at or above a cut-off probability, so the kept set
    is the one above the highest of the three cut-offs; top_p's is found within what min_p and
    top_k keep (vLLM applies min_p first, then top_k and top_p to the renormalized rest). The top
    token is always kept.
    """
    device, vocab_size = probs.device, probs.shape[1]
    k_host = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    k = to_device(k_host, torch.long, device)
    top_p = to_device([p.top_p for p in params], probs.dtype, device)
    min_p = to_device([p.min_p for p in params], probs.dtype, device)
    threshold = probs.amax(dim=-1) * min_p  # (R,)
    # Which cut-offs apply is decided from the host-side params (no device sync), comparing top_p
    # in float32 as the tensor holds it.
    max_k = max((x for x in k_host if x < vocab_size), default=0)
    any_top_p = any(np.float32(p.top_p) < 1 for p in params)
    if not (max_k or any_top_p):
        return threshold.unsqueeze(1), None
    if full_sort:
        candidates = probs.sort(dim=-1, descending=True).values  # (R, V)
    else:  # a partial top-k, far cheaper than a sort
        num = max(max_k, NUCLEUS_CANDIDATES) if any_top_p else max_k
        candidates = probs.topk(min(num, vocab_size), dim=-1).values  # (R, n), descending
    # the mass min_p keeps, over the whole row (1 without min_p): top_p's share is of it
    kept_mass = (probs * (probs >= threshold.unsqueeze(1))).sum(dim=-1) if any(p.min_p > 0 for p in params) \
        else torch.ones_like(threshold)
    cut, covered = _threshold_from_candidates(candidates, k, top_p, threshold, kept_mass, vocab_size)
    short = ~covered if any_top_p and not full_sort else None
    return torch.maximum(threshold, cut).unsqueeze(1), short


def _threshold_from_candidates(candidates: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                               min_p_cut: torch.Tensor, kept_mass: torch.Tensor,
                               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (R,) cut-off, (R,) whether the candidates sufficed to find it. `min_p_cut`: (R,) the
    probability min_p keeps from; `kept_mass`: (R,) the row's mass at or above it."""
    num = candidates.shape[1]
    positions = torch.arange(num, device=candidates.device)
    in_set = (positions < k.unsqueeze(1)) & (candidates >= min_p_cut.unsqueeze(1))  # (R, n)
    mass = (candidates * in_set).cumsum(dim=-1)  # (R, n)
    # The nucleus takes top_p of the mass of what top_k and min_p keep (min_p's alone without top_k,
    # whether the candidates are a partial top-k or the whole sorted row: the same cut-off, so a
    # seeded row draws the same token either way).
    total = torch.where(k < vocab_size, mass[:, -1], kept_mass)
    num_keep = (mass < (top_p * total).unsqueeze(1)).sum(dim=-1) + 1  # (R,)
    # Without top_p keep exactly k: float absorption may stop `mass` growing before k.
    num_keep = torch.where(top_p < 1, num_keep, k).clamp(max=num)
    threshold = candidates.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
    no_cut = (k == vocab_size) & (top_p >= 1)
    threshold = threshold.masked_fill(no_cut, 0.0)
    covered = no_cut | (k <= num) | (mass[:, -1] >= top_p * total)
    return threshold, covered


@dataclass
class _Redraw:
    """Random rows whose top NUCLEUS_CANDIDATES tokens held less than their top_p mass (flat
    distributions): their cut-off lies further down the row. Whether any exists travels back
    with the step's one device-to-host copy; where one does (rare), those rows are drawn again
    over their whole sorted row with the same Exp(1) draws, which gives the token a full sort
    would have given in the first place."""
    short: torch.Tensor  # (R,) bool
    logits: torch.Tensor  # (R, V) the rows' processed logits
    q: torch.Tensor  # (R, V) their Exp(1) draws
    rows: list[SamplingRow]
    index: torch.Tensor | None  # (R,) the rows' places in the batch; None: the whole batch

    def apply(self, token_ids: torch.Tensor) -> torch.Tensor:
        redo = self.short.nonzero().squeeze(1)
        rows = [self.rows[i] for i in redo.tolist()]
        probs = _probs(self.logits[redo], rows)
        threshold, _ = _keep_thresholds(probs, [r.params for r in rows], full_sort=True)
        probs.masked_fill_(probs < threshold, 0.0)
        token_ids = token_ids.clone()
        token_ids[redo if self.index is None else self.index[redo]] = (probs / self.q[redo]).argmax(dim=-1)
        return token_ids


def _probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """(R, V) logits -> (R, V) float32 probabilities at each row's temperature."""
    temperature = to_device([r.params.temperature for r in rows], torch.float32, logits.device)
    return (logits.float() / temperature.unsqueeze(1)).softmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.seed, self.logprobs_mode = seed, logprobs_mode
        self._generators: dict[torch.device, torch.Generator] = {}  # shared, for unseeded rows

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits: (B, V), one row per entry of `rows`; not modified. On a GPU the host waits for
        the device once, in the one copy that brings the results back."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        processed = apply_min_tokens(apply_penalties(apply_token_bans(apply_logit_bias(logits, rows), rows), rows),
                                     rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        # processed modes with logprobs asked: the values the rows draw from, else None
        scores = processed if self.logprobs_mode.startswith("processed") and any(
            r.params.logprobs is not None for r in rows) else None
        redraw = None
        if len(greedy) == len(rows):
            token_ids = processed.argmax(dim=-1)  # (B,)
        elif not greedy:
            token_ids, redraw, scores = self._sample_random(processed, rows, scored=scores is not None)
        else:
            device = logits.device
            rand = [i for i, r in enumerate(rows) if not r.params.greedy]
            greedy_index, rand_index = to_device(greedy, torch.long, device), to_device(rand, torch.long, device)
            token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
            token_ids[greedy_index] = processed[greedy_index].argmax(dim=-1)
            token_ids[rand_index], redraw, rand_scores = self._sample_random(
                processed[rand_index], [rows[i] for i in rand], rand_index, scored=scores is not None)
            if scores is not None:
                scores = scores.to(torch.float32, copy=True)  # greedy rows: the processed logits
                scores[rand_index] = rand_scores
        if scores is None:
            scores = logits
        results = self._results(scores, token_ids, rows, None if redraw is None else redraw.short)
        if results is None:
            results = self._results(scores, redraw.apply(token_ids), rows)
        return results

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], index: torch.Tensor | None = None,
                       scored: bool = False) -> tuple[torch.Tensor, _Redraw | None, torch.Tensor | None]:
        """(R, V) logits, not modified -> (R,) token ids, the rows that may need drawing again
        (None: none can), and with `scored` the logits the rows draw from (at their temperature,
        the tokens their filters drop at -inf); `index`: the rows' places in the batch."""
        params = [r.params for r in rows]
        probs = _probs(logits, rows)  # (R, V)
        short, scores = None, None
        if scored:
            temperature = to_device([p.temperature for p in params], torch.float32, logits.device)
            scores = logits.float() / temperature.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            threshold, short = _keep_thresholds(probs, params, full_sort=scored)
            dropped = probs < threshold
            probs.masked_fill_(dropped, 0.0)
            if scored:
                scores.masked_fill_(dropped, float("-inf"))

        # q = -log(u) ~ Exp(1), u ~ U[0, 1): u == 0 gives q = inf, a zero score, never a NaN.
        u = torch.empty_like(probs)  # (R, V)
        if any(r.generator is None for r in rows):
            u.uniform_(generator=self._shared_generator(u.device))
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i].uniform_(generator=r.generator)
        q = u.log_().neg_()
        redraw = None if short is None else _Redraw(short, logits, q, rows, index)
        return (probs / q).argmax(dim=-1), redraw, scores

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def _results(self, scores: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow],
                 short: torch.Tensor | None = None) -> list[SampleResult] | None:
        """One device-to-host copy: the sampled ids, with the asked-for logprobs packed behind them
        (as float64, which holds every token id and float32 logprob exactly), and whether any of
        the `short` rows must be drawn again: None when one must. `scores`: (B, V) the logits the
        logprobs are of (the logprobs mode's)."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        parts = [token_ids]
        if want:
            want_index = to_device(want, torch.long, scores.device)
            logprobs = scores[want_index].float()  # (R, V)
            if self.logprobs_mode.endswith("logprobs"):
                logprobs = logprobs.log_softmax(dim=-1)
            sampled = logprobs.gather(1, token_ids[want_index].unsqueeze(1)).squeeze(1)  # (R,)
            ranks = (logprobs >= sampled.unsqueeze(1)).sum(dim=1)  # (R,)
            num_top = max(rows[i].params.logprobs for i in want)
            top_values, top_ids = logprobs.topk(num_top, dim=-1)  # (R, num_top), highest first
            parts += [sampled, ranks, top_values.flatten(), top_ids.flatten()]
        if short is not None:
            parts.append(short.any().unsqueeze(0))
        packed = token_ids.tolist() if len(parts) == 1 else torch.cat([p.double() for p in parts]).tolist()
        if short is not None and packed.pop():
            return None
        b, r = len(rows), len(want)
        results = [SampleResult(int(t), None, None) for t in packed[:b]]
        if not want:
            return results
        values, ids = packed[b + 2 * r:b + 2 * r + r * num_top], packed[b + 2 * r + r * num_top:]
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            top = slice(j * num_top, j * num_top + n)
            results[i].logprob = packed[b + j]
            results[i].rank = int(packed[b + r + j])
            results[i].top_logprobs = [(int(t), v) for t, v in zip(ids[top], values[top])]
        return results


def _after_drafts(row: SamplingRow, drafts: list[int]) -> SamplingRow:
    """The row of the position after `drafts`: its output includes them, where it is read."""
    if not reads_output(row.params):
        return row
    return dataclasses.replace(row, output_token_ids=row.output_token_ids + drafts)


def _rewind(generator: torch.Generator, state: torch.Tensor, rows: int, vocab_size: int) -> None:
    """Set a row's generator to where `rows` draws (one uniform per token each, as
    Sampler._sample_random draws a row) from `state` leave it."""
    generator.set_state(state)
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(rows):
        scratch.uniform_(generator=generator)


def reads_prompt(params: SamplingParams) -> bool:
    """Only the repetition penalty reads a row's prompt tokens; other rows may leave them out."""
    return params.repetition_penalty != 1.0


def reads_output(params: SamplingParams) -> bool:
    """Only penalties, min_tokens and bad words of several tokens read a row's output tokens; other
    rows may leave them out (a copy of a long output per row per step otherwise)."""
    return params.min_tokens > 0 or _has_penalties(params) or bans_read_output(params)


class SequenceSampler:
    """Draws the next token of whole sequences: builds each one's SamplingRow and samples the rows
    with one Sampler. The same code runs in the engine process (tp=1) and on the sampling rank
    (tp > 1), so seeds, penalties and min_tokens behave the same at any tensor_parallel_size.

    A sequence is anything with `index`, `params`, `prompt_token_ids` and `output_token_ids`
    (an engine Sequence, or a rank's record of one), and `spec_token_ids` where it has drafts. A
    seeded sequence draws from its own generator, seeded with params.seed + index on first use,
    which lives as long as the sequence does (through preemption, gone with it).
    """

    def __init__(self, seed: int, eos_token_ids: list[int], logprobs_mode: str = "raw_logprobs") -> None:
        self.sampler = Sampler(seed, logprobs_mode)
        self.eos_token_ids = sorted(set(eos_token_ids))  # masked until min_tokens, in every row
        self._generators: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def sample(self, logits: torch.Tensor, rows: list[int], seqs: list,
               grammar_mask: GrammarMask | None = None) -> list[SampleResult | list[SampleResult]]:
        """logits: (R, V), one row per sampling sequence; seqs[i] draws from logits[rows[i]] (the
        n - 1 children forked from a parent share its row). `grammar_mask`: the constrained rows'
        allowed tokens (engine.structured), applied first, so logprobs are of the masked logits
        (as vLLM's). -> one result per sequence.

        A sequence with k drafts (its spec_token_ids, engine.speculative) also draws at each of
        their rows, which follow every sequence's own row, in sequence order; a draft's row reads
        the drafts before it as output (penalties, min_tokens, bad words). It gets the list of the
        results its output keeps (engine.sequence.num_kept): those of the drafts drawn as proposed,
        then the one after them. A seeded sequence's generator is left as if only those rows had
        drawn, so its tokens are the ones it draws without drafts."""
        if grammar_mask is not None:
            logits = apply_grammar_mask(logits, grammar_mask)
        sampling = [self._row(s, logits.device) for s in seqs]
        drafts = [len(getattr(s, "spec_token_ids", ())) for s in seqs]
        num_drafts = sum(drafts)
        if num_drafts:
            first = logits.shape[0] - num_drafts
            rows = rows + list(range(first, logits.shape[0]))
            sampling += [_after_drafts(row, s.spec_token_ids[:j + 1])
                         for row, s, k in zip(sampling, seqs, drafts) for j in range(k)]
        if len(rows) != logits.shape[0]:
            logits = logits[to_device(rows, torch.long, logits.device)]  # (len(seqs) + drafts, V)
        seeded = {i: row.generator.get_state() for i, (row, k) in enumerate(zip(sampling, drafts))
                  if k and row.generator is not None and not row.params.greedy}
        results = self.sampler.sample(logits, sampling)
        if not num_drafts:
            return results
        grouped, next_row = [], len(seqs)
        for i, (seq, result, k) in enumerate(zip(seqs, results, drafts)):
            if k:
                draws = [result] + results[next_row:next_row + k]
                result = draws[:num_kept(seq.spec_token_ids, [r.token_id for r in draws]) + 1]
                if i in seeded:
                    _rewind(sampling[i].generator, seeded[i], len(result), logits.shape[1])
            grouped.append(result)
            next_row += k
        return grouped

    def _row(self, seq, device: torch.device) -> SamplingRow:
        p = seq.params
        return SamplingRow(params=p, prompt_token_ids=seq.prompt_token_ids if reads_prompt(p) else [],
                           output_token_ids=seq.output_token_ids if reads_output(p) else [],
                           generator=self._generator(seq, device),
                           eos_token_ids=self.eos_token_ids)

    def _generator(self, seq, device: torch.device) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        generator = self._generators.get(seq)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(seq.params.seed + seq.index)
            self._generators[seq] = generator
        return generator
