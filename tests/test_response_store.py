"""Stored responses (router.response_store): `previous_response_id` continues a conversation,
and `GET` / `DELETE /v1/responses/{id}` and `GET .../input_items` work through the official
openai client, over a scripted engine (tests.scripted_engine)."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from router.response_store import ResponseStore
from tests.scripted_engine import run

REPLY = "Yes, the sky is blue."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _prompt(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_previous_response_id_continues_the_conversation_without_its_instructions(tokenizer):
    async def go(client):
        first = await client.responses.create(model="m", instructions="Answer briefly.", input="Is the sky blue?")
        second = await client.responses.create(model="m", previous_response_id=first.id, input="Why?")
        third = await client.responses.create(model="m", previous_response_id=second.id, instructions="Be terse.",
                                              input=[{"role": "user", "content": "And at night?"}])
        return first, second, third

    (first, second, third), engine = run(tokenizer, REPLY, go)
    turns = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": REPLY},
             {"role": "user", "content": "Why?"}]
    assert tokenizer.decode(engine.seen[1][0]) == _prompt(tokenizer, turns)  # instructions do not carry over
    turns += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "And at night?"}]
    assert tokenizer.decode(engine.seen[2][0]) == _prompt(tokenizer, [{"role": "system", "content": "Be terse."},
                                                                      *turns])
    assert first.store and first.previous_response_id is None
    assert second.previous_response_id == first.id and third.previous_response_id == second.id


def test_a_streamed_response_is_stored_before_its_last_event(tokenizer):
    async def go(client):
        stream = await client.responses.create(model="m", input="Is the sky blue?", stream=True)
        async for event in stream:
            if event.type == "response.completed":  # a follow-up sent on this event finds it
                follow = await client.responses.create(model="m", previous_response_id=event.response.id,
                                                       input="Why?")
                got = await client.responses.retrieve(event.response.id)
                return event.response, follow, got

    (done, follow, got), engine = run(tokenizer, REPLY, go)
    assert done.store and got.model_dump() == done.model_dump()
    assert follow.status == "completed" and REPLY in tokenizer.decode(engine.seen[1][0])


def test_a_function_call_and_its_output_given_after_it_are_the_chats_tool_turns(tokenizer):
    async def go(client):
        first = await client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER])
        (call,) = first.output
        await client.responses.create(model="m", previous_response_id=first.id, tools=[WEATHER], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
        return call

    call, engine = run(tokenizer, CALL, go)
    assert call.type == "function_call"
    chat_turns = [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": "get_weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    _, chat = run(tokenizer, "It is sunny.", lambda client: client.chat.completions.create(
        model="m", messages=chat_turns, tools=[chat_tool]))
    assert engine.seen[1][0] == chat.seen[0][0]


def test_a_stored_response_is_retrieved_listed_and_deleted(tokenizer):
    turns = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Is the sky blue?"}]}]

    async def go(client):
        r = await client.responses.create(model="m", input=turns, metadata={"k": "v"})
        got = await client.responses.retrieve(r.id)
        newest_first = [item async for item in client.responses.input_items.list(r.id)]
        oldest_first = await client.responses.input_items.list(r.id, order="asc", limit=1)
        after = await client.responses.input_items.list(r.id, order="asc", after=oldest_first.data[0].id)
        await client.responses.delete(r.id)
        errors = []
        for call in (client.responses.retrieve(r.id), client.responses.delete(r.id),
                     client.responses.create(model="m", previous_response_id=r.id, input="Why?")):
            try:
                await call
            except openai.APIStatusError as e:
                errors.append((e.status_code, e.body))
        return r, got, newest_first, oldest_first, after, errors

    r, got, newest_first, oldest_first, after, errors = run(tokenizer, REPLY, go)[0]
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    assert [(i.type, i.role, i.content[0].text) for i in newest_first] == [
        ("message", "user", "Is the sky blue?"), ("message", "developer", "Be terse.")]
    assert all(i.id.startswith("msg_") for i in newest_first)
    assert [i.role for i in oldest_first.data] == ["developer"] and oldest_first.has_more
    assert [i.role for i in after.data] == ["user"] and not after.has_more
    assert [status for status, _ in errors] == [404, 404, 400]
    assert errors[2][1]["param"] == "previous_response_id" and errors[2][1]["code"] == "previous_response_not_found"


def test_store_false_or_the_store_off_keeps_nothing(tokenizer):
    async def go(client):
        r = await client.responses.create(model="m", input="hi", store=False)
        statuses = []
        for call in (client.responses.retrieve(r.id),
                     client.responses.create(model="m", previous_response_id=r.id, input="Why?")):
            try:
                await call
            except openai.APIStatusError as e:
                statuses.append((e.status_code, e.body.get("param"), e.body["message"]))
        return r, statuses

    (r, statuses), _ = run(tokenizer, REPLY, go)
    assert r.store is False and [s[:2] for s in statuses] == [(404, "response_id"), (400, "previous_response_id")]
    (r, statuses), _ = run(tokenizer, REPLY, go, settings={"responses_store_max_bytes": 0})
    assert r.store is False and statuses[1][:2] == (400, "previous_response_id") and "off" in statuses[1][2]


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=abc", "limit"), ("order=up", "order"),
                                          ("after=msg_nope", "after")])
def test_bad_input_item_queries_are_a_400_naming_the_parameter(tokenizer, query, param):
    async def go(client):
        r = await client.responses.create(model="m", input="hi")
        return await client._client.get(f"http://t/v1/responses/{r.id}/input_items?{query}")

    response, _ = run(tokenizer, REPLY, go)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_store_keeps_the_most_recently_used_within_its_bytes():
    async def go():
        store = ResponseStore(max_bytes=400)
        record = {"response": {"status": "completed"}, "text": "x" * 80}  # 125 bytes as JSON
        size = len(json.dumps(record, separators=(",", ":")))
        for i in range(3):
            assert await store.put(f"r{i}", record)
        assert store.num_bytes == 3 * size
        assert await store.get("r0") == record  # r0 is now the most recently used
        assert await store.put("r3", record)  # over 400 bytes: the least recently used (r1) goes
        kept = [k for k in ("r0", "r1", "r2", "r3") if await store.get(k) is not None]
        assert kept == ["r0", "r2", "r3"] and store.num_bytes == 3 * size
        assert not await store.put("big", {"response": {"status": "completed"}, "text": "x" * 400})  # alone over the bound: not kept
        assert await store.delete("r2") and not await store.delete("r2") and store.num_bytes == 2 * size
        return len(store)

    assert asyncio.run(go()) == 2
