"""The generator's per-step arithmetic over a batch's drafts, in numba: the draft-length
policy's decision and learning (``policy/`` owns their state) and the batch drafter's
accounting of what the engine verified (``batch.py``).

A decision (``DraftLengthPolicy.choose_batch``) and the learning before it
(``DraftLengthPolicy.update``) were some forty numpy calls a step, each a few µs of dispatch on
arrays of a few dozen values: a quarter of ``propose()`` at every batch size, where the budget
is 2% of a plain step (ARCHITECTURE §13).  Here each is one call that walks the drafts' tokens
once.  The arithmetic is the one ``AcceptanceModel`` documents:

``logit p = logit(clip(prior_scale × share)) + w[order] + w[tier] + w[position] + w[bucket]
+ w[history]``

(one weight vector and prior scale per sampling band: a row is priced by its band's model) with
the features capped as ``AcceptanceModel.features_of`` caps them (``caps``: the last
index of each), and the weights' offsets in ``offsets`` (order, tier, position, bucket,
history).  The history is the request's (``DraftScorer.history``), one value a row or span.
``AcceptanceModel.predict`` is the numpy form, kept for reports and tests; the two agree
(``tests/test_stepkernels.py``).  The accounting (``account``) was a dozen numpy calls and two
more a row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_warmed = False


@njit(cache=True, inline="always")
def _cell(order, tier, position, share, hist, caps):
    """The five feature indices of one drafted token."""
    return (min(order, caps[0]), min(tier, caps[1]), min(position, caps[2]),
            min(int(share * 10.0), caps[3]), min(hist, caps[4]))


@njit(cache=True, inline="always")
def _offset(prior_scale, share):
    """The prior's logit: ``logit(clip(prior_scale × share, 1e-4, 1 - 1e-4))``."""
    q = min(max(prior_scale * share, 1e-4), 1.0 - 1e-4)
    return np.log(q / (1.0 - q))


@njit(cache=True, inline="always")
def _p(coef, offsets, prior_scale, o, t, p, c, h, share):
    z = (_offset(prior_scale, share) + coef[offsets[0] + o] + coef[offsets[1] + t]
         + coef[offsets[2] + p] + coef[offsets[3] + c] + coef[offsets[4] + h])
    return 1.0 / (1.0 + np.exp(-z))


@njit(cache=True)
def choose(orders, tiers, shares, sizes, hists, bands, weights, coefs, offsets, caps,
           prior_scales, log_cost, drafted, ranked_rows):
    """Rank every drafted token of a step by its value (its chain probability, the product of
    its row's predicted acceptances up to it, times its row's weight) and find the count that
    pays best.

    ``orders``/``tiers``/``shares``: the rows' drafts concatenated (int64, int64, float64);
    ``sizes[r]``: row ``r``'s draft length (0 for none), ``hists[r]`` its request's history,
    ``bands[r]`` its sampling band (the row of ``coefs`` and of ``prior_scales``: the band's
    acceptance model), ``weights[r]`` what a token of it is worth (1: every token alike);
    ``log_cost[k]``: ``log f(rows + k)`` for ``k`` = 0 .. total.  Fills ``ranked_rows[i]``
    with the row of the ``i``-th best token (best first, ties in draft order: numpy's stable
    sort) and adds each token's capped position to ``drafted``.  Returns ``(best, gain)``:
    the count ``k`` maximising ``log(Σ weights + Σ value of the k best) - log_cost[k]`` (the
    first such), and its gain over ``k`` = 0 (plain)."""
    rows = sizes.shape[0]
    total = orders.shape[0]
    value = np.empty(total)
    row_of = np.empty(total, np.int64)
    base = 0.0
    for r in range(rows):
        base += weights[r]
    i = 0
    for r in range(rows):
        coef, scale = coefs[bands[r]], prior_scales[bands[r]]
        logsum = 0.0
        for j in range(sizes[r]):
            o, t, p, c, h = _cell(orders[i], tiers[i], j, shares[i], hists[r], caps)
            logsum += np.log(max(_p(coef, offsets, scale, o, t, p, c, h, shares[i]), 1e-12))
            value[i] = np.exp(logsum) * weights[r]
            row_of[i] = r
            drafted[p] += 1.0
            i += 1
    order = np.argsort(-value, kind="mergesort")
    expected = max(base, 1e-12)
    best, best_gain = 0, np.log(expected) - log_cost[0]
    plain = best_gain
    for k in range(total):
        ranked_rows[k] = row_of[order[k]]
        expected += value[order[k]]
        gain = np.log(expected) - log_cost[k + 1]
        if gain > best_gain:
            best, best_gain = k + 1, gain
    return best, best_gain - plain


