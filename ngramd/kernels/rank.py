"""The hot build's ranking: which rows earn a place in the hot tier, best first.

``ngramd/hotset.py`` documents the rules (confidence, redundancy against the parent, score).
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
             prune):
    """Rank candidate rows for the hot tier.

    Rows (any order, unique keys) are filtered by confidence, pruned when redundant (a
    confident parent with the same best token and at least the same share, so the drafter,
    which falls through to the parent, drafts that token with no lower confidence: see
    ``ngramd.hotset``, rule 2; hits of pruned rows flow to the parent, longest order first)
    and ranked by ``share * (hits + count_weight * total)`` desc, then order asc,
    then key asc.  Returns ``(rank, score_sorted, conf_count, redundant_mask, eff_hits)``:
    ``rank`` indexes the input rows, best first; ``eff_hits`` are the hits with those of pruned
    children added.

    Cost: four sorts and a few passes.  numpy's sorts, 3-4x faster than numba's here (4M
    uint64 keys: 0.33 s against 1.13 s), and a merge of the rows sorted by parent with the rows
    sorted by key to find each row's parent (a binary search a row cost ~2.5 us in cache
    misses): ranking a 19.7M-entry table for the hot tier (scan, selection, slots) went from
    47.7 to 22.0 CPU-s (measured on held-out transformers code, issue 18)."""
    by_key = np.argsort(key)
    by_parent = np.argsort(parent)
    n_conf, conf, redundant, eff = _hot_prune(key, parent, order, total, best_tok, best_cnt,
                                              hits, cmin, smin, prune, by_key, by_parent)
    keep, score, ords = _hot_scores(by_key, conf, redundant, eff, order, total, best_cnt,
                                    float(count_weight))
    p1 = np.argsort(ords, kind="stable")  # (order, key): keep is in key order
    p2 = np.argsort(_neg_at(score, p1), kind="stable")  # (score desc, order, key)
    rank, ssorted = _compose_rank(keep, p1, p2, score)
    return rank, ssorted, n_conf, redundant, eff


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
    top = 0
    for i in range(m):
        top = max(top, np.int64(order[i]))
    for n in range(top, 1, -1):  # longest first: chains propagate
        for i in range(m):
            if redundant[i] and order[i] == n:
                eff[pidx[i]] += eff[i]
    return n_conf, conf, redundant, eff


@njit(cache=True, nogil=True)
def _hot_scores(by_key, conf, redundant, eff, order, total, best_cnt, count_weight):
    """The confident, non-redundant rows in key order, their scores and orders (uint8)."""
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
    ords = np.empty(nk, np.uint8)
    for j in range(nk):
        i = keep[j]
        t = max(np.float64(total[i]), 1.0)
        score[j] = (np.float64(best_cnt[i]) / t) * (eff[i] + count_weight * np.float64(total[i]))
        ords[j] = order[i]
    return keep, score, ords


@njit(cache=True, nogil=True)
def _neg_at(score, idx):
    out = np.empty(idx.shape[0], np.float64)
    for j in range(idx.shape[0]):
        out[j] = -score[idx[j]]
    return out


@njit(cache=True, nogil=True)
def _compose_rank(keep, p1, p2, score):
    nk = keep.shape[0]
    rank = np.empty(nk, np.int64)
    ssorted = np.empty(nk, np.float64)
    for j in range(nk):
        q = p1[p2[j]]
        rank[j] = keep[q]
        ssorted[j] = score[q]
    return rank, ssorted
