"""Python-call tool calls (`--tool-call-parser pythonic`, and `llama4_pythonic`: vLLM's names), as
Llama 3.2, 3.3 and 4 write them: a Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit="celsius"), now()]

(Llama 4 may put it between `<|python_start|>` and `<|python_end|>`). Argument values are
Python literals: strings, numbers, True/False/None, and lists and dicts of them; JSON's
true/false/null are taken too. The text is parsed with `ast`, never evaluated. As with Llama 3's
JSON calls (router.tool_calls.WholeReplyStream), a reply is calls when it starts with the list
and is nothing else; a reply that cannot start one (`[1, 2]`, prose) streams as content at once;
cut at max_tokens, the calls that were whole stand.
"""
from __future__ import annotations

import ast
import json
import keyword
import math
import re

from router.tool_calls import WholeReplyStream

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_HEAD = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*(?:\(.*)?)?", re.DOTALL)  # what a list of calls starts as
_NAMES = {"true": True, "false": False, "null": None}
_TAIL = re.compile(r"\s*(,\s*([A-Za-z_][\w.]*(\(.*)?)?)?", re.DOTALL)  # after a whole call: the next, cut


class _NotALiteral(ValueError):
    pass


def parse_calls(text: str, cut: bool = False) -> list[tuple[str, str]] | None:
    """The (name, arguments JSON text) of each call in the list `text` is, or None if it is not one;
    `cut`: the list may end inside a call, which is left out."""
    calls = _calls(text)
    if calls is not None or not cut:
        return calls
    text = text.strip()
    closed, ends = _scan(text)
    if closed is not None or not _HEAD.fullmatch(text):
        return None  # a list that closed and was not calls, or text that never could be
    if not ends:
        return []  # cut inside the first call
    whole = _calls(text[:ends[-1]] + "]")
    return whole if whole is not None and _TAIL.fullmatch(text, ends[-1]) else None


def _scan(text: str) -> tuple[int | None, list[int]]:
    """Where the list `text` opens closes (None: it does not), and where each of its calls ends,
    read past string literals as Python reads them."""
    depth, ends, quote, i = 0, [], None, 0
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i, quote = i + len(quote), None
                continue
        elif c in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] in ("'''", '"""') else c
            i += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i, ends
            if depth == 1 and c == ")":
                ends.append(i + 1)
        i += 1
    return None, ends


def _calls(text: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None  # a call takes keyword arguments only
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            arguments = {}
            for k in node.keywords:  # `**{"from": 1}`: a name Python does not take as a keyword
                value = _literal(k.value)
                if k.arg is None and not isinstance(value, dict):
                    raise _NotALiteral("** of something other than a dict")
                arguments.update(value if k.arg is None else {k.arg: value})
        except (_NotALiteral, RecursionError):
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _dotted(node: ast.expr) -> str | None:
    """A function's name: `f`, or `pkg.f` (as some tools are named)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _literal(node: ast.expr):
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotALiteral("not a JSON number")
        return _text(node.value) if isinstance(node.value, str) else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _NotALiteral("a sign before something other than a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = None if k is None else _literal(k)  # None key: a `**` spread
            if not isinstance(key, str):
                raise _NotALiteral("a dict key that is not a string")
            out[key] = _literal(v)
        return out
    raise _NotALiteral(type(node).__name__)


def _text(value: str) -> str:
    """A string literal's text as JSON reads it: `"\\ud83d\\ude00"` is one character (Python's
    literal keeps two surrogates, which no response can encode); a lone surrogate is no text."""
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:
        raise _NotALiteral("a lone surrogate") from None


def python_literal(value) -> str:
    """A JSON value written as the Python literal a model would write (for calls in history)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a Python string literal
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def call_text(name: str, arguments: dict) -> str:
    """A call as the model writes it; an argument whose name Python does not take as a keyword
    (`from`, `first-name`) goes in a `**{...}` that parse_calls reads back."""
    named = [f"{k}={python_literal(v)}" for k, v in arguments.items() if _keyword(k)]
    other = {k: v for k, v in arguments.items() if not _keyword(k)}
    return f"{name}(" + ", ".join(named + ([f"**{python_literal(other)}"] if other else [])) + ")"


def _keyword(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


class PythonicStream(WholeReplyStream):
    """One choice's text deltas -> OpenAI chat deltas, for calls written as a Python list."""

    tag, end_tag = PYTHON_START, PYTHON_END

    def could_be(self, head: str) -> bool:
        return _HEAD.fullmatch(head) is not None

    def parse(self, body: str, cut: bool) -> list[tuple[str, str]] | None:
        return parse_calls(body, cut)