@njit(cache=True)
def learn(orders, tiers, shares, bases, starts, lens, missed, hists, coef, offsets, caps,
          prior_scale, clip, n, k, share_sum, scored, matched, predicted):
    """Record outcomes: span ``j`` covers positions ``starts[j]`` .. ``+ lens[j]`` of a draft
    whose tokens' features begin at ``bases[j]`` in ``orders``/``tiers``/``shares`` (the
    drafts concatenated), every one matched but the span's last when ``missed[j]``, drafted
    when its request's history was ``hists[j]``.  Each is
    predicted with ``coef`` first (the calibration report), then counted into the model's
    cells ``n`` (outcomes), ``k`` (matches) and ``share_sum`` (5-d, by the five features),
    and into ``scored``, ``matched`` and ``predicted`` by capped position.  Returns the number
    of outcomes, their surprise (matches - predictions) with each span's held within
    ``clip`` of its own binomial standard deviation (a span's tokens match or miss together:
    one long span is one odd draft, not many surprising tokens), and its binomial variance."""
    total = 0
    surprise = 0.0
    variance = 0.0
    for j in range(starts.shape[0]):
        off = 0.0
        var = 0.0
        for q in range(lens[j]):
            at = starts[j] + q
            i = bases[j] + at
            o, t, p, c, h = _cell(orders[i], tiers[i], at, shares[i], hists[j], caps)
            pred = _p(coef, offsets, prior_scale, o, t, p, c, h, shares[i])
            ok = 0.0 if missed[j] and q == lens[j] - 1 else 1.0
            n[o, t, p, c, h] += 1.0
            k[o, t, p, c, h] += ok
            share_sum[o, t, p, c, h] += shares[i]
            scored[p] += 1.0
            matched[p] += ok
            predicted[p] += pred
            off += ok - pred
            var += pred * (1.0 - pred)
        total += lens[j]
        # a floor of half a token: a span of near-certain predictions (variance ~0) still
        # moves the sum by up to ~clip/2 when it misses (as _surprised's + 1.0 for the sum)
        cap = clip * np.sqrt(var + 0.25)
        surprise += min(max(off, -cap), cap)
        variance += var
    return total, surprise, variance


@njit(cache=True)
def _solve_spd(a, b):
    """``a x = b`` for a symmetric positive definite ``a`` (Cholesky; ``a`` is overwritten)."""
    m = b.shape[0]
    for j in range(m):
        s = a[j, j]
        for q in range(j):
            s -= a[j, q] * a[j, q]
        d = np.sqrt(s)
        a[j, j] = d
        for i in range(j + 1, m):
            s = a[i, j]
            for q in range(j):
                s -= a[i, q] * a[j, q]
            a[i, j] = s / d
    x = b.copy()
    for i in range(m):  # L y = b
        s = x[i]
        for q in range(i):
            s -= a[i, q] * x[q]
        x[i] = s / a[i, i]
    for i in range(m - 1, -1, -1):  # L^T x = y
        s = x[i]
        for q in range(i + 1, m):
            s -= a[q, i] * x[q]
        x[i] = s / a[i, i]
    return x


