"""The small-pool server's configuration and what its tests share.

The server: the tiny model, 16 KV blocks of 16 tokens (256 tokens in all) for up to 16 running
sequences, so a burst of streams outgrows the pool and the scheduler preempts; a bounded queue
in front of the replica, so part of a burst is refused with 503 + Retry-After; an API key; 1 MiB
bodies at most.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import httpx

from tests.reliability.harness import ServeProcess, count

NUM_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN = 16, 16, 16, 256
MAX_BODY = 1 << 20
MODEL = "tiny"  # --served-model-name
KEY = "rel-" + uuid.uuid4().hex
LOAD_STREAMS = count("load_streams", 64, 256)
# Room for all but about one in eight of a load burst: the rest must be refused, not hang.
MAX_QUEUED = max(8, LOAD_STREAMS - MAX_NUM_SEQS - LOAD_STREAMS // 8)

SERVE_ARGS = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
              "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS),
              "--max-queued-requests", str(MAX_QUEUED), "--max-request-body-bytes", str(MAX_BODY)]


def prompt(i: int, most_words: int = 40) -> str:
    """Prompts of about 6 to most_words + 8 tokens, none the same."""
    words = ["alpha", "river", "stone", "quiet", "ember", "north", "paper", "cloud"]
    return f"Request {i}: " + " ".join(words[(i + j) % len(words)] for j in range(2 + i % most_words))


def assert_pool_whole(server: ServeProcess) -> dict:
    """The engine's gauges once it is idle: nothing running or waiting, no KV block in use."""
    m = server.wait_engine_idle(timeout_s=60)
    state = {"running": m.engine_running(), "waiting": m.engine_waiting(), "kv_usage": m.kv_usage(),
             "leaked_blocks": round(m.kv_usage() * NUM_BLOCKS)}
    assert (state["running"], state["waiting"], state["leaked_blocks"]) == (0, 0, 0), state
    return state


def counters(server: ServeProcess) -> dict[str, float]:
    """The engine's request ends by finished_reason, and its preemptions, so far."""
    m = server.scrape()
    out = {r: m.finished(r) for r in ("stop", "length", "abort", "error")}
    out["preemptions"] = m.preemptions()
    return out


def settled_counters(server: ServeProcess, timeout_s: float = 30.0) -> dict[str, float]:
    """counters() once the engine is idle and two scrapes 1.5 s apart agree: requests that ended
    just before (Ray exports a second or two late) are in, so a later delta holds only what came
    after."""
    server.wait_engine_idle(timeout_s=60)
    deadline = time.monotonic() + timeout_s
    last = counters(server)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = counters(server)
        if now == last:
            return now
        last = now
    return last


def wait_counters(server: ServeProcess, before: dict, want: dict | Callable[[dict], bool],
                  timeout_s: float = 30.0) -> dict:
    """Counter increments since `before`, once they equal `want` (or `want(delta)` holds; Ray
    exports them within a few seconds) or the time is up; returns the last increments seen."""
    done = want if callable(want) else (lambda delta: all(delta[k] == v for k, v in want.items()))
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(server)
        delta = {k: now[k] - before[k] for k in now}
        if done(delta) or time.monotonic() > deadline:
            return delta
        time.sleep(1.0)


def is_openai_error(r: httpx.Response) -> bool:
    return is_openai_error_text(r.text)


def is_openai_error_text(text: str) -> bool:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error


def assert_healthy(server: ServeProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=60,
                   json={"prompt": "still alive?", "max_tokens": 2})
    assert r.status_code == 200, r.text
