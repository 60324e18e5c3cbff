import gc
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from unittest import mock

from engine import sampler as sampler_module
from engine.sampler import SamplingRow, Sampler, SequenceSampler, apply_min_tokens, apply_penalties
from engine.sampling_params import SamplingParams

EOS = 2


def row(params=None, prompt=(), output=(), eos=(EOS,), device="cpu", **kwargs):
    params = params or SamplingParams(**kwargs)
    generator = None if params.seed is None else torch.Generator(device).manual_seed(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator, list(eos))


def random_logits(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_batch_is_exactly_argmax():
    logits = random_logits(16, 5000)
    logits[3, [10, 20]] = logits[3].max() + 1  # a tie: the first index wins
    rows = [row(temperature=0.0) for _ in range(16)]
    tokens = [r.token_id for r in Sampler().sample(logits, rows)]
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[3] == 10


def test_greedy_rows_in_a_mixed_batch_are_exactly_argmax():
    logits = random_logits(8, 3000, seed=1)
    rows = [row(temperature=0.0) if i % 2 else row(temperature=0.8, top_k=1 if i == 4 else 0)
            for i in range(8)]
    tokens = [r.token_id for r in Sampler().sample(logits, rows)]
    expected = logits.argmax(dim=-1).tolist()
    for i in (1, 3, 4, 5, 7):
        assert tokens[i] == expected[i]


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-6, 1e-3])
def test_a_temperature_too_small_to_divide_by_samples_at_the_smallest_one(temperature):
    # 1e-40 is subnormal in float32 and 1e-300 rounds to 0: the logits divided by it were inf /
    # nan, and every draw was token 0. vLLM raises such a temperature to 0.01 (with a warning).
    logits = random_logits(4, 3000, seed=4)
    assert SamplingParams(temperature=temperature).temperature == 0.01
    drawn = [r.token_id for r in Sampler().sample(logits, [row(temperature=temperature, seed=1) for _ in range(4)])]
    assert drawn == [r.token_id for r in Sampler().sample(logits, [row(temperature=0.01, seed=1) for _ in range(4)])]


@pytest.mark.parametrize("temperature", [1e7, 1e300])
def test_a_huge_temperature_draws_near_uniformly_without_nan(temperature):
    logits = random_logits(1, 50, seed=5).expand(2000, -1).clone()
    logits[:, 0] = float("-inf")  # a banned token stays banned (-inf / inf was nan)
    assert SamplingParams(temperature=temperature).temperature == 1e6
    drawn = [r.token_id for r in Sampler().sample(logits, [row(temperature=temperature) for _ in range(2000)])]
    assert 0 not in drawn and len(set(drawn)) > 40


