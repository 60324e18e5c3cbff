"""CUDA graphs for decode-only steps: one graph per batch-size bucket, captured at start-up on
static input buffers; a step pads its batch to the next bucket and replays.

A decode step of a small model is a few hundred short kernel launches (~30 layers x ~10); the
launches, not the arithmetic, bound it, and one replay issues them all at once.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from unittest import mock

import torch

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, the last one covering max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    s = 8
    while s < max_num_seqs:
        s += 8 if s < 64 else 16
        sizes.append(min(s, max_num_seqs))
    return sorted(set(sizes + [max_num_seqs]))


MAX_DEFAULT_ROWS = 512  # the largest size captured by default past max_num_seqs, for steps with drafts (vLLM's cap)


def capture_sizes(given: tuple[int, ...] | None, largest: int | None, max_num_seqs: int, max_rows: int) -> list[int]:
    """The sizes to capture: those given (vLLM's cudagraph_capture_sizes), else the buckets up to
    `largest`; none beyond the `max_rows` a step can hold. By default the buckets reach every
    decode step: max_num_seqs rows, or with drafts (more rows than sequences) up to 512."""
    if largest is None:
        largest = max(max_num_seqs, min(max_rows, MAX_DEFAULT_ROWS))
    sizes = sorted(set(given)) if given is not None else graph_batch_sizes(largest)
    return [s for s in sizes if s <= max_rows]


class DecodeGraphs:
    """`setup(size)` puts padding inputs for `size` rows into the static buffers (outside the
    graph); `body(size)` is the captured forward, returning its (size, hidden) output."""

    def __init__(self, setup: Callable[[int], None], body: Callable[[int], torch.Tensor], sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps that ran as a graph (tests and benchmarks read it)
        pool = torch.cuda.graph_pool_handle()  # one memory pool: the largest graph's serves them all
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            setup(size)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
                body(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with _collected_once(first=not self.graphs), torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = body(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, None past the largest."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size]


def _collected_once(first: bool) -> contextlib.AbstractContextManager:
    """torch.cuda.graph collects Python's garbage and empties the allocator's cache as each
    capture begins (~0.1 s each with a serving process's heap, 46 times for a start-up that
    measures and captures 23 sizes); before the first capture is enough (as vLLM does)."""
    if first:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("gc.collect", lambda *args: 0))
    stack.enter_context(mock.patch("torch.cuda.empty_cache", lambda: None))
    return stack
