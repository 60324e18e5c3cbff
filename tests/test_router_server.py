"""The OpenAI-compatible server, end to end: a real Ray + Serve on 127.0.0.1 serving SmolLM2.

Greedy output must equal the offline `engine.LLM`'s for the same prompt, through the official
`openai` client; every error has its status and OpenAI error JSON; a client that disconnects
frees its KV blocks at once; 32 concurrent streams all finish with the right usage.
"""
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from tests.local_serve import running_server

API_KEY = "sk-kvserve-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
BODY_LIMIT = 64 << 10
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
LORA = "smol-lora"  # the LoRA module the server serves beside the model (--lora-modules)


@pytest.fixture(scope="module")
def oracle(smollm2_path, tmp_path_factory):
    """Greedy reference texts from the offline engine, computed before the server starts; the
    same with a LoRA adapter (random, PEFT's) that the server serves as LORA."""
    from engine import LLM, LoRARequest, SamplingParams
    from tests.tiny_lora import make_adapter

    adapter = make_adapter(smollm2_path, tmp_path_factory.mktemp("lora") / LORA, ["q_proj", "v_proj", "down_proj"],
                           r=4, seed=3)
    llm = LLM(model=smollm2_path, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=256, enable_lora=True)
    chat_text = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    completion, chat = llm.generate([PROMPT, chat_text], params)
    adapted = llm.generate([PROMPT, chat_text], params, lora_request=LoRARequest(LORA, 1, adapter))
    return {"completion": completion.outputs[0].text, "chat": chat.outputs[0].text, "tokenizer": llm.tokenizer,
            "chat_tokens": len(chat.outputs[0].token_ids), "chat_finish": chat.outputs[0].finish_reason,
            "adapter": adapter, "lora": {"completion": adapted[0].outputs[0].text, "chat": adapted[1].outputs[0].text}}


@pytest.fixture(scope="module")
def server(oracle):
    # Requests that set no temperature are greedy here: a sampling default, as a model's
    # generation_config.json would give one (test_a_generation_config_default_reaches_the_server)
    args = dict(max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=256, max_num_seqs=32, api_key=API_KEY,
                max_request_body_bytes=BODY_LIMIT, override_generation_config={"temperature": 0},
                enable_lora=True, lora_modules=[f"{LORA}={oracle['adapter']}"])
    with running_server(args) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def engine_stats(server):
    from ray import serve

    handle = serve.get_deployment_handle("EngineServer", app_name="kvserve")
    return lambda: handle.stats.remote().result()


# -- the openai client against the offline engine ------------------------------------------------