def test_a_seed_of_minus_one_is_no_seed():
    """vLLM's: clients send -1 to mean "random"; it was a seed, and two such requests drew alike."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2


def test_sample_does_not_modify_the_logits():
    logits = random_logits(4, 100, seed=2)
    before = logits.clone()
    rows = [row(temperature=0.0, repetition_penalty=1.5, prompt=[1, 5], output=[7]),
            row(top_p=0.5, top_k=10, min_p=0.1, frequency_penalty=1.0, output=[3, 3]),
            row(min_tokens=4, output=[1]),
            row(seed=3, temperature=0.5)]
    Sampler().sample(logits, rows)
    assert torch.equal(logits, before)


# ---- seeded reproducibility -----------------------------------------------------------------

SEEDED = dict(seed=1234, temperature=0.9, top_k=40, top_p=0.95)


def seeded_tokens(step_logits, batch_of):
    """Runs the seeded row over several steps inside batches built by `batch_of(step, row)`."""
    target = row(**SEEDED)
    sampler = Sampler(seed=99)
    tokens = []
    for step, logits in enumerate(step_logits):
        rows, position = batch_of(step, target)
        batch = torch.stack([logits if i == position else random_logits(logits.shape[0], seed=step * 10 + i)
                             for i in range(len(rows))])
        token = sampler.sample(batch, rows)[position].token_id
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


@pytest.fixture(scope="module")
def step_logits():
    return [random_logits(1000, seed=100 + s, scale=2.0) for s in range(12)]


def test_seeded_row_is_independent_of_the_batch(step_logits):
    alone = seeded_tokens(step_logits, lambda step, r: ([r], 0))
    first_of_many = seeded_tokens(step_logits, lambda step, r: (
        [r, row(temperature=0.0), row(temperature=1.3), row(seed=5, top_p=0.5)], 0))
    later_index = seeded_tokens(step_logits, lambda step, r: (
        [row(temperature=1.0), row(temperature=0.0, repetition_penalty=1.3, output=[1, 2]),
         row(seed=7, min_p=0.2), r], 3))
    moving = seeded_tokens(step_logits, lambda step, r: (
        [row(temperature=0.7) for _ in range(step % 3)] + [r], step % 3))
    assert alone == first_of_many == later_index == moving
    assert len(set(alone)) > 1  # really random, not collapsed to argmax


def test_different_seeds_give_different_sequences(step_logits):
    def run(seed):
        target = row(**{**SEEDED, "seed": seed})
        return [Sampler().sample(l[None], [target])[0].token_id for l in step_logits]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(6, 500, seed=3)

    def run(sampler_seed):
        return [r.token_id for r in Sampler(sampler_seed).sample(logits, [row() for _ in range(6)])]

    assert run(0) == run(0)
    assert run(0) != run(1)


# ---- filters ---------------------------------------------------------------------------------


def allowed_tokens(logits: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens that temperature/min_p/top_k/top_p may emit, computed independently (float64) in
    vLLM's order (min_p, then top_k, then top_p over what those kept, renormalized), with a little
    slack at the boundaries so that float rounding never counts as a violation."""
    x = (logits / p.temperature).double().numpy()
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max() * (1 - slack)
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[-p.top_k] - slack
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    # Mass of the strictly more likely tokens (any one of tied tokens may be the one kept).
    mass_above = np.array([kept[kept > q * (1 + slack)].sum() for q in kept])
    keep &= mass_above < p.top_p + slack
    return set(np.flatnonzero(keep).tolist())


filter_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, 70),
    top_p=st.floats(0.01, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=60),
    params=st.lists(filter_params, min_size=1, max_size=3),
    sampler_seed=st.integers(0, 2**31),
    nucleus_candidates=st.sampled_from([1, 3, 1024]),  # 1 and 3 exercise the full-sort fallback
)
def test_filters_never_emit_excluded_tokens(logits, params, sampler_seed, nucleus_candidates):
    """Rows with different filters share a batch; each row keeps to its own allowed set."""
    logits = torch.tensor(logits, dtype=torch.float32)
    rows = [row(params[i % len(params)], eos=()) for i in range(60)]
    with mock.patch.object(sampler_module, "NUCLEUS_CANDIDATES", nucleus_candidates):
        results = Sampler(sampler_seed).sample(logits.expand(len(rows), -1), rows)
    allowed = [allowed_tokens(logits, p) for p in params]
    for i, result in enumerate(results):
        assert result.token_id in allowed[i % len(params)]


@pytest.mark.parametrize("nucleus_candidates", [1, 2, 1024])
def test_filters_exclude_exactly_the_expected_tokens(nucleus_candidates, monkeypatch):
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", nucleus_candidates)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, -1)

    def emitted(**kwargs):
        rows = [row(**kwargs) for _ in range(4000)]
        return {r.token_id for r in Sampler(3).sample(logits, rows)}

    assert emitted() == {0, 1, 2, 3}
    assert emitted(top_k=2) == {1, 3}
    assert emitted(top_p=0.75) == {1, 3}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert emitted(top_p=0.79) == {1, 3}
    assert emitted(top_p=0.81) == {1, 2, 3}
    assert emitted(top_p=0.01) == {1}  # the top token always stays
    assert emitted(min_p=0.25) == {1, 2, 3}  # threshold 0.125
    assert emitted(top_k=3, top_p=0.9, min_p=0.5) == {1, 3}
    # vLLM's order: top_p's 0.81 is of what min_p kept (0.95), so 0.5 + 0.3 = 0.84 of it ends the
    # nucleus; of the whole distribution (0.8 < 0.81) token 2 would have been kept too
    assert emitted(min_p=0.25, top_p=0.81) == {1, 3}


