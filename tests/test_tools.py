"""Tool calling and structured-output requests at the HTTP edge, without Ray or a model: the
official `openai` client against the app over an in-process engine that replies with a script,
so that every tool_choice's reply shape (whole and streamed) is checked on known text; plus the
Hermes parser, the streaming parser under every split, prompt rendering, and the 400s."""
from __future__ import annotations

import json
import random
import sys

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.protocol import ChatCompletionRequest, ChatMessage, MAX_TOOLS
from router.tool_calls import NamedCallStream
from router.tool_parser import ToolCallStream, parse_tool_calls
from router.tools import ToolPlan, render, required_grammar
from tests.scripted_engine import run

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string"},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ARGS = '{"city": "Paris", "unit": "celsius"}'
CALL = f'{{"name": "get_weather", "arguments": {CALL_ARGS}}}'
HERMES = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>"


def create(**kwargs):
    return lambda client: client.chat.completions.create(model="m", messages=kwargs.pop("messages", USER), **kwargs)


def streamed(**kwargs):
    """The stream's chunks, and the calls they add up to: index -> [id, name, arguments]."""
    async def go(client):
        stream = await create(stream=True, **kwargs)(client)
        chunks = [c async for c in stream]
        calls, content = {}, ""
        for c in chunks:
            delta = c.choices[0].delta if c.choices else None
            content += (delta.content or "") if delta else ""
            for tc in (delta.tool_calls or []) if delta else []:
                entry = calls.setdefault(tc.index, [None, None, ""])
                if tc.id:
                    assert entry[0] is None and tc.function.name, "id and name come once, first"
                    entry[0], entry[1] = tc.id, tc.function.name
                assert entry[0] is not None, "an argument fragment before its call's name"
                entry[2] += tc.function.arguments or ""
        return chunks, calls, content
    return go


# -- replies: whole and streamed -----------------------------------------------------------------------

def test_auto_turns_hermes_blocks_into_tool_calls(tokenizer):
    r, engine = run(tokenizer, HERMES, create(tools=TOOLS))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
    (tc,) = msg.tool_calls
    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name == "get_weather"
    jsonschema.validate(json.loads(tc.function.arguments), WEATHER_ARGS)
    prompt, params = engine.seen[0]
    assert params.structured_outputs is None  # auto is not constrained
    assert "<tools>" in tokenizer.decode(prompt) and "get_weather" in tokenizer.decode(prompt)


def test_auto_streams_each_call_whole_once_its_block_closed(tokenizer):
    two = HERMES + "\n<tool_call>\n" + '{"name": "now", "arguments": {}}' + "\n</tool_call>"
    (chunks, calls, content), _ = run(tokenizer, two, streamed(tools=TOOLS))
    assert content == "Let me look."  # as the whole reply: no "\n" before the call
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]
    # One chunk per call: arguments go out once the block is known to be a call (valid JSON).
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls) == 2
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and not chunks[-1].choices[0].delta.tool_calls
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert all(d.role or d.content or d.tool_calls for d in deltas)  # no empty chunk while a block is held


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_sdk_stream_helper_closes_every_streamed_call(tokenizer, choice):
    """openai's `chat.completions.stream()` fires `arguments.done` for each call: a reply's last call
    completes on its last token, and the helper reads a chunk's finish_reason before its tool calls,
    so the finish comes in a chunk of its own (as vLLM's parser sends it after the arguments)."""
    two = "<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + '{"name": "now", "arguments": {}}' + "\n</tool_call>"

    async def go(client):
        async with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS, tool_choice=choice) as s:
            events = [(e.type, e.index) async for e in s if e.type.startswith("tool_calls.")]
            return events, await s.get_final_completion()

    (events, final), _ = run(tokenizer, two, go)
    done = [index for kind, index in events if kind == "tool_calls.function.arguments.done"]
    assert done == [0, 1], events
    assert final.choices[0].finish_reason == "tool_calls"
    assert [json.loads(tc.function.arguments) for tc in final.choices[0].message.tool_calls] == [
        {"city": "Paris", "unit": "celsius"}, {}]


