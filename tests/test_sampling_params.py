import pytest

from engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.greedy


@pytest.mark.parametrize("stop, expected", [
    (None, []),
    ("###", ["###"]),
    (["a", "bc"], ["a", "bc"]),
    (("x",), ["x"]),
])
def test_stop_is_normalized_to_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_stop_list_is_copied():
    stops = ["a"]
    p = SamplingParams(stop=stops, stop_token_ids=(3, 4))
    stops.append("b")
    assert p.stop == ["a"] and p.stop_token_ids == [3, 4]


@pytest.mark.parametrize("field, value", [
    ("n", 0),
    ("temperature", -0.1),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),  # a logit of 0 times inf was nan, and always drawn
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -3.0),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("prompt_logprobs", -2),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [5, -1]),
    ("temperature", float("inf")),
    ("seed", 1 << 63),  # beyond torch's 64-bit seeds
    # the wrong type: said when the params are built, naming the field (vLLM's checks too)
    ("n", 2.5), ("n", "2"), ("max_tokens", "10"), ("max_tokens", 10.0), ("top_k", 1.5), ("seed", 1.0),
    ("logprobs", "1"), ("temperature", "0.5"), ("top_p", None), ("stop", 5), ("stop_token_ids", 5),
    ("stop_token_ids", [1.5]),
    # what the engine does per token or per step, bounded: a request cannot stall it (a live
    # server: 300,000 stop strings held every other request 2 s)
    ("stop", [f"s{i}" for i in range(129)]), ("bad_words", ["x" * 1001]), ("bad_words", ["w"] * 101),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


def test_token_id_lists_keep_each_id_once_in_order():
    """A list of ids is then no longer than the vocabulary whatever a client repeats (1.7 M ids
    were rebuilt per row every step: 9 s for a 1-token request beside it)."""
    p = SamplingParams(allowed_token_ids=[5, 3, 5, 5, 3, 9] * 1000, stop_token_ids=[2, 2, 7, 2])
    assert p.allowed_token_ids == [5, 3, 9] and p.stop_token_ids == [2, 7]
    assert len(SamplingParams(stop=[f"s{i}" for i in range(128)], bad_words=["x" * 1000]).stop) == 128


def test_numbers_of_other_kinds_are_accepted():
    import numpy as np

    p = SamplingParams(n=np.int64(2), max_tokens=np.int32(5), temperature=1, top_p=np.float32(0.5))
    assert (p.n, p.max_tokens, p.temperature) == (2, 5, 1)


def test_detokenize_off_takes_no_stop_strings():
    with pytest.raises(ValueError, match="stop must be empty with detokenize=False"):
        SamplingParams(detokenize=False, stop=["x"])
    assert SamplingParams(detokenize=False, stop_token_ids=[3]).stop_token_ids == [3]


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=50), dict(top_p=1.0), dict(top_p=1e-3),
    dict(min_p=0.0), dict(min_p=1.0), dict(temperature=0.0), dict(logprobs=0), dict(logprobs=20),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(max_tokens=None), dict(max_tokens=1),
    dict(stop_token_ids=[0]), dict(seed=-5), dict(seed=(1 << 63) - 1), dict(seed=-(1 << 63)),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, greedy", [
    (dict(temperature=0.0), True),
    (dict(temperature=0.7, top_k=1), True),
    (dict(temperature=0.7), False),
    (dict(temperature=1e-6), False),  # raised to 0.01, as vLLM raises it
    (dict(temperature=2e-5), False),
    (dict(top_k=2), False),
])
def test_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_greedy_params_read_back_with_no_filters_as_vllm_s():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.1)
    assert (p.top_p, p.top_k, p.min_p, p.greedy) == (1.0, 0, 0.0, True)
    sampled = SamplingParams(temperature=0.5, top_p=0.5, top_k=5, min_p=0.1)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 5, 0.1)
    with pytest.raises(ValueError, match="top_p must be in"):  # checked before: a bad value is still refused
        SamplingParams(temperature=0, top_p=0)


def test_vllm_s_constructors_copies_and_extra_args():
    assert SamplingParams.from_optional(temperature=None, top_p=0.5) == SamplingParams(top_p=0.5)
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None  # vLLM's: no cap but the room
    p = SamplingParams(stop=["x"], logit_bias={3: 1.0}, extra_args={"plugin": [1]})
    q = p.clone()
    assert q == p and q is not p and q.extra_args is not p.extra_args
    q.stop.append("y")
    assert p.stop == ["x"]
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])
