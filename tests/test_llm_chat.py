"""Offline `LLM.chat` (vLLM's): conversations rendered by the model's chat template, as the server
renders /v1/chat/completions, then generated as `LLM.generate` does."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=smollm2_path, max_model_len=512, num_gpu_blocks_override=64)


def _hf_ids(tokenizer, messages, **kwargs) -> list[int]:
    """The chat template's tokens as transformers itself tokenizes them."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_conversation_is_answered_from_the_template_s_own_tokens(llm):
    out, = llm.chat(QUESTION, GREEDY)
    assert out.prompt_token_ids == _hf_ids(llm.tokenizer, QUESTION, add_generation_prompt=True)
    # system, user, and the assistant turn it opens: no BOS (also <|im_start|> here) added before them
    assert out.prompt_token_ids.count(llm.tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert out.prompt.endswith("<|im_start|>assistant\n") and "Paris" in out.outputs[0].text
    assert out.outputs[0].token_ids == llm.generate([out.prompt_token_ids], GREEDY)[0].outputs[0].token_ids


def test_several_conversations_keep_their_order_and_a_final_message_is_continued(llm):
    started = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    outs = llm.chat([started, QUESTION], SamplingParams(temperature=0, max_tokens=4),
                    add_generation_prompt=False, continue_final_message=True)
    assert outs[0].prompt.endswith("The capital of France is")  # left open: no end of turn
    assert outs[0].prompt_token_ids == _hf_ids(llm.tokenizer, started, continue_final_message=True)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].prompt_token_ids == _hf_ids(llm.tokenizer, QUESTION, continue_final_message=True)
    assert not llm.engine.has_unfinished()