def test_parallel_tool_calls_false_keeps_one_call(tokenizer):
    two = HERMES + "\n<tool_call>\n" + '{"name": "now", "arguments": {}}' + "\n</tool_call>"
    r, _ = run(tokenizer, two, create(tools=TOOLS, parallel_tool_calls=False))
    assert [tc.function.name for tc in r.choices[0].message.tool_calls] == ["get_weather"]
    (_, calls, _), _ = run(tokenizer, two, streamed(tools=TOOLS, parallel_tool_calls=False))
    assert [name for _, name, _ in calls.values()] == ["get_weather"]


def test_auto_without_a_call_is_content(tokenizer):
    r, _ = run(tokenizer, "It is sunny. <b>ok</b> <tool_c", create(tools=TOOLS))
    assert r.choices[0].message.content == "It is sunny. <b>ok</b> <tool_c" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    (_, calls, content), _ = run(tokenizer, "It is sunny. <b>ok</b> <tool_c", streamed(tools=TOOLS))
    assert content == "It is sunny. <b>ok</b> <tool_c" and not calls


STRICT = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS, "strict": True}}]


@pytest.mark.parametrize("tools, block, is_call", [
    (TOOLS, '{"name": "rm_rf", "arguments": {}}', False),  # not offered
    (STRICT, '{"name": "get_weather", "arguments": {"city": 5, "extra": true}}', False),  # off a strict schema
    (STRICT, '{"name": "get_weather", "arguments": {}}', False),  # required keys missing
    (STRICT, CALL, True),
    (TOOLS, '{"name": "get_weather", "arguments": {"city": 5}}', True),  # not strict: OpenAI does not check
])
def test_auto_calls_only_offered_tools_and_holds_strict_ones_to_their_schema(tokenizer, tools, block, is_call):
    text = f"<tool_call>\n{block}\n</tool_call>"
    r, _ = run(tokenizer, text, create(tools=tools))
    (_, calls, content), _ = run(tokenizer, text, streamed(tools=tools))
    if is_call:
        expected = [json.dumps(json.loads(block)["arguments"])]
        assert [tc.function.arguments for tc in r.choices[0].message.tool_calls] == expected
        assert [args for _, _, args in calls.values()] == expected
    else:  # as any block that is not a call: content, whole and streamed alike
        assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop" and content == text and not calls


