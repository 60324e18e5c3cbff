"""The security table against the small-pool server: the API key (missing, wrong or malformed:
401 on every API route; /health, /ready, /openapi.json and /docs open), and prompts kept out of
every log unless --enable-log-requests."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.reliability.small_pool.common import KEY, MAX_MODEL_LEN

pytestmark = pytest.mark.reliability

API_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize")]
OPEN_ROUTES = ["/health", "/ready", "/openapi.json", "/docs"]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


# -- the API key table -------------------------------------------------------------------------------
VALID_BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}
BAD_AUTH = [
    ("missing", {}),
    ("wrong key", {"authorization": "Bearer wrong-key"}),
    ("key minus its last character", {"authorization": f"Bearer {KEY[:-1]}"}),
    ("key plus a character", {"authorization": f"Bearer {KEY}x"}),
    ("scheme only", {"authorization": "Bearer"}),
    ("key without a scheme", {"authorization": KEY}),
    ("Basic scheme", {"authorization": "Basic cmVsOmtleQ=="}),
    ("Token scheme", {"authorization": f"Token {KEY}"}),
    ("key in x-api-key only", {"x-api-key": KEY}),
    ("key twice", {"authorization": f"Bearer {KEY} {KEY}"}),
    ("non-ASCII bytes", {"authorization": b"Bearer \xff\xfe\xc3\xa9"}),
    ("16 KB key", {"authorization": "Bearer " + "k" * 16384}),
]


@pytest.mark.parametrize("method, path", API_ROUTES, ids=[p for _, p in API_ROUTES])
def test_every_api_route_wants_the_key(server, method, path):
    body = VALID_BODIES.get(path)
    for name, headers in BAD_AUTH:
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, f"{name}: {r.status_code} {r.text[:300]}"
        assert r.headers.get("www-authenticate") == "Bearer", name
        assert r.json()["error"]["type"] == "authentication_error", name
        assert KEY not in r.text and "wrong-key" not in r.text, f"{name}: the reply echoes the key"
    r = httpx.request(method, server.url + path, json=body, headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text  # the right key is let in


@pytest.mark.parametrize("path", OPEN_ROUTES)
def test_probes_and_docs_need_no_key(server, path):
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 200, r.text[:300]


# -- logs ----------------------------------------------------------------------------------------------
def test_prompts_never_reach_the_logs(server, smollm2_path, figures):
    """A canary prompt sent every way a prompt can arrive (completions, chat, streamed, token ids,
    /tokenize, a 400, a 401) appears in no log: not the serve process's output (which carries
    every Ray worker's log lines) and not any file of its Ray session. The files do hold this
    traffic's access-log lines, so the search reads the right place; and a server started with
    --enable-log-requests does log prompt ids (tests/reliability/test_rank_kill.py)."""
    from transformers import AutoTokenizer

    canary = f"canary {uuid.uuid4().hex} quokka"
    ids = AutoTokenizer.from_pretrained(smollm2_path).encode(canary, add_special_tokens=False)
    h = server.headers()
    calls = [
        (CMPL, {"prompt": canary, "max_tokens": 2}, h, 200),
        (CMPL, {"prompt": canary, "max_tokens": 2, "stream": True}, h, 200),
        (CMPL, {"prompt": ids, "max_tokens": 2}, h, 200),
        (CHAT, {"messages": [{"role": "user", "content": canary}], "max_tokens": 2}, h, 200),
        ("/tokenize", {"prompt": canary}, h, 200),
        (CMPL, {"prompt": canary, "max_tokens": MAX_MODEL_LEN + 1}, h, 400),
        (CMPL, {"prompt": canary + " \ud800"}, h, 400),
        (CMPL, {"prompt": canary, "max_tokens": 2}, {}, 401),
    ]
    for path, body, headers, want in calls:
        content = json.dumps(body).encode("utf-8", "surrogatepass")
        r = httpx.post(server.url + path, content=content, timeout=60,
                       headers={"content-type": "application/json", **headers})
        assert r.status_code == want, (path, r.status_code, r.text[:300])
    time.sleep(3)  # Ray's log monitor forwards worker lines about once a second
    id_text = ", ".join(map(str, ids[1:-1]))
    text_hits, id_hits = server.logs_containing(canary.split()[1]), server.logs_containing(id_text)
    access = server.logs_containing("/v1/completions")
    figures(log_files_searched=len(server.log_files()), canary_text_hits=text_hits, canary_id_hits=id_hits,
            files_with_access_lines=len(access))
    assert access, "no log file shows the requests at all: the search looks in the wrong place"
    assert not text_hits and not id_hits, (text_hits, id_hits)
