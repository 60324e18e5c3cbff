"""tests/tiny_llama.py's `tie_breaks`, which the GPU's bfloat16 exactness test judges by: a greedy
sequence that leaves HF's only where HF's two best logits nearly tie is accepted; any other
departure is reported. Checked here on CPU against HF's own float32 logits."""
from __future__ import annotations

import pytest
import torch

from tests.test_engine_exact import MAX_NEW, _prompts
from tests.tiny_llama import hf_greedy, make_tiny_llama, tie_breaks


@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm2_path):
    """The gqa model, its prompts, HF's greedy tokens, and per generated token (sequence, index,
    runner-up, relative gap between HF's two best logits)."""
    from transformers import AutoModelForCausalLM

    d = make_tiny_llama(tmp_path_factory.mktemp("gqa"), smollm2_path, "gqa")
    prompts = _prompts()
    expected = hf_greedy(d, prompts, MAX_NEW)
    model = AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()
    gaps = []
    for i, (p, e) in enumerate(zip(prompts, expected)):
        with torch.no_grad():
            logits = model(torch.tensor([p + e])).logits[0, len(p) - 1:-1]
        top = logits.topk(2)
        for k in range(len(e)):
            best, second = top.values[k].tolist()
            assert top.indices[k, 0] == e[k]  # greedy's choice is HF's best
            gaps.append((i, k, int(top.indices[k, 1]), (best - second) / abs(best)))
    return d, prompts, expected, sorted(gaps, key=lambda g: g[3])


def _taking(expected, i, k, token):
    got = [list(e) for e in expected]
    got[i] = got[i][:k] + [token] + [3] * (len(got[i]) - k - 1)  # whatever follows a departure
    return got


def test_the_same_tokens_pass(path):
    d, prompts, expected, _ = path
    assert tie_breaks(d, prompts, [list(e) for e in expected], expected) == []


def test_the_runner_up_at_a_near_tie_passes_and_elsewhere_fails(path):
    d, prompts, expected, gaps = path
    (i, k, runner_up, gap), (j, m, far_runner_up, far_gap) = gaps[0], gaps[-1]
    assert tie_breaks(d, prompts, _taking(expected, i, k, runner_up), expected, max_gap=gap * 1.01) == []
    (problem,) = tie_breaks(d, prompts, _taking(expected, j, m, far_runner_up), expected, max_gap=gap * 1.01)
    assert problem.startswith(f"sequence {j}, token {m}:") and "apart" in problem


def test_a_token_outside_the_two_best_fails_and_so_does_a_length(path):
    d, prompts, expected, gaps = path
    i, k, runner_up, _ = gaps[0]
    other = next(t for t in range(3, 512) if t not in (expected[i][k], runner_up))
    (problem,) = tie_breaks(d, prompts, _taking(expected, i, k, other), expected, max_gap=1.0)
    assert "not one of HF's two best" in problem
    shorter = [list(e) for e in expected]
    shorter[0] = shorter[0][:-1]
    assert tie_breaks(d, prompts, shorter, expected) == [f"sequence 0: {MAX_NEW - 1} tokens, HF {MAX_NEW}"]


def test_the_best_of_hfs_own_forward_passes_where_hfs_generate_left_it(path):
    """HF's generate can take the runner-up at an exact bfloat16 tie (its KV cache rounds the step
    otherwise than one forward over the prefix): the engine's token, that forward's best, is right."""
    d, prompts, expected, gaps = path
    i, k, runner_up, _ = gaps[-1]  # even far from a tie: the engine agrees with HF's forward
    generated = _taking(expected, i, k, runner_up)
    assert tie_breaks(d, prompts, [list(e) for e in expected], generated, max_gap=0.0) == []
