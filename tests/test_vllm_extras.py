"""Request fields beyond OpenAI's that vLLM users send, at the HTTP edge over a scripted engine:
each is either honoured (vLLM's pre-0.12 `guided_*` fields, `continue_final_message`,
`chat_template_kwargs`, `truncate_prompt_tokens`, `allowed_token_ids`, `bad_words`,
`return_tokens_as_token_ids`, chat's `echo` and `prompt_logprobs`) or refused with a 400 naming it, never ignored in a reply that
looks fine without it."""
from __future__ import annotations

import copy

import openai
import pytest

from tests.scripted_engine import run

USER = [{"role": "user", "content": "Is the sky blue?"}]
GRAMMAR = 'start: "yes" | "no"'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}


def chat(**kwargs):
    return lambda client: client.chat.completions.create(model="m", messages=kwargs.pop("messages", USER), **kwargs)


def completion(**kwargs):
    return lambda client: client.completions.create(model="m", **kwargs)


def sent(tokenizer, go):
    """(prompt ids, SamplingParams) the engine got for the request `go` makes."""
    _, engine = run(tokenizer, "yes", go)
    (seen,) = engine.seen
    return seen


def refused(tokenizer, go) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, "yes", go)
    return e.value.body


@pytest.mark.parametrize("key, value", [("json", SCHEMA), ("regex", "(yes|no)"), ("choice", ["yes", "no"]),
                                        ("grammar", GRAMMAR)])
@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_a_guided_field_constrains_as_structured_outputs_does(tokenizer, endpoint, key, value):
    _, legacy = sent(tokenizer, endpoint(extra_body={f"guided_{key}": value, "guided_decoding_backend": "xgrammar"}))
    _, current = sent(tokenizer, endpoint(extra_body={"structured_outputs": {key: value}}))
    assert legacy.structured_outputs is not None and legacy.structured_outputs == current.structured_outputs


@pytest.mark.parametrize("extra, param, says", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex", "give one constraint"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "give one constraint"),
    ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "at least 1 item"),
    ({"guided_regex": "(("}, "guided_regex", "invalid regex"),
    ({"guided_whitespace_pattern": " ", "guided_regex": "a"}, "guided_whitespace_pattern",
     "guided_whitespace_pattern applies to guided_json"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern applies to json"),
    ({"use_beam_search": True, "top_k": 5}, "top_k", "cannot be combined with use_beam_search"),
    ({"use_beam_search": True, "n": 11}, "n", "at most 10 with use_beam_search"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be positive"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "send tools"),
    ({"function_call": {"name": "f"}}, "function_call", "send tools"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "greater than max allowed: 20"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "not supported in chat"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt false"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "may not set tokenize"),
    ({"priority": 10}, "priority", "Got priority 10 but priority scheduling is not enabled"),  # fcfs
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    ({"length_penalty": 0.5}, "length_penalty", "beam search"),
    ({"logits_processors": ["m.Processor"]}, "logits_processors", "not supported"),
    ({"vllm_xargs": {"k": 1}}, "vllm_xargs", "not supported"),
    ({"mm_processor_kwargs": {"k": 1}}, "mm_processor_kwargs", "not supported"),
    ({"thinking_token_budget": 0}, "thinking_token_budget", "not supported"),
    ({"logprob_token_ids": [5]}, "logprob_token_ids", "not supported"),
    ({"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection", "not supported"),
    ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens", "greater than max_model_len (4096)"),
    ({"request_id": "has space"}, "request_id", "should match pattern"),
    ({"cache_salt": ""}, "cache_salt", "at least 1 character"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),  # OpenAI fields a text model cannot honour
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "not supported"),
])
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(tokenizer, extra, param, says):
    error = refused(tokenizer, chat(extra_body=extra))
    assert error["param"] == param and says in error["message"], error


def test_the_same_fields_at_their_defaults_are_accepted(tokenizer):
    defaults = {"use_beam_search": False, "bad_words": [], "functions": [], "function_call": "auto", "echo": False,
                "guided_decoding_backend": "x", "priority": 0, "length_penalty": 1.0, "modalities": ["text"],
                "audio": None, "prediction": None, "web_search_options": None}
    _, params = sent(tokenizer, chat(extra_body=defaults))
    assert params.structured_outputs is None


@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_priority_reaches_an_engine_scheduling_by_priority(tokenizer, endpoint):
    """vLLM's `priority` extra under --scheduling-policy priority (the engine says which in its info)."""
    _, engine = run(tokenizer, "yes", endpoint(extra_body={"priority": -4}), config={"scheduling_policy": "priority"})
    ((_, params),) = engine.seen
    assert params.priority == -4


@pytest.mark.parametrize("endpoint, nulls", [
    (chat, ["stream", "n", "logprobs", "presence_penalty", "frequency_penalty", "parallel_tool_calls"]),
    (lambda **kw: completion(prompt="Is the sky blue?", **kw),
     ["stream", "n", "echo", "presence_penalty", "frequency_penalty", "return_tokens_as_token_ids"])])
def test_null_is_the_default_where_openai_allows_null(tokenizer, endpoint, nulls):
    """A client that sends every field, unset ones as null (OpenAI's "boolean or null"; vLLM's Optional)."""
    _, params = sent(tokenizer, endpoint(extra_body=dict.fromkeys(nulls)))
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.logprobs) == (1, 0.0, 0.0, None)