def test_random_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 40000
    rows = [row(temperature=0.5) for _ in range(n)]
    logits = (probs.log() * 0.5).expand(n, -1)  # temperature 0.5 undoes the scaling
    counts = torch.bincount(torch.tensor([r.token_id for r in Sampler(0).sample(logits, rows)]), minlength=4)
    assert torch.allclose(counts / n, probs, atol=0.01)


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    target = row(seed=11)
    counts = [0, 0, 0]
    for _ in range(6000):
        counts[Sampler().sample(probs.log()[None], [target])[0].token_id] += 1
    assert np.allclose(np.array(counts) / 6000, probs.numpy(), atol=0.025)


# ---- penalties and min_tokens ---------------------------------------------------------------


def expected_penalized(logits, prompt, output, rep, freq, pres):
    out = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / rep if value > 0 else value * rep
        value -= freq * output.count(token)
        value -= pres * (token in output)
        out.append(value)
    return out


def test_penalties_change_logits_exactly_as_defined():
    values = [2.0, -1.0, 0.5, 3.0, -2.5, 0.0, 1.5]
    logits = torch.tensor([values, values, values])
    rows = [
        row(prompt=[0, 1], output=[1, 2, 2, 4], repetition_penalty=2.0,
            frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[3, 3], output=[], repetition_penalty=0.5, frequency_penalty=1.0),
        row(prompt=[0], output=[6, 6, 6], presence_penalty=-1.0, frequency_penalty=-0.5),
    ]
    before = logits.clone()
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, before)
    for i, r in enumerate(rows):
        p = r.params
        expected = expected_penalized(values, r.prompt_token_ids, r.output_token_ids,
                                      p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        assert out[i].tolist() == pytest.approx(expected, abs=1e-6)
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.25 - 1.0 - 0.25, 3.0, -5.0 - 0.5 - 0.25, 0.0, 1.5])


def test_penalties_leave_other_rows_untouched():
    logits = random_logits(3, 50, seed=4)
    rows = [row(), row(repetition_penalty=1.2, prompt=[1, 2, 3]), row(temperature=0.0)]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])
    assert apply_penalties(logits, [row(), row(), row()]) is logits


def test_greedy_with_repetition_penalty_avoids_the_repeated_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert Sampler().sample(logits, [row(temperature=0.0, output=[1])])[0].token_id == 1
    penalized = row(temperature=0.0, output=[1], repetition_penalty=2.0)
    assert Sampler().sample(logits, [penalized])[0].token_id == 2


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]] * 2)  # eos (2) is the argmax, then 3, then 4
    rows = [row(temperature=0.0, min_tokens=3, output=[1, 1], stop_token_ids=[3]),
            row(temperature=0.0, min_tokens=3, output=[1, 1, 1], stop_token_ids=[3])]
    assert [r.token_id for r in Sampler().sample(logits, rows)] == [4, 2]
    masked = apply_min_tokens(logits, rows)
    assert masked[0, 2] == masked[0, 3] == float("-inf") and torch.equal(masked[1], logits[1])
    assert apply_min_tokens(logits, [row(), row()]) is logits


