"""The routing session of the HTTP request being served.

A client names its conversation with the `X-Session-ID` header or, failing that, the OpenAI
body's `user` field. The API layer records it here for the request's task; the ingress hands it
to Serve with each engine call (`handle.options(session_id=...)`), where routers that keep a
session on one replica (`--routing session`) read it, and kv tells a conversation's first request
by it (that request places the whole chat; cluster/policy.py). Other routers ignore it.
"""
from __future__ import annotations

from contextvars import ContextVar

SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256  # a longer id is cut: it only feeds a hash

_session: ContextVar[str | None] = ContextVar("kvserve_routing_session", default=None)


def set_session(header: str | None, user: str | None) -> None:
    """Record the session of the request this task serves (the header wins over `user`)."""
    sid = header or user
    _session.set(sid[:MAX_SESSION_CHARS] if sid else None)


def current_session() -> str | None:
    return _session.get()