def test_continue_final_message_renders_the_last_message_open(tokenizer):
    messages = USER + [{"role": "assistant", "content": "The sky is"}]
    ids, _ = sent(tokenizer, chat(messages=messages, extra_body={"continue_final_message": True,
                                                                 "add_generation_prompt": False}))
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe sky is")  # no end of turn, no new turn

    async def tokenize(client):  # /tokenize renders it the same way (openai's client has no call for it)
        r = await client._client.post("http://t/tokenize", json={
            "messages": messages, "continue_final_message": True, "add_generation_prompt": False})
        return r.json()["tokens"]

    assert run(tokenizer, "yes", tokenize)[0] == ids


def test_a_role_beyond_openais_reaches_the_template_as_vllm_passes_it(tokenizer):
    """Llama 3's `ipython` tool turns and other template roles (vLLM's custom roles); a role the
    template rejects is its 400."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'ipython'] %}"
                         "{{ raise_exception('no role ' + m['role']) }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
                         "{% endfor %}")
    turns = USER + [{"role": "ipython", "content": "42"}]
    ids, _ = sent(tok, chat(messages=turns))
    assert tok.decode(ids) == "[user]Is the sky blue?[ipython]42"
    error = refused(tok, chat(messages=USER + [{"role": "robot", "content": "x"}]))
    assert error["param"] == "messages" and "no role robot" in error["message"]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail | default('') }}"
    ids, _ = sent(tok, chat(extra_body={"chat_template_kwargs": {"tail": " Answer:"}}))
    assert tok.decode(ids) == "Is the sky blue? Answer:"
    ids, _ = sent(tok, chat())
    assert tok.decode(ids) == "Is the sky blue?"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tokenizer):
    prompt = list(range(100, 120))
    ids, _ = sent(tokenizer, completion(prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}))
    assert ids == prompt[-5:]
    ids, _ = sent(tokenizer, completion(prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": -1}))
    assert ids == prompt  # -1: up to max_model_len, which this prompt is under
    full, _ = sent(tokenizer, chat())
    ids, _ = sent(tokenizer, chat(extra_body={"truncate_prompt_tokens": 3}))
    assert ids == full[-3:]


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(tokenizer):
    """vLLM's: -1 keeps max_model_len - max_tokens tokens (4096 here), so that a long prompt fits
    with its reply; truncation_side "right" keeps the first tokens instead."""
    prompt = list(range(100, 4300))
    ids, params = sent(tokenizer, completion(prompt=prompt, max_tokens=20, extra_body={"truncate_prompt_tokens": -1}))
    assert ids == prompt[-(4096 - 20):] and params.max_tokens == 20
    ids, _ = sent(tokenizer, chat(messages=[{"role": "user", "content": "sky " * 5000}], max_completion_tokens=30,
                                  extra_body={"truncate_prompt_tokens": -1}))
    assert len(ids) == 4096 - 30
    ids, _ = sent(tokenizer, completion(prompt=prompt[:50], max_tokens=2,
                                        extra_body={"truncate_prompt_tokens": 5, "truncation_side": "right"}))
    assert ids == prompt[:5]
    error = refused(tokenizer, chat(messages=[{"role": "user", "content": "sky " * 5000}],
                                    extra_body={"truncate_prompt_tokens": -1}))
    assert error["param"] == "max_tokens" and "give max_tokens" in error["message"]  # vLLM's -1 keeps 4096 then


def test_empty_stream_options_and_streamed_prompt_logprobs_0_ask_nothing_as_in_vllm(tokenizer):
    _, params = sent(tokenizer, chat(extra_body={"stream_options": {}}))
    assert params.output_kind.name == "FINAL_ONLY"

    async def go(client):
        stream = await client.chat.completions.create(model="m", messages=USER, stream=True,
                                                      extra_body={"prompt_logprobs": 0})
        return [c async for c in stream]
    _, engine = run(tokenizer, "yes", go)
    assert engine.seen[0][1].prompt_logprobs is None
    assert refused(tokenizer, chat(extra_body={"stream_options": {"include_usage": False}}))["param"] == \
        "stream_options"


def test_a_null_completions_max_tokens_is_16_and_chat_top_logprobs_0_asks_nothing(tokenizer):
    """As vLLM: completions' max_tokens null is its default (not the model's whole room), and
    top_logprobs 0, vLLM's own default, needs no logprobs."""
    _, params = sent(tokenizer, completion(prompt="Is the sky blue?", extra_body={"max_tokens": None}))
    assert params.max_tokens == 16
    _, params = sent(tokenizer, chat(logprobs=False, top_logprobs=0))
    assert params.logprobs is None
    assert refused(tokenizer, chat(logprobs=False, top_logprobs=2))["param"] == "top_logprobs"
    sent(tokenizer, chat(extra_body={"thinking_token_budget": -1}))  # vLLM's "no budget"