def test_the_developer_role_is_system_for_a_template_that_does_not_know_it(llm):
    """vLLM's reading of OpenAI's `developer` role: SmolLM2's template has no such role (it would
    render its default system prompt and a `developer` turn), so a developer message is a system one,
    merged with any other system message into one, first."""
    as_dev = [{"role": "developer", "content": "Be terse."}, *QUESTION]
    as_sys = [{"role": "system", "content": "Be terse."}, *QUESTION]
    prompt = llm.chat(as_dev, GREEDY)[0].prompt_token_ids
    assert prompt == _hf_ids(llm.tokenizer, as_sys, add_generation_prompt=True)
    two = [{"role": "system", "content": "A."}, *QUESTION, {"role": "assistant", "content": "Paris."},
           {"role": "developer", "content": [{"type": "text", "text": "B."}]}, *QUESTION]
    merged = [{"role": "system", "content": "A.\n\nB."}, *QUESTION, {"role": "assistant", "content": "Paris."},
              *QUESTION]
    assert llm.chat(two, GREEDY)[0].prompt_token_ids == _hf_ids(llm.tokenizer, merged, add_generation_prompt=True)
    knows = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{# 'developer' #}"
    assert llm.chat(as_dev, GREEDY, chat_template=knows)[0].prompt.startswith("developer: Be terse.")


def test_content_parts_are_the_text_they_hold(llm):
    """OpenAI's content parts, as the openai client sends them: their text, joined by newlines."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    plain = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.chat(plain, GREEDY)[0].prompt_token_ids
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_template_kwargs_go_over_the_named_arguments_and_parts_stay_parts_when_asked(llm):
    """vLLM's order: chat_template_kwargs update the arguments chat names (add_generation_prompt
    there was a TypeError); chat_template_content_format="openai" hands the template a message's
    parts as a list, for templates that iterate over them."""
    plain = llm.chat(QUESTION, GREEDY, add_generation_prompt=False)[0].prompt_token_ids
    assert llm.chat(QUESTION, GREEDY, chat_template_kwargs={"add_generation_prompt": False})[0].prompt_token_ids \
        == plain == _hf_ids(llm.tokenizer, QUESTION, add_generation_prompt=False)
    template = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "user", "content": "c"}]
    for content_format in ("openai", "auto"):  # auto: vLLM's detection of a loop over the content
        out, = llm.chat(parts, GREEDY, chat_template=template, chat_template_content_format=content_format)
        assert out.prompt == "[a][b][c]"
    assert llm.chat(parts, GREEDY, chat_template=template, chat_template_content_format="string")[0].prompt \
        == "[][][]" + "[]"  # vLLM's string format: the template iterates "a\nb" and "c" (3 + 1 characters)
    with pytest.raises(ValueError, match="chat_template_content_format must be auto, string or openai"):
        llm.chat(QUESTION, GREEDY, chat_template_content_format="json")


def test_what_chat_cannot_render_is_a_value_error(llm, monkeypatch):
    with pytest.raises(ValueError, match="cannot both be set"):
        llm.chat(QUESTION, continue_final_message=True)
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(QUESTION)


def test_a_chat_prompt_holds_the_template_s_tokens_only(llm, bos_tokenizer, monkeypatch):
    """With a tokenizer that begins every encoding with a BOS (as Llama's), the chat prompt gets no
    BOS the template did not write (Llama 3's writes its own: one more made two), in LLM.chat and
    in `kvserve generate`: as vLLM sends chat."""
    from cluster.cli import _format_prompt

    template = bos_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    want = bos_tokenizer.encode(template, add_special_tokens=False)
    assert bos_tokenizer.encode(template)[0] == 0 and want[0] != 0
    monkeypatch.setattr(llm.engine, "tokenizer", bos_tokenizer)
    assert llm.chat(QUESTION, SamplingParams(max_tokens=1))[0].prompt_token_ids == want
    assert _format_prompt(bos_tokenizer, QUESTION[0]["content"], chat=True) == want
    assert _format_prompt(bos_tokenizer, "Once upon", chat=False) == "Once upon"  # the engine adds the BOS


def test_generate_takes_vllm_s_prompt_dicts(llm):
    """{"prompt": text} and {"prompt_token_ids": ids} (vLLM's TextPrompt and TokensPrompt) are the
    text and the ids; a dict's cache_salt keeps its prompt out of other salts' cached blocks."""
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate([text, ids], greedy)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids, "multi_modal_data": None}], greedy)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == text and dicts[1].prompt_token_ids == ids
    long = list(range(100, 140))  # two whole KV blocks: cached once computed
    llm.generate([long], greedy)
    salted, again = llm.generate([{"prompt_token_ids": long, "cache_salt": "a"}], greedy) + llm.generate([long], greedy)
    assert salted.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert llm.get_tokenizer() is llm.tokenizer


def test_generate_takes_a_tokenizers_output(llm):
    """transformers' BatchEncoding (what `tokenizer(texts)` and, in transformers 5,
    `apply_chat_template(..., tokenize=True)` return) is its input_ids, without the padding its
    attention_mask marks; not its keys read as two text prompts."""
    from transformers import BatchEncoding

    texts = ["The capital of France is", "Two plus two is"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ids, greedy)]
    assert [o.outputs[0].token_ids for o in llm.generate(llm.tokenizer(texts), greedy)] == want
    one = llm.generate(llm.tokenizer(texts[0]), greedy)  # one prompt's encoding: one prompt
    assert len(one) == 1 and one[0].outputs[0].token_ids == want[0]
    width = max(map(len, ids))
    padded = BatchEncoding({"input_ids": [[0] * (width - len(i)) + i for i in ids],  # left-padded, as for decoders
                            "attention_mask": [[0] * (width - len(i)) + [1] * len(i) for i in ids]})
    outs = llm.generate(padded, greedy)
    assert [o.prompt_token_ids for o in outs] == ids and [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("prompt, error, says", [
    ({"text": "hi"}, ValueError, "holds `prompt`"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, ValueError, "holds `prompt`"),
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, ValueError, "multi-modal"),
    ({"prompt_token_ids": [1, "x"]}, TypeError, "a prompt is"),
    ([1.5], TypeError, "a prompt is"),
])
def test_a_prompt_generate_cannot_take_is_an_error_naming_what_it_takes(llm, prompt, error, says):
    with pytest.raises(error, match=says):
        llm.generate([prompt], GREEDY)
    assert not llm.engine.has_unfinished()


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens_offline(llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: the last k tokens (-1: as many as leave room for
    max_tokens) are the prompt, the answer the one those tokens alone give; more than
    max_model_len is refused."""
    from engine.errors import InvalidRequestError

    ids = llm.tokenizer.encode("Paris is lovely in spring. " * 40 + "The capital of France is")
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    cut, = llm.generate([ids], SamplingParams(truncate_prompt_tokens=12, **greedy))
    whole, = llm.generate([ids[-12:]], SamplingParams(**greedy))
    assert cut.prompt_token_ids == ids[-12:] and cut.outputs[0].token_ids == whole.outputs[0].token_ids
    assert len(ids) < 512 and llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **greedy))[0].prompt_token_ids == ids
    long, = llm.generate([ids * 3], SamplingParams(truncate_prompt_tokens=-1, **greedy))  # room for 4 tokens left
    assert long.prompt_token_ids == (ids * 3)[-(512 - 4):] and len(long.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="greater than max_model_len"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=513))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=0)
    assert not llm.engine.has_unfinished()
