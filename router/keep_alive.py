"""vLLM's --sse-keep-alive-interval: an SSE comment line whenever a stream has been idle that long
(queued, in its prefill, between tokens), so that a proxy or tunnel with a read timeout does not
cut a stream that is only slow. Clients skip comment lines (the SSE format's `:` lines)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

COMMENT = ": keep-alive\n\n"


async def with_keep_alive(body: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """`body`'s events, and COMMENT after each `interval_s` without one. Closing this closes
    `body` (which is what ends the engine requests behind it)."""
    it = aiter(body)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield COMMENT
                continue
            event, pending = pending, None
            try:
                yield event.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:  # the body is mid-step: stop it there before closing it
            pending.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await pending
        await it.aclose()