def test_an_echoed_truncated_prompt_is_the_text_that_was_kept(tokenizer):
    text = "one two three four five six seven eight"
    kept = tokenizer.encode(text, add_special_tokens=False)[-3:]
    r, _ = run(tokenizer, "yes", completion(prompt=text, max_tokens=1, echo=True,
                                            extra_body={"truncate_prompt_tokens": 3}))
    assert r.choices[0].text == tokenizer.decode(kept) + "yes"


def test_a_text_prompt_gets_the_tokenizers_bos_as_vllm_gives_it(bos_tokenizer):
    """Completions add special tokens unless told not to (vLLM's default); chat does not, since
    the template writes them; /tokenize does as the endpoint it mirrors."""
    plain = bos_tokenizer.encode("Is the sky blue?", add_special_tokens=False)
    ids, _ = sent(bos_tokenizer, completion(prompt="Is the sky blue?", max_tokens=2))
    assert ids == [0] + plain
    ids, _ = sent(bos_tokenizer, completion(prompt="Is the sky blue?", max_tokens=2,
                                            extra_body={"add_special_tokens": False}))
    assert ids == plain
    ids, _ = sent(bos_tokenizer, completion(prompt=plain, max_tokens=2))
    assert ids == plain  # token ids are taken as given
    template = bos_tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    ids, _ = sent(bos_tokenizer, chat())
    assert ids == bos_tokenizer.encode(template, add_special_tokens=False)
    ids, _ = sent(bos_tokenizer, chat(extra_body={"add_special_tokens": True}))
    assert ids == bos_tokenizer.encode(template, add_special_tokens=True) and ids[0] == 0

    async def tokenize(client):
        counts = []
        for body in ({"prompt": "Is the sky blue?"}, {"prompt": "Is the sky blue?", "add_special_tokens": False},
                     {"messages": USER}):
            counts.append(len((await client._client.post("http://t/tokenize", json=body)).json()["tokens"]))
        return counts

    assert run(bos_tokenizer, "yes", tokenize)[0] == [len(plain) + 1, len(plain), len(ids) - 1]


def test_the_engine_encodes_a_text_prompt_with_its_special_tokens(bos_tokenizer):
    from engine.llm_engine import LLMEngine

    engine = object.__new__(LLMEngine)  # tokenize reads the tokenizer only
    engine.tokenizer = bos_tokenizer
    assert engine.tokenize("Is the sky blue?") == ("Is the sky blue?", bos_tokenizer.encode("Is the sky blue?"))
    assert engine.tokenize([5, 6]) == (None, [5, 6])


def test_completions_take_response_format_as_vllm_does(tokenizer):
    strict = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    _, params = sent(tokenizer, completion(prompt="JSON:", max_tokens=8, extra_body={"response_format": strict}))
    _, chat_params = sent(tokenizer, chat(response_format=strict))
    assert params.structured_outputs is not None and params.structured_outputs == chat_params.structured_outputs
    text = {"response_format": {"type": "text"}}
    _, params = sent(tokenizer, completion(prompt="JSON:", max_tokens=8, extra_body=text))
    assert params.structured_outputs is None
    error = refused(tokenizer, completion(prompt="JSON:", max_tokens=8, extra_body={
        "response_format": {"type": "json_object"}, "guided_regex": "a"}))
    assert error["param"] == "response_format" and "give one of them" in error["message"]


