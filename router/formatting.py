"""Response bodies of the OpenAI API, built from the engine replicas' `StepOutput`s.

Choice indices: a request with P prompts and n samples each has choices `p * n + i`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import ChoiceDelta, PromptLogprobs

TokenStr = Callable[[int], str]
TokenBytes = Callable[[int], list[int]]
_MIN_LOGPROB = -9999.0  # -inf is not JSON


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    """A logprob (or logit) as JSON can hold it: -inf as -9999.0 (vLLM's), and so NaN (weights
    that made NaN logits), never a value a JSON encoder refuses."""
    return min(x, -_MIN_LOGPROB) if x >= _MIN_LOGPROB else _MIN_LOGPROB


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], k: int, token_str: TokenStr,
                        offset: int = 0) -> dict:
    """The legacy completions shape; `offset` is where this piece starts in the choice's text. An
    entry of None (an echoed prompt's first token, which nothing conditions) has null logprobs.
    A token's top_logprobs are the k most likely and the token itself (k + 1 when it is not
    among them), as OpenAI's and vLLM's are."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        s = token_str(tid)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = _top(entry, k)
        if all(t != tid for t, _ in top):
            top.append((tid, entry[tid]))
        out["token_logprobs"].append(_lp(entry[tid]))
        out["top_logprobs"].append({token_str(t): _lp(lp) for t, lp in top})
    return out


def vllm_prompt_logprobs(scored: PromptLogprobs, k: int, token_str: TokenStr) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else token id -> {logprob,
    rank, decoded_token} for the token itself and the k most likely."""
    out = []
    for pl in scored:
        if pl is None:
            out.append(None)
            continue
        entry = {pl.token_id: {"logprob": _lp(pl.logprob), "rank": pl.rank, "decoded_token": token_str(pl.token_id)}}
        for rank, (tid, lp) in enumerate(pl.top[:k], 1):
            entry.setdefault(tid, {"logprob": _lp(lp), "rank": rank, "decoded_token": token_str(tid)})
        out.append(entry)
    return out


@dataclass
class PromptEcho:
    """The prompt's part of each completion choice: its text and tokens before the completion
    (`echo`), with their logprobs when `logprobs` is set, and vLLM's `prompt_logprobs`."""
    texts: list[str] | None  # per prompt, when echo
    token_ids: list[list[int]]  # per prompt
    prompt_logprobs: int | None  # vLLM's extra, when asked: its top-k
    # each prompt token's text in prompt_logprobs (`decoded_token`): the text whatever the
    # request's return_tokens_as_token_ids, which renames only the `logprobs` tokens (vLLM's)
    decoded_token: TokenStr

    def head(self, acc: "Accumulator", choice: int,
             with_logprobs: bool) -> tuple[str, list[int], list[dict[int, float] | None], dict]:
        """-> the text, token ids and logprob entries the choice starts with, and its extra fields."""
        p = choice // acc.n
        scored = acc.prompt_logprobs[p]
        extra = {}
        if self.prompt_logprobs is not None:
            extra["prompt_logprobs"] = vllm_prompt_logprobs(scored, self.prompt_logprobs, self.decoded_token)
        if self.texts is None:
            return "", [], [], extra
        entries = [pl.entry() if pl else None for pl in scored] if with_logprobs else []
        return self.texts[p], self.token_ids[p], entries, extra


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int, token_str: TokenStr,
                  token_bytes: TokenBytes) -> dict:
    """`bytes` are the token's own (part of a UTF-8 character, for some), as OpenAI gives them:
    joined, they rebuild the text, where the text of such a token is only U+FFFD."""
    def item(tid: int, lp: float) -> dict:
        return {"token": token_str(tid), "logprob": _lp(lp), "bytes": token_bytes(tid)}

    content = [{**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]}
               for tid, entry in zip(token_ids, entries)]
    return {"content": content, "refusal": None}


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, c: ChoiceDelta) -> None:
        self.text.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


class Accumulator:
    """Collects the whole response of a non-streaming request, and the usage of any request."""

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.prompt_lens, self.n = prompt_lens, n
        self.choices = [ChoiceState() for _ in range(len(prompt_lens) * n)]
        # Per prompt, its tokens the prefix cache served: the least any of its engine calls had
        # (an n cut into calls: the later ones find what the first computed), None before any.
        self.cached: list[int | None] = [None] * len(prompt_lens)
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompt_lens)  # when asked

    def index(self, prompt: int, c: ChoiceDelta) -> int:
        return prompt * self.n + c.index

    def add(self, prompt: int, step) -> None:
        cached = self.cached[prompt]
        self.cached[prompt] = step.num_cached_tokens if cached is None else min(cached, step.num_cached_tokens)
        if step.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = step.prompt_logprobs
        for c in step.choices:
            self.choices[self.index(prompt, c)].add(c)

    def usage(self) -> dict:
        return usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices),
                     sum(c or 0 for c in self.cached))

    def choice_usage(self, i: int) -> dict:
        """The usage so far of choice `i` alone: its prompt's tokens and its own (vLLM's
        continuous_usage_stats chunks count each choice's, not the request's)."""
        prompt = i // self.n
        return usage(self.prompt_lens[prompt], len(self.choices[i].token_ids), self.cached[prompt] or 0)


# OpenAI's reply fields that say nothing here, null as in vLLM's replies (no service tiers; no
# fingerprint of a backend configuration)
UNSET_REPLY_FIELDS = {"service_tier": None, "system_fingerprint": None}


def completion_response(rid: str, created: int, model: str, acc: Accumulator, k: int | None,
                        token_str: TokenStr, echo: PromptEcho | None = None) -> dict:
    choices = []
    for i, c in enumerate(acc.choices):
        text, ids, entries, extra = echo.head(acc, i, k is not None) if echo else ("", [], [], {})
        lps = completion_logprobs(ids + c.token_ids, entries + c.logprobs, k, token_str) if k is not None else None
        choices.append({"index": i, "text": text + "".join(c.text), "logprobs": lps,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, **extra})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": acc.usage(), **UNSET_REPLY_FIELDS}


def chat_response(rid: str, created: int, model: str, acc: Accumulator, k: int | None,
                  token_str: TokenStr, token_bytes: TokenBytes, role: str = "assistant") -> dict:
    choices = []
    for i, c in enumerate(acc.choices):
        lps = chat_logprobs(c.token_ids, c.logprobs, k, token_str, token_bytes) if k is not None else None
        # vLLM's message: no refusal, no tool calls unless the tools found some (router.tools)
        choices.append({"index": i, "message": {"role": role, "content": "".join(c.text), "refusal": None,
                                                "tool_calls": []},
                        "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": acc.usage(), **UNSET_REPLY_FIELDS}
