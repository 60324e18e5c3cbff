"""Response bodies of the OpenAI API, built from the engine replicas' `StepOutput`s.

Choice indices: a request with P prompts and n samples each has choices `p * n + i`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import ChoiceDelta

TokenStr = Callable[[int], str]
_MIN_LOGPROB = -9999.0  # -inf is not JSON


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int, token_str: TokenStr,
                        offset: int = 0) -> dict:
    """The legacy completions shape; `offset` is where this piece starts in the choice's text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, entries):
        s = token_str(tid)
        top = _top(entry, k) if k > 0 else [(tid, entry[tid])]
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(entry[tid]))
        out["top_logprobs"].append({token_str(t): _lp(lp) for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], k: int, token_str: TokenStr) -> dict:
    def item(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}

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
        self.cached = [0] * len(prompt_lens)

    def index(self, prompt: int, c: ChoiceDelta) -> int:
        return prompt * self.n + c.index

    def add(self, prompt: int, step) -> None:
        self.cached[prompt] = step.num_cached_tokens
        for c in step.choices:
            self.choices[self.index(prompt, c)].add(c)

    def usage(self) -> dict:
        return usage(sum(self.prompt_lens), sum(len(c.token_ids) for c in self.choices), sum(self.cached))


def completion_response(rid: str, created: int, model: str, acc: Accumulator, k: int | None,
                        token_str: TokenStr) -> dict:
    choices = []
    for i, c in enumerate(acc.choices):
        lps = completion_logprobs(c.token_ids, c.logprobs, k, token_str) if k is not None else None
        choices.append({"index": i, "text": "".join(c.text), "logprobs": lps,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": acc.usage()}


def chat_response(rid: str, created: int, model: str, acc: Accumulator, k: int | None,
                  token_str: TokenStr) -> dict:
    choices = []
    for i, c in enumerate(acc.choices):
        lps = chat_logprobs(c.token_ids, c.logprobs, k, token_str) if k is not None else None
        choices.append({"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": acc.usage()}
