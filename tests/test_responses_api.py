"""POST /v1/responses (OpenAI's Responses API) through the official openai client, over a
scripted engine: the request runs as the chat request it amounts to, and comes back as a
response object or the Responses stream's typed events; what this server does not have is a 400
naming the field. Stored responses: tests/test_response_store.py."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.scripted_engine import run

REPLY = "Yes, the sky is blue."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}


def create(**kwargs):
    return lambda client: client.responses.create(model="m", **{"input": "Is the sky blue?", **kwargs})


def streamed(**kwargs):
    async def go(client):
        stream = await client.responses.create(model="m", stream=True, **{"input": "Is the sky blue?", **kwargs})
        return [event async for event in stream]
    return go


def test_a_response_is_the_chat_reply_to_instructions_then_input(tokenizer):
    r, engine = run(tokenizer, REPLY, create(instructions="Answer briefly.", max_output_tokens=40, temperature=0.5,
                                             top_p=0.9, metadata={"team": "a"}))
    (ids, params), = engine.seen
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is the sky blue?"}]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (params.max_tokens, params.temperature, params.top_p) == (40, 0.5, 0.9)
    assert r.output_text == REPLY and r.status == "completed" and r.incomplete_details is None
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "m"
    (item,) = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", "completed",
                                                                         "output_text")
    n_out = len(tokenizer.encode(REPLY, add_special_tokens=False))
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(ids), n_out, len(ids) + n_out)
    assert r.store is True and r.metadata == {"team": "a"} and r.instructions == "Answer briefly."


def test_input_messages_and_their_content_parts(tokenizer):
    turns = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Is the sky"}, {"type": "input_text",
                                                                                          "text": "blue?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
             {"role": "user", "content": "Why?"}]
    _, engine = run(tokenizer, REPLY, create(input=turns))
    (ids, _), = engine.seen
    # SmolLM2's template names no developer role: a system message, as vLLM renders it
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Is the sky\nblue?"},
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Why?"}]
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_the_stream_is_the_responses_events_in_order(tokenizer):
    events, _ = run(tokenizer, REPLY, streamed(max_output_tokens=40))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert kinds[:4] == head and kinds[-4:] == tail and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events[4:-4]) == REPLY == events[-4].text
    done = events[-1].response
    assert done.status == "completed" and done.output_text == REPLY and done.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert len({e.item_id for e in events[3:-3]}) == 1 and events[2].item.id == events[-2].item.id


def test_a_reply_cut_at_max_output_tokens_is_incomplete(tokenizer):
    r, _ = run(tokenizer, REPLY, create(max_output_tokens=3), finish_reason="length")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    events, _ = run(tokenizer, REPLY, streamed(max_output_tokens=3), finish_reason="length")
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason \
        == "max_output_tokens"


def test_text_format_constrains_the_output_as_response_format_does(tokenizer):
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    r, engine = run(tokenizer, '{"answer": true}', create(text={"format": fmt}))
    (_, params), = engine.seen
    chat_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    _, chat = run(tokenizer, '{"answer": true}', lambda client: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Is the sky blue?"}], response_format=chat_format))
    assert params.structured_outputs is not None and params.structured_outputs == chat.seen[0][1].structured_outputs
    assert json.loads(params.structured_outputs.json) == SCHEMA
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    r, engine = run(tokenizer, "{}", create(text={"format": {"type": "json_object"}}))
    assert engine.seen[0][1].structured_outputs.json_object
    assert r.text.format.model_dump(exclude_unset=True) == {"type": "json_object"}  # no json_schema name given back


def test_an_error_while_streaming_is_an_error_event_then_response_failed(tokenizer):
    events, _ = run(tokenizer, "Yes, the sky is blue today.", streamed(), finish_reason="error",
                    stop_reason="the grammar failed")
    error, failed = events[-2:]
    assert error.type == "error" and "the grammar failed" in error.message and error.code == "invalid_grammar"
    assert failed.type == "response.failed" and failed.response.status == "failed"  # as OpenAI ends a failed stream
    assert failed.response.error.code == "invalid_grammar" and "the grammar failed" in failed.response.error.message
    assert "response.completed" not in [e.type for e in events]


@pytest.mark.parametrize("extra, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function"}]}, "tools.0.name", "Field required"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "18 C"}]}, "input",
     "No tool call found for function call output with call_id call_9"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message to answer"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning", "only its effort, and a summary of \"auto\""),
    ({"reasoning": {"effort": ""}}, "reasoning", "effort must be a string of 1 to 64 characters"),
    ({"include": ["message.output_text.tokens"]}, "include.0", "message.output_text.logprobs"),
    ({"extra_body": {"priority": 3}}, "priority", "priority scheduling is not enabled"),  # fcfs
    ({"top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs", "less than or equal to 20"),
    ({"extra_body": {"enable_response_messages": True}}, "enable_response_messages", "not supported"),
    ({"extra_body": {"previous_response": {"id": "resp_1"}}}, "previous_response", "not supported"),
    ({"extra_body": {"top_k": -5}}, "top_k", "greater than or equal to -1"),  # vLLM's extras: chat's checks
    ({"extra_body": {"vllm_xargs": {"k": 1}}}, "vllm_xargs", "not supported"),
    ({"extra_body": {"structured_outputs": {"choice": ["a"]}}, "text": {"format": {"type": "json_object"}}},
     "structured_outputs", "cannot be combined with text.format"),
    ({"extra_body": {"request_id": "has space"}}, "request_id", "should match pattern"),
    ({"extra_body": {"request_id": "a/b"}}, "request_id", "may not contain '/'"),  # GET could not find it
    ({"input": "sky " * 5000, "truncation": "auto"}, "max_output_tokens",
     'truncation "auto" without max_output_tokens keeps max_model_len'),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "not among"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": ""}, "input", "at least 1"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}}, "text.format", ""),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format", "needs its schema"),
    ({"tools": [{"type": "function", "name": "g", "parameters": {"type": "foo"}}]}, "tools.0.parameters", "foo"),
    ({"text": {"format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}}, "text.format",
     "puts json_schema's fields in text.format itself"),  # chat's shape, whose schema was ignored
    ({"tools": [{"type": "function", "name": "g", "parameters": {"type": "string"}}]}, "tools.0.parameters",
     "must be a JSON Schema of 'type: \"object\"'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference input items are not supported"),
    # an item's errors are its own type's (a function_call_output's were a message's: "type should be 'message'")
    ({"input": [{"type": "function_call_output", "output": "4"}]}, "input.0.call_id", "Field required"),
    ({"input": [{"type": "foo"}]}, "input.0", "an input item's type must be one of message, function_call, "
                                              "function_call_output, reasoning"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "'allowed_tools' is not supported"),
])
def test_what_this_server_lacks_is_a_400_naming_it(tokenizer, extra, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, REPLY, create(**extra))
    error = e.value.body
    assert error["param"] == param and says in error["message"], error


def test_nulls_take_the_defaults(tokenizer):
    """OpenAI's nullable fields, as clients that send every field send them."""
    nulls = {f: None for f in ("stream", "store", "parallel_tool_calls", "background", "truncation")}
    response, _ = run(tokenizer, REPLY, create(extra_body={**nulls, "priority": None}))
    assert response.output_text == REPLY and response.store and response.truncation == "disabled"


