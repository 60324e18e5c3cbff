"""What every tool-call format shares: the OpenAI call object, what makes parsed JSON a call, and
the stream base a format's parser implements (router.tool_parser: Hermes' `<tool_call>` blocks;
router.llama3_tool_parser: Llama 3's bare JSON), plus the stream of a call the request named.

A whole reply is parsed by streaming it (`parse_whole`), so the two never differ.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable

PARSERS = ("hermes", "llama3_json")  # --tool-call-parser's choices: router.tools.FORMATS' keys
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
            return (obj["name"], args) if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


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

    def finish(self, cut: bool = False) -> dict: ...

    def step(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """One engine delta of this choice -> (the chat delta, the finish_reason to send: a reply
        that called tools and stopped ends with "tool_calls", unless the request named the function)."""
        delta = self.feed(text)
        if finish_reason is not None:
            end = self.finish(cut=finish_reason == "length")
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