def test_auto_mode_checks_strict_arguments_without_the_schemas_regular_expressions(tokenizer):
    """The check runs on the ingress's event loop, on text a client can steer (a regex constraint,
    a prompt): Python's `re` backtracks, and `^(a+)+$` against 40 a's and a "!" would hold every
    client for hours, wherever in the schema the pattern sits (a $ref can lead anywhere). Structure,
    types and enums are still held to the schema."""
    evil = {"type": "string", "pattern": "^(a+)+$"}
    args = {"type": "object", "properties": {"a": evil, "b": {"$ref": "#/x-lib/evil"}, "n": {"type": "integer"}},
            "required": ["a"], "patternProperties": {"^(x+)+$": {"type": "integer"}}, "additionalProperties": False,
            "x-lib": {"evil": evil}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": args, "strict": True}}]
    slow = "a" * 40 + "!"
    for arguments, is_call in [({"a": slow, "b": slow}, True), ({"a": "aa", "x" * 40 + "y": 2}, True),
                               ({"a": 5}, False), ({"n": 1}, False)]:
        text = f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
        r, _ = run(tokenizer, text, create(tools=tools))
        assert bool(r.choices[0].message.tool_calls) == is_call, arguments


def test_named_choice_constrains_to_the_arguments_schema(tokenizer):
    args = '{"city": "Paris", "unit": "celsius"}'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r, engine = run(tokenizer, args, create(tools=TOOLS, tool_choice=choice))
    (tc,) = r.choices[0].message.tool_calls
    # A forced call ends "stop", as OpenAI's and vLLM's do (an auto or required call: "tool_calls").
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "stop"
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == json.loads(args)
    spec = engine.seen[0][1].structured_outputs
    assert json.loads(spec.json) == WEATHER_ARGS and spec.lenient  # the tool is not `strict`
    (chunks, calls, _), _ = run(tokenizer, args, streamed(tools=TOOLS, tool_choice=choice))
    ((call_id, name, streamed_args),) = calls.values()
    assert name == "get_weather" and streamed_args == args
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_choice_constrains_to_hermes_calls_of_the_tools(tokenizer):
    block = f"<tool_call>\n{CALL}\n</tool_call>"
    r, engine = run(tokenizer, block, create(tools=TOOLS, tool_choice="required"))
    assert [tc.function.name for tc in r.choices[0].message.tool_calls] == ["get_weather"]
    spec = engine.seen[0][1].structured_outputs
    assert spec.grammar == required_grammar(tuple(ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": TOOLS}).tools), True)


def test_a_tool_name_past_openais_pattern_is_taken_as_vllm_takes_it(tokenizer):
    """MCP-style and non-English names (OpenAI's API allows only [A-Za-z0-9_-]{1,64}; vLLM any text):
    the required grammar compiles with them and the call comes back under its name."""
    name = "weather:查询 天气/" + "x" * 70
    tools = [{"type": "function", "function": {"name": name, "parameters": WEATHER_ARGS}}]
    block = f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {CALL_ARGS}}}\n</tool_call>'
    r, engine = run(tokenizer, block, create(tools=tools, tool_choice="required"))
    assert [tc.function.name for tc in r.choices[0].message.tool_calls] == [name]
    grammar = engine.seen[0][1].structured_outputs.grammar
    assert _grammar_accepts(tokenizer, grammar, block)  # the name raw, as the prompt shows it


def test_a_required_reply_a_stop_string_cut_gives_its_whole_calls_and_no_markup(tokenizer):
    """The request's stop string cut the forced markup: its whole calls stand, the cut one is
    dropped as at max_tokens (not given back as content "<tool_call>")."""
    block = f"<tool_call>\n{CALL}\n</tool_call>\n"
    for text, names in (("<tool_call>", []), (block + "<tool_call>", ["get_weather"])):
        kw = dict(finish_reason="stop", stop_reason="\n")
        r, _ = run(tokenizer, text, create(tools=TOOLS, tool_choice="required", stop=["\n"]), **kw)
        message = r.choices[0].message
        assert message.content is None and [tc.function.name for tc in message.tool_calls or []] == names
        (chunks, calls, content), _ = run(tokenizer, text, streamed(tools=TOOLS, tool_choice="required", stop=["\n"]),
                                          **kw)
        assert not content and [name for _, name, _ in calls.values()] == names
    r, _ = run(tokenizer, "<tool_call>", create(tools=TOOLS, stop=["\n"]), finish_reason="stop", stop_reason="\n")
    assert r.choices[0].message.content == "<tool_call>"  # auto: the model may write text, and did


def test_a_function_takes_an_object_of_arguments(tokenizer):
    """OpenAI's rule: parameters of another type are a 400 naming them; `parameters: {}` (MCP's
    tools without arguments) or a schema that gives no type constrains a forced call to an object."""
    def tool(parameters):
        return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]

    for parameters in ({"type": "string"}, {"type": ["array", "null"]}):
        for choice in ("auto", "required"):
            with pytest.raises(openai.BadRequestError) as e:
                run(tokenizer, "x", create(tools=tool(parameters), tool_choice=choice))
            assert e.value.body["param"] == "tools.0.function.parameters", e.value.body
            assert "must be a JSON Schema of 'type: \"object\"'" in e.value.body["message"]
    named = {"type": "function", "function": {"name": "f"}}
    for parameters in ({}, {"properties": {"a": {"type": "integer"}}}, {"type": ["object", "null"]}):
        r, engine = run(tokenizer, '{"a": 1}', create(tools=tool(parameters), tool_choice=named))
        assert json.loads(engine.seen[0][1].structured_outputs.json) == {**parameters, "type": "object"}
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"a": 1}
        _, engine = run(tokenizer, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
                        create(tools=tool(parameters), tool_choice="required"))
        assert '"type": "object"' in engine.seen[0][1].structured_outputs.grammar