def test_vllms_extra_fields_reach_the_engine_as_in_chat(tokenizer):
    """vLLM's Responses extras (they were dropped unseen): sampling and stops, a constraint, the
    prefix cache's salt, and request_id naming the response."""
    extras = {"stop": ["3"], "seed": 7, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "logit_bias": {"9": 500},
              "ignore_eos": True, "skip_special_tokens": False, "include_stop_str_in_output": True,
              "structured_outputs": {"choice": ["yes", "no"]}, "cache_salt": "s", "request_id": "resp_abc"}
    r, engine = run(tokenizer, "yes", create(extra_body=extras))
    ((_, params),) = engine.seen
    assert (params.stop, params.seed, params.top_k, params.min_p, params.repetition_penalty) == (["3"], 7, 5, 0.1, 1.2)
    assert params.logit_bias == {9: 100.0} and params.ignore_eos and not params.skip_special_tokens
    assert params.include_stop_str_in_output and params.cache_salt == "s"
    assert params.structured_outputs is not None and r.id == "resp_abc"


def test_truncation_auto_drops_the_inputs_start_to_leave_room_for_the_reply(tokenizer):
    """vLLM's truncation auto: truncate_prompt_tokens -1, max_model_len (4096) less max_output_tokens."""
    r, engine = run(tokenizer, REPLY, create(input="sky " * 5000, truncation="auto", max_output_tokens=50))
    ((ids, params),) = engine.seen
    assert len(ids) == 4096 - 50 and params.max_tokens == 50 and r.truncation == "auto"


