"""The engine core in a process of its own: `python -m engine.core_process --in-fd R --out-fd W`.

`engine.process_engine.ProcessEngine` starts it. Its one thread owns an `LLMEngine` and loops:
apply the requests and aborts that came in, step, send back what the step produced. So the step
never waits for the process that relays its outputs (a Serve replica, whose transport costs CPU
per streamed message under its own GIL), as vLLM's EngineCore runs apart from its API server.

    parent --("add", key, rid, prompt, params) | ("abort", key) | ("routing",) | ("shutdown",)--> core
    parent <--("ready", info) | ("failed", exc) once, then ("tick", outputs, events, stats, routing)-- core

A tick carries one step's outputs as deltas only (`encode`): never a prompt or a text so far,
which the parent keeps itself. `events` end requests that never reached a step: (key, exc) for a
request that can never run, (key, None) for one aborted before it was added. Keys, not request
ids, name requests on the wire: an id may be reused while outputs for its last use are in flight.

The core ends when told to, when its input pipe closes (the parent went away), or when a step
raises; then its last message is ("dead", repr of the error).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import signal
import threading
from multiprocessing.connection import Connection

from engine.outputs import RequestOutput
from engine.structured.compiler import checked

logger = logging.getLogger(__name__)

# Wire form of one completion's delta, and of one request's output in a tick.
#   (index, delta_text, delta_token_ids, delta_logprobs, cumulative_logprob, finish_reason, stop_reason)
#   (key, finished, num_cached_tokens, prompt_token_ids or None, prompt_logprobs or None,
#    first_scheduled_time or None, completions, pooled vector or None, num_preemptions)


def encode(key: int, out: RequestOutput, first: bool) -> tuple:
    """The deltas of `out`; the prompt's ids (only for a text prompt, which the parent could not
    tokenize), its logprobs and when it was first scheduled go with a request's `first` output only."""
    comps = tuple((c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs, c.cumulative_logprob,
                   c.finish_reason, c.stop_reason) for c in out.outputs)
    prompt_ids = out.prompt_token_ids if first and out.prompt is not None else None
    return (key, out.finished, out.num_cached_tokens, prompt_ids, out.prompt_logprobs if first else None,
            out.first_scheduled_time if first else None, comps, out.pooled, out.num_preemptions)