NATIVE = ("{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
          "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")  # a template that renders tools


def test_tool_choice_none_shows_the_tools_and_parses_no_call(tokenizer):
    """As vLLM: a template that renders tools is given them under tool_choice none (the model knows
    what it could not call), and what the model writes is text; --exclude-tools-when-tool-choice-none
    leaves them out. A template that does not is given no instructions to call them."""
    native = {"chat_template": NATIVE}
    r, engine = run(tokenizer, HERMES, create(tools=TOOLS, tool_choice="none"), settings=native)
    assert r.choices[0].message.content == HERMES and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls and engine.seen[0][1].structured_outputs is None
    assert "TOOLS get_weather now" in tokenizer.decode(engine.seen[0][0])
    r, engine = run(tokenizer, HERMES, create(tools=TOOLS, tool_choice="none"),
                    settings={**native, "exclude_tools_when_tool_choice_none": True})
    assert r.choices[0].message.content == HERMES and "TOOLS" not in tokenizer.decode(engine.seen[0][0])
    (chunks, calls, content), _ = run(tokenizer, HERMES, streamed(tools=TOOLS, tool_choice="none"), settings=native)
    assert content == HERMES and not calls and chunks[-1].choices[0].finish_reason == "stop"
    _, engine = run(tokenizer, HERMES, create(tools=TOOLS, tool_choice="none"))  # SmolLM2's: no tools in it
    assert "<tools>" not in tokenizer.decode(engine.seen[0][0])
    _, engine = run(tokenizer, HERMES, create(tools=TOOLS))
    assert "<tools>" in tokenizer.decode(engine.seen[0][0])  # what auto shows it


def test_a_cut_reply_keeps_its_length_finish(tokenizer):
    r, _ = run(tokenizer, '{"city": "Par', create(tools=TOOLS, tool_choice={"type": "function",
                                                                              "function": {"name": "get_weather"}}),
               finish_reason="length")
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls[0].function.arguments == \
        '{"city": "Par'


def test_a_generation_error_is_an_error_reply(tokenizer):
    with pytest.raises(openai.BadRequestError, match="structured output failed: boom"):
        run(tokenizer, "{", create(response_format={"type": "json_object"}), finish_reason="error",
            stop_reason="structured output failed: boom")

    async def stream(client):
        chunks = []
        with pytest.raises(openai.APIError, match="boom"):
            async for c in await create(stream=True, response_format={"type": "json_object"})(client):
                chunks.append(c)
        return chunks
    run(tokenizer, "{", stream, finish_reason="error", stop_reason="structured output failed: boom")


def test_response_format_and_structured_outputs_reach_the_engine(tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    _, engine = run(tokenizer, '{"a": 1}', create(response_format=fmt))
    spec = engine.seen[0][1].structured_outputs
    assert json.loads(spec.json) == schema and not spec.lenient
    _, engine = run(tokenizer, "yes", create(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}))
    assert engine.seen[0][1].structured_outputs.choice == ("yes", "no")

    async def completion(client):
        return await client.completions.create(model="m", prompt="x", extra_body={"structured_outputs": {
            "regex": "[0-9]+"}})
    _, engine = run(tokenizer, "12", completion)
    assert engine.seen[0][1].structured_outputs.regex == "[0-9]+"


