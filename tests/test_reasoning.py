"""--reasoning-parser: a chat reply's <think> block to `reasoning`, whole and streamed, through the
real HTTP app and the official openai client over a scripted engine (router.reasoning)."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.reasoning import (ReasoningStream, count_reasoning_tokens, grammar_gate, opens_in_reasoning,
                              split_reasoning)
from tests.scripted_engine import run
from tests.test_tools import CALL, TOOLS, USER, create

THINKING = {"reasoning_parser": "qwen3"}
REPLY = "<think>\nThe user asks about Paris.\n</think>\n\nParis is in France."


def _whole(tokenizer, script, settings=THINKING, **kwargs):
    r, engine = run(tokenizer, script, create(**kwargs), settings=settings)
    return r.choices[0], engine


def _streamed(tokenizer, script, settings=THINKING, **kwargs):
    async def go(client):
        stream = await create(stream=True, **kwargs)(client)
        return [c async for c in stream]
    chunks, _ = run(tokenizer, script, go, settings=settings)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    assert reasoning == "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_reasoning_and_answer_come_apart_whole_and_streamed(tokenizer):
    choice, _ = _whole(tokenizer, REPLY)
    msg = choice.message.model_dump()
    assert msg["reasoning"] == msg["reasoning_content"] == "\nThe user asks about Paris.\n"
    assert msg["content"] == "\n\nParis is in France." and choice.finish_reason == "stop"
    reasoning, content, chunks = _streamed(tokenizer, REPLY)
    assert (reasoning, content) == (msg["reasoning"], msg["content"])
    assert all("<think>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_include_reasoning_false_leaves_the_reasoning_out_as_vllm_does(tokenizer):
    choice, _ = _whole(tokenizer, REPLY, extra_body={"include_reasoning": False})
    msg = choice.message.model_dump()
    assert msg["content"] == "\n\nParis is in France." and msg.get("reasoning") is None
    reasoning, content, _ = _streamed(tokenizer, REPLY, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", msg["content"])


def test_without_a_parser_the_tags_stay_in_the_content(tokenizer):
    choice, _ = _whole(tokenizer, REPLY, settings={})
    assert choice.message.content == REPLY and "reasoning" not in choice.message.model_dump()


def test_thinking_off_is_all_content_and_a_cut_reply_all_reasoning(tokenizer):
    choice, _ = _whole(tokenizer, "Paris is in France.")
    assert (choice.message.reasoning, choice.message.content) == (None, "Paris is in France.")
    cut, _ = _whole(tokenizer, "<think>Let me think about this for a wh")
    assert (cut.message.reasoning, cut.message.content) == ("Let me think about this for a wh", None)
    assert _streamed(tokenizer, "<think>Let me think about this for a wh")[:2] == ("Let me think about this for a wh", "")


def test_a_template_that_opens_the_block_starts_the_reply_inside_it(tokenizer):
    """Qwen3.5's (and DeepSeek-R1's) template ends the prompt with <think>: no opening tag comes."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
    settings = {"reasoning_parser": "qwen3", "chat_template": template}
    choice, _ = _whole(tokenizer, "Paris, surely.</think>The capital is Paris.", settings=settings)
    assert (choice.message.reasoning, choice.message.content) == ("Paris, surely.", "The capital is Paris.")
    assert _streamed(tokenizer, "Paris, surely.</think>The capital is Paris.", settings=settings)[:2] == \
        ("Paris, surely.", "The capital is Paris.")


def test_tool_calls_are_read_from_the_answer_only(tokenizer):
    script = f"<think>I should call get_weather.</think>\n<tool_call>\n{CALL}\n</tool_call>"
    choice, _ = _whole(tokenizer, script, tools=TOOLS)
    assert choice.message.reasoning == "I should call get_weather." and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    assert choice.finish_reason == "tool_calls"
    reasoning, content, chunks = _streamed(tokenizer, script, tools=TOOLS)
    assert (reasoning, content) == ("I should call get_weather.", "")
    assert [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []] == \
        ["get_weather"]


