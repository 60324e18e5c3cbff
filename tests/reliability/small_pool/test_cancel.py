"""A cancel storm: CANCEL_STREAMS streams (32; 200 under RELIABILITY_SCALE=full) dropped by their
clients mid-stream, then CANCEL_BLOCKING non-streaming requests (2; 10) dropped while generating."""
from __future__ import annotations

import collections
import concurrent.futures
import time

import httpx
import pytest

from tests.reliability.harness import CANCELLED, COMPLETED, FAILED, REFUSED, StreamResult, count, drop_stream
from tests.reliability.small_pool.common import (MAX_MODEL_LEN, assert_pool_whole, prompt, settled_counters,
                                                 wait_counters)

pytestmark = pytest.mark.reliability

CANCEL_STREAMS = count("cancel_streams", 32, 200)
CANCEL_BLOCKING = count("cancel_blocking", 2, 10)
# Far more tokens than the 1-3 a client reads before it leaves (drop_stream tells a stream that
# had ended by the time its client left from one it left mid-way, however slow the client), and
# nearly as many as the pool holds with the prompt: the abort's trip (socket -> proxy -> ingress ->
# replica) must end before the request does, on a loaded host too.
STORM_MAX_TOKENS = 224  # + a prompt of up to 32 tokens: within MAX_MODEL_LEN (256)


def test_cancel_storm_aborts_every_dropped_request_and_frees_its_blocks(server, figures):
    """All streams at once, each dropped by its client after 1-3 events (so each had reached the
    engine), over plain sockets: the engine counts one abort per request its client left while
    it was still being sent, no more and no fewer, `length` for any that had ended by then, and
    its KV pool is whole again."""
    before = settled_counters(server)

    def drop(i: int) -> StreamResult:
        body = {"prompt": prompt(1000 + i, 8), "max_tokens": STORM_MAX_TOKENS, "ignore_eos": True, "stream": True}
        return drop_stream(server.url, "/v1/completions", body, 1 + i % 3, 600.0, headers=server.headers())

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CANCEL_STREAMS) as pool:
        streams = list(pool.map(drop, range(CANCEL_STREAMS)))
    # Non-streaming: the client gives up after 1 s of a ~240-token generation, one at a time so
    # each has reached the engine (an idle server admits it at once) before its client leaves.
    blocking = []
    for i in range(CANCEL_BLOCKING):
        body = {"prompt": f"Blocking {i}", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
        try:
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers(),
                           timeout=httpx.Timeout(1.0, connect=10.0))
            blocking.append(StreamResult(COMPLETED if r.status_code == 200 else FAILED, r.status_code,
                                         detail=r.text[:200]))
        except httpx.ReadTimeout:
            blocking.append(StreamResult(CANCELLED))
    elapsed = time.monotonic() - t0

    # A stream its client left with more than half its tokens already received may end before the
    # abort reaches the engine (a tiny model makes a token every few ms; the abort travels socket ->
    # proxy -> ingress -> replica): `late`, either an abort or a `length`. One left earlier must be
    # an abort.
    late = [r for r in streams if r.outcome == CANCELLED and r.events > STORM_MAX_TOKENS // 2]
    outcomes = collections.Counter(r.outcome for r in streams + blocking)
    cancelled = outcomes[CANCELLED] - len(late)
    failures = [r for r in streams + blocking if r.outcome == FAILED]
    ended = cancelled + len(late) + outcomes[COMPLETED]
    delta = wait_counters(server, before, lambda d: d["abort"] + d["length"] >= ended)
    pool = assert_pool_whole(server)
    figures(streams=CANCEL_STREAMS, blocking=CANCEL_BLOCKING, cancelled_mid_stream=cancelled,
            cancelled_late=len(late), completed_before_the_drop=outcomes[COMPLETED], refused=outcomes[REFUSED],
            failed=len(failures), aborts_counted=delta["abort"], length_counted=delta["length"],
            leaked_blocks=pool["leaked_blocks"], seconds=round(elapsed, 1))
    assert not failures, [(r.status, r.detail) for r in failures[:5]]
    assert cancelled >= CANCEL_STREAMS // 4, "too few streams were left mid-way for the test to mean much"
    assert delta["error"] == 0 and delta["stop"] == 0, delta
    # Every request ended once, and every one left mid-stream was aborted.
    assert delta["abort"] + delta["length"] == cancelled + len(late) + outcomes[COMPLETED], delta
    assert cancelled <= delta["abort"] <= cancelled + len(late), delta
