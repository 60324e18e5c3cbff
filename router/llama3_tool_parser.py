"""Llama 3.1+'s JSON tool calls (`--tool-call-parser llama3_json`, vLLM's name), out of generated text.

Llama 3's chat template asks for a call as a bare JSON object, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}

A reply is calls when it starts with `{` (after whitespace, and `<|python_tag|>` where special
tokens are shown) and every object in it is one; otherwise it is content, as written. (vLLM's
streaming parser decides on the same start; its whole-reply parser also takes calls that follow
other text, and drops that text: one rule here, so that a stream and a whole reply agree.)
Such a reply is held until it ends (router.tool_calls.WholeReplyStream). Cut at max_tokens,
the calls that were whole stand and an unfinished one (`{"name"`, or less) is dropped (the
finish_reason "length" says so), not sent as content.
"""
from __future__ import annotations

import json

from router.tool_calls import WholeReplyStream, call_of

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
        except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
            return calls if cut and unfinished_call(text[i:]) else None
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


def unfinished_call(text: str) -> bool:
    """Whether text a reply was cut inside could still be a call: `{` and then nothing, or a first
    key that is (the start of) "name", as Llama writes its calls. A cut JSON answer such as
    `{"summary": "...` is content."""
    rest = text.lstrip()[1:].lstrip() if text.lstrip().startswith("{") else None
    return rest is not None and (rest.startswith('"name"') or '"name"'.startswith(rest))


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Llama3JsonStream(WholeReplyStream):
    """One choice's text deltas -> OpenAI chat deltas, for Llama 3's JSON calls."""

    tag = PYTHON_TAG

    def could_be(self, head: str) -> bool:
        return head.startswith("{")

    def parse(self, body: str, cut: bool) -> list[tuple[str, str]] | None:
        return parse_calls(body, cut)