BAD = [
    (dict(tool_choice="required"), "tool_choice", "requires tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tools=[TOOLS[0]] * (MAX_TOOLS + 1)), "tools", "128"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function.name", "at least 1 character"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}),
     "response_format", "strin"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "if": {}}}}), "response_format", "Unimplemented keys"),
    (dict(response_format={"type": "json_schema"}), "response_format", "needs a json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "x" * 70_000}}}), "response_format.json_schema.schema", "64000"),
    (dict(extra_body={"structured_outputs": {"regex": "a" * 5000}}), "structured_outputs.regex", "4000"),
    (dict(extra_body={"structured_outputs": {"regex": "a("}}), "structured_outputs", "unclosed group"),
    (dict(extra_body={"structured_outputs": {"grammar": "start: foo"}}), "structured_outputs", "foo"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "exactly one"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice", "combined"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], tool_choice="required"), "tools", "strin"),
]


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}


@pytest.mark.parametrize("choice", [None, "auto", "required", {"type": "function", "function": {"name": "g"}}])
def test_every_tool_schema_is_checked_in_every_mode_a_strict_one_strictly(tokenizer, choice):
    """A schema llguidance cannot compile is a 400 naming its tool in any mode (it passed in auto
    mode); a keyword it lacks is refused in a strict tool only (a non-strict tool's was refused
    in required mode). pydantic writes uniqueItems for any set[...] field."""
    def tools(second: dict) -> list[dict]:
        return [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": second}]

    with_choice = {} if choice is None else {"tool_choice": choice}
    for second, says in [({"name": "g", "parameters": {"type": "foo"}}, "foo"),
                         ({"name": "g", "parameters": UNIQUE, "strict": True}, "Unimplemented keys")]:
        with pytest.raises(openai.BadRequestError) as e:
            run(tokenizer, "x", create(tools=tools(second), **with_choice))
        assert e.value.body["param"] == "tools.1.function.parameters" and says in e.value.body["message"]
        assert "<tool_call>" not in e.value.body["message"]  # not the grammar the tools make
    reply, engine = run(tokenizer, "x", create(tools=tools({"name": "g", "parameters": UNIQUE}), **with_choice))
    assert reply.choices[0].finish_reason  # served: the keyword is not enforced, as OpenAI's non-strict mode


@pytest.mark.parametrize("kwargs,param,says", BAD, ids=[b[2] for b in BAD])
def test_what_cannot_be_enforced_is_a_400_naming_it(tokenizer, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, "x", create(**kwargs))
    assert says in e.value.body["message"]
    assert (e.value.body["param"] or "").startswith(param.split(".")[0])


# -- the prompt ------------------------------------------------------------------------------------

HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]


def test_tool_turns_render_into_a_template_without_tool_support(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, tools = render(req.messages, ToolPlan.of(req), native=False)
    assert tools is None and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert msgs[2]["content"] == f"<tool_call>\n{CALL}\n</tool_call>"
    assert msgs[3] == {"role": "tool", "content": "<tool_response>\n21 degrees\n</tool_response>"}
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.index("<tools>") < text.index("Weather in Paris?") < text.index(CALL) < text.index("21 degrees")


def test_tool_turns_go_to_a_template_that_renders_tools(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, tools = render(req.messages, ToolPlan.of(req), native=True)
    assert [t["function"]["name"] for t in tools] == ["get_weather", "now"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert msgs[2]["tool_call_id"] == "call_1" and msgs[2]["content"] == "21 degrees"
    plain = [ChatMessage.model_validate(m) for m in USER]
    assert render(plain, ToolPlan("none"), native=True) == ([{"role": "user", "content": "Weather in Paris?"}], None)
    # arguments that are no JSON object (a call cut short elsewhere) reach such a template as {}
    # (vLLM's): a template iterating over them would fail on every later turn of the conversation
    for cut in ('{"city": "Par', "[]", "5"):
        history = [*USER, {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
                                                          "function": {"name": "get_weather", "arguments": cut}}]}]
        req = ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
        assert render(req.messages, ToolPlan.of(req), native=True)[0][1]["tool_calls"][0]["function"]["arguments"] == {}


# A template that shows what it gets: roles, content, and an assistant turn's reasoning.
SHOWING = ("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
           "</think>{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.mark.parametrize("message, shown", [
    ({"role": "user", "content": [{"type": "input_text", "text": "a"}, "b", {"type": "text", "text": None}]},
     "[user]a\nb"),  # the Responses API's part type, a bare string, a part with no text (vLLM reads all three)
    ({"role": "assistant", "content": [{"type": "text", "text": "Sure"}, {"type": "refusal", "refusal": "no"}]},
     "[assistant]Sure\nno"),
    ({"role": "assistant", "content": "It is 21.", "reasoning": "Read the tool."},
     "[assistant]<think>Read the tool.</think>It is 21."),  # reasoning given back, as vLLM passes it on
    ({"role": "assistant", "content": "It is 21.", "reasoning_content": "Read the tool."},
     "[assistant]<think>Read the tool.</think>It is 21."),
])
def test_message_shapes_clients_send_render_as_vllm_renders_them(tokenizer, message, shown):
    ids, _ = run(tokenizer, "x", create(messages=[*USER, message]), settings={"chat_template": SHOWING})[1].seen[0]
    assert tokenizer.decode(ids) == f"[user]Weather in Paris?\n{shown}\n[assistant]"


