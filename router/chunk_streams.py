"""Chat and completion streams as OpenAI's SSE chunks: a chunk per sample delta of every engine
output (none for text held back), the usage chunk where asked, then `data: [DONE]`; a failed
stream ends with its error, then [DONE], as vLLM's."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.outputs import ChoiceDelta
from router.engine_streams import events
from router.formatting import (SSE_DONE, Accumulator, PromptEcho, TokenBytes, TokenStr, chat_logprobs,
                               completion_logprobs, sse)
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.reasoning import ReasoningStream, reasoning_fields
from router.tools import ToolPlan


@dataclass(frozen=True)
class ChunkStreams:
    reply_model: Callable[[str | None], str]  # the name chunks give the model, for the request's `model`
    response_role: str  # a chat reply's role when it opens a new turn (--response-role)
    token_bytes: TokenBytes  # a token's own bytes, for chat logprobs
    force_usage: bool = False  # vLLM's --enable-force-include-usage: usage in every chunk and a last one

    def _usage(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
        return (True, True) if self.force_usage else req.stream_usage

    def _chunk_base(self, rid: str, obj: str, model: str, include_usage: bool) -> dict:
        """Fields every chunk of one stream shares; `usage` is null until the final usage chunk
        (unless continuous usage stats replace it in each)."""
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
        if include_usage:
            base["usage"] = None
        return base

    def completion(self, rid: str, req: CompletionRequest, acc: Accumulator, first, merged: AsyncIterator,
                   echo: PromptEcho | None, prompts: list[list[int]], token_str: TokenStr) -> AsyncIterator[str]:
        """A completion request's stream (`echo`: the prompts' part, where it asks for one)."""
        offsets = [0] * len(acc.choices)  # per choice: text offset of its next logprobs token
        started = [False] * len(acc.choices)  # the prompt's part goes with each choice's first chunk

        def choice(i: int, c: ChoiceDelta) -> dict:
            text, ids, entries, extra = "", [], [], {}
            if echo is not None and not started[i]:
                text, ids, entries, extra = echo.head(acc, i, req.logprobs is not None)
            if req.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk, then its new ids
                extra = {**extra, "token_ids": c.token_ids}
                if not started[i]:
                    extra["prompt_token_ids"] = prompts[i // req.n]
            started[i] = True
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(ids + c.token_ids, entries + (c.logprobs or []), req.logprobs,
                                          token_str, offsets[i])
                offsets[i] += sum(len(t) for t in lps["tokens"])
            return [{"index": i, "text": text + c.text, "logprobs": lps, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason, **extra}]

        return self._sse(rid, ("text_completion", self.reply_model(req.model)), self._usage(req), acc, first, merged,
                         [], choice)

    def chat(self, rid: str, req: ChatCompletionRequest, acc: Accumulator, first, merged: AsyncIterator,
             plan: ToolPlan, prompt_ids: list[int], thinking: bool | None, token_str: TokenStr) -> AsyncIterator[str]:
        """A chat request's stream: its tool calls parsed out (`plan`), its reasoning split off
        (`thinking`, as router.reasoning's)."""
        k = (req.top_logprobs or 0) if req.logprobs else None
        calls = [plan.stream() for _ in acc.choices] if plan.calls_tools else None
        splits = [ReasoningStream(thinking) for _ in acc.choices] if thinking is not None else None

        def choice(i: int, c: ChoiceDelta) -> list[dict]:
            lps = None if k is None else chat_logprobs(c.token_ids, c.logprobs or [], k, token_str, self.token_bytes)
            text, finish_reason, head = c.text, c.finish_reason, {}
            if splits is not None:  # reasoning first; what follows it is the answer
                reasoning, text = splits[i].step(c.text, final=finish_reason is not None)
                head = reasoning_fields(reasoning) if reasoning and req.include_reasoning else {}
            delta = {"content": text} if text or (c.token_ids and splits is None) else {}
            if calls is not None:  # tool calls: name first, then argument fragments
                delta, finish_reason = calls[i].step(text, c.finish_reason)
            delta = {**head, **delta}
            if (calls is not None or splits is not None) and not delta and finish_reason is None \
                    and lps is None and not req.return_token_ids:
                return []  # text held back (it may be a call or a tag): no empty chunk, as vLLM
            out = {"index": i, "delta": delta, "logprobs": lps, "finish_reason": finish_reason,
                   "stop_reason": c.stop_reason}
            if req.return_token_ids:  # every token's id, held-back text's too
                out["token_ids"] = c.token_ids
            if "tool_calls" in delta and finish_reason is not None:
                # The finish in a chunk of its own: the openai SDK's stream helper reads a chunk's
                # finish_reason before its tool calls, and would never close a call sent with it.
                last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason}
                return [{**out, "finish_reason": None, "stop_reason": None},
                        {**last, "token_ids": []} if req.return_token_ids else last]
            return [out]

        n = len(acc.choices)
        role = self.response_role
        preamble = [{"index": i, "delta": {"role": req.reply_role(role), "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(n)]
        if echoed := req.echoed_text(role):  # as vLLM streams it: one chunk per choice after the roles
            preamble += [{"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}
                         for i in range(n)]
        head = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}  # vLLM's: on the first chunk
        return self._sse(rid, ("chat.completion.chunk", self.reply_model(req.model)), self._usage(req), acc, first,
                         merged, preamble, choice, head)

    async def _sse(self, rid: str, kind: tuple[str, str], usage: tuple[bool, bool], acc: Accumulator, first,
                   merged: AsyncIterator, preamble: list[dict],
                   choice: Callable[[int, ChoiceDelta], list[dict]], head: dict | None = None) -> AsyncIterator[str]:
        """The SSE body of a stream: `preamble` chunks, then the chunks `choice` makes of each sample
        delta of every engine output that made tokens, text or not (see module doc; usually one, none
        for text held back),
        the usage chunk if asked for, and [DONE]. `kind`: the chunks' object and model names; `usage`:
        (include_usage, continuous_usage_stats); `head`: fields of the first chunk only."""
        include_usage, continuous = usage
        base = self._chunk_base(rid, *kind, include_usage)
        first_fields = dict(head or {})

        def chunk(c: dict) -> str:
            extra = first_fields.copy()
            first_fields.clear()
            return sse({**base, **extra, "choices": [c], "usage": acc.choice_usage(c["index"])} if continuous
                       else {**base, **extra, "choices": [c]})

        failed = False
        acc.cached[first[0]] = first[1].num_cached_tokens  # the preamble's usage counts the cache hit too
        async with contextlib.aclosing(merged):  # however this generator ends, the engine requests end
            for c in preamble:
                yield chunk(c)
            async for prompt, step in events(first, merged, acc):
                if isinstance(step, str):  # the error event that ends a failed stream
                    failed = True
                    yield step
                    continue
                for c in step.choices:
                    for out in choice(acc.index(prompt, c), c):
                        yield chunk(out)
        if include_usage and not failed:  # as vLLM: a failed stream ends with its error, then [DONE]
            yield sse({**base, "choices": [], "usage": acc.usage()})
        yield SSE_DONE
