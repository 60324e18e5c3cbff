"""A soak: SOAK_REQUESTS requests (80; 2,000 under RELIABILITY_SCALE=full) of a mixed workload,
SOAK_CONCURRENCY at a time, with the engine replica's RSS and open fds sampled at idle points
after a warm-up of a tenth of them (at least 40)."""
from __future__ import annotations

import asyncio
import collections
import time

import httpx
import pytest

from tests.reliability.harness import (CANCELLED, COMPLETED, FAILED, REFUSED, StreamResult, async_client,
                                       classify_refusal, count, proc_usage, stream_request)
from tests.reliability.small_pool.common import MAX_MODEL_LEN, assert_pool_whole, prompt

pytestmark = pytest.mark.reliability

SOAK_REQUESTS = count("soak_requests", 80, 2000)
SOAK_SAMPLES = count("soak_samples", 1, 4)  # idle points sampled after the warm-up one
SOAK_CONCURRENCY = 8
KINDS = ("completion", "completion", "completion-stream", "chat", "chat-stream", "completion-n2",
         "completion", "bad-request", "chat", "dropped-stream")


def soak_request(i: int) -> tuple[str, str, dict, str]:
    """(kind, path, body, what the client does) for request i of the soak's mixed workload."""
    kind = KINDS[i % len(KINDS)]
    n_tok = 4 + i % 13
    chat = {"messages": [{"role": "user", "content": prompt(i)}], "max_tokens": n_tok, "temperature": 0.8, "seed": i}
    comp = {"prompt": prompt(i), "max_tokens": n_tok, "temperature": 0.8, "seed": i}
    if kind == "completion":
        return kind, "/v1/completions", comp, "json"
    if kind == "completion-n2":
        return kind, "/v1/completions", {**comp, "n": 2, "logprobs": 2, "stop": [" river"]}, "json"
    if kind == "completion-stream":
        return kind, "/v1/completions", {**comp, "stream": True, "stream_options": {"include_usage": True}}, "sse"
    if kind == "chat":
        return kind, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1}, "json"
    if kind == "chat-stream":
        return kind, "/v1/chat/completions", {**chat, "stream": True}, "sse"
    if kind == "bad-request":  # max_tokens over max_model_len: a 400
        return kind, "/v1/completions", {**comp, "max_tokens": MAX_MODEL_LEN + 1}, "400"
    return kind, "/v1/completions", {**comp, "max_tokens": 48, "ignore_eos": True, "stream": True}, "drop"


async def _one(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, StreamResult]:
    kind, path, body, mode = soak_request(i)
    if mode in ("sse", "drop"):
        return kind, await stream_request(client, url, path, body, 120.0,
                                          cancel_after_events=1 if mode == "drop" else None)
    try:
        r = await asyncio.wait_for(client.post(url + path, json=body), 120.0)
    except (asyncio.TimeoutError, httpx.HTTPError) as e:
        return kind, StreamResult(FAILED, detail=repr(e))
    if mode == "400":
        ok = r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        return kind, StreamResult(COMPLETED if ok else FAILED, r.status_code, detail=r.text[:200])
    if r.status_code != 200:
        return kind, classify_refusal(r.status_code, r.headers, r.content)
    choices = r.json()["choices"]
    if not choices or any(c["finish_reason"] not in ("stop", "length") for c in choices):
        return kind, StreamResult(FAILED, 200, detail=r.text[:300])
    return kind, StreamResult(COMPLETED, 200, finish_reason=choices[0]["finish_reason"])


def _run(server, start: int, stop: int, deadline: float) -> list[tuple[str, StreamResult]]:
    """Requests start..stop-1 by SOAK_CONCURRENCY clients, each sending its next one as soon as
    its last one ended; stops at `deadline` (the caller then finds fewer results than asked)."""
    async def main():
        out: list[tuple[str, StreamResult]] = []
        next_i = start
        async with async_client(64, headers=server.headers()) as client:
            async def worker():
                nonlocal next_i
                while next_i < stop and time.monotonic() < deadline:
                    i, next_i = next_i, next_i + 1
                    out.append(await _one(client, server.url, i))
            await asyncio.gather(*(worker() for _ in range(SOAK_CONCURRENCY)))
        return out
    return asyncio.run(main())


def test_soak_keeps_memory_and_fds_flat(server, figures):
    """Completions and chat, streamed and not, n=2 with logprobs and stop strings, 400s and
    dropped streams: every request ends as it should; at each idle point the pool is whole; the
    engine replica's RSS grows by less than 5% after the warm-up and its open fds do not grow;
    the replica is never restarted."""
    replicas = server.engine_replicas()
    assert len(replicas) == 1, replicas
    replica = replicas[0]
    others = {"ingress": server.procs_named("ServeReplica", "OpenAIIngress")[0],
              "proxy": server.procs_named("ProxyActor")[0]}
    warmup = max(40, SOAK_REQUESTS // 10)
    deadline = time.monotonic() + max(300.0, SOAK_REQUESTS * 0.5)
    t0 = time.monotonic()

    results = _run(server, 0, warmup, deadline)
    assert_pool_whole(server)
    rss0, fds0 = proc_usage(replica)
    others0 = {name: proc_usage(p) for name, p in others.items()}
    samples = [(len(results), rss0, fds0)]
    start = warmup
    for k in range(1, SOAK_SAMPLES + 1):
        stop = warmup + (SOAK_REQUESTS - warmup) * k // SOAK_SAMPLES
        results += _run(server, start, stop, deadline)
        start = stop
        assert_pool_whole(server)
        samples.append((len(results), *proc_usage(replica)))
    elapsed = time.monotonic() - t0
    rss1, fds1 = samples[-1][1], samples[-1][2]
    others1 = {name: proc_usage(p) for name, p in others.items()}

    outcomes = collections.Counter(r.outcome for _, r in results)
    failures = [(kind, r) for kind, r in results if r.outcome == FAILED]
    growth = (rss1 - rss0) / rss0
    mib = 2**20
    figures(requests=len(results), warmup=warmup, concurrency=SOAK_CONCURRENCY,
            ok=outcomes[COMPLETED], dropped=outcomes[CANCELLED], refused=outcomes[REFUSED], failed=len(failures),
            rss_after_warmup_mib=round(rss0 / mib, 1), rss_end_mib=round(rss1 / mib, 1),
            rss_growth_pct=round(100 * growth, 2), fds_after_warmup=fds0, fds_end=fds1,
            samples_requests_rss_mib_fds=[(n, round(r / mib, 1), f) for n, r, f in samples],
            others_rss_mib_fds={name: [(round(others0[name][0] / mib, 1), others0[name][1]),
                                       (round(others1[name][0] / mib, 1), others1[name][1])] for name in others},
            seconds=round(elapsed, 1), requests_per_s=round(len(results) / elapsed, 1))
    assert len(results) == SOAK_REQUESTS, f"only {len(results)} requests ended before the deadline"
    assert not failures, [(k, r.status, r.detail) for k, r in failures[:5]]
    assert server.engine_replicas() == [replica], "the engine replica was restarted during the soak"
    assert growth < 0.05, f"engine replica RSS grew {100 * growth:.1f}% after warm-up: {samples}"
    assert fds1 <= fds0, f"engine replica fds grew after warm-up: {samples}"
