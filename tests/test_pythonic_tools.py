"""`--tool-call-parser pythonic` (and `llama4_pythonic`): calls written as a Python list, as Llama
3.2+ write them, parsed whole and streamed under every split, never evaluated; required mode
held to llama3_json's calls (as vLLM holds it to JSON); history rendered as Python calls for a
template without tool support; and at the HTTP edge through the `openai` client."""
from __future__ import annotations

import json
import random

import pytest

from router.protocol import ChatCompletionRequest
from router.pythonic_tool_parser import PythonicStream, call_text, parse_calls
from router.tool_calls import parse_whole
from router.tools import ToolPlan, render
from tests.scripted_engine import run
from tests.test_tools import HISTORY, TOOLS, USER, create, split_stream, streamed

PYTHONIC = {"tool_call_parser": "pythonic"}
WEATHER = 'get_weather(city="Paris", unit="celsius")'
WEATHER_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})


def parse(text: str, cut: bool = False, max_calls: int | None = None, accepts=None):
    content, calls = parse_whole(PythonicStream(max_calls, accepts), text, cut)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_reply_that_is_a_list_of_calls_is_calls():
    assert parse(f"[{WEATHER}]") == (None, [WEATHER_CALL])
    assert parse(f" \n[{WEATHER}, now()]\n") == (None, [WEATHER_CALL, ("now", {})])
    assert parse(f"<|python_start|>[{WEATHER}]<|python_end|>") == (None, [WEATHER_CALL])  # Llama 4's tags
    assert parse(f"[{WEATHER}, now()]", max_calls=1) == (None, [WEATHER_CALL])  # parallel_tool_calls false
    values = "[f(a=[1, -2.5, (3,)], b={'k': None, \"j\": True}, c=true, d=null, e='it\\'s', g=+4)]"
    assert parse(values) == (None, [("f", {"a": [1, -2.5, [3]], "b": {"k": None, "j": True}, "c": True,
                                           "d": None, "e": "it's", "g": 4})])
    assert parse("[tools.search(q='x')]") == (None, [("tools.search", {"q": "x"})])


@pytest.mark.parametrize("text", [
    "The weather is fine.", "  Hello there \n", "[1, 2, 3]", "[]", "[x]", "[now]",
    f"[{WEATHER}] and some words", f"Sure: [{WEATHER}]",
    "[get_weather('Paris')]",  # positional: no call
    "[f(**kwargs)]", "[f(a=g())]", "[f(a=x)]", "[f(a=1+2)]", "[f(a=b'x')]", "[f(a=1j)]", "[f(a={1: 2})]",
    "[f(a=float('nan'))]", "[f(a=1e999)]",  # not JSON
    "[__import__('os').system('true')]", "[f(a=__import__('os'))]",  # never run: not literals
    f"[{WEATHER}", "<|python_start|>", "",
])
def test_anything_else_is_content_as_written(text):
    assert parse(text) == (text or None, [])


def test_a_cut_reply_keeps_its_whole_calls_and_drops_the_unfinished_one():
    cut = f'[{WEATHER}, now(a="x'
    assert parse(cut, cut=True) == (None, [WEATHER_CALL])
    assert parse(cut) == (cut, [])  # it stopped there: not calls
    assert parse("[get_wea", cut=True) == (None, [])
    assert parse('[get_weather(city="Par', cut=True) == (None, [])
    assert parse(f'[{WEATHER}, now(a="(x), y")', cut=True) == (None, [WEATHER_CALL, ("now", {"a": "(x), y"})])
    assert parse(f"[{WEATHER}, now()", cut=True) == (None, [WEATHER_CALL, ("now", {})])  # cut before its `]`
    assert parse(f"<|python_start|>[{WEATHER}", cut=True) == (None, [WEATHER_CALL])
    many = f'[{WEATHER}, run(code="' + "f(1), " * 20  # calls inside an unfinished string are text
    assert parse(many, cut=True) == (None, [WEATHER_CALL])
    for answer in ("[1, 2, 3", "[The answer is", "[see below] and",  # cut where no call can start
                   "[print(x) for x in range(10)] prints ten", f"[{WEATHER}] is how you call it, and",
                   f"[{WEATHER} and then"):  # or after a list that closed, or not as a list goes on
        assert parse(answer, cut=True) == (answer, [])


def test_a_call_of_a_function_not_offered_is_content():
    accepts = ToolPlan.of(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS})).accepts
    other = "[get_time()]"
    assert parse(other, accepts=accepts) == (other, [])
    assert parse(f"[{WEATHER}, now()]", accepts=accepts) == (None, [WEATHER_CALL, ("now", {})])


