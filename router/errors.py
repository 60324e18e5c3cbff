"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Everything the router rejects is raised as an `OpenAIError`; the engine's
`engine.errors.InvalidRequestError` becomes a 400 here (`from_invalid_request`), in this one place;
anything else that escapes a handler becomes a 500 whose message says nothing about the internals
(the detail goes to the log only).
"""
from __future__ import annotations

import math
from collections import Counter

from pydantic import ValidationError

from engine.errors import InvalidRequestError


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def internal_error() -> OpenAIError:
    return OpenAIError(500, "The server had an error while processing your request.", type="server_error",
                       code="internal_error")


def overloaded(retry_after_s: float | None, status: int = 503,
               message: str = "The server is overloaded: too many requests are queued. Retry later.",
               code: str = "queue_full") -> OpenAIError:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s or 1)))}
    return OpenAIError(status, message, type="server_overloaded" if status == 503 else "rate_limit_exceeded",
                       code=code, headers=headers)


def unavailable(message: str, retry_after_s: int = 2) -> OpenAIError:
    """No engine replica can serve this now (one died, or none is running yet)."""
    return OpenAIError(503, message, type="server_error", code="unavailable",
                       headers={"Retry-After": str(retry_after_s)})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def from_validation_error(e: ValidationError, fields: set[str] = frozenset()) -> OpenAIError:
    """The first schema error, named by its dotted field path (`messages.0.role`); never echoes
    the offending value back, since it may be part of a prompt. A cross-field rule's message
    starts with the field it is about, which becomes `param` when it is one of `fields`."""
    errors = e.errors(include_url=False, include_input=False)
    # A union reports errors per member. The client meant the member with the deepest error and,
    # among equally deep ones, the member with the fewest errors ([1, -1] is a token list with one
    # bad id, not a list of strings with two wrong types), then one whose types matched ([-1]: a
    # value out of range, not an int where a string goes).
    field = errors[0]["loc"][:1]
    candidates = [x for x in errors if x["loc"][:1] == field]
    per_member = Counter(x["loc"][:2] for x in candidates)
    err = max(candidates, key=lambda x: (len(x["loc"]), -per_member[x["loc"][:2]], not x["type"].endswith("_type")))
    # loc mixes field names and indices with pydantic's union tags ('str', 'list[int]', a member
    # model's class name 'NamedToolChoice'): drop those (OpenAI's field names are snake_case)
    path = [p for p in err["loc"] if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS
                                                            and not p[0].isupper())]
    param = ".".join(str(p) for p in path) or None
    msg = err["msg"].removeprefix("Value error, ")
    first = msg.split(" ", 1)[0].removesuffix(":")
    if param is None and first in fields:
        param = first
    return bad_request(f"{param}: {msg}" if err["loc"] else msg, param=param, code="invalid_value")


def from_invalid_request(e: InvalidRequestError) -> OpenAIError:
    """The engine's (and SamplingParams') own validation, which names the field at fault."""
    return bad_request(e.message, param=e.param, code=e.code)