@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(tokenizer, endpoint):
    script = "Yes, the sky is blue on a clear day."

    def stream(**options):
        async def go(client):
            return [c async for c in await endpoint(stream=True, max_tokens=50, stream_options=options)(client)]
        return run(tokenizer, script, go, cached=2)[0]  # 2 prompt tokens from the prefix cache

    chunks = stream(include_usage=True, continuous_usage_stats=True)
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    assert all(u.prompt_tokens_details.cached_tokens == 2 for u in usages)  # the first chunk's too
    done = [u.completion_tokens for u in usages]
    assert done == sorted(done) and done[-1] == len(tokenizer.encode(script)) and done[0] < done[-1]
    assert len({u.prompt_tokens for u in usages}) == 1
    assert chunks[-1].choices == [] and usages[-1] == usages[-2]  # the usage chunk repeats the last count
    plain = stream(include_usage=True)
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage == usages[-1]
    assert all(c.usage is None for c in stream(continuous_usage_stats=True))  # needs include_usage, as vLLM


@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_continuous_usage_stats_count_each_choices_own_tokens(tokenizer, endpoint):
    """n=2: a chunk's usage is its choice's so far (vLLM's); the last chunk has both together."""
    script = "Yes, the sky is blue on a clear day."
    length = len(tokenizer.encode(script))

    async def go(client):
        return [c async for c in await endpoint(stream=True, max_tokens=50, n=2, stream_options={
            "include_usage": True, "continuous_usage_stats": True})(client)]
    chunks = run(tokenizer, script, go)[0]
    for i in (0, 1):
        done = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == i]
        assert done == sorted(done) and done[-1] == length
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * length


@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_allowed_token_ids_and_bad_words_reach_the_engine(tokenizer, endpoint):
    _, params = sent(tokenizer, endpoint(extra_body={"allowed_token_ids": [5, 9], "bad_words": ["sky", "blue"]}))
    assert params.allowed_token_ids == [5, 9] and params.bad_words == ["sky", "blue"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tokenizer):
    ids = tokenizer.encode("yes", add_special_tokens=False)
    named = [f"token_id:{t}" for t in ids]
    r, _ = run(tokenizer, "yes", chat(logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True}))
    assert [c.token for c in r.choices[0].logprobs.content] == named
    assert b"".join(bytes(c.bytes) for c in r.choices[0].logprobs.content) == b"yes"  # the tokens' own bytes
    r, _ = run(tokenizer, "yes", completion(prompt="Is the sky blue?", max_tokens=2, logprobs=2,
                                            extra_body={"return_tokens_as_token_ids": True}))
    assert r.choices[0].logprobs.tokens == named and "token_id:7" in r.choices[0].logprobs.top_logprobs[0]

    async def streamed(client):
        stream = await chat(logprobs=True, stream=True, extra_body={"return_tokens_as_token_ids": True})(client)
        return [t.token async for c in stream if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]

    assert run(tokenizer, "yes", streamed)[0] == named
    # prompt_logprobs' decoded_token stays the token's text (vLLM renames only the logprobs' tokens)
    for endpoint, where in ((chat, lambda r: r), (lambda **kw: completion(prompt="Sky?", max_tokens=2, logprobs=1, **kw),
                                                  lambda r: r.choices[0])):  # a completion's, per choice
        r, _ = run(tokenizer, "yes", endpoint(extra_body={"return_tokens_as_token_ids": True, "prompt_logprobs": 1}))
        decoded = {e["decoded_token"] for pos in where(r).model_extra["prompt_logprobs"] if pos for e in pos.values()}
        assert decoded and not any(d.startswith("token_id:") for d in decoded), decoded
    r, _ = run(tokenizer, "yes", chat(logprobs=True))
    assert [c.token for c in r.choices[0].logprobs.content] == [tokenizer.decode([t]) for t in ids]


def test_a_completion_suffix_is_a_400_naming_it(tokenizer):
    error = refused(tokenizer, completion(prompt="def f(", suffix="return x", max_tokens=4))
    assert error["param"] == "suffix" and "not supported" in error["message"], error


