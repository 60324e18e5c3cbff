"""`--tool-call-parser mistral`: Mistral's `[TOOL_CALLS]` calls (v0.3's JSON list, v11's
`name[ARGS]{...}`), parsed whole and streamed under every split, with 9-character ids (Mistral's
templates refuse others); the tag shows because such requests keep special tokens (vLLM's
adjust_request); required mode's grammar writes the JSON list; history for templates with and
without tool support."""
from __future__ import annotations

import json
import random
import re

import pytest

from engine.structured.compiler import GrammarCompiler
from engine.structured.params import StructuredOutputsParams
from router.mistral_tool_parser import MistralStream
from router.protocol import ChatCompletionRequest
from router.tool_calls import parse_whole
from router.tools import FORMATS, ToolPlan, render, required_grammar
from tests.scripted_engine import run
from tests.test_tools import HISTORY, TOOLS, USER, create, split_stream, streamed

MISTRAL = {"tool_call_parser": "mistral"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NOW = '{"name": "now", "arguments": {}}'
WEATHER_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})


def parse(text: str, cut: bool = False, max_calls: int | None = None, accepts=None):
    content, calls = parse_whole(MistralStream(max_calls, accepts), text, cut)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_reply_that_is_calls_is_calls():
    assert parse(f"[TOOL_CALLS][{WEATHER}]") == (None, [WEATHER_CALL])
    assert parse(f"[TOOL_CALLS] [{WEATHER}, {NOW}]\n") == (None, [WEATHER_CALL, ("now", {})])
    assert parse(f"[{WEATHER}]") == (None, [WEATHER_CALL])  # special tokens skipped: the list alone
    assert parse(f"[TOOL_CALLS]{WEATHER}") == (None, [WEATHER_CALL])  # one object
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]now[ARGS]{}'
    assert parse(v11) == (None, [WEATHER_CALL, ("now", {})])
    assert parse(v11, max_calls=1) == (None, [WEATHER_CALL])
    assert parse("[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}") == (None, [("now", {})])  # v13's ids


@pytest.mark.parametrize("text", [
    "The weather is fine.", "  Hello there \n", "[1, 2, 3]", "[]", "[see below]", '{"city": "Paris"}',
    f"[{WEATHER}] and some words", '[{"name": "now"}]', "Sure: [TOOL_CALLS] not calls", "ends in [TOOL_C",
    "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]now[ARGS][1]", "[TOOL_CALLS]now", "[TOOL_CALLS]", "",
])
def test_anything_else_is_content_as_written(text):
    assert parse(text) == (text or None, [])


def test_a_name_past_openais_pattern_is_a_call():
    """Tool names are any text (as vLLM takes them): MCP-style and non-English ones are calls."""
    assert parse('[TOOL_CALLS]mcp:weather/get[ARGS]{"a": 1}') == (None, [("mcp:weather/get", {"a": 1})])
    assert parse('[TOOL_CALLS]查询天气[ARGS]{}') == (None, [("查询天气", {})])


def test_text_before_the_tag_is_content_and_the_tag_starts_calls():
    """Mistral Small writes a sentence before its calls: content, as in vLLM's parser."""
    assert parse(f"Sure: [TOOL_CALLS][{WEATHER}]") == ("Sure: ", [WEATHER_CALL])
    assert parse('Let me look.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}') == (
        "Let me look.\n", [WEATHER_CALL])
    assert parse(f'Sure: [TOOL_CALLS][{WEATHER}, {{"name": "no', cut=True) == ("Sure: ", [WEATHER_CALL])
    assert parse(f"Sure: [TOOL_CALLS][{WEATHER}], done") == (f"Sure: [TOOL_CALLS][{WEATHER}], done", [])
    # text that looked like calls at first (held), then a tag: the same split
    assert parse(f'{{"plan": 1}} [TOOL_CALLS][{WEATHER}]') == ('{"plan": 1} ', [WEATHER_CALL])
    assert parse(f"[{{ not json [TOOL_CALLS][{WEATHER}]") == ("[{ not json ", [WEATHER_CALL])