@pytest.fixture(scope="module")
def thinking(tokenizer):
    """The tokenizer with `<think>` and `</think>` as tokens of their own, as thinking models have them."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    return tok


def test_a_grammar_waits_for_the_reasoning_to_end(thinking):
    """A constrained reply reasons first; the engine is told to hold the grammar back until
    `</think>` (engine.structured.params), and the reply is split like any other."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    choice, engine = _whole(thinking, '<think>It wants JSON.</think>{"a": "<think>"}', response_format=fmt)
    assert (choice.message.reasoning, choice.message.content) == ("It wants JSON.", '{"a": "<think>"}')
    spec = engine.seen[0][1].structured_outputs
    assert (spec.json, spec.reasoning_start, spec.reasoning_end) == (json.dumps(schema, separators=(",", ":")),
                                                                     "<think>", "</think>")
    assert _streamed(thinking, '{"a": "b"}', response_format=fmt)[:2] == ("", '{"a": "b"}')  # no reasoning
    _, engine = _whole(thinking, "x</think>[1]", settings={"reasoning_parser": "deepseek_r1"},
                       extra_body={"structured_outputs": {"regex": r"\[\d\]"}})
    spec = engine.seen[0][1].structured_outputs
    assert (spec.regex, spec.reasoning_start, spec.reasoning_end) == (r"\[\d\]", None, "</think>")
    _, engine = _whole(thinking, "{}", settings={}, response_format=fmt)  # no parser: no gate
    assert engine.seen[0][1].structured_outputs.reasoning_end is None


def test_enable_in_reasoning_puts_the_grammar_over_the_whole_reply(thinking):
    """vLLM's structured_outputs_config enable_in_reasoning: no gate; the reply is the grammar's
    from its first token, and none of it is taken for reasoning."""
    fmt = {"type": "json_object"}
    choice, engine = _whole(thinking, '{"a": "<think>"}', response_format=fmt,
                            settings={**THINKING, "structured_outputs_in_reasoning": True})
    assert (choice.message.reasoning, choice.message.content) == (None, '{"a": "<think>"}')
    assert engine.seen[0][1].structured_outputs.reasoning_end is None
    choice, engine = _whole(thinking, REPLY, settings={**THINKING, "structured_outputs_in_reasoning": True})
    assert choice.message.reasoning == "\nThe user asks about Paris.\n"  # unconstrained replies still reason


def test_without_a_one_token_end_tag_the_grammar_governs_the_whole_reply(tokenizer):
    """SmolLM2 writes `</think>` in pieces: no gate could hold its grammar back exactly, so none is
    asked for, and the reply, all the grammar's, is not split."""
    fmt = {"type": "json_object"}
    for parser in ("qwen3", "deepseek_r1"):
        choice, engine = _whole(tokenizer, '{"a": "</think>"}', settings={"reasoning_parser": parser},
                                response_format=fmt)
        assert (choice.message.reasoning, choice.message.content) == (None, '{"a": "</think>"}')
        assert engine.seen[0][1].structured_outputs.reasoning_end is None


def test_a_required_tool_call_comes_after_the_reasoning(thinking):
    script = f"<think>Weather needs a call.</think><tool_call>\n{CALL}\n</tool_call>"
    choice, engine = _whole(thinking, script, tools=TOOLS, tool_choice="required")
    assert choice.message.reasoning == "Weather needs a call." and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert engine.seen[0][1].structured_outputs.reasoning_end == "</think>"


def test_a_named_call_cut_inside_the_reasoning_has_empty_arguments(thinking):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice, _ = _whole(thinking, "<think>Still weighing it", tools=TOOLS, tool_choice=named)
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments, choice.message.reasoning) == \
        ("get_weather", "", "Still weighing it")