def test_completion_equals_offline_engine(client, oracle):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == oracle["completion"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens == len(oracle["tokenizer"].encode(PROMPT, add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS


def test_streamed_completion_equals_offline_engine(client, oracle):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == oracle["completion"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_equals_offline_engine(client, oracle):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == oracle["chat"]
    assert r.choices[0].finish_reason == oracle["chat_finish"]
    assert r.usage.completion_tokens == oracle["chat_tokens"]


def test_a_generation_config_default_reaches_the_server(client, oracle):
    """The ingress reads its sampling defaults where it runs (RouterSettings.with_sampling_defaults):
    no temperature here is the override's 0, greedy, not OpenAI's 1."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == oracle["chat"]


def test_responses_api_equals_offline_engine(client, oracle):
    """OpenAI's Responses API, whole and streamed: the chat reply, as the openai client reads it."""
    r = client.responses.create(model=MODEL, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0)
    assert r.output_text == oracle["chat"] and r.usage.output_tokens == oracle["chat_tokens"]
    assert r.status == ("incomplete" if oracle["chat_finish"] == "length" else "completed")
    events = list(client.responses.create(model=MODEL, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0,
                                          stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == oracle["chat"]
    assert events[-1].response.output_text == oracle["chat"]


def test_responses_logprobs_are_chats(client):
    """include message.output_text.logprobs: the same tokens and logprobs as chat's for the same
    greedy request (its eos's too), whole and streamed."""
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=2).choices[0].logprobs.content
    asked = dict(model=MODEL, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0, top_logprobs=2,
                 include=["message.output_text.logprobs"])
    whole = client.responses.create(**asked).output[0].content[0].logprobs
    events = list(client.responses.create(**asked, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    want = [(lp.token, lp.bytes, round(lp.logprob, 4), [(t.token, round(t.logprob, 4)) for t in lp.top_logprobs])
            for lp in chat]
    for got in (whole, streamed):
        assert [(lp.token, lp.bytes, round(lp.logprob, 4), [(t.token, round(t.logprob, 4)) for t in lp.top_logprobs])
                for lp in got] == want


def test_streamed_chat_equals_offline_engine(client, oracle, http):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == oracle["chat"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == oracle["chat_finish"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == oracle["chat_tokens"]
    count = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert usage.prompt_tokens == count


def test_sse_wire_format_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-1])  # not asked for


# -- sampling fields -------------------------------------------------------------------------------

def test_stop_string_ends_with_finish_reason_stop(client, oracle):
    word = oracle["completion"].split()[1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == oracle["completion"][:oracle["completion"].index(word)]


def test_n_and_seed(client):
    def run():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, seed=7, temperature=1.0)

    a, b = run(), run()
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 12


def test_batch_of_prompts(client, oracle):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == oracle["completion"]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and sampled == pytest.approx(max(top.values()), abs=1e-4)  # greedy: top-1
    # Sampled: each token's top_logprobs hold the most likely and the token itself when it is not
    # that one (up to logprobs + 1 entries, as OpenAI's and vLLM's).
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.5, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and len(top) <= 2, (token, top)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # a draw other than the most likely


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def test_penalties_and_vllm_extras_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0.7, top_p=0.9,
                                       presence_penalty=0.5, frequency_penalty=0.5,
                                       extra_body={"top_k": 20, "repetition_penalty": 1.1, "min_tokens": 5,
                                                   "ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_a_chat_message_has_vllms_keys_in_raw_json(http):
    """Clients that read the JSON itself find refusal and tool_calls, as vLLM's reply has them, and
    OpenAI's service_tier and system_fingerprint (null, as vLLM's)."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}).json()
    message = r["choices"][0]["message"]
    assert message["refusal"] is None and message["tool_calls"] == [] and message["role"] == "assistant"
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()
    for reply in (r, completion):
        assert "service_tier" in reply and "system_fingerprint" in reply
        assert reply["service_tier"] is None and reply["system_fingerprint"] is None


def test_the_bodys_request_id_names_the_reply_behind_serves_proxy(client):
    """Serve's proxy puts an X-Request-Id on every request: the body's id must still win."""
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"request_id": "mine-1"})
    assert r.id == "cmpl-mine-1"
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_headers={"X-Request-Id": "hdr-1"})
    assert r.id == "chatcmpl-hdr-1"


# -- other endpoints -------------------------------------------------------------------------------

def test_a_lora_module_runs_where_a_request_names_it(client, oracle):
    """Through Serve: completion, chat and Responses with `model` naming the adapter equal the
    offline engine's with that adapter, and name it."""
    assert oracle["lora"] != {"completion": oracle["completion"], "chat": oracle["chat"]}
    r = client.completions.create(model=LORA, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert (r.model, r.choices[0].text) == (LORA, oracle["lora"]["completion"])
    r = client.chat.completions.create(model=LORA, messages=CHAT, max_tokens=MAX_TOKENS)
    assert (r.model, r.choices[0].message.content) == (LORA, oracle["lora"]["chat"])
    r = client.responses.create(model=LORA, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS)
    assert (r.model, r.output_text) == (LORA, oracle["lora"]["chat"])


def test_models(client, oracle):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, LORA]
    assert (models[1].root, models[1].parent) == (oracle["adapter"], MODEL)
    assert client.models.retrieve(MODEL).id == MODEL
    card = models[0].model_dump()  # vLLM's ModelCard fields
    assert card["root"] == MODEL and card["max_model_len"] == MAX_MODEL_LEN and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_sampling"]
    assert time.time() - 3600 < models[0].created <= time.time()  # when it began serving, as vLLM's
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_tokenize_detokenize(http, oracle):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == oracle["tokenizer"].encode(PROMPT, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    assert "token_strs" not in r
    strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert strs == oracle["tokenizer"].convert_ids_to_tokens(r["tokens"])  # vLLM's extra


def test_health_and_ready_need_no_key(server):
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/ping").status_code == httpx.post(f"{server}/ping").status_code == 200  # vLLM's
    r = httpx.get(f"{server}/ready")
    assert r.status_code == 200 and r.json()["ready"] is True


def test_replica_hooks(server):
    from ray import serve

    handle = serve.get_deployment_handle("EngineServer", app_name="kvserve")
    stats = handle.record_routing_stats.remote().result()
    assert stats["num_total_blocks"] == 256 and 0.0 <= stats["kv_usage"] <= 1.0
    assert handle.check_health.remote().result() is None


# -- errors ----------------------------------------------------------------------------------------

LONG_PROMPT = "hello " * 600  # > MAX_MODEL_LEN tokens

ERROR_ROWS = [
    # (endpoint, body, status, param, code)
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "invalid_json"),
    ("/v1/chat/completions", b"\xff\xfe", 400, None, "invalid_json"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    # any other role is the chat template's to refuse, as in vLLM (tests/test_vllm_extras.py)
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", [1, 2], 400, None, "invalid_value"),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN + 1}, 400,
     "max_completion_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10 ** 7], "max_tokens": 1}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": "inf"}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    # more than --max-sequences-per-request (256; > max_num_seqs is served)
    ("/v1/completions", {"prompt": "x", "n": 300}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 16385}, 400, "n", "invalid_value"),  # vLLM's cap on the field
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 8}, 400, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop.0", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 1 << 64}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "invalid_value"),  # echo is supported now
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    # Tools are supported now; one without its function definition is still a 400, naming the field.
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, None, "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "invalid_value"),
]


def assert_error(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize("path, body, status, param, code", ERROR_ROWS)
def test_error_rows(http, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, status, param, code)


def test_errors_reach_the_openai_client_typed(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/v1/chat/completions"), ("POST", "/tokenize")])
def test_api_key_required(server, headers, method, path):
    r = httpx.request(method, f"{server}{path}", headers=headers, json={"prompt": "x", "messages": CHAT})
    error = assert_error(r, 401, None, "invalid_api_key")
    assert error["type"] == "authentication_error"
    assert API_KEY not in r.text


def test_openai_client_with_wrong_key(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_body_over_the_limit_is_413(http):
    big = json.dumps({"prompt": "x" * BODY_LIMIT}).encode()
    assert_error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                 413, None, "request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_error(http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}),
                 413, None, "request_too_large")


def test_unknown_route_is_openai_json(http):
    assert_error(http.get("/v1/nope"), 404)


# -- cancellation ----------------------------------------------------------------------------------

def wait_until_free(engine_stats, timeout: float = 30.0):  # the abort crosses several Ray hops
    deadline = time.monotonic() + timeout
    while True:
        s = engine_stats()
        if s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0:
            return time.monotonic() - (deadline - timeout)
        assert time.monotonic() < deadline, f"blocks not freed: {s}"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_kv_blocks(http, engine_stats):
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith("data:")]
        assert len(data) >= 3
        s = engine_stats()
        assert s.num_running == 1 and s.num_free_blocks < s.num_total_blocks
    wait_until_free(engine_stats)


def test_a_background_response_runs_on_and_a_cancel_frees_its_kv_blocks(client, oracle, engine_stats):
    """Through Serve, a background run outlives its HTTP request, and its reply is the offline
    engine's; a cancelled one ends its engine request."""
    queued = client.responses.create(model=MODEL, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS,
                                     temperature=0, background=True)
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert queued.status == "queued" and done.output_text == oracle["chat"]
    long = client.responses.create(model=MODEL, input=CHAT[0]["content"], max_output_tokens=400, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
    while client.responses.retrieve(long.id).status != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.responses.cancel(long.id).status == "cancelled"
    wait_until_free(engine_stats)
    assert client.responses.retrieve(long.id).status == "cancelled"


def test_disconnect_while_waiting_for_a_reply_frees_kv_blocks(server, engine_stats):
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    client_gone = threading.Event()

    def impatient_client():
        try:
            httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=6.0)
        except httpx.ReadTimeout:
            pass
        client_gone.set()

    threading.Thread(target=impatient_client, daemon=True).start()
    deadline = time.monotonic() + 6.0
    while engine_stats().num_running == 0:  # the request reached the engine
        assert time.monotonic() < deadline and not client_gone.is_set()
        time.sleep(0.05)
    assert client_gone.wait(30)
    wait_until_free(engine_stats)


# -- concurrency -----------------------------------------------------------------------------------

def test_32_concurrent_streams_complete_with_correct_usage(server, oracle, engine_stats):
    tok = oracle["tokenizer"]
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.8,
                                                 seed=1, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(main())
    for prompt, (text, usage, finish) in zip(prompts, results):
        assert usage.completion_tokens == 8 and finish == "length" and text
        assert usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
        assert usage.total_tokens == usage.prompt_tokens + 8
    wait_until_free(engine_stats)
