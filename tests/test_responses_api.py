"""POST /v1/responses (OpenAI's Responses API) through the official openai client, over a
scripted engine: the request runs as the chat request it amounts to, and comes back as a
response object or the Responses stream's typed events; what this server does not have is a 400
naming the field."""
from __future__ import annotations

import json

import openai
import pytest

from tests.scripted_engine import run

REPLY = "Yes, the sky is blue."
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
    assert r.store is False and r.metadata == {"team": "a"} and r.instructions == "Answer briefly."


def test_input_messages_and_their_content_parts(tokenizer):
    turns = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Is the sky"}, {"type": "input_text",
                                                                                          "text": "blue?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
             {"role": "user", "content": "Why?"}]
    _, engine = run(tokenizer, REPLY, create(input=turns))
    (ids, _), = engine.seen
    chat = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Is the sky\nblue?"},
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
    _, engine = run(tokenizer, "{}", create(text={"format": {"type": "json_object"}}))
    assert engine.seen[0][1].structured_outputs.json_object


def test_an_error_while_streaming_is_an_error_event(tokenizer):
    events, _ = run(tokenizer, "Yes, the sky is blue today.", streamed(), finish_reason="error",
                    stop_reason="the grammar failed")
    assert events[-1].type == "error" and "the grammar failed" in events[-1].message
    assert events[-1].code == "invalid_grammar"
    assert "response.completed" not in [e.type for e in events]


@pytest.mark.parametrize("extra, param, says", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "not supported in /v1/responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
    ({"background": True}, "background", "foreground only"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": ""}, "input", "at least 1"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "strin"}}}}, "text.format", ""),
])
def test_what_this_server_lacks_is_a_400_naming_it(tokenizer, extra, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, REPLY, create(**extra))
    error = e.value.body
    assert error["param"] == param and says in error["message"], error


def test_another_model_is_a_404(tokenizer):
    with pytest.raises(openai.NotFoundError):
        run(tokenizer, REPLY, lambda client: client.responses.create(model="other", input="hi"))
