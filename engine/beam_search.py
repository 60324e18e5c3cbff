"""Beam search (vLLM's `use_beam_search`, and its offline `LLM.beam_search`), run over the
engine's logprobs: at the ingress on its engine calls, offline on the LLM's engine.

As vLLM's OpenAI server does it: each round asks the engine for one token of every live beam,
with the 2k most likely next tokens' logprobs (k = the beam width, the request's `n`), and keeps
the k best of the candidates by cumulative logprob. A candidate ending in an end-of-sequence token
is set aside as complete. After `max_tokens` rounds the complete and live beams are ranked by
vLLM's score, cumulative logprob / (sequence length, prompt included, the end token not) **
length_penalty, and the k best are the reply's choices, best first. The prefix cache keeps the
rounds cheap: a beam's tokens before its last block are already in the KV cache.

A beam that ended is given as vLLM gives it: finish_reason "stop", stop_reason its end token's
id; on the server an end-of-sequence token is in its token ids (and text) only with
include_stop_str_in_output, one of `stop_token_ids` always (sampling's rule for them; vLLM's beam
search has none); the offline `LLM.beam_search` keeps it always (vLLM's offline search).

Only the model's distribution decides: temperature and seed do not change the beams (vLLM's rule
too); the fields that reshape the distribution are refused with beam search (router.protocol).
The reply comes whole, also to a stream: one chunk per choice once the search ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.outputs import ChoiceDelta, StepOutput
from engine.sampling_params import DEFAULT_MAX_LOGPROBS, RequestOutputKind, SamplingParams

MAX_BEAM_WIDTH = DEFAULT_MAX_LOGPROBS // 2  # each round asks for 2k logprobs per beam

Generate = Callable[[str, list[int], SamplingParams], AsyncIterator[StepOutput]]


class BeamSearchAborted(RuntimeError):
    """The engine stopped one of the search's requests before it finished (a drain, a shutdown)."""


@dataclass(frozen=True)
class BeamSearch:
    width: int
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # the end token's text in the reply's text


@dataclass
class BeamSearchParams:
    """vLLM's offline `LLM.beam_search` params. `temperature` and `include_stop_str_in_output` are
    taken and not used, as by vLLM's offline search: the beams follow the model's own logprobs, and
    a beam keeps the end token it drew (in its tokens; its text has special tokens, the end token
    among them, only without `skip_special_tokens`). The most beams: half the engine's max_logprobs
    (`LLM` checks)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, as vLLM's: its tokens with the prompt's, each generated
    token's round logprobs (the 2k best and it; `LLM` makes each a vLLM Logprob), and the text of
    them all."""
    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float
    text: str
    finish_reason: str  # "stop" (an end token) or "length"
    stop_reason: int | None = None  # the end token


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]  # generated so far (an end token last where it ended)
    cum_logprob: float = 0.0
    entries: tuple[dict[int, float], ...] = ()  # per token: the round's logprobs (top ones + it)
    ended: bool = False


def _rank(beam: _Beam, prompt_len: int, length_penalty: float) -> float:
    """vLLM's score, cum_logprob / length ** length_penalty, as an order: log(-1 / score), which
    no length_penalty overflows (a sure beam, logprob 0, ranks first)."""
    if beam.cum_logprob >= 0:
        return math.inf
    length = max(prompt_len + len(beam.tokens) - beam.ended, 1)
    return length_penalty * math.log(length) - math.log(-beam.cum_logprob)


async def _one_token(generate: Generate, request_id: str, ids: list[int], params: SamplingParams) -> StepOutput:
    """The engine's one-token reply to `ids`, its outputs folded into one; an error when the
    engine cut the request (a drain) or gave no logprobs."""
    choices, first = [], None
    async with contextlib.aclosing(generate(request_id, ids, params)) as stream:
        async for step in stream:
            first = first or step
            choices += step.choices
    if first is None or not choices or choices[-1].finish_reason == "abort":
        raise BeamSearchAborted("the engine stopped this beam search's request before it finished")
    if len(choices[0].logprobs or ()) != 1:
        raise RuntimeError(f"the engine gave {len(choices[0].logprobs or ())} tokens' logprobs for one token")
    return dataclasses.replace(first, choices=choices)


async def _round(generate: Generate, request_id: str, prompts: list[list[int]],
                 params: SamplingParams) -> list[StepOutput]:
    """One token for each prompt, asked together; one failing cancels the others."""
    tasks = [asyncio.create_task(_one_token(generate, f"{request_id}-{i}", p, params)) for i, p in enumerate(prompts)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # the ones still running: after a failure, or when the search itself is cancelled
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]