def test_min_tokens_random_rows_never_sample_eos():
    logits = torch.zeros(500, 4)
    logits[:, EOS] = 5.0
    rows = [row(min_tokens=1, seed=i if i % 2 else None) for i in range(500)]
    tokens = {r.token_id for r in Sampler().sample(logits, rows)}
    assert EOS not in tokens and tokens == {0, 1, 3}


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits():
    logits = random_logits(4, 300, seed=5)
    rows = [row(logprobs=5, temperature=0.3, repetition_penalty=1.5, output=[1, 2]),
            row(logprobs=0, temperature=0.0),
            row(),
            row(logprobs=20, seed=1, top_k=3)]
    results = Sampler().sample(logits, rows)
    raw = logits.log_softmax(dim=-1)
    for i in (0, 1, 3):
        res = results[i]
        assert res.logprob == pytest.approx(raw[i, res.token_id].item(), abs=1e-6)
        assert res.rank == int((raw[i] >= raw[i, res.token_id]).sum())  # the sampled token's vocabulary rank
        n = rows[i].params.logprobs
        assert len(res.top_logprobs) == n
        values = [v for _, v in res.top_logprobs]
        assert values == sorted(values, reverse=True)
        top = raw[i].topk(n) if n else None
        if n:
            assert [t for t, _ in res.top_logprobs] == top.indices.tolist()
            assert values == pytest.approx(top.values.tolist(), abs=1e-6)
    assert results[1].top_logprobs == []
    assert results[2].logprob is None and results[2].top_logprobs is None and results[2].rank is None
    assert math.isfinite(results[0].logprob)
    assert results[1].rank == 1 and results[0].rank > 1  # greedy: the top; a penalized, tempered draw: not


def test_logprobs_modes_report_raw_or_processed_values():
    """vLLM's --logprobs-mode: raw values, or those the row was drawn from (after bias and
    penalties; for a random row also temperature and the filters, the dropped tokens at -inf)."""
    logits = random_logits(3, 50, seed=6)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    logits[2, :4], logits[2, 4:] = probs, -30.0

    def rows():  # afresh for each mode: a seeded row's generator moves on with each draw
        return [row(logprobs=4, temperature=0.0, logit_bias={7: 50.0}),
                row(logprobs=3, temperature=0.5, presence_penalty=1.0, output=[int(logits[1].argmax())], seed=2),
                row(logprobs=4, temperature=2.0, top_p=0.75, seed=3)]

    results = {mode: Sampler(1, mode).sample(logits, rows()) for mode in sampler_module.LOGPROBS_MODES}
    assert len({tuple(r.token_id for r in res) for res in results.values()}) == 1  # the draws are the same

    biased = logits.clone()
    biased[0, 7] += 50.0
    penalized = logits[1].clone()
    penalized[int(logits[1].argmax())] -= 1.0
    # At temperature 2, 0.05 / 0.5 / 0.15 / 0.3 become 0.12 / 0.38 / 0.21 / 0.29: top_p 0.75 of
    # them keeps three tokens (of the untempered ones it would have kept two)
    kept = logits[2] / 2.0
    kept[0], kept[4:] = float("-inf"), float("-inf")
    expected = {"raw_logits": logits, "raw_logprobs": logits.log_softmax(-1),
                "processed_logits": torch.stack([biased[0], penalized / 0.5, kept]),
                "processed_logprobs": torch.stack([biased[0].log_softmax(-1), (penalized / 0.5).log_softmax(-1),
                                                   kept.log_softmax(-1)])}
    for mode, res in results.items():
        for i, r in enumerate(res):
            want = expected[mode][i]
            assert r.logprob == pytest.approx(want[r.token_id].item(), abs=1e-5), (mode, i)
            top = want.topk(4 if i != 1 else 3)
            assert [t for t, _ in r.top_logprobs] == top.indices.tolist(), (mode, i)
            assert [v for _, v in r.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5), (mode, i)
            assert r.rank == int((want >= want[r.token_id]).sum()), (mode, i)
    assert results["processed_logprobs"][0].token_id == 7  # the bias decided the greedy row
    assert [v for _, v in results["processed_logprobs"][2].top_logprobs][3] == float("-inf")
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(0, "processed")


