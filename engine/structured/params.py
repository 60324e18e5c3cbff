"""What a request constrains its output to: vLLM's `StructuredOutputsParams`, one kind per request.

    json         a JSON schema (dict, or its JSON text)          response_format json_schema, tools
    json_object  any JSON object                                 response_format json_object
    regex        a regular expression (Rust regex syntax)
    choice       exactly one of these strings
    grammar      a context-free grammar: Lark (llguidance's dialect) or GBNF

With a reasoning model the grammar may govern the answer only, as vLLM's structured outputs do
under a reasoning parser: `reasoning_end` set, the reply's text is free until it has drawn that
token (`</think>`, one token of the vocabulary) and the grammar applies from the next token on
(engine.structured.gate).

Frozen and hashable: `key` is what compiled grammars are cached by. No llguidance here; the
compiler (engine.structured.compiler) turns a spec into a grammar.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

from engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # stored as compact JSON text, property order kept (it is the output's)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    lenient: bool = False  # JSON schema keywords llguidance does not implement are ignored, not refused
    # Reasoning before the grammar (not part of `key`): free text until the token `reasoning_end`
    # is drawn. `reasoning_start` set: the reply does not open inside its reasoning but its first
    # token may open it (where that text is one token); any other first token is the grammar's.
    reasoning_end: str | None = None
    reasoning_start: str | None = None
    # vLLM's options. disable_any_whitespace: JSON with no whitespace at all; by default the model
    # lays it out (engine.structured.compiler.JSON_WHITESPACE: never a run of whitespace, which
    # vLLM's default allows); objects listing their properties are closed whatever
    # disable_additional_properties says (what it asks when True); one backend (llguidance), so
    # `backend` and `disable_fallback` choose nothing. whitespace_pattern: the JSON's whitespace,
    # a regular expression (e.g. "[ ]?"; part of `key`).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None
    disable_fallback: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "structured_outputs must set exactly one of "
                                      f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _json.dumps(self.json, separators=(",", ":"), ensure_ascii=False))
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) for c in choice):
                raise InvalidRequestError("structured_outputs", "choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", choice)
        if self.structural_tag is not None:
            raise InvalidRequestError("structured_outputs", "structural_tag is not supported")
        if self.whitespace_pattern is not None and not (self.json is not None or self.json_object):
            raise InvalidRequestError("structured_outputs", "whitespace_pattern applies to json and json_object only")
        if self.reasoning_start is not None and not self.reasoning_end:
            raise InvalidRequestError("structured_outputs", "reasoning_start needs reasoning_end")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        return (self.kind, getattr(self, self.kind), self.lenient, self.whitespace_pattern, self.disable_any_whitespace)
