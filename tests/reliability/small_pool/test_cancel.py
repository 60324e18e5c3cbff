"""A cancel storm: CANCEL_STREAMS streams (32; 200 under RELIABILITY_SCALE=full) dropped by their
clients mid-stream, then CANCEL_BLOCKING non-streaming requests (2; 10) dropped while generating."""
from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from tests.reliability.harness import (CANCELLED, COMPLETED, FAILED, REFUSED, StreamResult, async_client, count,
                                       stream_request)
from tests.reliability.small_pool.common import (MAX_MODEL_LEN, assert_pool_whole, prompt, settled_counters,
                                                 wait_counters)

pytestmark = pytest.mark.reliability

CANCEL_STREAMS = count("cancel_streams", 32, 200)
CANCEL_BLOCKING = count("cancel_blocking", 2, 10)
# Far more tokens than the 1-3 a client reads before it leaves: the engine cannot finish a stream
# (and count it `length`) while a client that is slow to read its first events still holds it.
STORM_MAX_TOKENS = 128


def test_cancel_storm_aborts_every_dropped_request_and_frees_its_blocks(server, figures):
    """All streams at once, each dropped by its client after 1-3 events (so each had reached the
    engine): the engine counts one abort per dropped request, no more and no fewer, and its KV
    pool is whole again."""
    before = settled_counters(server)

    async def storm() -> list[StreamResult]:
        async with async_client(headers=server.headers()) as client:
            return await asyncio.gather(*(
                stream_request(client, server.url, "/v1/completions",
                               {"prompt": prompt(1000 + i, 8), "max_tokens": STORM_MAX_TOKENS, "ignore_eos": True,
                                "stream": True}, 600.0, cancel_after_events=1 + i % 3)
                for i in range(CANCEL_STREAMS)))

    t0 = time.monotonic()
    streams = asyncio.run(storm())
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

    outcomes = collections.Counter(r.outcome for r in streams + blocking)
    failures = [r for r in streams + blocking if r.outcome == FAILED]
    delta = wait_counters(server, before, {"abort": outcomes[CANCELLED], "length": outcomes[COMPLETED]})
    pool = assert_pool_whole(server)
    figures(streams=CANCEL_STREAMS, blocking=CANCEL_BLOCKING, cancelled=outcomes[CANCELLED],
            completed=outcomes[COMPLETED], refused=outcomes[REFUSED], failed=len(failures),
            aborts_counted=delta["abort"], leaked_blocks=pool["leaked_blocks"], seconds=round(elapsed, 1))
    assert not failures, [(r.status, r.detail) for r in failures[:5]]
    assert outcomes[CANCELLED] >= CANCEL_STREAMS // 2
    assert (delta["abort"], delta["length"], delta["error"]) == (outcomes[CANCELLED], outcomes[COMPLETED], 0), delta