def test_a_full_sort_finds_the_cut_off_the_candidates_do():
    """The processed logprobs modes find a random row's cut-off by a full sort when a row asks
    for logprobs, and draws use the top candidates otherwise: the same cut-off, also where top_p is
    exactly a token's mass, so a seeded request's tokens do not depend on asking for logprobs."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        logits = torch.full((1, 4096), -12.0) + torch.randn(1, 4096, generator=g) * 0.1
        logits[0, 0], logits[0, 1] = 5.0, 5.0 - 0.01 * torch.rand(1, generator=g).item()
        probs = logits.softmax(dim=-1)
        top_p = float(probs.max())  # the boundary: the top token's mass exactly
        for p in (SamplingParams(temperature=1.0, top_p=top_p), SamplingParams(temperature=1.0, top_p=top_p, min_p=1e-6),
                  SamplingParams(temperature=1.0, top_p=top_p, top_k=50)):
            partial, _ = sampler_module._keep_thresholds(probs.clone(), [p])
            full, _ = sampler_module._keep_thresholds(probs.clone(), [p], full_sort=True)
            assert partial.item() == full.item(), (trial, p)
    for seed in range(20):
        rows = [row(temperature=1.0, top_p=top_p, seed=seed, logprobs=lp) for lp in (None, 1)]
        tokens = [Sampler(0, "processed_logprobs").sample(logits, [r])[0].token_id for r in rows]
        assert tokens[0] == tokens[1], seed


# ---- host waits ------------------------------------------------------------------------------


class HostWaits(TorchDispatchMode):
    """Records the ops that would make the host wait for a GPU mid-step: a tensor read as a
    Python number, and ops whose output size depends on the values. (The one copy that brings
    the results back, `tolist`, is not a dispatched op.)"""
    WAITS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.WAITS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def mixed_rows(device="cpu"):
    """Every sampling feature in one batch (the seeded row's generator on `device`)."""
    return [row(), row(temperature=0.7), row(temperature=1.0, top_k=5), row(temperature=1.2, top_p=0.9),
            row(temperature=0.9, min_p=0.2), row(temperature=1.0, top_p=0.8, seed=3, device=device),
            row(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                logit_bias={7: 3.0}, min_tokens=4, prompt=[5, 7], output=[7, 9]),
            row(temperature=0.0, logprobs=3), row(temperature=0.5, top_k=3, top_p=0.5, logprobs=0),
            row(temperature=0.8, allowed_token_ids=[4, 8, 15, 16], bad_words_token_ids=[[15], [3, 16]], output=[3])]


def test_sampling_reads_nothing_back_before_its_one_copy():
    """On a GPU each such read would stall the host until the forward has run, then launch the
    rest of the sampler behind an idle device; the step's one copy is the only wait."""
    logits = random_logits(len(mixed_rows()), 2000, seed=9)
    with HostWaits() as waits:
        results = Sampler(1).sample(logits, mixed_rows())
    assert waits.ops == []
    assert len(results) == len(mixed_rows()) and results[7].token_id == int(logits[7].argmax())


@pytest.mark.parametrize("candidates", [1, 2, 16])
def test_rows_short_of_their_nucleus_are_drawn_as_with_a_full_sort(candidates, monkeypatch):
    """Flat rows whose top candidates hold less than top_p: the copy says so, they are drawn again
    over the whole sorted row with the same draws, and every row gets the token that considering
    the whole vocabulary from the start gives."""
    logits = random_logits(len(mixed_rows()), 64, seed=4, scale=0.1)  # nearly flat
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", 64)
    full = [r.token_id for r in Sampler(2).sample(logits, mixed_rows())]
    monkeypatch.setattr(sampler_module, "NUCLEUS_CANDIDATES", candidates)
    with HostWaits() as waits:
        short = [r.token_id for r in Sampler(2).sample(logits, mixed_rows())]
    assert short == full
    assert "aten.nonzero.default" in waits.ops  # the redraw ran


# ---- sequences -------------------------------------------------------------------------------


class _Seq:
    """What SequenceSampler reads of a sequence."""

    def __init__(self, index, params, prompt=(), output=()):
        self.index, self.params = index, params
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def test_sequence_sampler_is_the_sampler_on_each_sequences_row():
    """Forked siblings share a row; each seeded sequence draws from seed + index; penalties read
    the prompt and output; eos stays masked until min_tokens."""
    params = SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.4, min_tokens=30, max_tokens=40)
    seqs = [_Seq(0, params, prompt=[1, 4], output=[7]), _Seq(1, params, prompt=[1, 4], output=[7]),
            _Seq(0, SamplingParams(temperature=0.8, top_k=4))]
    sampler = SequenceSampler(seed=3, eos_token_ids=[EOS, EOS])
    reference, generators = Sampler(seed=3), [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6), None]
    for step in range(6):
        logits = random_logits(2, 50, seed=step)
        got = sampler.sample(logits, [0, 0, 1], seqs)
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, g, [EOS])
                for s, g in zip(seqs, generators)]
        want = reference.sample(logits[[0, 0, 1]], rows)
        assert [r.token_id for r in got] == [r.token_id for r in want]
        assert EOS not in [r.token_id for r in got[:2]]
        for s, r in zip(seqs, got):
            s.output_token_ids.append(r.token_id)


