"""Hermes' tool calls (`--tool-call-parser hermes`, the default) out of generated text: whole (a
finished reply) and streamed (OpenAI's deltas). Blocks, as router.tools asks for them:

    Let me check.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    `-- content --'`-- a call: name, then arguments as JSON text ----------------'

A whole reply is parsed by streaming it, so the two never differ. A stream sends each call
whole, `{"index", "id", "type", "function": {"name", "arguments"}}`, once its block has closed
and its JSON parsed: arguments that went out in fragments could not be taken back if the block
then turned out not to be a call (unquoted strings, arguments that are not an object), and a
client would get arguments that are not JSON. Text that might still become a `<tool_call>` tag is
held back until it cannot. A block that is not a call stays content, as does one that calls a
function not offered or gives a strict function arguments off its schema (OpenAI's guarantee). The content is the
reply's text outside its calls, without the whitespace between a call and the reply's start or end
(a reply without calls is content as written, as vLLM gives it): a stream holds whitespace back
until it knows what follows it.
"""
from __future__ import annotations

import json

from router.tool_calls import Accepts, CallStream, call, call_of, chat_delta, held_back, parse_whole

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _unfinished_object(text: str) -> bool:
    """Whether text a reply was cut inside could be the start of a call's JSON object: nothing yet,
    or `{` and then nothing or a key ("{x | x > 0} is ..." is prose)."""
    text = text.lstrip()
    return not text or (text[0] == "{" and text[1:].lstrip()[:1] in ("", '"'))


def _inside_string(text: str) -> bool:
    """Whether a block's body, a JSON object so far, ends inside one of its strings: a close tag
    there is part of a value (a function named "a</tool_call>b"), not the block's end. A body that
    is no object (prose) ends at its first close tag."""
    if not text.lstrip().startswith("{"):
        return False
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\" and inside:
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _parse_block(body: str) -> tuple[str, str] | None:
    """-> (name, arguments JSON text) of one block's body, or None if it is not a call."""
    try:
        return call_of(json.loads(body))
    except (ValueError, RecursionError):  # nested past the decoder's recursion: not calls
        return None


def parse_tool_calls(text: str, max_calls: int | None = None, cut: bool = False,
                     accepts: Accepts | None = None) -> tuple[str | None, list[dict]]:
    """A finished reply's Hermes blocks and content (router.tool_calls.parse_whole). Calls past
    `max_calls` are dropped; `cut`: the reply ended at max_tokens."""
    return parse_whole(ToolCallStream(max_calls, accepts), text, cut)


class ToolCallStream(CallStream):
    """One choice's stream of text deltas -> OpenAI chat deltas with content and tool_calls.

    Content goes out as it comes (text that might still become a `<tool_call>` tag is held back
    until it cannot); a block is held until its close tag, or the text's end, and then decided: a
    call (sent whole), or content as written. A block the text ends inside is a call when its body
    parses (a close tag the text ends inside left out); else it is content, unless the reply was
    cut at max_tokens inside what could still be a call's object (_unfinished_object): then it is
    an unfinished call and is dropped (the finish_reason "length" says so), not sent as markup, as
    is the start of an open tag the cut reply ends with."""

    def __init__(self, max_calls: int | None = None, accepts: Accepts | None = None) -> None:
        self.max_calls, self.accepts = max_calls, accepts
        self.buffer = ""  # text not yet sent: the current block's body while in_call
        self.in_call = False
        self.scanned = 0  # of the block's body in buffer, how much holds no close tag
        self.num_calls = 0
        self.content_sent = False
        self.after_call = False  # the last thing in the reply so far is a call (or an unfinished one)
        self.spaces = ""  # whitespace after the content sent, held back until it is known what follows

    def _content(self, text: str) -> str:
        """The part of this content to send now. Whitespace goes out once content follows it; at
        the reply's start it is dropped when a call comes first, at its end when a call came last
        (so a reply without calls is content as written, as vLLM gives it)."""
        if not self.content_sent and self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.spaces += text
            return ""
        out, self.spaces, self.content_sent, self.after_call = self.spaces + body, text[len(body):], True, False
        return out

    def _called(self) -> None:
        if not self.content_sent:
            self.spaces = ""  # whitespace before the reply's first call
        self.after_call = True

    def feed(self, text: str) -> dict:
        """-> the delta for `text` ({} when nothing can be sent yet)."""
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start == -1:
                    keep = held_back(self.buffer, OPEN)
                    content.append(self._content(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self._content(self.buffer[:start]))
                self.buffer, self.in_call, self.scanned = self.buffer[start + len(OPEN):], True, 0
                continue
            end = self.buffer.find(CLOSE, self.scanned)
            if end == -1:
                self.scanned = max(self.scanned, len(self.buffer) - len(CLOSE) + 1)
                break
            if _inside_string(self.buffer[:end]):
                self.scanned = end + 1
                continue
            self._end_block(self.buffer[:end], calls, content, closed=True)
            self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False
        return chat_delta("".join(content), calls)

    def _end_block(self, body: str, calls: list[dict], content: list[str], closed: bool, cut: bool = False) -> None:
        # a block the text ends inside may end inside its close tag: "{...}\n</tool_c"
        parsed = _parse_block(body if closed else body[:len(body) - held_back(body, CLOSE)])
        if parsed is not None and self.accepts is not None and not self.accepts(*parsed):
            parsed = None  # a function not offered, or a strict one's arguments off its schema
        if parsed is None and (closed or not cut or not _unfinished_object(body)):
            content.append(self._content(OPEN + body + (CLOSE if closed else "")))
            return
        self._called()  # a call (one past max_calls too), or an unfinished one dropped
        if parsed is not None and (self.max_calls is None or self.num_calls < self.max_calls):
            calls.append({"index": self.num_calls, **call(*parsed)})
            self.num_calls += 1

    def finish(self, cut: bool = False) -> dict:
        """The delta for what was held back when the text ends (`cut`: at max_tokens)."""
        content, calls = [], []
        if self.in_call:
            self._end_block(self.buffer, calls, content, closed=False, cut=cut)
        elif cut and self.buffer and (len(self.buffer) > 1 or self.calls_only):
            self._called()  # an unfinished tag ("<t" and longer; any under required): dropped, as an unfinished call is
        else:  # held back as a possible "<tool_call>": content after all (a lone "<" is text)
            content.append(self._content(self.buffer))
        if not self.after_call:  # the reply ends in content: its trailing whitespace is its own
            content.append(self.spaces)
        self.buffer, self.in_call, self.spaces = "", False, ""
        return chat_delta("".join(content), calls)
