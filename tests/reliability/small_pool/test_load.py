"""Load: LOAD_STREAMS concurrent streams (64; 256 under RELIABILITY_SCALE=full) of
LOAD_MAX_TOKENS tokens (24; 32) against the small pool (common.py)."""
from __future__ import annotations

import asyncio
import collections
import time

import pytest

from router.ingress import BACKPRESSURE_LOG_INTERVAL_S
from tests.reliability.harness import (COMPLETED, FAILED, REFUSED, Metrics, StreamResult, async_client, count,
                                       stream_request)
from tests.reliability.small_pool.common import (LOAD_STREAMS, MAX_NUM_SEQS, MAX_QUEUED, assert_pool_whole, prompt,
                                                 settled_counters, wait_counters)

pytestmark = pytest.mark.reliability

LOAD_MAX_TOKENS = count("load_max_tokens", 24, 32)


def test_load_burst_over_a_small_pool_completes_or_refuses_every_stream(server, figures):
    """LOAD_STREAMS streams at once, a quarter of them chat and a quarter n=3 completions: each
    ends with [DONE] and a finish_reason on every choice, or is refused with 503 + Retry-After;
    none fails or hangs. The running batch outgrows the pool, so the scheduler preempts: the KV
    router budgets a request as one sequence (prompt + max_tokens, half its growth reserved), so
    an n=3 request brings three times the growth it was admitted on. Afterwards every KV block
    is free again, and the engine counted exactly the streams the clients saw complete."""
    before = settled_counters(server)

    async def burst() -> list[StreamResult]:
        async with async_client(headers=server.headers()) as client:
            def one(i: int):
                if i % 4 == 3:
                    body = {"messages": [{"role": "user", "content": prompt(i, 8)}], "max_tokens": LOAD_MAX_TOKENS,
                            "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i}
                    return stream_request(client, server.url, "/v1/chat/completions", body, 600.0)
                n = 3 if i % 4 == 1 else 1
                body = {"prompt": prompt(i, 8), "max_tokens": LOAD_MAX_TOKENS, "ignore_eos": True, "stream": True,
                        "n": n, "temperature": 0.8 if n > 1 else 0.0, "seed": i}
                return stream_request(client, server.url, "/v1/completions", body, 600.0)
            return await asyncio.gather(*(one(i) for i in range(LOAD_STREAMS)))

    t0 = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    outcomes = collections.Counter(r.outcome for r in results)
    failures = [r for r in results if r.outcome == FAILED]
    delta = wait_counters(server, before, {"length": outcomes[COMPLETED], "abort": 0, "error": 0})
    pool = assert_pool_whole(server)
    warned = backpressure_lines(server)
    figures(streams=LOAD_STREAMS, max_tokens=LOAD_MAX_TOKENS, max_queued=MAX_QUEUED, completed=outcomes[COMPLETED],
            refused=outcomes[REFUSED], failed=len(failures), preemptions=delta["preemptions"],
            leaked_blocks=pool["leaked_blocks"], backpressure_log_lines=warned, seconds=round(elapsed, 1))
    assert not failures, [(r.status, r.detail) for r in failures[:5]]
    assert outcomes[COMPLETED] + outcomes[REFUSED] == LOAD_STREAMS
    assert outcomes[COMPLETED] >= MAX_NUM_SEQS
    assert all(r.finish_reason == "length" and r.events >= LOAD_MAX_TOKENS
               for r in results if r.outcome == COMPLETED)
    assert (delta["length"], delta["stop"], delta["abort"], delta["error"]) == (outcomes[COMPLETED], 0, 0, 0), delta
    assert delta["preemptions"] > 0, "the burst never outgrew the KV pool: no preemption was exercised"
    # Serve's warning per refused call (two per refused request) is logged once a second at most.
    assert outcomes[REFUSED] == 0 or 1 <= warned <= elapsed / BACKPRESSURE_LOG_INTERVAL_S + 2, (warned, elapsed)


def backpressure_lines(server) -> int:
    """Serve's "Request dropped due to backpressure" warnings in the ingress replicas' own logs."""
    return sum(path.read_text(errors="replace").count("Request dropped due to backpressure")
               for path in server.ray_tmp.rglob("replica_*OpenAIIngress*.log"))


def test_a_chat_request_without_max_tokens_is_served_not_held(server, figures):
    """On this server max_model_len (256 tokens) is the whole pool: a chat request without
    max_tokens may run to max_model_len, which the engine accepts (16 blocks). Streamed, its first
    token comes within a second or two on an idle server; 15 s without one, while the engine
    reads nothing running and nothing waiting, means the request never reached it. (Completions
    with "max_tokens": null are held the same way.)"""
    settled_counters(server)  # idle
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "stream": True}

    async def first_event() -> tuple[str, float, Metrics | None]:
        async with async_client(headers=server.headers()) as client:
            t0 = time.monotonic()
            task = asyncio.create_task(stream_request(client, server.url, "/v1/chat/completions", body, 15.0,
                                                      cancel_after_events=1))
            done, _ = await asyncio.wait([task], timeout=10.0)
            during = None if done else await asyncio.to_thread(server.scrape)  # the engine, while we wait
            result = await task
            return result.outcome, time.monotonic() - t0, during
    outcome, seconds, m = asyncio.run(first_event())
    engine = None if m is None else {"running": m.engine_running(), "waiting": m.engine_waiting()}
    figures(outcome=outcome, seconds=round(seconds, 1), engine_while_waiting=engine)
    assert outcome != FAILED, f"no first token within 15 s; the engine meanwhile: {engine}"
    assert_pool_whole(server)