STARTED = USER + [{"role": "assistant", "content": "The sky"}]
GO_ON = {"add_generation_prompt": False, "continue_final_message": True}


def _content(chunks) -> dict[int, str]:
    out = {}
    for chunk in chunks:
        for c in chunk.choices:
            out[c.index] = out.get(c.index, "") + (c.delta.content or "")
    return out


@pytest.mark.parametrize("messages, options, head, role", [
    (STARTED, GO_ON, "The sky", "assistant"),  # the last message is the reply's own start
    (USER, {}, "", "assistant"),  # a new assistant turn: the user's message is not the reply's
    (USER, {"add_generation_prompt": False}, "Is the sky blue?", "user"),  # no new turn: the reply is the user's
])
def test_chat_echo_puts_the_last_message_before_the_reply_as_vllm_does(tokenizer, messages, options, head, role):
    body = {**options, "echo": True}
    whole, _ = run(tokenizer, " is blue.", chat(messages=messages, n=2, extra_body=body))
    assert [(c.message.role, c.message.content) for c in whole.choices] == [(role, head + " is blue.")] * 2

    async def streamed(client):
        stream = await client.chat.completions.create(model="m", messages=messages, n=2, stream=True, extra_body=body)
        return [chunk async for chunk in stream]

    chunks, _ = run(tokenizer, " is blue.", streamed)
    assert _content(chunks) == {0: head + " is blue.", 1: head + " is blue."}
    assert {c.choices[0].delta.role for c in chunks[:2]} == {role}
    plain, _ = run(tokenizer, " is blue.", chat(messages=messages, extra_body=options))
    assert plain.choices[0].message.content == " is blue."


