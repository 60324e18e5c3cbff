"""`ProcessEngine`: the streaming engine client with the engine core in its own process.

    ProcessEngine (this process: the event loop, a sender thread)      engine.core_process (child)
      generate() --add--> sender thread --pipe-->                        EngineCore: receive, step,
      streams <--deltas merged per request-- loop's reader <--pipe--     send one tick per step

`AsyncEngine` steps on a thread of the process that relays its outputs, so every stream's
per-message work (Serve's transport in a replica) holds the GIL the step needs, and the step
waits for it (docs/benchmarks.md, "relay bound"). Here the step runs in a process of its own, as
vLLM's EngineCore does, and never waits for a relay. A stream that falls behind takes the deltas
of every step since its last read as one output (vLLM's RequestOutputCollector), so a slow relay
costs messages, not steps.

It meets `engine.protocol.EngineClient` as AsyncEngine does, with tensor_parallel_size 1 only
(a tensor-parallel group already runs its forward in rank processes). Requests are validated in
the core: one that can never run raises from the stream's first `__anext__`, as it does with
AsyncEngine (whose body, an async generator's, also runs only then).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.pooling import PoolerConfig
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ABORTED = object()  # the request was aborted before it reached the engine


class _Stream:
    """One request's outputs as they come from the core, merged until the stream reads them."""

    def __init__(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.with_logprobs = params.logprobs is not None  # as the engine's Request makes its completions
        self.prompt = prompt if isinstance(prompt, str) else None
        self.prompt_token_ids = None if isinstance(prompt, str) else list(prompt)
        self.completions: dict[int, CompletionOutput] = {}
        self.finished = False
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.prompt_logprobs = None
        self.first_scheduled_time = None
        self.lora_request = params.lora_request
        self.pooled = None  # a pooling request's vector
        self.end = None  # an exception to raise, or _ABORTED
        self.has_data = False  # outputs since the last take()
        self.ready = asyncio.Event()

    def add(self, wire: tuple) -> None:
        (_, self.finished, self.num_cached_tokens, prompt_ids, prompt_logprobs, scheduled, comps, pooled,
         self.num_preemptions) = wire
        if pooled is not None:
            self.pooled = pooled
        if scheduled is not None:  # the core's time.monotonic(): the same clock on the same host
            self.first_scheduled_time = scheduled
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        for index, text, ids, logprobs, cumulative, finish, stop in comps:
            c = self.completions.get(index)
            if c is None:
                c = self.completions[index] = CompletionOutput(index, logprobs=[] if self.with_logprobs else None)
            c.delta_text += text
            c.delta_token_ids += ids
            if logprobs is not None:
                if c.delta_logprobs is None:
                    c.delta_logprobs = []
                c.delta_logprobs += logprobs
            c.cumulative_logprob, c.finish_reason, c.stop_reason = cumulative, finish, stop
        self.has_data = True
        self.ready.set()

    def fail(self, end) -> None:
        """Ends the stream, after the outputs it has already received (a request that finished
        in the core's last tick before it died still gets its last output)."""
        if self.end is None:  # the first cause stays
            self.end = end
            self.ready.set()

    def take(self) -> RequestOutput:
        """Everything since the last take, as one output (a snapshot; the deltas start over)."""
        self.has_data = False
        self.ready.clear()
        outs = []
        for index in sorted(self.completions):
            c = self.completions[index]
            c.text += c.delta_text
            c.token_ids = c.token_ids + c.delta_token_ids  # new lists: earlier snapshots keep theirs
            if c.delta_logprobs is not None:
                c.logprobs = c.logprobs + c.delta_logprobs
            outs.append(c.snapshot())
            c.delta_text, c.delta_token_ids, c.delta_logprobs = "", [], None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished,
                             self.num_cached_tokens, self.prompt_logprobs, self.first_scheduled_time,
                             lora_request=self.lora_request, pooled=self.pooled, num_preemptions=self.num_preemptions)


class ProcessEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        if config.tensor_parallel_size != 1:
            raise ValueError("ProcessEngine runs tensor_parallel_size 1 only: a tensor-parallel group already "
                             "runs its forward in rank processes (use engine.AsyncEngine)")
        self._proc, self._conn_in, self._conn_out = _start_core()
        self._conn_out.send((config, _torch_threads()))
        kind, payload = _wait_ready(self._proc, self._conn_in)
        if kind != "ready":
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._conn_in.close()
            self._conn_out.close()
            raise payload
        self.max_model_len: int = payload["max_model_len"]
        self.vocab_size: int = payload["vocab_size"]
        self.eos_token_ids: list[int] = payload["eos_token_ids"]
        self.pooler: PoolerConfig | None = payload["pooler"]  # a pooling engine's (engine.pooling)
        self._stats: EngineStats = payload["stats"]
        self._routing: EngineStats = payload["routing"]
        self._routing_asked = False
        self._streams: dict[int, _Stream] = {}  # wire key -> stream
        self._keys: dict[str, int] = {}  # request id -> wire key
        self._next_key = itertools.count()
        self._error: str | None = None
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        # Sends block while the core is inside a step with its pipe full; never on the loop.
        self._sender = threading.Thread(target=self._send_loop, name="kvserve-core-send", daemon=True)
        self._sender.start()

    # -- EngineState --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The core's snapshot after its last step (or after it took requests in)."""
        return self._stats

    def routing_snapshot(self) -> EngineStats:
        """The last routing snapshot the core sent; a fresh one is asked for, taken between two
        of its steps (so one call later, it is at most a step old)."""
        if not self._routing_asked and self._error is None:
            self._routing_asked = True
            self._send(("routing",))
        return self._routing

    # -- EngineClient -------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._proc.poll() is None

    def check_health(self) -> None:
        if self._error is None and self._proc.poll() is not None:
            if not self._conn_in.closed:
                self._read()  # the core's last word, when it sent one, names the cause
            if self._error is None:
                self._error = f"engine core exited with code {self._proc.returncode}"
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error}")

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate; an output holds every step since the stream's last one."""
        self.check_health()
        self._attach()
        if request_id in self._keys:
            raise ValueError(f"request id {request_id!r} is already in use")
        key = next(self._next_key)
        stream = self._streams[key] = _Stream(request_id, prompt, params)
        self._keys[request_id] = key
        self._send(("add", key, request_id, prompt, params))
        finished = False
        try:
            while not finished:
                if not stream.has_data and stream.end is None:
                    await stream.ready.wait()
                if stream.has_data:
                    out = stream.take()
                    finished = out.finished
                    yield out
                elif stream.end is _ABORTED:
                    return
                else:
                    raise stream.end
        finally:
            self._streams.pop(key, None)
            self._keys.pop(request_id, None)
            if not finished and stream.end is None:
                self._send(("abort", key))  # frees its KV blocks in the core's next iteration

    async def abort(self, request_id: str) -> None:
        key = self._keys.get(request_id)
        if key is not None:
            self._send(("abort", key))

    async def shutdown(self) -> None:
        """Stops the core; streams still open end with EngineDeadError. Twice is once."""
        if self._closed:
            return
        self._closed = True
        self._detach()
        self._send(("shutdown",))
        self._outbox.put(None)
        await asyncio.to_thread(self._stop_core)
        self._die("the engine was shut down")

    def _stop_core(self, timeout_s: float = 30.0) -> None:
        self._sender.join(timeout=5)
        # Read on until the core closes its end: a core blocked sending a tick into a full pipe
        # would never read the shutdown.
        end = time.monotonic() + timeout_s
        try:
            while time.monotonic() < end:
                if self._conn_in.poll(0.1):
                    self._conn_in.recv()
                elif self._proc.poll() is not None:
                    break
        except (EOFError, OSError):
            pass
        except Exception:  # a message that does not unpickle: nothing left to deliver it to
            logger.exception("engine core: undecodable message at shutdown")
        try:
            self._proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn_in.close()
        self._conn_out.close()

    # -- the pipes ----------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn_out.send(msg)
            except OSError:  # the core is gone; the reader says why
                return
            except Exception as e:  # the message did not pickle; nothing of it was written
                self._on_loop(self._unsent, msg, e)

    def _on_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _unsent(self, msg: tuple, e: Exception) -> None:
        """A request that could not be sent to the core fails alone; any other message lost
        leaves the core and this side apart: the engine is dead."""
        stream = self._streams.get(msg[1]) if msg[0] == "add" else None
        if stream is not None:
            stream.fail(RuntimeError(f"the request could not be sent to the engine core: {e!r}"))
        elif msg[0] != "abort":  # an abort's stream has gone already
            self._die(f"a {msg[0]!r} message could not be sent to the engine core: {e!r}")

    def _attach(self) -> None:
        """Read the core's pipe on the running loop (from the first request on)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._detach()
        self._loop = loop
        loop.add_reader(self._conn_in.fileno(), self._read)

    def _detach(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self._conn_in.closed:
            self._loop.remove_reader(self._conn_in.fileno())

    def _read(self) -> None:
        try:
            while self._error is None and self._conn_in.poll():
                self._dispatch(self._conn_in.recv())
        except (EOFError, OSError) as e:
            self._die(f"engine core exited ({e!r}, code {self._proc.poll()})")
        except Exception as e:  # a tick that does not unpickle: its outputs are lost
            self._die(f"undecodable message from the engine core: {e!r}")

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "dead":
            self._die(msg[1])
            return
        _, outputs, events, self._stats, routing = msg
        if routing is not None:
            self._routing, self._routing_asked = routing, False
        streams = self._streams
        for wire in outputs:
            stream = streams.get(wire[0])
            if stream is not None:  # else its stream has gone: it was aborted
                stream.add(wire)
        for key, end in events:
            stream = streams.get(key)
            if stream is not None:
                stream.fail(_ABORTED if end is None else end)

    def _die(self, why: str) -> None:
        """Every stream ends with the first cause; later ones (the EOF after a core's last word)
        change nothing."""
        if self._error is not None:
            return
        if not self._closed:
            logger.error("engine core failed: %s", why)
        self._error = why
        self._detach()
        for stream in list(self._streams.values()):  # each sent to the core, or on its way
            stream.fail(EngineDeadError(f"engine loop failed: {why}", admitted=True))


def _start_core() -> tuple[subprocess.Popen, Connection, Connection]:
    """The core as `python -m engine.core_process`, with one pipe each way. A fresh interpreter,
    not multiprocessing's spawn, which would import this process's __main__ (a Ray worker's)."""
    to_core_r, to_core_w = Pipe(duplex=False)
    from_core_r, from_core_w = Pipe(duplex=False)
    root = str(Path(__file__).resolve().parents[1])  # where `engine` imports from here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    fds = (to_core_r.fileno(), from_core_w.fileno())
    proc = subprocess.Popen([sys.executable, "-m", "engine.core_process", "--in-fd", str(fds[0]),
                             "--out-fd", str(fds[1]), "--parent-pid", str(os.getpid())], pass_fds=fds, env=env)
    to_core_r.close()
    from_core_w.close()
    return proc, from_core_r, to_core_w


def _wait_ready(proc: subprocess.Popen, conn: Connection) -> tuple[str, object]:
    """The core's first message: ("ready", info), or ("failed", the exception it raised)."""
    while not conn.poll(1.0):
        if proc.poll() is not None:
            return "failed", RuntimeError(f"engine core exited with code {proc.returncode} while loading")
    try:
        return conn.recv()
    except EOFError:
        return "failed", RuntimeError(f"engine core exited with code {proc.wait()} while loading")
    except Exception as e:  # its message did not unpickle here
        return "failed", RuntimeError(f"engine core sent an undecodable message while loading: {e!r}")


def _torch_threads() -> int | None:
    """The core takes this process's torch threads (a replica sets them before building its engine)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None