def test_sequence_sampler_drops_a_generator_with_its_sequence():
    sampler = SequenceSampler(seed=0, eos_token_ids=[])
    seqs = [_Seq(i, SamplingParams(seed=1)) for i in range(3)]
    sampler.sample(random_logits(3, 20), [0, 1, 2], seqs)
    assert len(sampler._generators) == 3
    del seqs[1:]
    gc.collect()
    assert len(sampler._generators) == 1


# ---- allowed_token_ids, bad_words (engine.token_bans) -------------------------------------------


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, seed=4),
                                    dict(temperature=1.2, top_p=0.5, logprobs=2)])
def test_only_allowed_tokens_are_sampled(params):
    allowed = [3, 17, 40, 41]
    logits = random_logits(6, 100, seed=5)
    rows = [row(allowed_token_ids=allowed, **params) for _ in range(3)] + [row(**params) for _ in range(3)]
    for _ in range(20):
        results = Sampler(2).sample(logits, rows)
        assert all(r.token_id in allowed for r in results[:3])
    if params["temperature"] == 0:
        assert [r.token_id for r in results[:3]] == [allowed[int(logits[i, allowed].argmax())] for i in range(3)]
        assert [r.token_id for r in results[3:]] == logits[3:].argmax(dim=-1).tolist()  # other rows untouched


def test_a_bad_word_is_banned_only_where_it_would_be_completed():
    logits = torch.zeros(4, 50)
    logits[:, 7] = 5.0  # everyone's first choice
    logits[:, 8] = 4.0  # and second
    words = [[5, 6, 7]]
    rows = [row(temperature=0, bad_words_token_ids=words, output=[1, 5, 6]),  # 7 would complete it: banned
            row(temperature=0, bad_words_token_ids=words, output=[5, 6, 1]),  # not at its end: free
            row(temperature=0, bad_words_token_ids=words, output=[6]),  # too short: free
            row(temperature=0, bad_words_token_ids=[[7]])]  # a one-token word: always banned
    assert [r.token_id for r in Sampler(0).sample(logits, rows)] == [8, 7, 7, 8]


def test_banned_tokens_leave_the_logprobs_raw():
    logits = random_logits(1, 30, seed=2)
    banned = int(logits[0].argmax())
    (result,) = Sampler(0).sample(logits, [row(temperature=0, logprobs=1, bad_words_token_ids=[[banned]])])
    assert result.token_id != banned and result.top_logprobs[0][0] == banned


def test_bad_words_are_tokenized_alone_and_after_a_space(smollm2_path):
    from transformers import AutoTokenizer

    from engine.token_bans import bad_words_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    seqs = bad_words_token_ids(tok, ["Paris", " Paris", "Ile de France"])
    for text in ("Paris", " Paris", " Ile de France"):
        assert tok.encode(text, add_special_tokens=False) in seqs
    assert len(seqs) == len({tuple(s) for s in seqs}) == 4  # " Paris" is "Paris" again
