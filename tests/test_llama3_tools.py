"""`--tool-call-parser llama3_json`: Llama 3.1+'s bare JSON tool calls, parsed whole and streamed
under every split, in required mode's grammar (compiled by the engine's grammar compiler and
held to), in the prompt of a template without tool support, and at the HTTP edge through the
official `openai` client over a scripted engine."""
from __future__ import annotations

import json
import random

import pytest

from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
from router.llama3_tool_parser import Llama3JsonStream
from router.protocol import ChatCompletionRequest
from router.tool_calls import parse_whole
from router.tools import FORMATS, ToolPlan, render, required_grammar
from tests.scripted_engine import run
from tests.test_tools import HISTORY, TOOLS, USER, create, split_stream, streamed

LLAMA3 = {"tool_call_parser": "llama3_json"}
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
NOW = '{"name": "now", "arguments": {}}'


def parse(text: str, cut: bool = False, max_calls: int | None = None, accepts=None):
    content, calls = parse_whole(Llama3JsonStream(max_calls, accepts), text, cut)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


WEATHER_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})


def test_a_reply_that_is_json_calls_is_calls():
    assert parse(WEATHER) == (None, [WEATHER_CALL])
    assert parse(f" \n<|python_tag|>{WEATHER}; {NOW}\n") == (None, [WEATHER_CALL, ("now", {})])
    assert parse(f"{WEATHER};{NOW}", max_calls=1) == (None, [WEATHER_CALL])  # parallel_tool_calls false
    # arguments as a string holding an object: a call, as in the Hermes format; a `;` may end it
    assert parse('{"name": "now", "parameters": "{\\"a\\": 1}"}') == (None, [("now", {"a": 1})])
    assert parse(f"{WEATHER};") == (None, [WEATHER_CALL])
    assert parse(f"{WEATHER}; {NOW}; \n") == (None, [WEATHER_CALL, ("now", {})])


@pytest.mark.parametrize("text", [
    "The weather is fine.", "  Hello there \n",  # content: as written (vLLM's), whitespace and all
    '{"city": "Paris"}',  # JSON, but not a call
    f"{WEATHER} and then some words", f"{WEATHER}; not json", '{"name": "get_weather", "parameters": [1]}',
    f"Sure: {WEATHER}",  # a call that does not start the reply: content (vLLM's streaming rule)
    '{"name": "now"}',  # no arguments: no call (vLLM's KeyError)
    f"{WEATHER};;", f"; {WEATHER}",
    "<|python_tag|>", "",
])
def test_anything_else_is_content_as_written(text):
    assert parse(text) == (text or None, [])


def test_a_cut_reply_keeps_its_whole_calls_and_drops_the_unfinished_one():
    cut = f'{WEATHER}; {{"name": "now", "param'
    assert parse(cut, cut=True) == (None, [WEATHER_CALL])
    assert parse(cut) == (cut, [])  # it stopped there: not calls
    assert parse('{"name": "get_wea', cut=True) == (None, [])
    # cut inside prose that starts with a brace: content, not an unfinished call
    prose = "{x | x > 0} is the set of positive reals, so the answer"
    assert parse(prose, cut=True) == (prose, [])
    assert parse(f"{WEATHER}; {{x | x", cut=True) == (f"{WEATHER}; {{x | x", [])
    answer = '{"summary": "Paris is sunny today, with'  # a JSON answer cut short: content
    assert parse(answer, cut=True) == (answer, [])
    for head in ("{", '{ "na', '{"name"', '{"name": "no'):
        assert parse(f"{WEATHER}; {head}", cut=True) == (None, [WEATHER_CALL]), head


def test_a_call_of_a_function_not_offered_is_content():
    accepts = ToolPlan.of(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS})).accepts
    assert parse(WEATHER, accepts=accepts) == (None, [WEATHER_CALL])
    other = '{"name": "get_time", "parameters": {}}'
    assert parse(f"{WEATHER}; {other}", accepts=accepts) == (f"{WEATHER}; {other}", [])