def test_history_writes_python_literals_that_parse_back():
    arguments = {"a": [1, None, True, {"k": 'q"\n'}], "b": -1.5, "c": "é"}
    text = f"[{call_text('f', arguments)}]"
    assert text == '[f(a=[1, None, True, {"k": "q\\"\\n"}], b=-1.5, c="é")]'
    assert [(n, json.loads(a)) for n, a in parse_calls(text)] == [("f", arguments)]
    # names Python does not take as keywords go in a ** dict, which is read back
    odd = {"from": "USD", "to": "EUR", "first-name": 1}
    text = f"[{call_text('convert', odd)}]"
    assert text == '[convert(to="EUR", **{"from": "USD", "first-name": 1})]'
    assert [(n, json.loads(a)) for n, a in parse_calls(text)] == [("convert", odd)]
    assert parse_calls("[f(**[1])]") is None


def test_a_surrogate_pair_escape_is_one_character_and_a_lone_one_no_call():
    """Python's literal keeps "\\ud83d\\ude00" as two surrogates, which no response can encode."""
    assert parse('[send(text="hi \\ud83d\\ude00")]') == (None, [("send", {"text": "hi \U0001F600"})])
    assert parse('[send(text="\\ud83d")]') == ('[send(text="\\ud83d")]', [])


TEXTS = [f"[{WEATHER}]", f"<|python_start|>[{WEATHER}, now()]<|python_end|>", "plain words", "[1, 2]",
         f"[{WEATHER}] trailing", f'  [{WEATHER}, now(a="x', "<|python", "   ", "[get"]


def test_streamed_replies_add_up_to_the_parsed_whole_under_any_split():
    rng = random.Random(0)
    for _ in range(300):
        text, end = rng.choice(TEXTS), rng.choice(["stop", "length"])
        content, calls, finish = split_stream(PythonicStream(), text, end, rng)
        whole_content, whole = parse(text, cut=end == "length")
        assert (content, calls) == (whole_content, whole), (text, end)
        assert finish == ("tool_calls" if whole and end == "stop" else end)


def test_prose_streams_at_once_and_a_list_of_calls_is_held():
    stream = PythonicStream()
    assert stream.feed("Paris") == {"content": "Paris"}
    stream = PythonicStream()
    assert stream.feed("[1") == {"content": "[1"}  # a list, but not of calls
    stream = PythonicStream()
    assert stream.feed("[get_weather(") == {} and stream.feed('city="Paris")]') == {}


def test_tool_turns_render_as_python_calls_into_a_template_without_tool_support():
    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    msgs, tools = render(req.messages, ToolPlan.of(req, "pythonic"), native=False)
    assert tools is None and "a Python list of calls with keyword arguments" in msgs[0]["content"]
    assert msgs[2]["content"] == f"[{WEATHER}]" and msgs[3] == {"role": "tool", "content": "21 degrees"}


def test_the_server_parses_pythonic_calls_whole_and_streamed(tokenizer):
    r, _ = run(tokenizer, f"[{WEATHER}]", create(tools=TOOLS), settings=PYTHONIC)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == WEATHER_CALL
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    (chunks, calls, _), _ = run(tokenizer, f"[{WEATHER}]", streamed(tools=TOOLS),
                                settings={"tool_call_parser": "llama4_pythonic"})
    ((_, name, arguments),) = calls.values()
    assert (name, json.loads(arguments)) == WEATHER_CALL and chunks[-1].choices[0].finish_reason == "tool_calls"
    r, engine = run(tokenizer, "Paris is sunny.", create(tools=TOOLS), settings=PYTHONIC)
    assert r.choices[0].message.content == "Paris is sunny." and not r.choices[0].message.tool_calls
    assert engine.seen[0][1].structured_outputs is None  # auto is not constrained


def test_required_is_held_to_json_calls_and_parsed_as_such(tokenizer):
    """A grammar cannot hold Python arguments to a JSON schema: required writes llama3_json's calls
    (vLLM holds every parser's required output to JSON), and the prompt asks for those."""
    json_call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    r, engine = run(tokenizer, json_call, create(tools=TOOLS, tool_choice="required"), settings=PYTHONIC)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == WEATHER_CALL
    assert '\\"parameters\\": ' in engine.seen[0][1].structured_outputs.grammar
    assert "a Python list" not in tokenizer.decode(engine.seen[0][0])
