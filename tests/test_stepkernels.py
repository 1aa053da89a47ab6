"""The generator's per-step kernels (``ngram_generator.stepkernels``) against the numpy
arithmetic they replaced: the policy's ranking and choice, its learning and fit, the batch's
accounting.  Random drafts with continuous shares, so no two chains tie."""

from __future__ import annotations

import numpy as np
import pytest

from ngram_generator import stepkernels
from ngram_generator.policy import POSITIONS, AcceptanceModel, DraftLengthPolicy, StepCost
from ngramd.wire.commands import Draft


def _drafts(rng, rows: int, max_len: int = 9) -> list[Draft]:
    out = []
    for _ in range(rows):
        n = int(rng.integers(0, max_len))
        out.append(Draft(rng.integers(0, 1000, n).astype(np.uint32),
                         rng.integers(1, 40, n).astype(np.uint8),  # past MAX_ORDER too: capped
                         rng.integers(0, 5, n).astype(np.uint8),  # past the last tier too
                         rng.random(n).astype(np.float32)))
    return out


def _trained_model(rng) -> AcceptanceModel:
    m = AcceptanceModel()
    m._coef = rng.normal(0, 0.5, m._coef.shape)
    return m


def _numpy_choice(models, drafts, hists, bands, weights, log_cost):
    """``DraftLengthPolicy._choose``'s ranking as numpy computes it: (the row of each token,
    best first; gains of every count; positions).  Row ``r`` is priced by
    ``models[bands[r]]``, and its tokens weigh ``weights[r]``."""
    sizes = np.array([len(d) for d in drafts], np.int64)
    total, rows = int(sizes.sum()), len(drafts)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    row = np.repeat(np.arange(rows), sizes)
    some = [d for d in drafts if len(d)]
    args = (np.concatenate([d.orders for d in some]), np.concatenate([d.tiers for d in some]),
            np.arange(total) - starts[row], np.concatenate([d.conf for d in some]), hists[row])
    p = np.empty(total)
    for b, model in enumerate(models):
        feats = model.features_of(*args)
        p = np.where(bands[row] == b, model.predict(feats), p)
    cum = np.cumsum(np.log(np.maximum(p, 1e-12)))
    base = np.where(starts > 0, cum[np.maximum(starts - 1, 0)], 0.0)
    value = np.exp(cum - base[row]) * weights[row]
    order = np.argsort(-value, kind="stable")
    gain = np.log(weights.sum() + np.concatenate([[0.0], np.cumsum(value[order])])) - log_cost
    return row[order], gain, feats[2]


@pytest.mark.parametrize("seed", range(5))
def test_the_choice_ranks_and_counts_as_numpy_did(seed):
    """Rows of two sampling bands (two models), weighed unequally (a draining batch)."""
    rng = np.random.default_rng(seed)
    models = [_trained_model(rng), _trained_model(rng)]
    models[1].prior_scale = 0.4
    drafts = _drafts(rng, int(rng.integers(1, 40)))
    drafts[0] = _drafts(rng, 1, 2)[0] if not sum(map(len, drafts)) else drafts[0]
    total = sum(len(d) for d in drafts)
    if not total:
        pytest.skip("no draft token")
    some = [d for d in drafts if len(d)]
    log_cost = StepCost(slope=0.05).log_relative(len(drafts) + np.arange(total + 1))
    ranked, drafted = np.empty(total, np.int64), np.zeros(POSITIONS)
    hists = rng.integers(0, 9, len(drafts))  # past the last history too: capped
    bands = rng.integers(0, 2, len(drafts))
    weights = rng.random(len(drafts)) if seed % 2 else np.ones(len(drafts))
    best, gain = stepkernels.choose(
        np.concatenate([d.orders for d in some], dtype=np.int64),
        np.concatenate([d.tiers for d in some], dtype=np.int64),
        np.concatenate([d.conf for d in some], dtype=np.float64),
        np.array([len(d) for d in drafts], np.int64), hists, bands, weights,
        np.stack([m._coef for m in models]), models[0]._offsets, models[0]._caps,
        np.array([m.prior_scale for m in models]), log_cost, drafted, ranked)
    rows, gains, positions = _numpy_choice(models, drafts, hists, bands, weights, log_cost)
    assert ranked.tolist() == rows.tolist()
    assert best == int(np.argmax(gains)) and gain == pytest.approx(gains[best] - gains[0])
    assert drafted.tolist() == np.bincount(positions, minlength=POSITIONS).tolist()