@pytest.mark.parametrize("go, param", [
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (completion(prompt="x", logprobs=21), "logprobs"),
    (completion(prompt="x", extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),  # the whole vocabulary
])
def test_the_engines_max_logprobs_bounds_each_logprob_field_naming_it(tokenizer, go, param):
    error = refused(tokenizer, go)
    assert error["param"] == param and f"({param}), which is greater than max allowed: 20" in error["message"], error


def test_max_logprobs_lets_more_through_and_minus_one_asks_the_whole_vocabulary(tokenizer):
    reply, engine = run(tokenizer, "yes", chat(logprobs=True, top_logprobs=-1), config={"max_logprobs": -1})
    assert engine.seen[0][1].logprobs == len(tokenizer)  # the scripted engine's vocabulary
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2  # all it scored: the token, the runner-up
    _, engine = run(tokenizer, "yes", completion(prompt="x", logprobs=25, extra_body={"prompt_logprobs": 30}),
                    config={"max_logprobs": 30})
    assert (engine.seen[0][1].logprobs, engine.seen[0][1].prompt_logprobs) == (25, 30)
    with pytest.raises(openai.BadRequestError) as e:  # a beam round asks 2 logprobs per beam
        run(tokenizer, "yes", completion(prompt="x", n=3, extra_body={"use_beam_search": True}),
            config={"max_logprobs": 4})
    assert e.value.body["param"] == "n" and "asks 6 logprobs per beam round" in e.value.body["message"]


def test_response_role_names_a_new_turns_reply_as_vllm_does(tokenizer):
    bot = {"response_role": "bot"}
    whole, _ = run(tokenizer, " is blue.", chat(n=2), settings=bot)
    assert [c.message.role for c in whole.choices] == ["bot", "bot"]

    async def streamed(client):
        stream = await client.chat.completions.create(model="m", messages=STARTED, stream=True,
                                                      extra_body={**GO_ON, "echo": True})
        return [chunk async for chunk in stream]

    # No new turn: the last message's role, whatever the server's; its text is echoed as the reply's
    chunks, _ = run(tokenizer, " is blue.", streamed, settings=bot)
    assert chunks[0].choices[0].delta.role == "assistant" and _content(chunks) == {0: "The sky is blue."}


def test_chat_prompt_logprobs_come_with_the_reply(tokenizer):
    ids, params = sent(tokenizer, chat(extra_body={"prompt_logprobs": 3}))
    assert params.prompt_logprobs == 3
    r, _ = run(tokenizer, "yes", chat(extra_body={"prompt_logprobs": 3}))
    scored = r.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    assert [list(e) for e in scored[1:]] == [[str(t)] for t in ids[1:]]
    assert scored[1][str(ids[1])] == {"logprob": -1.0, "rank": 1, "decoded_token": tokenizer.decode([ids[1]])}
    assert "prompt_logprobs" not in run(tokenizer, "yes", chat())[0].model_extra
    error = refused(tokenizer, chat(stream=True, extra_body={"prompt_logprobs": 1}))
    assert error["param"] == "prompt_logprobs" and "stream" in error["message"], error


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 10**6]}, "prompt"), ({"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias"),
    ({"prompt": "hi", "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [5, 999999]}, "allowed_token_ids"),
])
def test_token_ids_the_model_lacks_are_refused_before_any_replica_sees_them(tokenizer, body, param):
    async def go(client):
        try:
            await client.completions.create(model="m", max_tokens=2, prompt=body.pop("prompt"), extra_body=body)
        except openai.BadRequestError as e:
            return e.body

    error, engine = run(tokenizer, "ok", go)
    assert error["param"] == param and f"[0, {len(tokenizer)})" in error["message"], error
    assert engine.seen == []  # an engine replica would log the refusal as a failed request


@pytest.mark.parametrize("prompt, param", [([-1], "prompt.0"), ([5, -2], "prompt.1"), ([[5], [-3]], "prompt.1.0")])
def test_a_negative_prompt_token_id_is_said_as_one(tokenizer, prompt, param):
    """Not "Input should be a valid string", which the prompt's first union member would say."""
    error = refused(tokenizer, completion(prompt=prompt))
    assert error["param"] == param and "greater than or equal to 0" in error["message"], error


@pytest.mark.parametrize("max_tokens", [200, None])  # None (chat): up to max_model_len (4096)
def test_a_request_the_kv_cache_could_never_hold_is_refused_before_any_replica_sees_it(tokenizer, max_tokens):
    async def go(client):
        try:
            if max_tokens is None:
                await client.chat.completions.create(model="m", messages=USER)
            else:
                await client.completions.create(model="m", prompt="hi", max_tokens=max_tokens)
        except openai.BadRequestError as e:
            return e.body

    error, engine = run(tokenizer, "ok", go, num_blocks=8)  # 8 blocks of 16: 128 tokens
    assert error["param"] == "max_tokens" and "The KV cache holds 128 tokens" in error["message"], error
    # a client that sent no max_tokens is told so, and to set one
    said = "to max_model_len (no max_tokens given)" if max_tokens is None else "+ 200 max_tokens need"
    assert said in error["message"] and error["message"].endswith(("Set" if max_tokens is None else "Lower")
                                                                   + " max_tokens."), error
    assert engine.seen == []  # an engine replica would log the refusal as a failed request
    ok, _ = run(tokenizer, "ok", lambda c: c.completions.create(model="m", prompt="hi", max_tokens=100), num_blocks=8)
    assert ok.choices[0].text == "ok"  # one that fits still runs


def test_a_prompt_the_kv_cache_could_never_hold_is_told_to_be_shorter(tokenizer):
    """Lowering max_tokens cannot help a prompt that alone is more than the cache: the error names the prompt."""
    async def go(client):
        try:
            await client.completions.create(model="m", prompt=[5] * 200, max_tokens=5)
        except openai.BadRequestError as e:
            return e.body

    error, engine = run(tokenizer, "ok", go, num_blocks=8)  # 8 blocks of 16: 128 tokens
    assert error["param"] == "prompt" and error["message"] == (
        "The KV cache holds 128 tokens, but the prompt has 200: this request could never be scheduled. "
        "Shorten the prompt."), error
    assert engine.seen == []


def test_chat_logprob_bytes_are_each_tokens_own_and_rebuild_characters_split_across_tokens(tokenizer):
    script = "😀你好 ok"
    ids = tokenizer.encode(script, add_special_tokens=False)
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # some tokens hold part of a character

    def joined(content) -> bytes:
        return b"".join(bytes(c.bytes) for c in content)

    r, _ = run(tokenizer, script, chat(logprobs=True, top_logprobs=2))
    content = r.choices[0].logprobs.content
    assert joined(content) == script.encode()
    runner_up = content[0].top_logprobs[1]  # token 7, as the scripted engine ranks it
    assert bytes(runner_up.bytes).decode() == tokenizer.decode([7])

    async def streamed(client):
        stream = await chat(logprobs=True, top_logprobs=2, stream=True)(client)
        return [t async for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]

    assert joined(run(tokenizer, script, streamed)[0]) == script.encode()


@pytest.mark.parametrize("endpoint", [chat, lambda **kw: completion(prompt="Is the sky blue?", **kw)])
def test_cache_salt_reaches_the_engine(tokenizer, endpoint):
    _, params = sent(tokenizer, endpoint(extra_body={"cache_salt": "tenant-a"}))
    assert params.cache_salt == "tenant-a"
    assert sent(tokenizer, endpoint())[1].cache_salt is None


def test_a_client_request_id_names_the_reply_and_the_engine_ids_stay_unique(tokenizer):
    async def go(client):
        by_header = await chat(extra_headers={"X-Request-Id": "abc-1"})(client)
        # the body's id first: behind Serve's proxy every request has the header (the proxy's id)
        by_body = await completion(prompt="hi", extra_headers={"X-Request-Id": "proxy-1"},
                                   extra_body={"request_id": "body-1"})(client)
        again = await completion(prompt="hi", extra_body={"request_id": "body-1"})(client)
        unfit = await chat(extra_headers={"X-Request-Id": "a b"})(client)  # not an id: the server makes one
        return by_header.id, by_body.id, again.id, unfit.id

    (by_header, by_body, again, unfit), engine = run(tokenizer, "yes", go)
    assert (by_header, by_body, again) == ("chatcmpl-abc-1", "cmpl-body-1", "cmpl-body-1")
    assert unfit.startswith("chatcmpl-") and " " not in unfit
    assert len(set(engine.request_ids)) == 4  # two replies named alike are two engine requests all the same


def test_return_token_ids_gives_the_prompt_and_each_choices_ids_as_vllm_does(tokenizer):
    reply = tokenizer.encode("Yes, the sky is blue.", add_special_tokens=False)

    async def go(client):
        whole = await completion(prompt=[5, 6, 7], n=2, extra_body={"return_token_ids": True})(client)
        stream = await completion(prompt=[5, 6, 7], stream=True, extra_body={"return_token_ids": True})(client)
        chunks = [c async for c in stream]
        chat_whole = await chat(extra_body={"return_token_ids": True})(client)
        chat_stream = [c async for c in await chat(stream=True, extra_body={"return_token_ids": True})(client)]
        plain = await chat()(client)
        return whole, chunks, chat_whole, chat_stream, plain

    (whole, chunks, chat_whole, chat_stream, plain), engine = run(tokenizer, "Yes, the sky is blue.", go)
    for c in whole.choices:
        assert c.prompt_token_ids == [5, 6, 7] and c.token_ids == reply
    assert chunks[0].choices[0].prompt_token_ids == [5, 6, 7]
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks), []) == reply
    chat_prompt = engine.seen[2][0]
    assert chat_whole.prompt_token_ids == chat_prompt and chat_whole.choices[0].token_ids == reply
    assert chat_stream[0].prompt_token_ids == chat_prompt
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chat_stream[1:])
    assert sum((getattr(c.choices[0], "token_ids", None) or [] for c in chat_stream if c.choices), []) == reply
    assert getattr(plain, "prompt_token_ids", None) is None and getattr(plain.choices[0], "token_ids", None) is None