@pytest.mark.parametrize("message, param, says", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
     "messages.1.content", "image_url content is not supported: this server serves a text-only model"),
    ({"role": "user", "content": [{"type": "odd", "text": "a"}]}, "messages.1.content", "unsupported content part"),
    ({"role": "assistant", "content": None, "function_call": {"name": "now", "arguments": "{}"}},
     "messages.1.function_call", "send tool_calls"),  # was dropped without a word
])
def test_message_shapes_this_server_cannot_render_are_400s_saying_why(tokenizer, message, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        run(tokenizer, "x", create(messages=[*USER, message]))
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


def _grammar_accepts(tokenizer, grammar: str, text: str) -> bool:
    from engine.structured.compiler import GrammarCompiler
    from engine.structured.params import StructuredOutputsParams

    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        StructuredOutputsParams(grammar=grammar)).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error()


def test_the_required_grammar_accepts_calls_and_nothing_else(tokenizer):
    tools = tuple(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS}).tools)
    for parallel, text, ok in [(True, f"<tool_call>\n{CALL}\n</tool_call>", True),
                               (True, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
                                      '{"name": "now", "arguments": {}}\n</tool_call>', True),
                               (False, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>", False),
                               (True, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', False),
                               (True, "Hello", False)]:
        assert _grammar_accepts(tokenizer, required_grammar(tools, parallel), text) == ok, text
    # a tool whose schema says nothing of other keys gets none invented (vLLM's default backend)
    open_args = {k: v for k, v in WEATHER_ARGS.items() if k != "additionalProperties"}
    tools = tuple(ChatCompletionRequest.model_validate({"messages": USER, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": open_args}}]}).tools)
    for args, ok in [('{"city": "Paris", "unit": "celsius"}', True), ('{"city": "Paris", "unit": "celsius", "x": 1}', False)]:
        text = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
        assert _grammar_accepts(tokenizer, required_grammar(tools, False), text) == ok, args


# -- the parser ------------------------------------------------------------------------------------

def test_parse_tool_calls():
    content, calls = parse_tool_calls(HERMES + ' then <tool_call>not json</tool_call> and'
                                      ' <tool_call>{"name": "now", "parameters": {"x": 1}}</tool_call>')
    assert content == "Let me look.\n then <tool_call>not json</tool_call> and"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {"x": 1})]
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("plain") == ("plain", [])
    assert parse_tool_calls(f"<tool_call>{CALL}")[1][0]["function"]["name"] == "get_weather"  # cut before its tag
    assert len(parse_tool_calls(HERMES + HERMES, max_calls=1)[1]) == 1
    # Not calls: arguments that are not JSON, or not an object (a client's json.loads must work).
    unquoted = '<tool_call>{"name": "f", "arguments": {"city": Paris}}</tool_call>'
    assert parse_tool_calls(unquoted) == (unquoted, [])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "x"}</tool_call>')[1] == []
    # A reply cut at max_tokens inside a call: the unfinished call is dropped, not sent as markup;
    # a reply that stopped there keeps its text.
    unfinished = HERMES + '\n<tool_call>\n{"name": "now", "arguments": {"tz": "Eur'
    content, calls = parse_tool_calls(unfinished, cut=True)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert parse_tool_calls(unfinished)[0].endswith('{"tz": "Eur')
    # cut inside the close tag of a whole call: a call all the same; cut inside the next open tag:
    # its start is not content
    weather = ("get_weather", {"city": "Paris", "unit": "celsius"})
    for close in ("\n", "\n<", "\n</tool", "\n</tool_call"):
        for cut in (True, False):
            content, calls = parse_tool_calls("<tool_call>\n" + CALL + close, cut=cut)
            assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                        for c in calls] == [weather], (close, cut)
    # whitespace: a reply without calls is content as written (vLLM's); between a call and the
    # reply's start or end it goes; elsewhere it stays
    assert parse_tool_calls("  Hello there \n") == ("  Hello there \n", [])
    assert parse_tool_calls(" \n" + HERMES + "\n ")[0] == " \nLet me look."
    assert parse_tool_calls("\n" + f"<tool_call>{CALL}</tool_call>" + "\n Done.\n")[0] == "Done.\n"
    assert parse_tool_calls(f"Hi\n<tool_call>{CALL}</tool_call>\nBye")[0] == "Hi\n\nBye"
    # a block without arguments is no call (vLLM's parsers); a cut block that is no JSON object is text
    no_arguments = '<tool_call>{"name": "now"}</tool_call>'
    assert parse_tool_calls(no_arguments) == (no_arguments, [])
    assert parse_tool_calls("Mention <tool_call> here, then", cut=True) == ("Mention <tool_call> here, then", [])
    for head in ("<t", "<tool", "<tool_call"):
        assert parse_tool_calls(HERMES + "\n" + head, cut=True)[0] == "Let me look."
        assert parse_tool_calls(HERMES + "\n" + head)[0] == "Let me look.\n\n" + head  # it stopped there: text
    assert parse_tool_calls("if a <", cut=True) == ("if a <", [])  # a lone "<" is text ...
    # a close tag inside a JSON string is the string's (a function may be named anything, as vLLM takes it)
    tagged = '<tool_call>\n{"name": "a</tool_call>b", "arguments": {"s": "\\"</tool_call>"}}\n</tool_call>'
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse_tool_calls(tagged)[1]] == [
        ("a</tool_call>b", {"s": '"</tool_call>'})]
    required = ToolPlan.of(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS,
                                                                 "tool_choice": "required"}))
    choice = {"message": {"content": HERMES.split("\n", 1)[1] + "\n<"}, "finish_reason": "length"}
    required.apply(choice)  # ... but under required, whose grammar allows no content, the start of a call
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1


