"""Structured outputs and tool calls end to end: the official `openai` client against a real Ray +
Serve app serving SmolLM2, one server for the module. Every constrained reply parses and
validates, greedy or sampled; forced tool calls carry arguments valid for their tool's schema,
whole and streamed."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import UUID4, BaseModel, Field, SecretStr

from tests.local_serve import running_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}},
                                               "required": ["city"], "additionalProperties": False}}}]
ARGS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: Literal["Paris", "London", "Rome"]


@pytest.fixture(scope="module")
def client():
    args = dict(max_model_len=1024, num_gpu_blocks_override=512, max_num_seqs=24)
    with running_server(args) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client, temperature):
    r = client.chat.completions.parse(
        model=MODEL, response_format=Person, temperature=temperature, max_tokens=80, seed=1,
        messages=[{"role": "user", "content": "Describe a person who lives in Rome as JSON."}])
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person), r.choices[0].message.content


class Account(BaseModel):  # formats the grammar lacks: uuid4, password (annotations, as in vLLM)
    id: UUID4
    token: SecretStr = Field(max_length=12)


def test_parse_with_pydantic_types_whose_formats_the_grammar_lacks(client):
    r = client.chat.completions.parse(model=MODEL, response_format=Account, temperature=0, max_tokens=80,
                                      messages=[{"role": "user", "content": "Make up an account as JSON."}])
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Account)


@pytest.mark.parametrize("constraint", [{"json": {}}, {"regex": ""}], ids=["any-json", "empty-regex"])
def test_an_empty_constraint_is_one(client, constraint):
    """{} is a schema (any JSON), "" a regex (the empty text): given, not "none given"."""
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": constraint}).choices[0]
    if "regex" in constraint:
        assert (c.text, c.finish_reason) == ("", "stop")
    elif c.finish_reason == "stop":
        json.loads(c.text)  # whatever JSON it is
    else:
        assert c.finish_reason == "length" and c.text.strip(), c


def test_json_schema_under_sampling_always_validates(client):
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["title", "year", "genres", "rating"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": schema, "strict": True}}

    def one(seed: int):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Recommend a movie, as JSON."}], temperature=1.0,
            seed=seed, max_tokens=120, response_format=fmt)

    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(one, range(20)))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert len({r.choices[0].message.content for r in replies}) > 1


def test_max_tokens_first_ends_with_length(client):
    long = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "story", "schema": long}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert "".join(r.choices[0].message.content.split()).startswith('{"story"')  # laid out as the model writes it


def test_a_schema_the_engine_cannot_enforce_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="Unimplemented keys"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                   "schema": {"type": "object", "not": {"type": "string"}}}})


def _streamed_calls(stream) -> tuple[dict[int, list], str | None]:
    calls, finish = {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, [None, None, ""])
            if tc.id:
                entry[0], entry[1] = tc.id, tc.function.name
            assert entry[1], "the name comes before the arguments"
            entry[2] += tc.function.arguments or ""
    return calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_have_valid_arguments(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=150,
                                       temperature=0)
    msg = r.choices[0].message
    # a named (forced) call ends "stop", as OpenAI's and vLLM's; "required" ends "tool_calls"
    assert r.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls") and msg.tool_calls
    for tc in msg.tool_calls:
        assert tc.id.startswith("call_")
        jsonschema.validate(json.loads(tc.function.arguments), ARGS[tc.function.name])
    if isinstance(choice, dict):
        assert [tc.function.name for tc in msg.tool_calls] == ["get_time"]
    # sampled: a small model may call again and again while parallel calls are allowed; one call here
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=4,
                                            stream=True)
    calls, finish = _streamed_calls(stream)
    assert finish == ("stop" if isinstance(choice, dict) else "tool_calls") and len(calls) == 1
    for _, name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), ARGS[name])


def test_auto_with_tool_results_in_the_conversation(client):
    """SmolLM2 (a template without tool support) sees the tools in its system prompt, an earlier
    call and its result; whatever it answers is well formed: content, or calls with valid arguments."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
        if stream:
            calls, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
            pairs = [(name, args) for _, name, args in calls.values()]
        else:
            r = client.chat.completions.create(**kwargs)
            finish, msg = r.choices[0].finish_reason, r.choices[0].message
            pairs = [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls or []]
            assert pairs or msg.content
        assert finish in ("stop", "length", "tool_calls")
        assert (finish == "tool_calls") == bool(pairs) or finish == "length"
        for name, arguments in pairs:
            assert name in ARGS and isinstance(json.loads(arguments), dict)
