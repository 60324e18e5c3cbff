"""Tool calls out of generated text: whole (a finished reply) and streamed (OpenAI's deltas).

Hermes-style blocks, as router.tools asks for them:

    Let me check.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    `-- content --'`-- a call: name, then arguments as JSON text ----------------'

A stream sends, per call, `{"index", "id", "type", "function": {"name", "arguments": ""}}` as soon
as the name is known, then the arguments as fragments while they are generated, as OpenAI does.
Text that might still become a `<tool_call>` tag is held back until it cannot. A block that is
not a call (not JSON, no name) stays content. The content is the reply's without the whitespace
around it, streamed or whole: a stream holds trailing whitespace back until more content follows.
"""
from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _parse_block(body: str) -> tuple[str, str] | None:
    """-> (name, arguments JSON text) of one block's body, or None if it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """-> (the content, None if empty; the calls). Calls past `max_calls` are dropped."""
    content, calls, pos = [], [], 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start)
        body = text[start + len(OPEN):end if end != -1 else len(text)]
        parsed = _parse_block(body)
        stop = len(text) if end == -1 else end + len(CLOSE)
        content.append(text[pos:start])
        if parsed is None:
            content.append(text[start:stop])
        elif max_calls is None or len(calls) < max_calls:
            calls.append(call(*parsed))
        pos = stop
    content.append(text[pos:])
    joined = "".join(content).strip()
    return joined or None, calls


def _held_back(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _JsonValueEnd:
    """Feeds characters of one JSON object or array; says where it ends (depth back to 0)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """-> how many characters of `text` belong to the value (all, until it is done)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _Stream:
    num_calls = 0

    def feed(self, text: str) -> dict: ...

    def finish(self) -> dict: ...

    def step(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """One engine delta of this choice -> (the chat delta, the finish_reason to send: a reply
        that called tools and stopped ends with "tool_calls")."""
        delta = self.feed(text)
        if finish_reason is not None:
            end = self.finish()
            delta = _delta(delta.get("content", "") + end.get("content", ""),
                           delta.get("tool_calls", []) + end.get("tool_calls", []))
            if self.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return delta, finish_reason


class ToolCallStream(_Stream):
    """One choice's stream of text deltas -> OpenAI chat deltas with content and tool_calls."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buffer = ""  # text not yet sent
        self.in_call = False
        self.block = ""  # the current block's text so far
        self.args: _JsonValueEnd | None = None  # set once the current call's name went out
        self.num_calls = 0
        self.content_sent = False
        self.spaces = ""  # trailing whitespace of the content sent, held back until content follows

    def _trimmed(self, content: str) -> str:
        """Content to send, as parse_tool_calls strips the whole: none of the whitespace before
        the first content, and whitespace only once content follows it."""
        if not self.content_sent:
            content = content.lstrip()
        body = content.rstrip()
        if not body:
            self.spaces += content
            return ""
        out, self.spaces, self.content_sent = self.spaces + body, content[len(body):], True
        return out

    def feed(self, text: str) -> dict:
        """-> the delta for `text` ({} when nothing can be sent yet)."""
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start == -1:
                    keep = _held_back(self.buffer, OPEN)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer, self.in_call, self.block, self.args = self.buffer[start + len(OPEN):], True, "", None
            elif not self._advance_call(calls, content):
                break
        return _delta(self._trimmed("".join(content)), calls)

    def _advance_call(self, calls: list[dict], content: list[str]) -> bool:
        """Consume buffered text of the current block; -> whether the block ended."""
        wanted = self.max_calls is None or self.num_calls < self.max_calls
        if self.args is None:
            head = _HEAD.match(self.buffer) if wanted else None
            if head is not None and self.buffer[head.end():head.end() + 1] in ("{", "["):
                calls.append({"index": self.num_calls, **call(json.loads(f'"{head.group(1)}"'), "")})
                self.block, self.buffer, self.args = self.buffer[:head.end()], self.buffer[head.end():], _JsonValueEnd()
        if self.args is not None and not self.args.done:
            n = self.args.feed(self.buffer)
            if n:
                calls.append({"index": self.num_calls, "function": {"arguments": self.buffer[:n]}})
            self.block, self.buffer = self.block + self.buffer[:n], self.buffer[n:]
        end = self.buffer.find(CLOSE)
        if end == -1:
            return False
        self.block, self.buffer = self.block + self.buffer[:end], self.buffer[end + len(CLOSE):]
        self._end_block(calls, content, wanted)
        return True

    def _end_block(self, calls: list[dict], content: list[str], wanted: bool) -> None:
        self.in_call = False
        if self.args is not None:  # streamed as it came
            self.num_calls += 1
            return
        parsed = _parse_block(self.block)
        if parsed is None:
            content.append(OPEN + self.block + CLOSE)
        elif wanted:  # a call whose head did not come first: sent whole
            calls.append({"index": self.num_calls, **call(*parsed)})
            self.num_calls += 1

    def finish(self) -> dict:
        """The delta for what was held back when the text ends. A block whose close tag never
        came ends here, as parse_tool_calls reads it: a call whose name went out stands (the
        rest of its block is its own, not content), one that parses whole is sent whole, and
        anything else is content."""
        rest, calls = self.buffer, []
        if self.in_call:
            self.block, rest = self.block + self.buffer, ""
            wanted = self.max_calls is None or self.num_calls < self.max_calls
            content: list[str] = []
            self._end_block(calls, content, wanted)
            if content:  # not a call: the text as it came, without the close tag it never had
                rest = content[0].removesuffix(CLOSE)
        self.buffer, self.block, self.in_call = "", "", False
        return _delta(self._trimmed(rest), calls)  # whitespace still held back is the reply's end


def _delta(content: str, calls: list[dict]) -> dict:
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = _merged(calls)
    return delta


def _merged(calls: list[dict]) -> list[dict]:
    """Fragments of the same call in one delta are joined into one entry."""
    out: list[dict] = []
    for c in calls:
        if out and out[-1]["index"] == c["index"] and "id" not in c:
            fn = out[-1].setdefault("function", {})
            fn["arguments"] = fn.get("arguments", "") + c["function"]["arguments"]
        else:
            out.append(c)
    return out


class NamedCallStream(_Stream):
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, text: str) -> dict:
        if not self.num_calls:
            self.num_calls = 1
            return {"tool_calls": [{"index": 0, **call(self.name, text)}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def finish(self) -> dict:
        return self.feed("") if not self.num_calls else {}
