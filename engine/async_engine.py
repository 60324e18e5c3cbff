"""Streaming front of the engine: `async for out in engine.generate(id, prompt, params)`.

One background task owns the LLMEngine. Model steps run in a single worker thread so the event
loop stays responsive; requests and aborts are queued and applied between steps, so the engine
itself is never touched by two threads at once.

Each run of a request is known to the engine by a key of its own (its id and a count), so an id
used again while outputs or an abort of its last run are still on their way gets none of them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.pooling import PoolerConfig
from engine.sampling_params import SamplingParams
from engine.structured.compiler import CompiledGrammar

logger = logging.getLogger(__name__)


_ABORTED = object()  # queue sentinel: the request was aborted before producing a final output


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **kwargs) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        # Load on the step thread too. OpenMP keeps a thread pool per thread that starts parallel
        # work; with a second pool (load on one thread, steps on another) libgomp manages more
        # threads than there are cores and stops spinning between parallel regions, which made
        # every decode step ~1.5x slower on CPU.
        self.engine = engine or self._thread.submit(LLMEngine, config or EngineConfig(**kwargs)).result()
        self._queues: dict[str, asyncio.Queue] = {}  # engine key -> its stream's queue
        self._keys: dict[str, str] = {}  # request id -> the engine key of its current run
        self._runs = itertools.count()
        self._pending_adds: dict[str, tuple[str | list[int], SamplingParams, CompiledGrammar | None]] = {}
        self._pending_aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        # The engine is touched by the step thread during a step and by the event loop between
        # steps; the lock lets a routing snapshot be taken by whichever thread finds it free.
        self._engine_lock = threading.Lock()
        self._stats: EngineStats = self.engine.stats()
        self._routing: EngineStats = self.engine.routing_snapshot()
        self._routing_wanted = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.executor.info.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.engine.eos_token_ids)

    @property
    def pooler(self) -> PoolerConfig | None:
        """How a pooling engine pools (engine.pooling); None for a generating one."""
        return self.engine.pooler

    @property
    def is_healthy(self) -> bool:
        return self._error is None

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}")
        executor_check = getattr(self.engine.executor, "check_health", None)
        if executor_check is not None:  # a worker group notices a rank that died while idle
            try:
                executor_check()
            except Exception as e:
                raise EngineDeadError(f"engine workers unhealthy: {e}") from e

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step or admission (never one from inside a step)."""
        return self._stats

    def routing_snapshot(self) -> EngineStats:
        """Stats with the prefix-hash summary, all from one moment between steps: taken now when
        no step runs, else the one the running step takes as it ends is asked for, and the last
        one is returned (its timestamp says when it was taken)."""
        if self._engine_lock.acquire(blocking=False):
            try:
                self._routing = self.engine.routing_snapshot()
                self._stats = self.engine.stats()
            finally:
                self._engine_lock.release()
        else:
            self._routing_wanted = True
        return self._routing

    def _step(self) -> list[RequestOutput]:
        with self._engine_lock:
            outputs = self.engine.step()
            self._take_stats()
        return outputs

    def _take_stats(self) -> None:
        """Under the engine lock."""
        self._stats = self.engine.stats()
        if self._routing_wanted:
            self._routing_wanted = False
            self._routing = self.engine.routing_snapshot()

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per engine step that produced something for this request (with
        text/token deltas); the last has finished=True. Leaving the loop early aborts the request."""
        self.check_health()
        _, ids = self.engine.tokenize(prompt)
        self.engine.validate(ids, params)  # raises ValueError now, not inside the loop
        grammar = None
        if params.structured_outputs is not None:  # compiled on the grammar thread, never the step's
            grammar = await self.engine.structured.compiler.compile_async(params.structured_outputs)
        if request_id in self._keys:
            raise ValueError(f"request id {request_id!r} is already in use")
        key = f"{request_id}#{next(self._runs)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key], self._keys[request_id] = queue, key
        self._pending_adds[key] = (prompt, params, grammar)
        self._kick()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                item.request_id = request_id  # the caller's id, not the engine's key
                yield item
        finally:
            self._queues.pop(key, None)
            self._keys.pop(request_id, None)
            if not finished:
                self._abort_now(key)

    async def abort(self, request_id: str) -> None:
        key = self._keys.get(request_id)
        if key is not None:
            self._abort_now(key)

    def _abort_now(self, key: str) -> None:
        if self._pending_adds.pop(key, None) is not None:
            self._deliver(key, _ABORTED)  # never reached the engine
        else:
            self._pending_aborts.add(key)
            self._kick()

    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    def _apply_pending(self) -> None:
        with self._engine_lock:
            self._apply_pending_locked()

    def _apply_pending_locked(self) -> None:
        for key in self._pending_aborts:
            out = self.engine.abort(key)  # frees its KV blocks now
            self._deliver(key, out if out is not None else _ABORTED)
        self._pending_aborts.clear()
        adds, self._pending_adds = self._pending_adds, {}
        for key, (prompt, params, grammar) in adds.items():
            try:
                self.engine.add_request(key, prompt, params, grammar)
            except Exception as e:  # this request's fault or not, it fails alone
                self._deliver(key, e)
        self._take_stats()

    def _deliver(self, key: str, item) -> None:
        queue = self._queues.get(key)
        if queue is not None:
            queue.put_nowait(item)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._thread, self._step)
                for out in outputs:
                    self._deliver(out.request_id, out)
        except Exception as e:  # the engine is unusable now: fail everyone, never hang
            logger.exception("engine loop failed")
            self._error = e
            for key in list(self._queues):
                admitted = key not in self._pending_adds
                self._deliver(key, EngineDeadError(f"engine loop failed: {e!r}", admitted=admitted))

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._thread.shutdown(wait=True)
        self.engine.executor.shutdown()
        self.engine.structured.compiler.shutdown()