TEXTS = [HERMES, "\n " + HERMES + "\n<tool_call>\n" + '{"arguments": {"b": "}"}, "name": "x"}' + "\n</tool_call> end",
         'x <tool_call>{"name": "f", "arguments": {"s": "a\\"}]", "l": [1, {"m": []}]}}</tool_call>',
         "no calls <tool_call> here", "<tool_call>\n{\"name\": \"f\", \"argu", "a <tool_call>broken</tool_call> b",
         # a whole call whose close tag never came (the model stopped after its JSON): it stands
         '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', 'ok <tool_call>{"arguments": {"a": 1}, "name": "g"}',
         # not calls, though their heads are: arguments that are not JSON, or not an object
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
         '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
         # arguments given as a string holding an object: a call
         '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
         # a second call cut inside its arguments
         HERMES + '\n<tool_call>\n{"name": "now", "arguments": {"tz": "Eur',
         # ends inside a whole call's close tag, or inside the next call's open tag
         '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c', HERMES + "\n<tool",
         # text that only mentions a tag, or ends in a "<"; whitespace at either end, with calls and without
         "Mention <tool_call> here, then", "if a <", "  Hello there \n", " \n" + HERMES + "\n ",
         f"\n<tool_call>{CALL}</tool_call>\n Done.\n",
         # close tags inside the JSON's strings, and one in a block that is no call
         'a <tool_call>{"name": "x</tool_call>", "arguments": {"q": "\\"</tool_call>"}}</tool_call> b',
         '<tool_call>not "json </tool_call> at all',
         '<tool_call>say "hi</tool_call> then ' + f"<tool_call>{CALL}</tool_call>"]


