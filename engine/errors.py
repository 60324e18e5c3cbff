"""Errors the engine raises about a request (as opposed to its own failures).

An `InvalidRequestError` says the request itself can never run as given; it names the request
field at fault, so the HTTP edge can answer 400 with that `param` without reading the message.
Any other exception from the engine is the server's fault (a 500 at the edge).
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, param: str | None, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault ("temperature", "prompt", "max_tokens", ...)
        self.message = message
        self.code = code  # a machine-readable reason, e.g. "context_length_exceeded"

    def __reduce__(self):  # crosses Ray process boundaries with its fields
        return type(self), (self.param, self.message, self.code)


def brief(value, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters and its size where longer: an error message quotes
    what a request sent without echoing a megabyte of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} items" if isinstance(value, (list, tuple, dict)) else f"{len(text)} characters"
    return f"{text[:limit]}... ({size})"


class EngineDeadError(RuntimeError):
    """The engine loop (or one of its workers) failed; in-flight and new requests end with this.

    `admitted`: the request was inside the engine when it died, so it may be what killed it (a
    query of death); a caller that retries elsewhere should not do so without bound. False for a
    request that reached an engine already dead, or that the engine had not taken in yet.
    """

    def __init__(self, message: str, admitted: bool = False) -> None:
        super().__init__(message)
        self.admitted = admitted

    def __reduce__(self):  # crosses Ray process boundaries with its field
        return type(self), (str(self), self.admitted)