def test_a_cut_reply_keeps_its_whole_calls_and_drops_the_unfinished_one():
    assert parse(f'[TOOL_CALLS][{WEATHER}, {{"name": "now", "argu', cut=True) == (None, [WEATHER_CALL])
    assert parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]no[AR',
                 cut=True) == (None, [WEATHER_CALL])
    assert parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', cut=True) == (None, [])
    assert parse('[{"name": "get_wea', cut=True) == (None, [])
    for answer in ('[{"summary": "Paris is sunny', "[TOOL_CALLS]get weather"):  # not the start of a call
        assert parse(answer, cut=True) == (answer, [])


TEXTS = [f"[TOOL_CALLS][{WEATHER}]", f"[{WEATHER}, {NOW}]", "plain words", "[1, 2]",
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]now[ARGS]{}',
         f'[TOOL_CALLS][{WEATHER}, {{"name": "no', "[TOOL_C", "   ", f"Sure: [TOOL_CALLS][{WEATHER}]",
         "a [TOOL_CALLS] b", f"x [TOOL_C [TOOL_CALLS]{NOW}", f'{{"plan": 1}} [TOOL_CALLS][{WEATHER}]']


def test_streamed_replies_add_up_to_the_parsed_whole_under_any_split():
    rng = random.Random(0)
    for _ in range(300):
        text, end = rng.choice(TEXTS), rng.choice(["stop", "length"])
        content, calls, finish = split_stream(MistralStream(), text, end, rng)
        whole_content, whole = parse(text, cut=end == "length")
        assert (content, calls) == (whole_content, whole), (text, end)
        assert finish == ("tool_calls" if whole and end == "stop" else end)


def test_required_grammar_writes_a_json_list_of_calls(tokenizer):
    tools = tuple(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS}).tools)
    grammar = required_grammar(tools, True, FORMATS["mistral"])
    assert grammar.startswith('start: "[" call (", " call)* "]"')
    compiled = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        StructuredOutputsParams(grammar=grammar))

    def accepts(text: str) -> bool:
        matcher, ids = compiled.matcher(), tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and not matcher.is_error() and matcher.is_accepting()

    assert accepts(f"[{WEATHER}]") and accepts(f"[{WEATHER}, {NOW}]")
    assert not accepts(WEATHER) and not accepts('[{"name": "get_time", "arguments": {}}]')
    assert parse(f"[{WEATHER}, {NOW}]")[1] == [WEATHER_CALL, ("now", {})]  # what it writes parses


def test_history_is_tagged_for_a_template_without_tool_support_and_ids_cut_for_one_with():
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, _ = render(req.messages, ToolPlan.of(req, "mistral"), native=False)
    assert msgs[2]["content"] == f"[TOOL_CALLS][{WEATHER}]" and "[TOOL_CALLS]" in msgs[0]["content"]
    long_id = [{**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "id": "call_0123456789abcdef"}]},
               {**HISTORY[2], "tool_call_id": "call_0123456789abcdef"}]
    req = ChatCompletionRequest.model_validate({"messages": USER + long_id, "tools": TOOLS})
    msgs, tools = render(req.messages, ToolPlan.of(req, "mistral"), native=True)
    assert msgs[1]["tool_calls"][0]["id"] == msgs[2]["tool_call_id"] == "789abcdef"


def test_the_server_keeps_special_tokens_while_tools_are_offered_and_parses_the_calls(tokenizer):
    r, engine = run(tokenizer, f"[TOOL_CALLS][{WEATHER}]", create(tools=TOOLS), settings=MISTRAL)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == WEATHER_CALL
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id) and r.choices[0].finish_reason == "tool_calls"
    assert engine.seen[0][1].skip_special_tokens is False  # the tag, a special token, shows
    (chunks, calls, _), _ = run(tokenizer, f"[TOOL_CALLS][{WEATHER}]", streamed(tools=TOOLS), settings=MISTRAL)
    ((_, name, arguments),) = calls.values()
    assert (name, json.loads(arguments)) == WEATHER_CALL and chunks[-1].choices[0].finish_reason == "tool_calls"
    for kwargs in ({}, {"tools": TOOLS, "tool_choice": "none"}):  # no calls to parse: as asked
        _, engine = run(tokenizer, "Paris is sunny.", create(**kwargs), settings=MISTRAL)
        assert engine.seen[0][1].skip_special_tokens is True