class EngineCore:
    def __init__(self, engine, conn_in: Connection, conn_out: Connection) -> None:
        self.engine = engine
        self.conn_in, self.conn_out = conn_in, conn_out
        self.keys: dict[str, int] = {}  # engine request id -> wire key, while the engine holds it
        self.rids: dict[int, str] = {}  # the inverse
        self.started: set[str] = set()  # request ids whose first output went out
        self.compiling: dict[int, tuple] = {}  # key -> (future grammar, rid, prompt, params)
        self.outputs: list[tuple] = []  # for the next tick, encoded
        self.events: list[tuple] = []
        self.routing_wanted = False
        self.running = True

    def run(self) -> None:
        while self.running:
            busy = self.engine.has_unfinished()
            # Idle: block until a message comes; a grammar compiling: look again soon.
            changed = self._receive(0 if busy else (0.002 if self.compiling else None))
            if not self.running:
                break
            changed |= self._add_compiled()
            if self.engine.has_unfinished():
                self._take(self.engine.step())
                busy = True
            if busy or changed:
                self._send_tick()

    def _receive(self, timeout: float | None) -> bool:
        got = False
        while self.running and self.conn_in.poll(timeout):
            try:
                msg = self.conn_in.recv()
            except EOFError:  # the parent is gone: nobody is left to serve
                self.running = False
                break
            self._handle(msg)
            got, timeout = True, 0
        return got

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "routing":
            self.routing_wanted = True
        elif kind == "shutdown":
            self.running = False
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _refuse(self, key: int, e: Exception) -> None:
        """The request's error goes to its stream, whatever its type: one bad request must not
        end the core, which serves every other stream (AsyncEngine raises it in the caller's task)."""
        self.events.append((key, sendable(e)))

    def _add(self, key: int, rid: str, prompt, params) -> None:
        try:
            _, ids = self.engine.tokenize(prompt)
            self.engine.validate(ids, params)
        except Exception as e:
            self._refuse(key, e)
            return
        if params.structured_outputs is not None:  # compiled on the grammar thread, never the step's
            future = self.engine.structured.compiler.submit(params.structured_outputs)
            self.compiling[key] = (future, rid, prompt, params)
        else:
            self._admit(key, rid, prompt, params, None)

    def _admit(self, key: int, rid: str, prompt, params, grammar) -> None:
        try:
            self.engine.add_request(rid, prompt, params, grammar)
        except Exception as e:
            self._refuse(key, e)
            return
        self.keys[rid], self.rids[key] = key, rid

    def _add_compiled(self) -> bool:
        done = [k for k, (future, *_) in self.compiling.items() if future.done()]
        for key in done:
            future, rid, prompt, params = self.compiling.pop(key)
            try:
                grammar = checked(future.result())
            except Exception as e:
                self._refuse(key, e)
                continue
            self._admit(key, rid, prompt, params, grammar)
        return bool(done)

    def _abort(self, key: int) -> None:
        if self.compiling.pop(key, None) is not None:
            self.events.append((key, None))  # never reached the engine
            return
        rid = self.rids.get(key)
        out = self.engine.abort(rid) if rid is not None else None  # frees its KV blocks now
        if out is not None:  # else it finished already, or was refused: its last message is sent
            self._take([out])

    def _take(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            key = self.keys[rid]
            first = rid not in self.started
            self.outputs.append(encode(key, out, first))
            if out.finished:
                del self.keys[rid], self.rids[key]
                self.started.discard(rid)
            elif first:
                self.started.add(rid)

    def _send_tick(self) -> None:
        routing = None
        if self.routing_wanted:
            self.routing_wanted = False
            routing = self.engine.routing_snapshot()
        outputs, events, self.outputs, self.events = self.outputs, self.events, [], []
        self.conn_out.send(("tick", outputs, events, self.engine.stats(), routing))


def sendable(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the parent raises it as it is), else its words in a RuntimeError."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(repr(e))
    return e


def watch_parent(done: threading.Event, parent: int, period_s: float = 0.5) -> None:
    """Exits this process when its parent (pid `parent`, as the parent said: one that died while
    this interpreter started is already gone) goes away before `done` is set. Loading a model
    reads no pipe, so a core whose replica was killed while it loaded would load on (minutes on a
    GPU, then the KV pool) beside the replica that replaces it; after loading, the closed pipe ends it."""
    def watch() -> None:
        while os.getppid() == parent:
            if done.wait(period_s):
                return
        os._exit(1)
    threading.Thread(target=watch, name="kvserve-core-parent", daemon=True).start()


def _info(engine) -> dict:
    return {"max_model_len": engine.max_model_len, "vocab_size": engine.executor.info.vocab_size,
            "eos_token_ids": sorted(engine.eos_token_ids), "pooler": engine.pooler,
            "stats": engine.stats(), "routing": engine.routing_snapshot()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="kvserve engine core (started by engine.process_engine)")
    p.add_argument("--in-fd", type=int, required=True)
    p.add_argument("--out-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, default=None, help="the process that started this one (default: ours)")
    args = p.parse_args(argv)
    # The engine's own lines (the model loaded, its KV blocks, the attention backend, a request's
    # grammar failing) on stderr, which the core shares with its replica, as they are in-process.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core %(process)d %(name)s: %(message)s")
    # A terminal's Ctrl-C reaches the whole process group: the parent drains its streams, and the
    # core must go on stepping them until it is told to stop (or its parent is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn_in, conn_out = Connection(args.in_fd, writable=False), Connection(args.out_fd, readable=False)
    loaded = threading.Event()
    watch_parent(loaded, os.getppid() if args.parent_pid is None else args.parent_pid)
    config, threads = conn_in.recv()
    try:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as e:  # the parent raises it where the engine was asked for
        try:
            conn_out.send(("failed", e))
        except Exception:  # an exception that does not pickle: its words, then
            conn_out.send(("failed", RuntimeError(f"engine core failed to load: {e!r}")))
        raise
    conn_out.send(("ready", _info(engine)))
    loaded.set()
    core = EngineCore(engine, conn_in, conn_out)
    try:
        core.run()
    except BaseException as e:
        logger.exception("engine core failed")
        with contextlib.suppress(OSError):  # a parent that went away has nobody to tell
            conn_out.send(("dead", repr(e)))
        raise
    finally:
        engine.executor.shutdown()
        engine.structured.compiler.shutdown()


if __name__ == "__main__":
    main()