def test_priority_reaches_an_engine_scheduling_by_priority(tokenizer):
    _, engine = run(tokenizer, REPLY, create(extra_body={"priority": 2}), config={"scheduling_policy": "priority"})
    ((_, params),) = engine.seen
    assert params.priority == 2


def test_another_model_is_a_404(tokenizer):
    with pytest.raises(openai.NotFoundError):
        run(tokenizer, REPLY, lambda client: client.responses.create(model="other", input="hi"))


def _chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def test_a_function_call_is_an_output_item(tokenizer):
    r, engine = run(tokenizer, "Let me look. " + CALL, create(tools=[WEATHER]))
    _, chat = run(tokenizer, CALL, lambda client: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Is the sky blue?"}], tools=[_chat_tool(WEATHER)]))
    assert engine.seen[0][0] == chat.seen[0][0]  # the prompt the chat path renders with these tools
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Let me look."  # as chat parses it
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.tools[0].name == "get_weather" and r.status == "completed"
    only, _ = run(tokenizer, CALL, create(tools=[WEATHER]))
    assert [item.type for item in only.output] == ["function_call"]


@pytest.mark.parametrize("text", ["Let me look. " + CALL, CALL + " Done.", CALL + CALL, "Just text."])
def test_whole_and_streamed_replies_have_the_same_output_items_in_the_order_of_their_text(tokenizer, text):
    whole, _ = run(tokenizer, text, create(tools=[WEATHER]))
    events, _ = run(tokenizer, text, streamed(tools=[WEATHER]))
    shape = [(i.type, i.content[0].text if i.type == "message" else i.name) for i in whole.output]
    assert shape == [(i.type, i.content[0].text if i.type == "message" else i.name) for i in events[-1].response.output]
    assert [t for t, _ in shape] == {CALL + " Done.": ["function_call", "message"], CALL + CALL: ["function_call"] * 2,
                                     "Just text.": ["message"]}.get(text, ["message", "function_call"])


@pytest.mark.parametrize("text", [CALL + CALL, "Let me look. " + CALL + " Done."])
def test_a_streamed_output_item_is_done_before_the_next_is_added(tokenizer, text):
    """As OpenAI's streams: one open item at a time, each item's events between its added and done
    (text after a call is a message of its own)."""
    events, _ = run(tokenizer, text, streamed(tools=[WEATHER]))
    items = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    n = len(events[-1].response.output)
    assert items == [(kind, i) for i in range(n) for kind in ("response.output_item.added", "response.output_item.done")]
    for e in events:
        if hasattr(e, "output_index") and e.type != "response.output_item.added":
            added = [x for x in events[:events.index(e)] if x.type == "response.output_item.added"]
            assert e.output_index == added[-1].output_index, e.type  # the open item's
    whole, _ = run(tokenizer, text, create(tools=[WEATHER]))
    assert [(i.type, i.status) for i in whole.output] == [(i.type, i.status) for i in events[-1].response.output]
    if "Done" in text:
        assert [i.type for i in whole.output] == ["message", "function_call", "message"]
        assert [i.content[0].text for i in whole.output if i.type == "message"] == ["Let me look.", "Done."]


def test_a_streamed_function_call_comes_as_argument_deltas(tokenizer):
    events, _ = run(tokenizer, "Let me look. " + CALL, streamed(tools=[WEATHER]))
    kinds = [e.type for e in events]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["message", "function_call"] and added[1].item.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments and json.loads(done.arguments) == {"city": "Paris"}
    assert done.output_index == 1 and done.item_id == added[1].item.id
    assert kinds.index("response.function_call_arguments.done") < len(kinds) - 1
    final = events[-1].response
    assert final.status == "completed" and [i.type for i in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "Let me look." and final.output[1].arguments == done.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_calls_and_their_outputs_given_back_are_the_chats_tool_turns(tokenizer):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    _, engine = run(tokenizer, "It is sunny.", create(input=turns, tools=[WEATHER]))
    chat_turns = [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    _, chat = run(tokenizer, "It is sunny.", lambda client: client.chat.completions.create(
        model="m", messages=chat_turns, tools=[_chat_tool(WEATHER)]))
    assert engine.seen[0][0] == chat.seen[0][0]
    assert "18 C, sunny" in tokenizer.decode(engine.seen[0][0])
    # the output may come as text parts too (OpenAI's other form), joined by newlines as chat joins a
    # tool message's parts (and vLLM both)
    turns[-1]["output"] = [{"type": "input_text", "text": "18 C,"}, {"type": "input_text", "text": "sunny"}]
    _, parts = run(tokenizer, "It is sunny.", create(input=turns, tools=[WEATHER]))
    chat_turns[-1]["content"] = [{"type": "text", "text": "18 C,"}, {"type": "text", "text": "sunny"}]
    _, chat_parts = run(tokenizer, "It is sunny.", lambda client: client.chat.completions.create(
        model="m", messages=chat_turns, tools=[_chat_tool(WEATHER)]))
    assert parts.seen[0][0] == chat_parts.seen[0][0] and "18 C,\nsunny" in tokenizer.decode(parts.seen[0][0])


def test_reasoning_given_back_goes_with_the_assistant_turn_after_it(tokenizer):
    """As vLLM passes it to the template (`reasoning`, `reasoning_content`); a refusal part given
    back is read as its text."""
    from tests.test_tools import SHOWING

    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Ask the tool."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Unused."}]},
             {"role": "user", "content": "And?"},
             {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
             {"role": "user", "content": "Why?"}]
    _, engine = run(tokenizer, "x", create(input=turns), settings={"chat_template": SHOWING})
    assert tokenizer.decode(engine.seen[0][0]) == ("[user]Weather in Paris?\n[assistant]<think>Ask the tool.</think>"
                                                   "Looking.\n[user]And?\n[assistant]No.\n[user]Why?\n[assistant]")