async def search(generate: Generate, request_id: str, prompt: list[int], params: SamplingParams,
                 beam: BeamSearch, eos_token_ids: set[int]) -> tuple[StepOutput, list[_Beam]]:
    """-> the first round's first output (cached tokens, prompt logprobs) and the `beam.width`
    best beams, best first. `params` gives max_tokens, ignore_eos, stop_token_ids (which end a
    beam too), logprobs and prompt_logprobs, cache_salt and lora_request."""
    k, enders = beam.width, set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    round_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                  logprobs=max(2 * k, params.logprobs or 0), cache_salt=params.cache_salt,
                                  lora_request=params.lora_request,
                                  output_kind=RequestOutputKind.FINAL_ONLY)
    live, done, head = [_Beam(())], [], None

    def rank(beams: list[_Beam]) -> list[_Beam]:
        return sorted(beams, key=lambda b: _rank(b, len(prompt), beam.length_penalty), reverse=True)

    for r in range(params.max_tokens):
        first = dataclasses.replace(round_params, prompt_logprobs=params.prompt_logprobs) if r == 0 else round_params
        outs = await _round(generate, f"{request_id}-{r}", [prompt + list(b.tokens) for b in live], first)
        head = head or outs[0]
        candidates = []
        for b, out in zip(live, outs):
            (entry,) = out.choices[0].logprobs
            top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:2 * k]
            for token, logprob in top:
                nxt = _Beam(b.tokens + (token,), b.cum_logprob + logprob, b.entries + (entry,), token in enders)
                (done if nxt.ended else candidates).append(nxt)
        live = rank(candidates)[:k]
        if not live:
            break
    return head, rank(done + live)[:k]


async def beam_search(generate: Generate, request_id: str, prompt: list[int], params: SamplingParams,
                      beam: BeamSearch, eos_token_ids: set[int], decode: Callable[[list[int], bool], str],
                      ) -> AsyncIterator[StepOutput]:
    """One StepOutput: the `beam.width` best beams as choices 0..k-1 (`search`, whose `params`
    skip_special_tokens also reads); `decode(token ids, skip_special_tokens)` writes a beam's text."""
    head, best = await search(generate, request_id, prompt, params, beam, eos_token_ids)
    choices = [_choice(i, b, params, beam, decode) for i, b in enumerate(best)]
    yield StepOutput(choices, len(prompt), head.num_cached_tokens, True, head.prompt_logprobs)


def _shown(b: _Beam, beam: BeamSearch, stop_token_ids) -> int:
    """How many of a beam's tokens its reply shows: an end token only with
    include_stop_str_in_output, one of `stop_token_ids` always (its text only with that flag)."""
    hidden = b.ended and not beam.include_stop_str_in_output and b.tokens[-1] not in stop_token_ids
    return len(b.tokens) - hidden


def _choice(index: int, b: _Beam, params: SamplingParams, beam: BeamSearch,
            decode: Callable[[list[int], bool], str]) -> ChoiceDelta:
    tokens = list(b.tokens[:_shown(b, beam, params.stop_token_ids)])
    logprobs = None
    if params.logprobs is not None:  # each token's: the asked-for top ones, and the token itself
        logprobs = [{**dict(sorted(e.items(), key=lambda kv: kv[1], reverse=True)[:params.logprobs]), t: e[t]}
                    for t, e in zip(tokens, b.entries)]
    # A stop token's text is left out as sampling leaves it out (engine.request.Request.append_token).
    stop_token = b.ended and not beam.include_stop_str_in_output and b.tokens[-1] in params.stop_token_ids
    text_tokens = tokens[:-1] if stop_token else tokens
    return ChoiceDelta(index, decode(text_tokens, params.skip_special_tokens), tokens, logprobs,
                       "stop" if b.ended else "length", b.tokens[-1] if b.ended else None)


def sequences(prompt: list[int], best: list[_Beam], beam: BeamSearch,
              decode: Callable[[list[int]], str]) -> BeamSearchOutput:
    """`search`'s best beams as `LLM.beam_search` gives them: an end token kept only with
    `beam`'s include_stop_str_in_output (which `LLM` sets), its logprob in cum_logprob either way."""
    out = []
    for b in best:
        shown = _shown(b, beam, ())
        tokens = prompt + list(b.tokens[:shown])
        out.append(BeamSearchSequence(tokens, list(b.entries[:shown]), b.cum_logprob, decode(tokens),
                                      "stop" if b.ended else "length", b.tokens[-1] if b.ended else None))
    return BeamSearchOutput(out)
