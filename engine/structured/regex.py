"""A `regex` constraint's Perl classes read as ASCII: `\\d` is [0-9], `\\w` [0-9A-Za-z_], `\\s` ASCII
whitespace (and `\\D`, `\\W`, `\\S` their complements), as vLLM's xgrammar and JSON Schema's
`pattern` read them. llguidance's regex syntax (Rust's) makes them Unicode classes, and even a
small model finds their other members: `\\d{3}` drew "🯴11" (U+1FBF4, SEGMENTED DIGIT FOUR).
Each becomes a bracketed class, which Rust's syntax also nests inside a class (`[a\\d]`). A
`grammar`'s terminals keep Rust's classes (they are the grammar author's to write)."""
from __future__ import annotations

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\x0B\\f\\r\\x20"}  # \x20: (?x) drops a bare space


def ascii_classes(regex: str) -> str:
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            escape = regex[i + 1]
            if escape.lower() in _ASCII:
                out.append(f"[{'^' if escape.isupper() else ''}{_ASCII[escape.lower()]}]")
            else:
                out.append(regex[i:i + 2])  # any other escape, `\\\\` included, as it is
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)
