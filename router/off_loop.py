"""A request's CPU-heavy preparation (parsing a large body, rendering the chat template,
tokenizing) on a worker thread instead of the ingress's event loop.

On the loop, a client's 8 MiB body held every other client, `/health` included, for seconds (289k
chat messages: 9 s; an 8 MiB prompt to /tokenize: 8 s). On the thread it holds the loop for one
interpreter switch interval at a time (5 ms), or not at all while the tokenizer's Rust code runs.
One thread: requests prepare one at a time (a small one may wait behind a large one), and no two
preparations encode at once (a fast tokenizer's encode may change its truncation settings, which
encoding with the defaults never does); the event loop's own calls (a token's text for logprobs)
only read.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor

_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-prepare")


async def off_loop(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) on the preparation thread, in this task's context (log fields)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_WORKER, call)
