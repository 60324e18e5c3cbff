"""vLLM's --sse-keep-alive-interval: an SSE comment line whenever a stream has been idle that long
(queued, in its prefill, between tokens), so that a proxy or tunnel with a read timeout does not
cut a stream that is only slow. Clients skip comment lines (the SSE format's `:` lines)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

COMMENT = ": keep-alive\n\n"


class KeepAlive:
    """`body`'s events, and COMMENT after each `interval_s` without one. `aclose()` closes `body`
    (which is what ends the engine requests behind it), whether or not it was read from."""

    def __init__(self, body: AsyncIterator[str], interval_s: float) -> None:
        self.body, self.interval_s = body, interval_s
        self.pending: asyncio.Future | None = None  # the body's next event, being awaited

    def __aiter__(self) -> KeepAlive:
        return self

    async def __anext__(self) -> str:
        if self.pending is None:
            self.pending = asyncio.ensure_future(anext(self.body))
        done, _ = await asyncio.wait({self.pending}, timeout=self.interval_s)
        if not done:
            return COMMENT
        event, self.pending = self.pending, None
        return event.result()  # the body's event; StopAsyncIteration, or its error, ends the stream

    async def aclose(self) -> None:
        try:
            if self.pending is not None:  # the body is mid-step: stop it there before closing it
                pending, self.pending = self.pending, None
                pending.cancel()
                try:
                    await pending
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():  # our own cancellation, not the step's
                        raise
                except Exception:  # the step's own end: the stream is over anyway
                    pass
        finally:
            if hasattr(self.body, "aclose"):
                await self.body.aclose()
