"""The engine's outputs for one HTTP request: the engine calls it is sent as, their streams merged
into one, and read into a reply's Accumulator, a sample the engine ended with an error failing the
request."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

from engine.outputs import StepOutput
from engine.sampling_params import SamplingParams
from router.errors import OpenAIError, internal_error
from router.formatting import Accumulator, sse

logger = logging.getLogger(__name__)


def sample_calls(num_prompts: int, params: SamplingParams, max_num_seqs: int) -> list[tuple[int, int, SamplingParams]]:
    """The engine calls that ask for `params.n` samples of each prompt: (prompt, its first sample's
    index, params), n cut to fit the engine's max_num_seqs (SamplingParams.split)."""
    calls = params.split(max_num_seqs)
    return [(i, first, p) for i in range(num_prompts) for first, p in calls]


async def renumbered(stream: AsyncIterator[StepOutput], first: int) -> AsyncIterator[StepOutput]:
    """A call's outputs with its samples numbered from `first` (sample_calls): as the request's."""
    async with contextlib.aclosing(stream) as s:
        async for step in s:
            yield dataclasses.replace(step, choices=[dataclasses.replace(c, index=first + c.index)
                                                     for c in step.choices])


async def merge_streams(streams: list[AsyncIterator], owners: list[int] | None = None,
                        ) -> AsyncIterator[tuple[int, object]]:
    """(stream index, or owners[stream index], item) as items arrive; closing this closes
    (cancels) every stream."""
    owners = owners or range(len(streams))
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as s:
            async for item in s:
                yield owners[0], item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for item in s:
                    queue.put_nowait((owners[i], item, None))
            queue.put_nowait((owners[i], done, None))
        except Exception as e:
            queue.put_nowait((owners[i], None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def logged_outputs(rid: str, merged: AsyncIterator, max_len: int | None) -> AsyncIterator:
    """`merged` as it is, each sample's text and finish reason logged at INFO when it ends, its
    token ids at DEBUG (vLLM's --enable-log-outputs); `max_len` cuts the text and ids logged."""
    texts: dict[tuple[int, int], list[str]] = {}
    ids: dict[tuple[int, int], list[int]] = {}
    async with contextlib.aclosing(merged):
        async for prompt, step in merged:
            for c in getattr(step, "choices", ()):
                key = (prompt, c.index)
                texts.setdefault(key, []).append(c.text)
                ids.setdefault(key, []).extend(c.token_ids)
                if c.finish_reason:
                    text, tokens = "".join(texts.pop(key)), ids.pop(key)
                    logger.info("%s: generated (prompt %d, sample %d): %r, finish_reason %s", rid, prompt, c.index,
                                text[:max_len], c.finish_reason)
                    logger.debug("%s: generated token ids (prompt %d, sample %d): %s", rid, prompt, c.index,
                                 tokens[:max_len])
            yield prompt, step


async def map_steps(merged: AsyncIterator, f: Callable[[StepOutput], StepOutput]) -> AsyncIterator:
    async with contextlib.aclosing(merged):
        async for prompt, step in merged:
            yield prompt, f(step)


def check_failed(step: StepOutput) -> None:
    """A sample the engine ended with an error fails its request, saying why. Only a request's own
    output constraint ends a sample so (one the model's tokens cannot follow: a regex forcing a
    control byte its tokenizer has no token for), so it is the request's error, a 400, as a
    constraint refused before it ran is; the engine goes on."""
    for c in step.choices:
        if c.finish_reason == "error":
            raise OpenAIError(400, f"generation failed: {c.stop_reason}", code="invalid_grammar")


async def collect(acc: Accumulator, first, merged: AsyncIterator) -> None:
    acc.add(*first)
    check_failed(first[1])
    async with contextlib.aclosing(merged):
        async for prompt, step in merged:
            acc.add(prompt, step)
            check_failed(step)


async def events(first, merged: AsyncIterator, acc: Accumulator,
                  error: Callable[[dict], str] = sse) -> AsyncIterator[tuple[int, StepOutput | str]]:
    """The request's outputs (counted into `acc`); a failure ends them with an error event,
    `error(OpenAI error JSON)` (default: chat's SSE data line)."""
    try:
        acc.add(*first)
        check_failed(first[1])
        yield first
        async for prompt, step in merged:
            acc.add(prompt, step)
            check_failed(step)
            yield prompt, step
    except OpenAIError as e:
        yield -1, error(e.body())
    except Exception:
        logger.exception("stream failed")
        yield -1, error(internal_error().body())