def test_a_named_tool_choice_constrains_as_chats_does(tokenizer):
    r, engine = run(tokenizer, '{"city": "Paris"}',
                    create(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}))
    _, chat = run(tokenizer, '{"city": "Paris"}', lambda client: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Is the sky blue?"}], tools=[_chat_tool(WEATHER)],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert engine.seen[0][1].structured_outputs == chat.seen[0][1].structured_outputs is not None
    (call,) = r.output
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.tool_choice.name == "get_weather"


def test_include_output_logprobs_gives_the_replys_logprobs_whole_and_streamed(tokenizer):
    """OpenAI's `include: ["message.output_text.logprobs"]` (and `top_logprobs`): the message's
    output_text carries every output token's logprob, as chat's content does; streamed, each
    text delta carries those of the tokens since the one before, and the done event all."""
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    r, engine = run(tokenizer, REPLY, create(**asked))
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert engine.seen[0][1].logprobs == 1 and r.top_logprobs == 1
    (part,) = r.output[0].content
    assert [lp.token for lp in part.logprobs] == [tokenizer.decode([t]) for t in ids]
    assert all(lp.logprob == -0.5 and len(lp.top_logprobs) == 1 for lp in part.logprobs)
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == REPLY
    events, _ = run(tokenizer, REPLY, streamed(**asked))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    assert len(done.logprobs) == len(ids) and [lp.model_dump() for lp in final] == [lp.model_dump() for lp in done.logprobs]
    plain, engine = run(tokenizer, REPLY, create(top_logprobs=3, include=["reasoning.encrypted_content"]))
    assert engine.seen[0][1].logprobs is None and plain.output[0].content[0].logprobs == []
    assert plain.top_logprobs is None  # OpenAI's: top_logprobs counts only with the include


@pytest.mark.parametrize("stream", [False, True])
def test_the_messages_logprobs_leave_its_reasoning_out(tokenizer, stream):
    """With a reasoning parser, the message's logprobs are its own tokens', not the reasoning's
    before it (the count its usage gives as reasoning tokens), whole and streamed."""
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    go = streamed(**asked) if stream else create(**asked)
    got, _ = run(tokenizer, "The sky scatters blue light.</think>Yes, it is.", go,
                 settings={"reasoning_parser": "deepseek_r1"})
    response = got[-1].response if stream else got
    (message,) = [item for item in response.output if item.type == "message"]
    logprobs = message.content[0].logprobs
    assert b"".join(bytes(lp.bytes) for lp in logprobs).decode() == message.content[0].text == "Yes, it is."
    if stream:
        deltas = [e for e in got if e.type == "response.output_text.delta"]
        assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in logprobs]


