"""Reasoning split from the answer, as vLLM's `--reasoning-parser` does for chat replies.

Thinking models (Qwen3, DeepSeek-R1 and its distills, QwQ) write their reasoning between
`<think>` and `</think>`, then the answer. With `qwen3`, a reply begins inside the reasoning when
the prompt left a block open (a template that opens it, as Qwen3.5's; an assistant message
continued from inside one), or when the reply's own text begins with `<think>`:

    prompt ... <think>\n | reasoning ... </think> | answer       (the prompt opened it)
    prompt ...           | <think> reasoning ... </think> | answer
    prompt ...           | answer                               (thinking off: all content)

With `deepseek_r1` every reply begins inside it (R1 always thinks, and its template opens the
block), as vLLM's parser of that name reads it: the text before `</think>` is reasoning. With
either, a prompt that ends with a closed block (a template that turned thinking off) starts the
reply in its answer. Tags are read from the text the template wrote after the last message
(reply_start), and from that message only where the reply continues it: never from what a user
typed.

A constrained reply (response_format, structured_outputs, a required tool call) reasons freely
too: its grammar applies to the answer only, from the token after `</think>` (grammar_gate), as
vLLM applies structured outputs under a reasoning parser. Where the prompt closed a block
(thinking turned off by the template) the grammar applies at once. This needs `</think>` to be
one token, as thinking models' vocabularies have it (engine.structured.gate); with another
tokenizer the grammar governs the whole reply, which is then not split.

The reasoning goes to the message's `reasoning` (vLLM's current name) and `reasoning_content`
(its earlier one, which clients such as LangChain still read); the tags are dropped, the answer
is `content`, where tool calls are then looked for. A reply cut before `</think>` is all
reasoning.
"""
from __future__ import annotations

from collections.abc import Callable

from router.tool_calls import held_back

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def reply_start(prompt_tail: str, last_message: str, continued: bool) -> str:
    """The text a reply follows, where its start in or out of reasoning is read: what the chat
    template wrote after the last message (its generation prompt), and the message itself where
    the reply continues it. A tag in a user's text is not the template's. The prompt's last text
    (`prompt_tail`, its last tokens decoded) where the message's end is not found in it."""
    probe = last_message.strip()[-128:]
    at = prompt_tail.rfind(probe) if probe else -1
    if at < 0:
        return prompt_tail
    after = prompt_tail[at + len(probe):]
    return last_message + after if continued else after


def thinking_off(start: str) -> bool:
    """Whether the text before the reply (reply_start) ends with a closed block: a template that
    turns thinking off writes an empty one there (Qwen3's `enable_thinking: false`)."""
    return start.rstrip().endswith(END)


def opens_in_reasoning(parser: str, start: str) -> bool:
    """Whether a reply begins inside the block, read from the text before it (reply_start): never
    after a closed block; else always with deepseek_r1; with qwen3, when that text opened a block
    it did not close."""
    if thinking_off(start):
        return False
    return parser == "deepseek_r1" or start.rfind(START) > start.rfind(END)


def grammar_gate(parser: str, start: str) -> dict:
    """engine.structured.params' fields that hold a reply's grammar back until its reasoning
    ends: none where thinking is off; from the start where the reply opens inside the block;
    else (qwen3) the reply's first token may open one, any other begins the answer."""
    if thinking_off(start):
        return {}
    if opens_in_reasoning(parser, start):
        return {"reasoning_end": END}
    return {"reasoning_end": END, "reasoning_start": START}


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A whole reply -> (reasoning, content), each None where empty. A `<think>` opening the
    reply is dropped even where the reply began inside the block (R1's distills write one)."""
    stripped = text.lstrip()
    if stripped.startswith(START):
        text = stripped[len(START):]
    elif not in_reasoning:
        return None, text or None
    reasoning, closed, content = text.partition(END)
    return reasoning or None, (content if closed else "") or None


def count_reasoning_tokens(token_ids: list[int], decode: Callable[[list[int]], str], in_reasoning: bool) -> int:
    """How many of a reply's tokens are its reasoning, up to and including the one that closes
    it (split_reasoning's reading of the same reply): the closing tag is found in log2(n) decodes
    of the reply's prefixes."""
    text = decode(token_ids)
    if not (in_reasoning or text.lstrip().startswith(START)):
        return 0
    if END not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds the tag
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if END in decode(token_ids[:mid]) else (mid + 1, hi)
    return lo


def reasoning_fields(reasoning: str | None) -> dict:
    return {"reasoning": reasoning, "reasoning_content": reasoning}


class ReasoningStream:
    """The same split over a stream's text deltas: step(text) -> (reasoning delta, content delta).
    Text that may be the start of a tag is held back until the next delta tells (or the end)."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self.state = "start"  # not yet known whether a <think> opens the reply
        self.held = ""

    def step(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self.held = self.held + text, ""
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(START):
                self.state, buf = "reasoning", stripped[len(START):]
            elif START.startswith(stripped) and not final:  # "", "<", "<th", ...: wait and see
                self.held = buf
                return "", ""
            else:
                self.state = "reasoning" if self.in_reasoning else "content"
        if self.state == "content":
            return "", buf
        reasoning, closed, content = buf.partition(END)
        if closed:
            self.state = "content"
            return reasoning, content
        keep = 0 if final else held_back(buf, END)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