TEXTS = [WEATHER, f"<|python_tag|>{WEATHER}; {NOW}", "plain words", f"{WEATHER} trailing", '{"city": 1}',
         f'  {WEATHER}; {{"name": "now", "param', "<|python", "   "]


def test_streamed_replies_add_up_to_the_parsed_whole_under_any_split():
    rng = random.Random(0)
    for _ in range(300):
        text, end = rng.choice(TEXTS), rng.choice(["stop", "length"])
        content, calls, finish = split_stream(Llama3JsonStream(), text, end, rng)
        whole_content, whole = parse(text, cut=end == "length")
        assert (content, calls) == (whole_content, whole), (text, end)
        assert finish == ("tool_calls" if whole and end == "stop" else end)


def test_required_grammar_holds_the_output_to_llama3_calls(tokenizer):
    tools = tuple(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS}).tools)
    grammar = required_grammar(tools, True, FORMATS["llama3_json"])
    compiled = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        StructuredOutputsParams(grammar=grammar))
    assert compiled.error is None, compiled.error

    def accepts(text: str) -> bool:
        """The whole text, and the grammar done there."""
        matcher, ids = compiled.matcher(), tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()

    assert accepts('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}')
    assert accepts('{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}')
    assert not accepts('{"name": "get_weather", "arguments": {}}')  # the format's key is "parameters"
    assert not accepts('<tool_call>')
    assert not accepts('{"name": "get_time", "parameters": {}}')  # not a tool


def test_tool_turns_render_in_llama3s_way_into_a_template_without_tool_support(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, tools = render(req.messages, ToolPlan.of(req, "llama3_json"), native=False)
    assert tools is None and '"parameters": <arguments as a JSON object>' in msgs[0]["content"]
    assert "<tool_call>" not in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == json.loads(WEATHER)
    assert msgs[3] == {"role": "tool", "content": "21 degrees"}


def test_tokenize_renders_tool_turns_as_chat_does(tokenizer):
    """/tokenize of a conversation with earlier calls (and no tools) counts what chat sends."""
    async def ids(client):
        r = await client._client.post("http://t/tokenize", json={"model": "m", "messages": HISTORY})
        return r.json()["tokens"]

    tokens, _ = run(tokenizer, "x", ids, settings=LLAMA3)
    _, engine = run(tokenizer, "x", create(messages=HISTORY), settings=LLAMA3)
    assert tokens == engine.seen[0][0] and "<tool_call>" not in tokenizer.decode(tokens)


def test_the_server_parses_llama3_calls_whole_and_streamed(tokenizer):
    r, engine = run(tokenizer, WEATHER, create(tools=TOOLS), settings=LLAMA3)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == WEATHER_CALL
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    (chunks, calls, _), _ = run(tokenizer, WEATHER, streamed(tools=TOOLS), settings=LLAMA3)
    ((_, name, arguments),) = calls.values()
    assert (name, json.loads(arguments)) == WEATHER_CALL and chunks[-1].choices[0].finish_reason == "tool_calls"
    r, _ = run(tokenizer, "Paris is sunny.", create(tools=TOOLS), settings=LLAMA3)
    assert r.choices[0].message.content == "Paris is sunny." and not r.choices[0].message.tool_calls
    # required: the engine is held to Llama 3's calls; the Hermes default is unchanged
    _, engine = run(tokenizer, WEATHER, create(tools=TOOLS, tool_choice="required"), settings=LLAMA3)
    grammar = engine.seen[0][1].structured_outputs.grammar
    assert 'start: call ("; " call)*' in grammar and '\\"parameters\\": ' in grammar and "<tool_call>" not in grammar
    _, engine = run(tokenizer, "x", create(tools=TOOLS, tool_choice="required"))
    assert "<tool_call>" in engine.seen[0][1].structured_outputs.grammar


def test_an_unknown_parser_is_refused():
    from router.settings import RouterSettings
    from router.tool_calls import PARSERS

    assert tuple(FORMATS) == PARSERS  # the flag's choices are the formats there are

    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json, mistral, pythonic, "
                                         "llama4_pythonic"):
        RouterSettings(served_model_name="m", tool_call_parser="granite")
