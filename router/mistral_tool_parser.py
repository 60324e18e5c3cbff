"""Mistral's tool calls (`--tool-call-parser mistral`, vLLM's name), out of generated text:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (v0.3, Nemo)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}           (v11 tokenizers)

`[TOOL_CALLS]` is a special token: the requests of a server with this parser keep special tokens
in their text while tools are offered (vLLM's adjust_request), so that the tag shows. A reply is
calls when it starts with the tag, or with a JSON list of call objects (the tag skipped), and is
nothing else; held until it ends (router.tool_calls.WholeReplyStream). Text before the tag (Mistral
Small writes some) is content, streamed as it comes, and the tag starts the calls, as in vLLM's
parser. Cut at max_tokens, the whole calls stand. Call ids are 9 letters and digits: Mistral's chat templates refuse others
when the calls come back in the history (vLLM makes the same).
"""
from __future__ import annotations

import json
import random
import re
import string

from router.llama3_tool_parser import unfinished_call
from router.tool_calls import WholeReplyStream, call_of, chat_delta, held_back

TAG = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[^\s\[\]{}]+")  # a name without spaces or brackets: MCP's "srv:tool/x", non-English ones
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def parse_calls(body: str, cut: bool = False) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) of each call in `body` (the reply past its first tag), or
    None if it is not all calls; `cut`: a call the text ends inside is left out."""
    segments = body.split(TAG)
    calls = []
    for k, segment in enumerate(segments):
        last = k == len(segments) - 1
        if last and cut and not segment.strip() and calls:
            break  # cut right after a tag
        found = _segment(segment, cut and last)
        if found is None:
            return None
        calls += found
    return calls


def _segment(text: str, cut: bool) -> list[tuple[str, str]] | None:
    text = text.strip()
    if text[:1] in ("[", "{"):
        return _json_calls(text, cut)
    name, args, rest = text.partition(ARGS)
    name = name.split(CALL_ID)[0].strip()  # v13's `name[CALL_ID]id[ARGS]{...}`
    if not args:  # no [ARGS] yet: a cut name (or a cut [ARGS])
        head = name[:len(name) - held_back(name, ARGS)]
        return [] if cut and (not head or _NAME.fullmatch(head)) else None
    if not _NAME.fullmatch(name):
        return None
    try:
        value, end = _DECODER.raw_decode(rest.strip())
    except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
        return [] if cut else None
    if not isinstance(value, dict) or rest.strip()[end:].strip():
        return None
    return [(name, json.dumps(value, ensure_ascii=False))]


def _json_calls(text: str, cut: bool) -> list[tuple[str, str]] | None:
    """A JSON list of call objects (or one object)."""
    if text.startswith("{"):
        try:
            value, end = _DECODER.raw_decode(text)
        except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
            return [] if cut and unfinished_call(text) else None
        found = call_of(value)
        return [found] if found is not None and not text[end:].strip() else None
    calls, i = [], 1
    while True:
        i = _skip_space(text, i)
        if i == len(text):
            return calls if cut and calls else None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
            return calls if cut and (calls or unfinished_call(text[i:])) else None
        found = call_of(value)
        if found is None:
            return None
        calls.append(found)
        i = _skip_space(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        if i < len(text) and text[i] == "]":
            return calls if not text[i + 1:].strip() else None
        return calls if cut and i == len(text) else None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class MistralStream(WholeReplyStream):
    """One choice's text deltas -> OpenAI chat deltas, for Mistral's calls."""

    tag = TAG
    new_id = staticmethod(new_call_id)

    def __init__(self, max_calls: int | None = None, accepts=None) -> None:
        super().__init__(max_calls, accepts)
        self.held = ""  # content: its end, that may be the start of a tag
        self.calls: MistralStream | None = None  # the reply past a tag that came after content

    def feed(self, text: str) -> dict:
        if self.calls is not None:
            return self.calls.feed(text)
        if not self.content:
            delta = super().feed(text)
            if not self.content:
                return delta
            text = delta.get("content", "")  # decided: content, so far
        text, self.held = self.held + text, ""
        at = text.find(TAG)
        if at < 0:
            keep = held_back(text, TAG)
            self.held = text[len(text) - keep:]
            return chat_delta(text[:len(text) - keep], [])
        return chat_delta(text[:at], self._open_calls(text[at:]).get("tool_calls", []))

    def _open_calls(self, text: str) -> dict:
        """The reply from its tag on (`text`) goes to a stream of its own, as a reply of calls."""
        self.calls = MistralStream(self.max_calls, self.accepts)
        return self.calls.feed(text)

    def finish(self, cut: bool = False) -> dict:
        before = ""
        if self.calls is None:
            end = super().finish(cut)
            text = self.held + end.get("content", "")
            at = text.find(TAG)
            if end.get("tool_calls") or at <= 0 or text.lstrip().startswith(TAG):
                return chat_delta(text, end.get("tool_calls", []))
            # held as it looked like calls ('[{', '{'), it was content before a tag after all
            before = text[:at]
            self._open_calls(text[at:])
        end = self.calls.finish(cut)
        self.num_calls = self.calls.num_calls
        return chat_delta(before + end.get("content", ""), end.get("tool_calls", []))

    def could_be(self, head: str) -> bool:
        if head.startswith("{") or re.match(r"\[\s*(\{|\Z)", head):
            return True
        return self.tagged  # past the tag, v11's `name[ARGS]{...}`

    def parse(self, body: str, cut: bool) -> list[tuple[str, str]] | None:
        return parse_calls(body, cut)