def test_learning_and_fitting_match_numpy():
    """Outcomes counted into the model's cells and the report as numpy's ``np.add.at`` and
    ``bincount`` did; the Newton fit (Cholesky in the kernel) as ``np.linalg.solve`` did."""
    rng = np.random.default_rng(7)
    model = _trained_model(rng)
    drafts = [d for d in _drafts(rng, 60) if len(d)]
    spans = []
    for d in drafts:
        s = int(rng.integers(0, len(d)))
        spans.append((d, s, int(rng.integers(s + 1, len(d) + 1)), bool(rng.integers(0, 2)),
                      int(rng.integers(0, 6))))
    pol = DraftLengthPolicy(model=model)
    for d, s, e, missed, h in spans:
        pol.learn(d, s, e - s, missed, h)  # positions s .. e
    coef = model._coef.copy()
    pol.update()
    # numpy: the same outcomes, one by one
    n, k, conf = (np.zeros(model._sizes) for _ in range(3))
    scored, matched, predicted = (np.zeros(POSITIONS) for _ in range(3))
    ref = AcceptanceModel()
    ref._coef = coef
    for d, s, e, missed, h in spans:
        f = ref.features(d, s, e, h)
        ok = np.ones(e - s)
        ok[-1] = 0.0 if missed else 1.0
        np.add.at(n, f[:5], 1.0)
        np.add.at(k, f[:5], ok)
        np.add.at(conf, f[:5], f[5])
        scored += np.bincount(f[2], minlength=POSITIONS)
        matched += np.bincount(f[2], ok, minlength=POSITIONS)
        predicted += np.bincount(f[2], ref.predict(f), minlength=POSITIONS)
    assert model.seen == int(n.sum()) > 0
    np.testing.assert_allclose(model._n, n)  # fewer than ``refit``: nothing decayed yet
    np.testing.assert_allclose(model._k, k)
    np.testing.assert_allclose(model._conf, conf, rtol=1e-6)
    np.testing.assert_allclose(pol.out.scored, scored)
    np.testing.assert_allclose(pol.out.matched, matched)
    np.testing.assert_allclose(pol.out.predicted, predicted, rtol=1e-9)
    # the fit: numpy's Newton steps on the same counts
    w = coef.copy()
    cells = np.nonzero(n > 1e-3)
    cols = [model._offsets[j] + cells[j] for j in range(5)]
    off = ref._offset(conf[cells] / n[cells])
    m = w.shape[0]
    for _ in range(4):
        p = 1.0 / (1.0 + np.exp(-(off + sum(w[c] for c in cols))))
        r, h = k[cells] - n[cells] * p, n[cells] * p * (1 - p)
        grad = sum(np.bincount(c, r, minlength=m) for c in cols) - model.ridge * w
        hess = sum(np.bincount(a * m + b, h, minlength=m * m) for a in cols for b in cols)
        w = w + np.linalg.solve(hess.reshape(m, m) + model.ridge * np.eye(m), grad)
    got = stepkernels.fit(n, k, conf, coef, model._offsets, model.prior_scale, model.ridge, 4)
    np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-12)


def test_the_accounting_counts_as_numpy_did():
    rng = np.random.default_rng(3)
    drafts = [d for d in _drafts(rng, 40, 20) if len(d)]
    acc = np.array([int(rng.integers(0, len(d) + 1)) for d in drafts], np.int64)
    slots = rng.permutation(64)[:len(drafts)].astype(np.int64)
    by_slot = np.zeros((64, 2, 33), np.int64)
    tiers = np.zeros((2, 4), np.int64)
    pos = np.zeros((2, 16), np.int64)
    policy = np.zeros((2, POSITIONS))
    stepkernels.account(np.array([len(d) for d in drafts], np.int64), acc,
                        np.concatenate([d.orders for d in drafts], dtype=np.int64),
                        np.concatenate([d.tiers for d in drafts], dtype=np.int64), slots,
                        by_slot, tiers[0], tiers[1], pos[0], pos[1], policy[0], policy[1])
    for d, a, s in zip(drafts, acc, slots):
        o, t = np.minimum(d.orders, 32), np.minimum(d.tiers, 3)
        j = np.arange(len(d))
        ok = j < a
        assert by_slot[s, 0].tolist() == np.bincount(o, minlength=33).tolist()
        assert by_slot[s, 1].tolist() == np.bincount(o[ok], minlength=33).tolist()
        tiers[0] -= np.bincount(t, minlength=4)
        tiers[1] -= np.bincount(t[ok], minlength=4)
        pos[0] -= np.bincount(np.minimum(j, 15), minlength=16)
        pos[1] -= np.bincount(np.minimum(j[ok], 15), minlength=16)
        policy[0] -= np.bincount(j[j < POSITIONS], minlength=POSITIONS)
        policy[1] -= np.bincount(j[ok & (j < POSITIONS)], minlength=POSITIONS)
    assert not tiers.any() and not pos.any() and not policy.any()
    assert len(drafts) > 10 and by_slot.sum() > 0
