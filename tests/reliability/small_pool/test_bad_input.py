"""Hostile input against the small-pool server (an API key is set; every request here sends it):
schemathesis fuzzing from the served /openapi.json, garbage bodies, and a table of hand-written
hostile requests. No client input may get a 5xx: every reply is a 2xx, or a 4xx with an OpenAI
error body, and the server stays healthy.

Sizes: FUZZ_EXAMPLES 8 / 150 cases per operation and generation mode (positive: bodies that fit
the schema; negative: bodies that break it), RAW_EXAMPLES 40 / 400 garbage bodies
(RELIABILITY_<NAME>; the second under RELIABILITY_SCALE=full).
"""
from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.reliability.harness import ServeProcess, count
from tests.reliability.small_pool.common import (MAX_BODY, MAX_MODEL_LEN, MAX_NUM_SEQS, assert_healthy,
                                                 is_openai_error, is_openai_error_text)

pytestmark = pytest.mark.reliability

FUZZ_EXAMPLES = count("fuzz_examples", 8, 150)
RAW_EXAMPLES = count("raw_examples", 40, 400)
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


# -- schemathesis ------------------------------------------------------------------------------------
SMALL = 4  # generated max_tokens / n / min_tokens above this are folded back under it


def _small(case):
    """Keep generation short, whatever was generated: every int max_tokens-like field is folded
    into 1..SMALL (out-of-range ones, such as 0 or -3, are left: they must get a 400), and a
    generation request whose max_tokens is null, or absent on chat, gets max_tokens=SMALL (else
    it may run to max_model_len; test_load.py has that case on its own)."""
    body = case.body
    if isinstance(body, dict) and case.path in GENERATION_ROUTES:
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n", "best_of"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > SMALL:
                body[key] = 1 + v % SMALL
        if case.path == "/v1/responses":
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = SMALL
            return case
        unset = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
        if unset and ("max_tokens" in body or case.path == "/v1/chat/completions"):
            body["max_tokens"] = SMALL
    return case


def _fuzz(server: ServeProcess, mode) -> tuple[collections.Counter, list[str]]:
    import schemathesis

    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()  # no key needed
    schema = schemathesis.openapi.from_dict(doc)
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []
    session = requests.Session()
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode).map(_small))
        def call(case):
            try:
                r = case.call(base_url=server.url, session=session, headers=server.headers(), timeout=60)
            except Exception as e:  # the connection broke: as bad as a 5xx
                bad.append(f"{case.method} {case.formatted_path} {str(case.body)[:300]!r} -> {e!r}")
                return
            statuses[(case.method, case.path, r.status_code)] += 1
            if r.status_code >= 500 or (r.status_code >= 400 and not is_openai_error_text(r.text)):
                bad.append(f"{case.method} {case.formatted_path} {str(case.body)[:300]!r} -> {r.status_code} "
                           f"{r.text[:300]}")
        try:
            call()
        except Unsatisfiable:  # negative mode, an operation with nothing to break (GET /health)
            statuses[(op.method.upper(), op.path, "no case")] += 0
    session.close()
    return statuses, bad


# Crashers the fuzzer found, replayed first in positive mode on every run (a fuzzer's regression
# corpus): (path, body, what it did).
CORPUS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [240814726]},
     "stop_token_ids past the vocabulary + min_tokens: IndexError in engine/sampler.py apply_min_tokens "
     "killed the engine loop (503 unavailable for it and every request in flight; the replica replaced)"),
    ("/v1/completions", {"prompt": "o", "guided_regex": "\U000e873c\x01\x1c\x1c\x06c\x03\u00fb"},
     "a regex forcing a control byte SmolLM2's tokens cannot write: llguidance's mask allowed 'c', the "
     "matcher then refused it, and the grammar's failure was a 500"),
]


def _replay_corpus(server: ServeProcess) -> list[str]:
    bad = []
    for path, body, found in CORPUS:
        r = httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120)
        if r.status_code >= 500 or (r.status_code >= 400 and not is_openai_error(r)):
            bad.append(f"corpus: POST {path} {body} -> {r.status_code} {r.text[:300]} (found: {found})")
    return bad


