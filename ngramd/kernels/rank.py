"""The hot build's ranking: which rows earn a place in the hot tier, best first.

``ngramd/hot/selection.py`` documents the rules (confidence, redundancy against the parent, score).
The loops run in numba without the GIL, the sorts are numpy's, which release it too (the first
numpy version held the GIL 1-2 s for 3M rows in its other steps), so ranking millions of
candidates never holds the daemon's GIL for long.  Placing the ranked rows into slots is
``ngramd.kernels.slots.gather_slots``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, SHARE_SLACK


def hot_rank(key, parent, order, total, best_tok, best_cnt, hits, cmin, smin, count_weight,
             prune, key_sorted=False):
    """Rank candidate rows for the hot tier.

    Rows (any order, unique keys) are filtered by confidence, pruned when redundant (a
    confident parent with the same best token and at least the same share, so the drafter,
    which falls through to the parent, drafts that token with no lower confidence: see
    ``ngramd.hot.selection``, rule 2; hits of pruned rows flow to the parent, longest order first)
    and ranked by ``share * (hits + count_weight * total)`` desc, then order asc,
    then key asc.  Returns ``(rank, score_sorted, conf_count, redundant_mask, eff_hits)``:
    ``rank`` indexes the input rows, best first; ``eff_hits`` are the hits with those of pruned
    children added.  ``key_sorted``: the rows come in ascending key order (a scan's order),
    so the sort by key is skipped.

    Cost: four sorts (three with ``key_sorted``) and a few passes.  numpy's sorts, several
    times faster than numba's here, and a merge of the rows sorted by parent with the rows
    sorted by key to find each row's parent (a binary search a row paid a cache miss per
    step): about half the CPU of the ranking before (ARCHITECTURE §13, ``hot_rank``)."""
    keep, score, n_conf, redundant, eff = hot_keep(
        key, parent, order, total, best_tok, best_cnt, hits, cmin, smin, count_weight, prune,
        key_sorted)
    q = rank_positions(score, order, keep)
    rank, ssorted = _compose_rank(keep, q, score)
    return rank, ssorted, n_conf, redundant, eff


def hot_keep(key, parent, order, total, best_tok, best_cnt, hits, cmin, smin, count_weight,
             prune, key_sorted=False):
    """``hot_rank`` without its ranking: ``(keep, score, conf_count, redundant_mask,
    eff_hits)``, ``keep`` the confident, non-redundant rows in key order and ``score`` theirs.
    The streaming selector's cuts need only this while no row is cut for space."""
    by_key = np.arange(key.shape[0]) if key_sorted else np.argsort(key)
    by_parent = np.argsort(parent)
    n_conf, conf, redundant, eff = _hot_prune(key, parent, order, total, best_tok, best_cnt,
                                              hits, cmin, smin, prune, by_key, by_parent)
    keep, score = _hot_scores(by_key, conf, redundant, eff, total, best_cnt,
                              float(count_weight))
    return keep, score, n_conf, redundant, eff


def rank_positions(score, order, keep):
    """Positions into ``keep`` (rows in key order, ``score`` theirs) by score desc, then order
    asc, then key asc: two stable sorts."""
    p1 = np.argsort(_orders_at(order, keep), kind="stable")  # (order, key)
    p2 = np.argsort(_neg_at(score, p1), kind="stable")  # (score desc, order, key)
    return p1[p2]


@njit(cache=True, nogil=True)
def _hot_prune(key, parent, order, total, best_tok, best_cnt, hits, cmin, smin, prune, by_key,
               by_parent):
    """Confidence, each row's parent row, redundancy and the hits moved to parents."""
    m = key.shape[0]
    conf = np.zeros(m, np.bool_)
    n_conf = 0
    for i in range(m):
        o = order[i]
        c = best_cnt[i]
        if best_tok[i] != EMPTY_TOKEN and c >= cmin[o] and \
                c >= smin[o] * np.float64(total[i]) * SHARE_SLACK:
            conf[i] = True
            n_conf += 1
    # each row's parent row, by a merge of the rows sorted by parent with the rows sorted by
    # key: one binary search a row over the whole buffer cost ~2.5 us a row in cache misses
    # (most of a 40M-entry rebuild's CPU, measured), the merge reads both sequentially
    pidx = np.full(m, -1, np.int64)
    j = 0
    for t in range(m):
        i = by_parent[t]
        p = parent[i]
        if p == 0:
            continue
        while j < m and key[by_key[j]] < p:
            j += 1
        if j == m:
            break
        r = by_key[j]
        if key[r] == p and order[r] == order[i] - 1:
            pidx[i] = r
    redundant = np.zeros(m, np.bool_)
    if prune:
        for i in range(m):
            r = pidx[i]
            # share(parent) >= share(row), exactly: cnt_r / total_r >= cnt_i / total_i
            if r >= 0 and conf[i] and conf[r] and best_tok[i] == best_tok[r] and \
                    np.uint64(best_cnt[r]) * np.uint64(total[i]) >= \
                    np.uint64(best_cnt[i]) * np.uint64(total[r]):
                redundant[i] = True
    eff = np.empty(m, np.float64)
    for i in range(m):
        eff[i] = hits[i]
    # the hits of redundant rows to their parents, longest order first (chains propagate),
    # in index order within an order: the redundant rows bucketed by order, one pass each
    per = np.zeros(257, np.int64)
    for i in range(m):
        if redundant[i] and order[i] >= 2:  # an order-1 row's parent is no row
            per[np.int64(order[i])] += 1
    at = np.zeros(257, np.int64)  # where order n's bucket starts: longer orders first
    for n in range(255, -1, -1):
        at[n] = at[n + 1] + per[n + 1]
    by_order = np.empty(at[0], np.int64)  # at[0]: every bucket (orders >= 2 only)
    for i in range(m):
        if redundant[i] and order[i] >= 2:
            n = np.int64(order[i])
            by_order[at[n]] = i
            at[n] += 1
    for i in by_order:
        eff[pidx[i]] += eff[i]
    return n_conf, conf, redundant, eff


@njit(cache=True, nogil=True)
def _hot_scores(by_key, conf, redundant, eff, total, best_cnt, count_weight):
    """The confident, non-redundant rows in key order and their scores."""
    m = by_key.shape[0]
    keep = np.empty(m, np.int64)
    nk = 0
    for j in range(m):  # in key order: the stable sorts after keep key order among ties
        i = by_key[j]
        if conf[i] and not redundant[i]:
            keep[nk] = i
            nk += 1
    keep = keep[:nk]
    score = np.empty(nk, np.float64)
    for j in range(nk):
        i = keep[j]
        t = max(np.float64(total[i]), 1.0)
        score[j] = (np.float64(best_cnt[i]) / t) * (eff[i] + count_weight * np.float64(total[i]))
    return keep, score


@njit(cache=True, nogil=True)
def _orders_at(order, idx):
    out = np.empty(idx.shape[0], np.uint8)
    for j in range(idx.shape[0]):
        out[j] = order[idx[j]]
    return out


@njit(cache=True, nogil=True)
def _neg_at(score, idx):
    out = np.empty(idx.shape[0], np.float64)
    for j in range(idx.shape[0]):
        out[j] = -score[idx[j]]
    return out


@njit(cache=True, nogil=True)
def _compose_rank(keep, q, score):
    nk = keep.shape[0]
    rank = np.empty(nk, np.int64)
    ssorted = np.empty(nk, np.float64)
    for j in range(nk):
        rank[j] = keep[q[j]]
        ssorted[j] = score[q[j]]
    return rank, ssorted