def test_responses_logprobs_are_bounded_as_chats(tokenizer):
    """--max-logprobs bounds top_logprobs here as in chat: a 400 at once, a background one's too."""
    asked = {"include": ["message.output_text.logprobs"], "top_logprobs": 10}
    for extra in ({}, {"background": True}):
        with pytest.raises(openai.BadRequestError) as e:
            run(tokenizer, REPLY, create(**asked, **extra), config={"max_logprobs": 5})
        assert e.value.body["param"] == "top_logprobs" and "max_logprobs" in e.value.body["message"]


@pytest.mark.parametrize("extra", [{}, {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
                                   {"tools": [WEATHER]}, {"background": True}])
def test_responses_and_events_validate_as_openais_types(tokenizer, extra):
    """Strictly, as a client that validates would read them (the openai client does not): every
    field OpenAI's types require is there, whole and in every streamed event."""
    from pydantic import TypeAdapter
    from openai.types.responses import Response, ResponseStreamEvent

    async def go(client):
        body = {"model": "m", "input": "Is the sky blue?", **extra}
        whole = (await client._client.post("http://t/v1/responses", json=body)).json()
        stream = await client._client.post("http://t/v1/responses", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
        while whole["status"] in ("queued", "in_progress"):  # a background one's end, as a poll gets it
            await asyncio.sleep(0.01)
            whole = (await client._client.get(f"http://t/v1/responses/{whole['id']}")).json()
        return whole, events

    (whole, events), _ = run(tokenizer, CALL if "tools" in extra else REPLY, go)
    Response.model_validate(whole)
    kinds = [TypeAdapter(ResponseStreamEvent).validate_python(e).type for e in events]
    assert kinds[-1] == "response.completed" and whole["status"] == "completed"


def test_a_reasoning_summary_left_to_the_server_is_none(tokenizer):
    """reasoning.summary "auto" (what agents such as Codex send) is taken: no summary is made,
    the reasoning comes whole as its reasoning_text."""
    r, _ = run(tokenizer, "Blue light scatters.</think>Yes.", create(reasoning={"summary": "auto"}),
               settings={"reasoning_parser": "deepseek_r1"})
    reasoning, message = r.output
    assert reasoning.summary == [] and reasoning.content[0].text == "Blue light scatters." and r.output_text == "Yes."
