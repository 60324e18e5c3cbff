"""Llama 3.1+'s JSON tool calls (`--tool-call-parser llama3_json`, vLLM's name), out of generated text.

Llama 3's chat template asks for a call as a bare JSON object, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

A reply is calls when it starts with `{` (after whitespace, and `<|python_tag|>` where special
tokens are shown) and every object in it is one; otherwise it is content, as written. (vLLM's
streaming parser decides on the same start; its whole-reply parser also takes calls that follow
other text, and drops that text: one rule here, so that a stream and a whole reply agree.)
Such a reply is held until it ends, then decided whole, so a stream never sends content it would
have to take back; a reply that starts otherwise streams as content at once. Cut at max_tokens,
the calls that were whole stand and an unfinished one (`{"name"`, or less) is dropped (the
finish_reason "length" says so), not sent as content.
"""
from __future__ import annotations

import json

from router.tool_calls import Accepts, CallStream, call, call_of, chat_delta

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_DECODER = json.JSONDecoder()


def parse_calls(text: str, cut: bool) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) of each object in `text` (what follows the tag; a `;` may end
    it too), or None if one is not a call; `cut`: an object the text ends inside is left out."""
    calls, i = [], 0
    while True:
        i = _skip_space(text, i)
        if calls and i == len(text):  # after a separator
            return calls
        try:
            obj, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return calls if cut and _unfinished_call(text[i:]) else None
        parsed = call_of(obj)
        if parsed is None:
            return None
        calls.append(parsed)
        i = _skip_space(text, i)
        if i == len(text):
            return calls
        if text[i] != SEPARATOR:
            return None
        i += 1


def _unfinished_call(text: str) -> bool:
    """Whether text a reply was cut inside could still be a call: `{` and then nothing, or a first
    key that is (the start of) "name", as Llama writes its calls. A cut JSON answer such as
    `{"summary": "...` is content."""
    rest = text.lstrip()[1:].lstrip() if text.lstrip().startswith("{") else None
    return rest is not None and (rest.startswith('"name"') or '"name"'.startswith(rest))


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Llama3JsonStream(CallStream):
    """One choice's text deltas -> OpenAI chat deltas, for Llama 3's JSON calls."""

    def __init__(self, max_calls: int | None = None, accepts: Accepts | None = None) -> None:
        self.max_calls, self.accepts = max_calls, accepts
        self.buffer = ""  # the reply so far, while it may still be calls
        self.content = False  # decided: the reply is content
        self.num_calls = 0

    def _body(self) -> str | None:
        """What follows the tag when the reply is calls so far, "" while it cannot tell yet, None
        once it cannot be calls."""
        head = self.buffer.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(head):
            return ""
        if not head:
            return ""
        return head if head.startswith("{") else None

    def feed(self, text: str) -> dict:
        if self.content:
            return chat_delta(text, [])
        self.buffer += text
        if self._body() is None:
            self.content, out, self.buffer = True, self.buffer, ""
            return chat_delta(out, [])
        return {}

    def finish(self, cut: bool = False) -> dict:
        body, text, self.buffer = self._body(), self.buffer, ""
        if self.content or not body:
            return chat_delta(text, [])
        parsed = parse_calls(body, cut)
        if parsed is None or (self.accepts is not None and not all(self.accepts(*c) for c in parsed)):
            return chat_delta(text, [])  # not calls (a function not offered, arguments off a strict schema): content
        if self.max_calls is not None:
            parsed = parsed[:self.max_calls]
        self.num_calls = len(parsed)
        return chat_delta("", [{"index": i, **call(*c)} for i, c in enumerate(parsed)])