def test_documents_reach_the_chat_template(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for d in documents or [] %}[{{ d['title'] }}] {% endfor %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ids, _ = sent(tok, chat(extra_body={"documents": [{"title": "Sky", "text": "It is blue."}]}))
    assert tok.decode(ids) == "[Sky] Is the sky blue?"


def test_tokenize_renders_tools_as_chat_does(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    ids, _ = sent(tokenizer, chat(tools=tools))

    async def tokenize(client):
        r = await client._client.post("http://t/tokenize", json={"messages": USER, "tools": tools})
        return r.json()

    out = run(tokenizer, "yes", tokenize)[0]
    assert out["tokens"] == ids and out["count"] == len(ids) > len(sent(tokenizer, chat())[0])


def test_the_servers_chat_template_replaces_the_tokenizers(tokenizer):
    """--chat-template (RouterSettings.chat_template): chat and /tokenize render with it."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    settings = {"chat_template": template}

    async def go(client):
        await chat()(client)
        return (await client._client.post("http://t/tokenize", json={"messages": USER})).json()["tokens"]

    tokens, engine = run(tokenizer, "yes", go, settings=settings)
    assert tokenizer.decode(engine.seen[0][0]) == "<user>Is the sky blue?" and tokens == engine.seen[0][0]
    assert tokenizer.chat_template != template  # the shared tokenizer is left as it was


PARTS_TEMPLATE = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"


@pytest.mark.parametrize("content_format, rendered", [("auto", "[Is the sky blue?]"), ("openai", "[Is the sky blue?]"),
                                                     ("string", "[]" * len("Is the sky blue?"))])
def test_a_template_that_loops_over_content_parts_gets_them(tokenizer, content_format, rendered):
    """vLLM's --chat-template-content-format: auto gives a template that loops over a message's
    content a list of text parts (the message's text as one part); string gives it the text, whose
    characters have no 'text' (vLLM's string format renders the same empty parts)."""
    settings = {"chat_template": PARTS_TEMPLATE, "chat_template_content_format": content_format}
    _, engine = run(tokenizer, "yes", chat(), settings=settings)
    (ids, _), = engine.seen
    assert tokenizer.decode(ids) == rendered


@pytest.mark.parametrize("extra", [{"guided_json": SCHEMA, "guided_whitespace_pattern": "[ ]?"},
                                   {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?",
                                                           "disable_any_whitespace": False, "disable_fallback": True}}])
def test_a_json_constraint_takes_vllm_s_whitespace_pattern(tokenizer, extra):
    _, params = sent(tokenizer, chat(extra_body=extra))
    assert params.structured_outputs.whitespace_pattern == "[ ]?" and params.structured_outputs.kind == "json"


def test_sagemakers_invocations_route_is_chat_or_completions_by_the_bodys_fields(tokenizer):
    """vLLM's POST /invocations: a body with messages is a chat request, one with a prompt a
    completion request (each validated as such), anything else a 400; the API key holds there too."""
    async def go(client):
        post = client._client.post
        keyed = {"Authorization": "Bearer k"}
        as_chat = await post("http://t/invocations", json={"messages": USER, "max_tokens": 5}, headers=keyed)
        as_completion = await post("http://t/invocations", json={"prompt": "Is the sky", "max_tokens": 5},
                                   headers=keyed)
        streamed = await post("http://t/invocations", json={"prompt": "Is", "stream": True}, headers=keyed)
        bad = [await post("http://t/invocations", json=body, headers=keyed)
               for body in ({"input": "hi"}, [1], {"messages": USER, "n": 0})]
        unkeyed = await post("http://t/invocations", json={"prompt": "Is"})
        return as_chat, as_completion, streamed, bad, unkeyed

    (as_chat, as_completion, streamed, bad, unkeyed), engine = run(tokenizer, "yes", go, settings={"api_key": "k"})
    assert as_chat.json()["object"] == "chat.completion" and as_chat.json()["choices"][0]["message"]["content"] == "yes"
    assert as_completion.json()["object"] == "text_completion" and as_completion.json()["choices"][0]["text"] == "yes"
    assert streamed.text.endswith("data: [DONE]\n\n")
    chat_prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert [tokenizer.decode(ids) for ids, _ in engine.seen[:2]] == [chat_prompt, "Is the sky"]
    assert [r.status_code for r in bad] == [400, 400, 400] and "Cannot find suitable handler" in bad[0].json()[
        "error"]["message"]
    assert bad[2].json()["error"]["param"] == "n" and unkeyed.status_code == 401


def test_reasoning_effort_reaches_a_template_that_reads_it(tokenizer):
    """OpenAI's reasoning_effort (and Responses' reasoning.effort) is the chat template's variable,
    as vLLM passes it; a template that reads none (SmolLM2's) renders as without it, as vLLM's."""
    template = ("{% if reasoning_effort %}effort={{ reasoning_effort }}\n{% endif %}"
                "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    settings = {"chat_template": template}
    _, effort = run(tokenizer, "yes", chat(reasoning_effort="low"), settings=settings)
    _, plain = run(tokenizer, "yes", chat(), settings=settings)
    reply, responses = run(tokenizer, "yes", lambda client: client.responses.create(
        model="m", input="Is the sky blue?", reasoning={"effort": "high"}), settings=settings)
    assert tokenizer.decode(effort.seen[0][0]) == "effort=low\nuser: Is the sky blue?\n"
    assert tokenizer.decode(plain.seen[0][0]) == "user: Is the sky blue?\n"
    assert tokenizer.decode(responses.seen[0][0]) == "effort=high\nuser: Is the sky blue?\n"
    assert reply.reasoning.effort == "high"  # echoed, as OpenAI's response object does
    _, ignored = run(tokenizer, "yes", chat(reasoning_effort="low"))
    _, plain = run(tokenizer, "yes", chat())
    assert ignored.seen[0][0] == plain.seen[0][0]