def test_a_template_that_closed_the_block_lets_the_grammar_apply_at_once(thinking):
    """Qwen3 with thinking off: its template writes an empty block into the prompt."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: <think>\n\n</think>\n\n{% endif %}")
    _, engine = _whole(thinking, '{"a": 1}', settings={"reasoning_parser": "qwen3", "chat_template": template},
                       response_format={"type": "json_object"})
    spec = engine.seen[0][1].structured_outputs
    assert spec.json_object and (spec.reasoning_start, spec.reasoning_end) == (None, None)


def test_tags_a_user_typed_are_not_the_templates(thinking):
    """The last message's own `<think>` opens nothing (nor turns the grammar off); continued
    assistant text's does."""
    msgs = [{"role": "user", "content": "Describe a cat as JSON. <think>"}]
    choice, engine = _whole(thinking, '{"a": 1}', messages=msgs, response_format={"type": "json_object"})
    assert (choice.message.reasoning, choice.message.content) == (None, '{"a": 1}')
    assert engine.seen[0][1].structured_outputs.reasoning_start == "<think>"  # may open one; not inside one
    choice, _ = _whole(thinking, "Paris.", messages=[{"role": "system", "content": "x </think>"}, *USER])
    assert (choice.message.reasoning, choice.message.content) == (None, "Paris.")


def test_unknown_parser_is_refused():
    from router.settings import RouterSettings

    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        RouterSettings(served_model_name="m", reasoning_parser="granite")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n"]), max_size=12),
       st.booleans())
def test_reasoning_tokens_end_with_the_one_that_closes_the_block(tokenizer, pieces, opened):
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    n = count_reasoning_tokens(ids, tokenizer.decode, opened)
    reasoning, content = split_reasoning(tokenizer.decode(ids), opened)
    if reasoning is None and not opened and not tokenizer.decode(ids).lstrip().startswith("<think>"):
        assert n == 0
    elif content is None and "</think>" not in tokenizer.decode(ids):
        assert n == len(ids)
    else:  # the tag is whole in the first n tokens' text and not in the first n - 1's
        assert "</think>" in tokenizer.decode(ids[:n]) and "</think>" not in tokenizer.decode(ids[:n - 1])


def test_opens_in_reasoning():
    assert opens_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert opens_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\nThe user")  # continued from inside
    assert not opens_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not opens_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert opens_in_reasoning("deepseek_r1", "<|im_start|>assistant\n")  # R1 always thinks
    assert not opens_in_reasoning("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n")  # unless turned off


def test_the_grammar_gate_reads_the_prompts_end_not_an_earlier_turn():
    # Qwen3's template keeps the last assistant turn's block in a tool loop: the new reply may still think
    loop = ("<|im_start|>assistant\n<think>\nCall it.\n</think>\n\n<tool_call>{}</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n12C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert grammar_gate("qwen3", loop) == {"reasoning_end": "</think>", "reasoning_start": "<think>"}
    assert grammar_gate("deepseek_r1", loop) == {"reasoning_end": "</think>"}
    off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert grammar_gate("qwen3", off) == grammar_gate("deepseek_r1", off) == {}  # thinking off: at once
    assert grammar_gate("qwen3", "<|im_start|>assistant\n<think>\n") == {"reasoning_end": "</think>"}


def test_an_assistant_message_continued_from_inside_its_reasoning(tokenizer):
    prefill = [*USER, {"role": "assistant", "content": "<think>\nThe user"}]
    script = " wants the place.</think>Paris."
    kwargs = dict(messages=prefill, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    choice, _ = _whole(tokenizer, script, **kwargs)
    assert (choice.message.reasoning, choice.message.content) == (" wants the place.", "Paris.")
    assert _streamed(tokenizer, script, **kwargs)[:2] == (" wants the place.", "Paris.")


def test_deepseek_r1_reads_text_before_a_bare_end_tag_as_reasoning(tokenizer):
    r1 = {"reasoning_parser": "deepseek_r1"}
    choice, _ = _whole(tokenizer, "abc</think>xyz", settings=r1)
    assert (choice.message.reasoning, choice.message.content) == ("abc", "xyz")
    choice, _ = _whole(tokenizer, "no end tag", settings=r1)
    assert (choice.message.reasoning, choice.message.content) == ("no end tag", None)
    choice, _ = _whole(tokenizer, "<think>\nabc</think>xyz", settings=r1)  # a distill that writes the tag
    assert (choice.message.reasoning, choice.message.content) == ("\nabc", "xyz")
    assert _streamed(tokenizer, "<think>\nabc</think>xyz", settings=r1)[:2] == ("\nabc", "xyz")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["<think>a</think>b", " <think>\nx</thi", "no tags </think> here", "<thin", "",
                        "<think></think>", "a</think></think>b", "<<think>>x</think>"]),
       st.booleans(), st.integers(0, 2 ** 32 - 1))