@njit(cache=True)
def fit(n, k, share_sum, coef, offsets, prior_scale, ridge, steps):
    """The ridge-penalised maximum-likelihood weights of the counts ``n``/``k``/``share_sum``
    (``AcceptanceModel._fit``): ``steps`` Newton steps from ``coef``.  The design is one-hot
    per feature, so the gradient and the Hessian are sums over the cells with outcomes."""
    m = coef.shape[0]
    cells = np.argwhere(n > 1e-3)
    nc = cells.shape[0]
    cols = np.empty((nc, 5), np.int64)
    cn, ck, base = np.empty(nc), np.empty(nc), np.empty(nc)
    for i in range(nc):
        o, t, p, c, h = cells[i, 0], cells[i, 1], cells[i, 2], cells[i, 3], cells[i, 4]
        cols[i, 0], cols[i, 1] = offsets[0] + o, offsets[1] + t
        cols[i, 2], cols[i, 3], cols[i, 4] = offsets[2] + p, offsets[3] + c, offsets[4] + h
        cn[i], ck[i] = n[o, t, p, c, h], k[o, t, p, c, h]
        base[i] = _offset(prior_scale, share_sum[o, t, p, c, h] / cn[i])
    w = coef.copy()
    for _ in range(steps):
        grad = -ridge * w
        hess = ridge * np.eye(m)
        for i in range(nc):
            z = (base[i] + w[cols[i, 0]] + w[cols[i, 1]] + w[cols[i, 2]] + w[cols[i, 3]]
                 + w[cols[i, 4]])
            q = 1.0 / (1.0 + np.exp(-z))
            r, h = ck[i] - cn[i] * q, cn[i] * q * (1.0 - q)
            for u in range(5):
                grad[cols[i, u]] += r
                for v in range(5):
                    hess[cols[i, u], cols[i, v]] += h
        w = w + _solve_spd(hess, grad)
    return w


@njit(cache=True)
def account(lens, accepted, orders, tiers, slots, by_slot, tier_drafted, tier_accepted,
            pos_verified, pos_accepted, policy_verified, policy_accepted):
    """Count the drafts the engine verified at its last step: row ``r`` verified ``lens[r]``
    tokens (their orders and tiers concatenated row by row in ``orders``, ``tiers``) and
    accepted the first ``accepted[r]``.  Per request (``by_slot[slots[r], 0 | 1, order]``:
    drafted | accepted), per tier, per position (``pos_*``: the positions past the last fold
    into it) and for the policy's report (``policy_*``: positions past the last not counted)."""
    i = 0
    max_order, max_tier = by_slot.shape[2] - 1, tier_drafted.shape[0] - 1
    last_pos, policy_positions = pos_verified.shape[0] - 1, policy_verified.shape[0]
    for r in range(lens.shape[0]):
        s = slots[r]
        for j in range(lens[r]):
            o, t = min(orders[i], max_order), min(tiers[i], max_tier)
            ok = j < accepted[r]
            by_slot[s, 0, o] += 1
            tier_drafted[t] += 1
            pos_verified[min(j, last_pos)] += 1
            if j < policy_positions:
                policy_verified[j] += 1.0
            if ok:
                by_slot[s, 1, o] += 1
                tier_accepted[t] += 1
                pos_accepted[min(j, last_pos)] += 1
                if j < policy_positions:
                    policy_accepted[j] += 1.0
            i += 1


def warm() -> None:
    """Compile (or load from numba's cache) every kernel here with the argument types the
    policy and the batch drafter pass, once a process: not in an engine's first steps."""
    global _warmed
    if _warmed:
        return
    i1, f1 = np.zeros(1, np.int64), np.zeros(1)
    caps, offsets = np.zeros(5, np.int64), np.zeros(6, np.int64)
    cells = np.zeros((1, 1, 1, 1, 1))
    choose(i1, i1, f1, np.ones(1, np.int64), i1, i1, np.ones(1), np.zeros((1, 1)), offsets,
           caps, np.full(1, 0.5), np.zeros(2), np.zeros(1), np.zeros(1, np.int64))
    learn(i1, i1, f1, i1, i1, np.ones(1, np.int64), np.zeros(1, np.bool_), i1, np.zeros(1),
          offsets, caps, 0.5, 2.5, cells, cells.copy(), cells.copy(), np.zeros(1), np.zeros(1),
          np.zeros(1))
    fit(cells + 1.0, cells, cells + 0.5, np.zeros(1), offsets, 0.5, 4.0, 1)
    account(np.ones(1, np.int64), i1, i1, i1, i1, np.zeros((1, 2, 1), np.int64),
            np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
            np.zeros(1, np.int64), np.zeros(1), np.zeros(1))
    _warmed = True
