"""What every tool-call format shares: the OpenAI call object, what makes parsed JSON a call, and
the stream base a format's parser implements (router.tool_parser: Hermes' `<tool_call>` blocks;
router.llama3_tool_parser: Llama 3's bare JSON), plus the stream of a call the request named.

A whole reply is parsed by streaming it (`parse_whole`), so the two never differ.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic")  # --tool-call-parser's: router.tools.FORMATS'
Accepts = Callable[[str, str], bool]  # (name, arguments JSON text) -> whether it calls an offered tool


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_of(obj) -> tuple[str, str] | None:
    """-> (name, arguments JSON text) of a parsed JSON value, or None if it is not a call: an
    object with a string `name` and `arguments` (or `parameters`) that are an object, or a string
    holding one (a call without either is not one, as in vLLM's parsers)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
    if isinstance(args, str):
        try:
            found = (obj["name"], args) if isinstance(json.loads(args), dict) else None
        except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
            return None
    else:
        try:
            found = (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None
        except RecursionError:  # decoded a few frames short of the limit, encoded past it
            return None
    return found if found is not None and _text("".join(found)) else None


def _text(text: str) -> bool:
    """Whether `text` is Unicode text a response can carry: JSON's `"\\ud800"` alone is a lone
    surrogate, which no UTF-8 body can encode (the reply would fail with a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def chat_delta(content: str, calls: list[dict]) -> dict:
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


class CallStream:
    """One choice's text deltas -> OpenAI chat deltas with content and tool_calls (a format's subclass)."""

    num_calls = 0
    ends_as_tool_calls = True  # a reply that called tools and stopped says "tool_calls"
    calls_only = False  # the output is held to calls (tool_choice "required"): no text of it is content

    def feed(self, text: str) -> dict: ...

    def cut_by(self, finish_reason: str | None) -> bool:
        """Whether a reply that ended so was cut short: at max_tokens; and under tool_choice
        "required", whose grammar ends only after whole calls, by a stop string too (the call
        it cut is dropped, not given back as its markup)."""
        return finish_reason == "length" or (self.calls_only and finish_reason == "stop")

    def finish(self, cut: bool = False) -> dict: ...

    def step(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """One engine delta of this choice -> (the chat delta, the finish_reason to send: a reply
        that called tools and stopped ends with "tool_calls", unless the request named the function)."""
        delta = self.feed(text)
        if finish_reason is not None:
            end = self.finish(cut=self.cut_by(finish_reason))
            delta = chat_delta(delta.get("content", "") + end.get("content", ""),
                           delta.get("tool_calls", []) + end.get("tool_calls", []))
            if self.num_calls and finish_reason == "stop" and self.ends_as_tool_calls:
                finish_reason = "tool_calls"
        return delta, finish_reason


def parse_whole(stream: CallStream, text: str, cut: bool = False) -> tuple[str | None, list[dict]]:
    """A finished reply's text -> (the content, None if empty; the calls), exactly as `stream`
    would give them streamed; `cut`: the reply ended at max_tokens."""
    deltas = [stream.feed(text), stream.finish(cut)]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", ())]
    return content or None, calls


class WholeReplyStream(CallStream):
    """A format whose reply is calls when it starts with them (after whitespace, and `tag` where
    the model writes one), and content otherwise: such a reply is held until it ends, then decided
    whole, so a stream never sends content it would have to take back; a reply that cannot be
    calls (`could_be` says no) streams as content at once. Cut at max_tokens, `parse` keeps the
    calls that were whole."""

    tag = ""  # a special token the calls may open with
    end_tag = ""  # and close with
    new_id = staticmethod(new_call_id)  # a call's id
    HEAD_CHARS = 256  # `could_be` reads this much of the reply at most: each delta costs O(1) past it

    def __init__(self, max_calls: int | None = None, accepts: Accepts | None = None) -> None:
        self.max_calls, self.accepts = max_calls, accepts
        self.parts: list[str] = []  # the reply so far, while it may still be calls
        self.size = 0
        self.content = False  # decided: the reply is content
        self.tagged = False  # the reply opened with the tag
        self.num_calls = 0

    def could_be(self, head: str) -> bool:
        """Whether a reply that starts with `head` (stripped, past the tag) may be calls."""
        raise NotImplementedError

    def parse(self, body: str, cut: bool) -> list[tuple[str, str]] | None:
        """The calls `body` (the reply past the tag) holds, or None; `cut`: it ends at max_tokens."""
        raise NotImplementedError

    def _body(self, text: str) -> str | None:
        """`text` (the reply, or its head) past the tag when it may be calls so far, "" while it
        cannot tell yet, None once it cannot be calls."""
        head = text.lstrip()
        self.tagged = bool(self.tag) and head.startswith(self.tag)
        if self.tagged:
            head = head[len(self.tag):].lstrip()
        elif self.tag.startswith(head):
            return ""
        if not head:
            return ""
        return head if self.could_be(head) else None

    def feed(self, text: str) -> dict:
        if self.content:
            return chat_delta(text, [])
        settled = self.size >= self.HEAD_CHARS  # the head read is all read: the verdict stands
        self.parts.append(text)
        self.size += len(text)
        if settled:
            return {}
        reply = "".join(self.parts)
        if self._body(reply[:self.HEAD_CHARS]) is None:
            self.content, self.parts, self.size = True, [], 0
            return chat_delta(reply, [])
        return {}

    def finish(self, cut: bool = False) -> dict:
        text, self.parts, self.size = "".join(self.parts), [], 0
        body = self._body(text)
        if self.content or not body:
            return chat_delta(text, [])
        body = body.rstrip()
        if self.end_tag and body.endswith(self.end_tag):
            body = body[:-len(self.end_tag)]
        try:
            parsed = self.parse(body, cut)
        except RecursionError:  # arguments nested as deep as the interpreter recurses: not calls
            parsed = None
        if parsed is None or (self.accepts is not None and not all(self.accepts(*c) for c in parsed)):
            return chat_delta(text, [])  # not calls (a function not offered, arguments off a strict schema): content
        if self.max_calls is not None:
            parsed = parsed[:self.max_calls]
        self.num_calls = len(parsed)
        return chat_delta("", [{"index": i, **call(*c, self.new_id())} for i, c in enumerate(parsed)])


class NamedCallStream(CallStream):
    """tool_choice naming a function: the whole output is its arguments, which its grammar holds
    to the function's schema, so they stream as they come. The reply ends "stop", as OpenAI's and
    vLLM's do when the request forced the function."""

    ends_as_tool_calls = False

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> dict:
        if not self.num_calls:
            self.num_calls = 1
            return {"tool_calls": [{"index": 0, **call(self.name, text)}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def finish(self, cut: bool = False) -> dict:
        return self.feed("") if not self.num_calls else {}
