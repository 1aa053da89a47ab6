"""Pure-function tests of the generator: processed distributions, greedy and speculative
acceptance (with a chi-square test that a broken sampler fails), the draft-length policy and the
verify-cost model.  No model is loaded here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ngram_generator import sampling
from ngram_generator.drafting import Draft, DraftLengthPolicy, VerifyCost
from ngram_generator.sampling import (SamplingParams, greedy_accept, processed_probs,
                                      speculative_accept)


def chi_square_pvalue(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    n = observed.sum()
    exp = expected_p * n
    small = exp < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# --------------------------------------------------------------------------------------------
# processed distribution
# --------------------------------------------------------------------------------------------
def test_processed_probs_temperature_only_is_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    p = processed_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2.0, -1))


def test_processed_probs_top_k_keeps_k_largest():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert set(torch.nonzero(p).flatten().tolist()) == {1, 4}
    assert torch.allclose(p.sum(), torch.tensor(1.0))


def test_processed_probs_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = probs.log()
    # mass before the third token is 0.75 < 0.8: it is kept; the fourth (0.9 before) is not
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert p[3] == 0 and (p[:3] > 0).all()
    assert torch.allclose(p[:3], probs[:3] / probs[:3].sum())
    # a tiny top_p still keeps the best token
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_processed_probs_batched_rows_are_independent():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=10)
    batched = processed_probs(logits, sp)
    for i in range(5):
        assert torch.allclose(batched[i], processed_probs(logits[i], sp))


def test_sampling_params_validate():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(temperature=1, top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=1, top_k=-2)


# --------------------------------------------------------------------------------------------
# acceptance rules
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft, target, expected", [
    ([], [7], (0, 7)),
    ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all right: bonus token
    ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # mismatch at 1: the target's token there
    ([9, 2, 3], [1, 2, 3, 4], (0, 1)),  # all wrong
])
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(draft, target) == expected


def _spec_first_tokens(probs: torch.Tensor, draft: list[int], n: int, seed: int,
                       accept=speculative_accept) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(probs.shape[-1], np.int64)
    for _ in range(n):
        k, tok = accept(draft, probs, g)
        counts[draft[0] if k else tok] += 1  # the first token emitted
    return counts


def _rows(*ps):
    return torch.tensor(ps, dtype=torch.float32)


P0 = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
P1 = [0.05, 0.05, 0.30, 0.30, 0.20, 0.10]


@pytest.mark.parametrize("draft_token", [0, 3, 5])  # likely, middling and unlikely drafts
def test_speculative_first_token_matches_target_distribution(draft_token):
    probs = _rows(P0, P1)
    counts = _spec_first_tokens(probs, [draft_token], 4000, seed=1234 + draft_token)
    assert chi_square_pvalue(counts, np.array(P0)) > 1e-3


def test_speculative_second_token_given_first_accepted():
    # the token after an accepted draft token must follow the next row
    probs = _rows(P0, P1, P0)
    g = torch.Generator().manual_seed(7)
    counts = np.zeros(6, np.int64)
    for _ in range(6000):
        n, tok = speculative_accept([0, 3], probs, g)
        if n >= 1:
            counts[3 if n == 2 else tok] += 1
    assert counts.sum() > 2000
    assert chi_square_pvalue(counts, np.array(P1)) > 1e-3


def test_chi_square_catches_a_broken_sampler():
    """Resampling from p itself (instead of p without x) biases towards x: the test must see it."""

    def broken(draft, probs, generator):
        n, tok = speculative_accept(draft, probs, generator)
        if n < len(draft):  # "forgot" to remove x: draw from the full row instead
            tok = sampling.sample(probs[n], generator)
        return n, tok

    probs = _rows(P0, P1)
    counts = _spec_first_tokens(probs, [0], 4000, seed=99, accept=broken)
    assert chi_square_pvalue(counts, np.array(P0)) < 1e-6


def test_speculative_respects_top_k_and_top_p():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.3, top_k=5, top_p=0.8)
    probs = processed_probs(logits, sp)
    allowed = [set(torch.nonzero(probs[i]).flatten().tolist()) for i in range(3)]
    assert all(1 <= len(a) <= 5 for a in allowed)
    g = torch.Generator().manual_seed(0)
    outside = int(torch.argmin(logits[0]))  # a draft the filters removed: never accepted
    for _ in range(500):
        n, tok = speculative_accept([outside, 1], probs, g)
        assert n == 0 and tok in allowed[0]
    for _ in range(500):
        d = sorted(allowed[0])[0]
        n, tok = speculative_accept([d], probs, g)
        assert tok in allowed[n]


def test_speculative_accept_is_reproducible_with_a_seed():
    probs = _rows(P0, P1, P0)
    a = [speculative_accept([0, 2], probs, g) for g in [torch.Generator().manual_seed(5)] * 50]
    b = [speculative_accept([0, 2], probs, g) for g in [torch.Generator().manual_seed(5)] * 50]
    assert a == b


def test_speculative_accept_certain_draft_is_always_accepted():
    probs = _rows([0.0, 1.0, 0.0], [0.0, 0.0, 1.0])
    g = torch.Generator().manual_seed(0)
    assert all(speculative_accept([1], probs, g) == (1, 2) for _ in range(100))


# --------------------------------------------------------------------------------------------
# draft length policy and verify cost
# --------------------------------------------------------------------------------------------
def _draft(orders):
    k = len(orders)
    return Draft(np.arange(k), np.asarray(orders), np.zeros(k, np.int64), np.ones(k, np.float32))


def test_verify_cost_interpolates_medians_and_ignores_outliers():
    c = VerifyCost()
    for s in (0.050, 0.052, 0.051, 0.400):  # one outlier
        c.observe(1, s)
    for s in (0.090, 0.091, 0.089):
        c.observe(2, s)
    for s in (0.110, 0.111):
        c.observe(4, s)
    assert c.seconds(1) == pytest.approx(0.0515, abs=1e-3)
    assert c.seconds(3) == pytest.approx(0.1, abs=2e-3)
    assert c.seconds(8) > c.seconds(4)  # extrapolated with the last slope


def test_policy_never_speculates_when_verification_is_too_expensive():
    cost = VerifyCost()
    for n in range(1, 18):
        cost.observe(n, 0.05 * n)  # k + 1 tokens cost k + 1 forwards: nothing to gain
    pol = DraftLengthPolicy(cost, prior_scale=0.9, explore_every=10**9)
    assert pol.choose(_draft([4, 5, 6, 7])) == 0


def test_policy_drafts_long_when_verification_is_free_and_acceptance_high():
    cost = VerifyCost()
    for n in range(1, 18):
        cost.observe(n, 0.05)
    pol = DraftLengthPolicy(cost, prior_scale=0.8)
    assert pol.choose(_draft([5] * 12)) == 12


def test_policy_learns_per_order_acceptance_and_explores():
    cost = VerifyCost()
    cost.observe(1, 0.05)
    cost.observe(17, 0.05 * 1.6)
    pol = DraftLengthPolicy(cost, prior_scale=0.5, explore_every=4)
    for _ in range(50):
        pol.observe([1, 1], 0)  # order 1 always rejected
        pol.observe([6, 6, 6], 3)  # order 6 always accepted
    assert pol.rate(1) < 0.1 < 0.9 < pol.rate(6)
    assert pol.choose(_draft([6, 6, 6, 6])) == 4
    ks = [pol.choose(_draft([1, 1])) for _ in range(8)]
    assert ks.count(1) == 2 and ks.count(0) == 6  # one exploratory token every 4 skips


def test_policy_prior_follows_the_tables_share():
    # a fresh request speculates on a confident match and declines a weak one
    cost = VerifyCost()
    # forward ms by tokens, measured here with SmolLM2 on 2 threads (bench/RESULTS.md)
    for n, ms in ((1, 72), (2, 117), (3, 130), (5, 140), (9, 150), (17, 170)):
        cost.observe(n, ms / 1000)
    pol = DraftLengthPolicy(cost, explore_every=10**9)
    confident = Draft(np.arange(8), np.full(8, 8), np.zeros(8, np.int64), np.ones(8, np.float32))
    weak = Draft(np.arange(8), np.full(8, 1), np.zeros(8, np.int64), np.full(8, 0.3, np.float32))
    assert pol.choose(confident) >= 4
    assert pol.choose(weak) == 0