@settings(max_examples=300, deadline=None)
@given(text=st.sampled_from(TEXTS), seed=st.integers(0, 10**6), end=st.sampled_from(["stop", "length"]))
def test_streamed_calls_add_up_to_the_parsed_whole_under_any_split(text, seed, end):
    content, calls, finish = split_stream(ToolCallStream(), text, end, random.Random(seed))
    whole_content, whole = parse_tool_calls(text, cut=end == "length")
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
    assert content == whole_content
    assert finish == ("tool_calls" if whole and end == "stop" else end)  # as plan.apply ends the whole reply


def split_stream(stream, text: str, end: str, rng: random.Random):
    """`text` fed to a call stream in random pieces, the last ending `end` -> (the content, None if
    empty; the calls as (name, parsed arguments), always an object; the finish_reason sent)."""
    deltas, i, finish = [], 0, None
    while i < len(text) or finish is None:
        n = rng.randint(1, 9)
        delta, finish = stream.step(text[i:i + n], end if i + n >= len(text) else None)
        deltas.append(delta)
        i += n
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], [c.get("function", {}).get("name"), ""])
            entry[1] += c["function"].get("arguments", "")
    parsed = [(name, json.loads(a)) for name, a in calls.values()]
    assert all(isinstance(a, dict) for _, a in parsed)
    return "".join(d.get("content", "") for d in deltas) or None, parsed, finish


def test_named_stream():
    s = NamedCallStream("f")
    first, _ = s.step("", None)
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert s.step('{"a"', None)[0] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert s.step(": 1}", "stop") == ({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                                      "stop")  # a forced call ends "stop" (OpenAI's and vLLM's)


@pytest.mark.parametrize("stream,text", [
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": '),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": '),
    ("llama3_json", '{"name": "f", "parameters": {"a": '),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": '),
])
@pytest.mark.parametrize("cut", [False, True])
def test_a_reply_nested_past_the_json_decoders_recursion_is_content(stream, text, cut):
    """A model stuck on '[' nests deeper than json's decoder recurses (RecursionError, not a
    ValueError): the reply is content, not a 500."""
    from router.llama3_tool_parser import Llama3JsonStream
    from router.mistral_tool_parser import MistralStream
    from router.tool_calls import parse_whole

    streams = {"mistral": MistralStream, "llama3_json": Llama3JsonStream, "hermes": ToolCallStream}
    close = "\n</tool_call>" if stream == "hermes" else ""
    deep = text + "[" * 5000 + close
    content, calls = parse_whole(streams[stream](), deep, cut)
    assert calls == [] and content == (None if cut and stream != "hermes" else deep)  # cut: a call cut short, dropped
    # whole arguments just short of the limit: decoded, then encoded a few frames deeper
    limit = sys.getrecursionlimit()
    for depth in range(limit - 200, limit + 5):  # the window moves with the stack depth at the call
        whole = text + "[" * depth + "]" * depth + "}" + ("}" if "arguments\": {" in text else "") + close
        whole += "]" if text.startswith("[TOOL_CALLS][") else ""
        content, calls = parse_whole(streams[stream](), whole, cut)
        assert (content, len(calls)) in ((whole, 0), (None, 1)) + (((None, 0),) if cut else ()), depth