def test_the_stream_adds_up_to_the_whole_split_under_any_chunking(text, opened, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stream, reasoning, content = ReasoningStream(opened), "", ""
    for k, piece in enumerate(pieces):
        r, c = stream.step(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == split_reasoning(text, opened)


# -- /v1/responses: a reasoning item before the message ----------------------------------------------

def test_responses_give_the_reasoning_its_own_item_whole_and_streamed(tokenizer):
    async def go(client):
        whole = await client.responses.create(model="m", input="Where is Paris?")
        stream = await client.responses.create(model="m", input="Where is Paris?", stream=True)
        events = [e async for e in stream]
        # Given back as input, as clients replay output items: accepted, kept out of the prompt.
        replayed = [item.model_dump(exclude_none=True) for item in whole.output]
        again = await client.responses.create(model="m", input=[*replayed, {"role": "user", "content": "And Rome?"}])
        follow = await client.responses.create(model="m", input="And Rome?", previous_response_id=whole.id)
        return whole, events, again, follow

    (whole, events, again, follow), engine = run(tokenizer, REPLY, go, settings=THINKING)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nThe user asks about Paris.\n")]
    assert message.type == "message" and whole.output_text == "\n\nParis is in France."
    # the reasoning's tokens: up to and including the one that completes </think>
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    thought = next(i for i in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:i]))
    assert 0 < thought < len(ids) and whole.usage.output_tokens_details.reasoning_tokens == thought
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == thought

    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning.content[0].text and done.output_index == 0
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    added = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert added == [("response.output_item.added", 0), ("response.output_item.done", 0),  # one item at a time
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert events[-1].response.output[0].status == "completed"

    assert again.output_text == follow.output_text == whole.output_text
    for prompt, _ in engine.seen[2:]:  # the earlier reply's answer is in the prompt, its reasoning is not
        text = tokenizer.decode(prompt)
        assert "Paris is in France." in text and "asks about Paris" not in text


def test_responses_close_the_reasoning_before_a_call_opens(tokenizer):
    tool = {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}
    script = f"<think>I should call it.</think>\n<tool_call>\n{CALL}\n</tool_call>"

    async def go(client):
        stream = await client.responses.create(model="m", input="Weather?", tools=[tool], stream=True)
        return [e async for e in stream]

    events, _ = run(tokenizer, script, go, settings=THINKING)
    items = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert items == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert [item.type for item in events[-1].response.output] == ["reasoning", "function_call"]


def test_responses_cut_inside_the_reasoning_have_no_message_and_an_incomplete_reasoning(tokenizer):
    # As OpenAI's reasoning models cut at max_output_tokens: the reasoning so far, no answer.
    async def go(client):
        whole = await client.responses.create(model="m", input="Where is Paris?", max_output_tokens=8)
        stream = await client.responses.create(model="m", input="Where is Paris?", max_output_tokens=8, stream=True)
        return whole, [e async for e in stream]

    (whole, events), _ = run(tokenizer, "<think>\nThe user asks about", go, settings=THINKING, finish_reason="length")
    for response in whole, events[-1].response:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        (reasoning,) = response.output
        assert reasoning.type == "reasoning" and reasoning.status == "incomplete"
        assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nThe user asks about")]
        assert response.output_text == ""
    assert events[-1].type == "response.incomplete"
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and "response.content_part.added" in kinds
    added = [(e.type, e.output_index) for e in events if e.type.startswith("response.output_item.")]
    assert added == [("response.output_item.added", 0), ("response.output_item.done", 0)]
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete"