def _wait_serving(server: ServeProcess, timeout_s: float = 240.0) -> float:
    """Seconds until /ready is 200 and a completion succeeds (a killed replica is being replaced)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if server.wait_ready(200, timeout_s=5) is not None:
            r = httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=60,
                           json={"prompt": "still alive?", "max_tokens": 2})
            if r.status_code == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise AssertionError(f"the server did not serve again within {timeout_s:g}s")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_fuzz_from_the_served_openapi_gets_no_5xx(server, figures, mode):
    """Every operation of /openapi.json, FUZZ_EXAMPLES cases each: bodies that fit the schema
    (positive; the corpus of crashers found so far first) and bodies that break it (negative),
    with the key, max_tokens kept small. Whatever happened, the test waits for the server to
    serve again before it asserts, so a crash does not spill into the tests after it."""
    from schemathesis import GenerationMode

    t0 = time.monotonic()
    bad = _replay_corpus(server) if mode == "positive" else []
    statuses, fuzz_bad = _fuzz(server, GenerationMode(mode))
    bad += fuzz_bad
    recovery_s = _wait_serving(server)
    by_status = collections.Counter()
    for (_, _, status), n in statuses.items():
        if n:
            by_status[status] += n
    figures(mode=mode, calls=sum(statuses.values()) + (len(CORPUS) if mode == "positive" else 0),
            by_status=dict(sorted(by_status.items())), bad=len(bad), seconds=round(time.monotonic() - t0, 1),
            serving_again_after_s=round(recovery_s, 1))
    assert not bad, "\n".join(bad[:10])
    assert sum(statuses.values()) >= 5 * FUZZ_EXAMPLES // 2


def test_garbage_bodies_get_a_4xx_error(server, figures):
    """Arbitrary bytes, and JSON-looking text, as the body of every POST route."""
    paths = POST_ROUTES
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []
    json_ish = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=4), max_leaves=12)
    bodies = st.binary(max_size=512) | json_ish.map(lambda v: json.dumps(v).encode()) | \
        st.builds(lambda v, cut: json.dumps(v).encode()[:cut], json_ish, st.integers(0, 64))

    with httpx.Client(timeout=60, headers=server.headers()) as client:
        @settings(max_examples=RAW_EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(paths), body=bodies,
               ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", None]))
        def post(path, body, ctype):
            headers = {"content-type": ctype} if ctype else {}
            r = client.post(server.url + path, content=body, headers=headers)
            statuses[r.status_code] += 1
            if not (r.status_code < 500 and (r.status_code < 400 or is_openai_error(r))):
                bad.append(f"POST {path} {body[:200]!r} -> {r.status_code} {r.text[:300]}")
        post()
    figures(calls=sum(statuses.values()), by_status=dict(sorted(statuses.items())), bad=len(bad))
    assert not bad, "\n".join(bad[:10])
    assert_healthy(server)


# -- the hostile table -------------------------------------------------------------------------------
def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "max_tokens": 1, "extra": ' + b"[" * depth + b"]" * depth + b"}"


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
# (name, method, path, body bytes or None, extra headers, expected status or statuses)
HOSTILE = [
    ("lone surrogate in prompt", "POST", CMPL, b'{"prompt": "abc\\ud800def", "max_tokens": 1}', {}, 400),
    ("lone surrogate in chat", "POST", CHAT,
     b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 1}', {}, 400),
    ("lone surrogate to /tokenize", "POST", "/tokenize", b'{"prompt": "\\ud800"}', {}, 400),
    ("lone surrogate in a key", "POST", CMPL, b'{"prompt": "a", "\\ud800": 1, "max_tokens": 1}', {}, 400),
    ("invalid UTF-8 bytes", "POST", CMPL, b'{"prompt": "\xff\xfe\xc3(", "max_tokens": 1}', {}, 400),
    # Python's json reads UTF-16/32 and a UTF-8 BOM (RFC 8259 lets a parser accept them)
    ("UTF-16 body", "POST", CMPL, '{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"), {}, {200, 400}),
    ("UTF-8 BOM", "POST", CMPL, b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}', {}, {200, 400}),
    ("nested 10,000 levels", "POST", CMPL, _nested(10_000), {}, 400),
    ("nested 100,000 levels", "POST", CHAT, _nested(100_000), {}, 400),
    ("nested 129 levels", "POST", CMPL, _nested(129), {}, 400),  # router.api.MAX_JSON_DEPTH is 128
    ("NaN temperature", "POST", CMPL, b'{"prompt": "a", "temperature": NaN, "max_tokens": 1}', {}, 400),
    ("Infinity top_p", "POST", CMPL, b'{"prompt": "a", "top_p": Infinity, "max_tokens": 1}', {}, 400),
    ("1e999 temperature", "POST", CMPL, b'{"prompt": "a", "temperature": 1e999, "max_tokens": 1}', {}, 400),
    ("5,000-digit max_tokens", "POST", CMPL, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400),
    ("2**64 max_tokens", "POST", CMPL, _j({"prompt": "a", "max_tokens": 2**64}), {}, 400),
    ("2**64 seed", "POST", CMPL, _j({"prompt": "a", "max_tokens": 1, "seed": 2**64}), {}, 400),
    ("seed below -2**63", "POST", CMPL, _j({"prompt": "a", "max_tokens": 1, "seed": -(2**63) - 1}), {}, 400),
    ("empty body", "POST", CMPL, b"", {}, 400),
    ("body null", "POST", CMPL, b"null", {}, 400),
    ("body a list", "POST", CHAT, b"[]", {}, 400),
    ("body a string", "POST", CMPL, b'"prompt"', {}, 400),
    ("truncated JSON", "POST", CMPL, b'{"prompt": "a", "max_tok', {}, 400),
    ("trailing garbage", "POST", CMPL, b'{"prompt": "a", "max_tokens": 1} xyz', {}, 400),
    ("prompt missing", "POST", CMPL, _j({"max_tokens": 1}), {}, 400),
    ("prompt empty string", "POST", CMPL, _j({"prompt": "", "max_tokens": 1}), {}, 400),
    ("prompt empty list", "POST", CMPL, _j({"prompt": [], "max_tokens": 1}), {}, 400),
    ("prompt of empty lists", "POST", CMPL, _j({"prompt": [[], []], "max_tokens": 1}), {}, 400),
    ("prompt an object", "POST", CMPL, _j({"prompt": {"a": 1}, "max_tokens": 1}), {}, 400),
    ("token id -1", "POST", CMPL, _j({"prompt": [1, -1], "max_tokens": 1}), {}, 400),
    ("token id past the vocabulary", "POST", CMPL, _j({"prompt": [1, 10**9], "max_tokens": 1}), {}, 400),
    ("token id 2**70", "POST", CMPL, _j({"prompt": [2**70], "max_tokens": 1}), {}, 400),
    ("token id a float", "POST", CMPL, _j({"prompt": [1.5], "max_tokens": 1}), {}, 400),
    ("token id a bool", "POST", CMPL, _j({"prompt": [True, 5], "max_tokens": 1}), {}, {200, 400}),  # lax: true is 1
    ("300 prompts", "POST", CMPL, _j({"prompt": ["a"] * 300, "max_tokens": 1}), {}, 400),
    ("100 prompts x n=3", "POST", CMPL, _j({"prompt": ["a"] * 100, "n": 3, "max_tokens": 1}), {}, 400),
    ("n=1000", "POST", CMPL, _j({"prompt": "a", "n": 1000, "max_tokens": 1}), {}, 400),
    ("n above max_num_seqs", "POST", CMPL, _j({"prompt": "a", "n": MAX_NUM_SEQS + 1, "max_tokens": 1}), {}, 200),
    ("n=0", "POST", CHAT, _j({"messages": [{"role": "user", "content": "a"}], "n": 0, "max_tokens": 1}), {}, 400),
    ("max_tokens 0", "POST", CMPL, _j({"prompt": "a", "max_tokens": 0}), {}, 400),
    ("max_tokens -1", "POST", CMPL, _j({"prompt": "a", "max_tokens": -1}), {}, 400),
    ("max_tokens a string", "POST", CMPL, _j({"prompt": "a", "max_tokens": "ten"}), {}, 400),
    ("max_tokens past max_model_len", "POST", CMPL, _j({"prompt": "a", "max_tokens": MAX_MODEL_LEN + 1}), {}, 400),
    ("prompt past max_model_len", "POST", CMPL, _j({"prompt": "word " * 400, "max_tokens": 1}), {}, 400),
    ("1 MB-ish prompt under the body limit", "POST", CMPL, _j({"prompt": "x" * (MAX_BODY - 100), "max_tokens": 1}),
     {}, 400),
    ("body over the limit", "POST", CMPL, _j({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}), {}, 413),
    ("temperature -1", "POST", CMPL, _j({"prompt": "a", "temperature": -1, "max_tokens": 1}), {}, 400),
    ("temperature a string", "POST", CMPL, _j({"prompt": "a", "temperature": "hot", "max_tokens": 1}), {}, 400),
    ("top_p 0", "POST", CMPL, _j({"prompt": "a", "top_p": 0, "max_tokens": 1}), {}, 400),
    ("top_k -5", "POST", CMPL, _j({"prompt": "a", "top_k": -5, "max_tokens": 1}), {}, 400),
    ("logprobs 1000", "POST", CMPL, _j({"prompt": "a", "logprobs": 1000, "max_tokens": 1}), {}, 400),
    # Rows that hold whether or not a feature is supported: an unsupported one is a 400 too.
    ("logit_bias id past the vocabulary", "POST", CMPL,
     _j({"prompt": "a", "logit_bias": {"999999999": 5}, "max_tokens": 1}), {}, 400),
    ("logit_bias key not a token id", "POST", CMPL, _j({"prompt": "a", "logit_bias": {"abc": 5}, "max_tokens": 1}),
     {}, 400),
    # taken as 100, as vLLM's server clamps it
    ("logit_bias value 1e9", "POST", CMPL, _j({"prompt": "a", "logit_bias": {"5": 1e9}, "max_tokens": 1}), {}, 200),
    ("echo a list", "POST", CMPL, _j({"prompt": "a", "echo": [1], "max_tokens": 1}), {}, 400),
    ("best_of != n", "POST", CMPL, _j({"prompt": "a", "best_of": 3, "max_tokens": 1}), {}, 400),
    ("stream_options without stream", "POST", CMPL,
     _j({"prompt": "a", "stream_options": {"include_usage": True}, "max_tokens": 1}), {}, 400),
    ("stop an empty string", "POST", CMPL, _j({"prompt": "a", "stop": "", "max_tokens": 1}), {}, 400),
    ("stop_token_ids negative", "POST", CMPL, _j({"prompt": "a", "stop_token_ids": [-3], "max_tokens": 1}), {}, 400),
    # Once a 503 that killed the engine replica (the fuzzer found it; fixed in 51c1603):
    ("stop_token_ids past the vocabulary + min_tokens", "POST", CMPL,
     _j({"prompt": "a", "min_tokens": 1, "stop_token_ids": [240814726], "max_tokens": 2}), {}, 400),
    ("stop_token_ids 2**64 + min_tokens", "POST", CHAT,
     _j({"messages": [{"role": "user", "content": "a"}], "min_tokens": 1, "stop_token_ids": [2**64],
         "max_tokens": 2}), {}, 400),
    ("10,000 stop strings", "POST", CMPL, _j({"prompt": "a", "stop": ["zz%d" % i for i in range(10_000)],
                                               "max_tokens": 1}), {}, 400),  # at most 128: each is searched per token
    ("messages empty", "POST", CHAT, _j({"messages": [], "max_tokens": 1}), {}, 400),
    ("messages not a list", "POST", CHAT, _j({"messages": "hi", "max_tokens": 1}), {}, 400),
    # a role beyond OpenAI's is the chat template's to refuse, as in vLLM; SmolLM2's renders any
    ("role unknown", "POST", CHAT, _j({"messages": [{"role": "wizard", "content": "a"}], "max_tokens": 1}), {}, 200),
    ("role empty", "POST", CHAT, _j({"messages": [{"role": "", "content": "a"}], "max_tokens": 1}), {}, 400),
    ("content an int", "POST", CHAT, _j({"messages": [{"role": "user", "content": 5}], "max_tokens": 1}), {}, 400),
    ("content part of unknown type", "POST", CHAT,
     _j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "max_tokens": 1}),
     {}, 400),
    ("tool without a function", "POST", CHAT,
     _j({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}], "max_tokens": 1}), {}, 400),
    ("response_format of an unknown type", "POST", CHAT,
     _j({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}, "max_tokens": 1}),
     {}, 400),
    ("top_logprobs without logprobs", "POST", CHAT,
     _j({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2, "max_tokens": 1}), {}, 400),
    ("another model", "POST", CMPL, _j({"model": "gpt-4", "prompt": "a", "max_tokens": 1}), {}, 404),
    ("model a number", "POST", CMPL, _j({"model": 5, "prompt": "a", "max_tokens": 1}), {}, 400),
    ("tokenize both prompt and messages", "POST", "/tokenize",
     _j({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}), {}, 400),
    ("tokenize neither", "POST", "/tokenize", _j({}), {}, 400),
    ("detokenize id past the vocabulary", "POST", "/detokenize", _j({"tokens": [10**9]}), {}, 400),
    ("detokenize id -1", "POST", "/detokenize", _j({"tokens": [-1]}), {}, 400),
    ("detokenize 2**70", "POST", "/detokenize", _j({"tokens": [2**70]}), {}, 400),
    ("text/plain content type", "POST", CMPL, _j({"prompt": "a", "max_tokens": 1}),
     {"content-type": "text/plain"}, 200),
    ("form content type", "POST", CMPL, b"prompt=a&max_tokens=1",
     {"content-type": "application/x-www-form-urlencoded"}, 400),
    ("multipart body", "POST", CMPL, b"--b\r\nContent-Disposition: form-data; name=prompt\r\n\r\na\r\n--b--\r\n",
     {"content-type": "multipart/form-data; boundary=b"}, 400),
    ("unknown path", "POST", "/v1/audio/transcriptions", _j({"input": "a"}), {}, 404),
    # a generating server's /v1/embeddings: a 400 that says which flag serves embeddings
    ("embeddings from a generating model", "POST", "/v1/embeddings", _j({"input": "a"}), {}, 400),
    ("GET on a POST route", "GET", CMPL, None, {}, 405),
    ("DELETE on /v1/models", "DELETE", "/v1/models", None, {}, 405),
    ("path traversal", "GET", "/v1/../../etc/passwd", None, {}, 404),
    ("query string junk", "GET", "/v1/models?x=%ff%fe&y=" + "z" * 2000, None, {}, 200),
]


@pytest.mark.parametrize("name, method, path, body, headers, expected", HOSTILE, ids=[row[0] for row in HOSTILE])
def test_hostile_request_gets_a_clear_4xx(server, name, method, path, body, headers, expected):
    r = httpx.request(method, server.url + path, content=body, timeout=120,
                      headers={"content-type": "application/json", **server.headers(), **headers})
    expected = expected if isinstance(expected, set) else {expected}
    assert r.status_code in expected, f"{name}: {r.status_code} {r.text[:500]}"
    if r.status_code >= 400:
        assert is_openai_error(r), f"{name}: not an OpenAI error body: {r.text[:300]}"
        assert "Traceback" not in r.text and "/work/" not in r.text and "site-packages" not in r.text


def test_chunked_body_over_the_limit_gets_413(server):
    """A body with no Content-Length (chunked) is cut off at the limit as it arrives."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 65536 + 2):
            yield b"x" * 65536
        yield b'", "max_tokens": 1}'
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **server.headers()})
    assert r.status_code == 413 and is_openai_error(r), r.text[:300]
    assert_healthy(server)
