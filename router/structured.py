"""From a request's `response_format` / `structured_outputs` to the engine's constraint, checked.

    response_format  {"type": "json_object"}                          -> json_object
                     {"type": "json_schema", "json_schema": {...}}     -> json (strict: unknown
                                                                         keywords are a 400; else ignored)
    structured_outputs (vLLM)  json | regex | choice | grammar | json_object

Each spec is compiled once here without a tokenizer (llguidance's own check, on a worker thread):
what it cannot compile is a 400 naming the field and the problem, before any engine slot is used.
The engine compiles it again against the tokenizer, on its grammar thread, and caches it.
"""
from __future__ import annotations

import asyncio
import functools

from engine.structured.compiler import check
from engine.structured.params import StructuredOutputsParams
from router.errors import bad_request
from router.protocol import ResponseFormat, StructuredOutputs


def from_response_format(rf: ResponseFormat | None) -> StructuredOutputsParams | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object" or rf.json_schema.schema_ is None:
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=rf.json_schema.schema_, lenient=not rf.json_schema.strict)


def from_structured_outputs(so: StructuredOutputs | None) -> StructuredOutputsParams | None:
    if so is None:
        return None
    if so.json_ is not None:
        return StructuredOutputsParams(json=so.json_, whitespace_pattern=so.whitespace_pattern,
                                       disable_any_whitespace=bool(so.disable_any_whitespace))
    if so.regex is not None:
        return StructuredOutputsParams(regex=so.regex)
    if so.choice is not None:
        return StructuredOutputsParams(choice=so.choice)
    if so.grammar is not None:
        return StructuredOutputsParams(grammar=so.grammar)
    return StructuredOutputsParams(json_object=True, whitespace_pattern=so.whitespace_pattern,
                                   disable_any_whitespace=bool(so.disable_any_whitespace))


@functools.lru_cache(maxsize=256)
def _problem(spec: StructuredOutputsParams) -> str | None:
    return check(spec)


async def checked(spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """`spec`, or a 400 saying why it cannot be enforced."""
    await check_all([(spec, param)])
    return spec


async def check_all(specs: list[tuple[StructuredOutputsParams, str]]) -> None:
    """A 400 for the first (spec, param) that cannot be enforced; all checked in one trip to a
    worker thread (a request may offer 128 tools)."""
    if not specs:
        return
    problems = await asyncio.to_thread(lambda: [(_problem(spec), param) for spec, param in specs])
    for problem, param in problems:
        if problem is not None:
            raise bad_request(f"{param}: {problem}", param=param, code="invalid_grammar")
