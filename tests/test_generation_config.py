"""vLLM's --generation-config: a model's generation_config.json sampling fields as the defaults of
requests that leave them unset (engine.generation_config), checked at the HTTP edge."""
from __future__ import annotations

import json

import pytest

from engine.generation_config import sampling_defaults
from router.protocol import check_sampling_values
from router.settings import RouterSettings
from tests.scripted_engine import run

USER = [{"role": "user", "content": "Is the sky blue?"}]
MODEL_DEFAULTS = {"temperature": 0.3, "top_k": 1, "top_p": 0.5, "repetition_penalty": 1.3, "do_sample": True,
                  "max_new_tokens": 40, "eos_token_id": 2}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return tmp_path


def test_the_sources_and_overrides(model_dir, tmp_path_factory):
    expected = {"temperature": 0.3, "top_k": 1, "top_p": 0.5, "repetition_penalty": 1.3, "max_tokens": 40}
    assert sampling_defaults("auto", model_dir) == expected  # only the sampling fields, as vLLM
    assert sampling_defaults("vllm", model_dir) == {}
    other = tmp_path_factory.mktemp("other")
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.1}))
    assert sampling_defaults(str(other), model_dir) == {"min_p": 0.1}
    assert sampling_defaults("auto", other.parent / "none") == {}  # no file: OpenAI's defaults
    assert sampling_defaults("auto", model_dir, {"temperature": 0.9, "max_new_tokens": 8}) == {
        **expected, "temperature": 0.9, "max_tokens": 8}


@pytest.mark.parametrize("source, overrides, says", [
    ("/nonexistent", None, "not auto, vllm or a directory"),
    ("auto", {"temprature": 1}, "unknown field(s) temprature"),
    ("auto", {"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ("auto", {"top_k": 1.5}, "top_k must be an integer"),
    ("auto", {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
])
def test_values_no_request_could_send_are_refused(model_dir, source, overrides, says):
    with pytest.raises(ValueError) as e:
        sampling_defaults(source, model_dir, overrides, check_sampling_values)
    assert says in str(e.value)


def test_a_request_takes_the_defaults_for_what_it_leaves_unset(tokenizer, model_dir):
    defaults = RouterSettings(served_model_name="m").with_sampling_defaults(model_dir).sampling_defaults

    async def go(client):
        await client.chat.completions.create(model="m", messages=USER)
        await client.chat.completions.create(model="m", messages=USER, temperature=1.0, top_p=1.0, max_tokens=5,
                                             extra_body={"top_k": -1, "repetition_penalty": 1.0})
        await client.completions.create(model="m", prompt="hi")  # completions' own max_tokens default: 16
        # no max_tokens in chat: the server's default, at most the room the context leaves
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi " * 4060}])

    _, engine = run(tokenizer, "yes", go, settings={"sampling_defaults": defaults})
    unset, given, completion = (params for _, params in engine.seen[:3])
    long_prompt, long = engine.seen[3]
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty, unset.max_tokens) == (
        0.3, 0.5, 1, 1.3, 40)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty, given.max_tokens) == (
        1.0, 1.0, -1, 1.0, 5)
    assert completion.max_tokens == 16 and completion.temperature == 0.3
    assert 4096 - len(long_prompt) < 40
    assert long.max_tokens == 4096 - len(long_prompt)  # vLLM's: the default, or less where the context leaves less room


def test_without_a_generation_config_requests_get_openais_defaults(tokenizer):
    _, engine = run(tokenizer, "yes", lambda client: client.chat.completions.create(model="m", messages=USER))
    (_, params), = engine.seen
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        1.0, 1.0, 0, 1.0, None)
