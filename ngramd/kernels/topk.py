"""Candidate lists: the best ``k`` next tokens of a context by count.

A context's candidates are kept best first (count descending, the smaller token id first on
ties), with counts that add and saturate at 2^32 - 1.  Counting, row-set merges and the recent
table all keep their candidates this way, so the rule lives once, here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN


@njit(cache=True, nogil=True)
def topk_into(tok, cnt, nd, out_tok, out_cnt):
    """Write the best ``len(out_tok)`` of ``tok[:nd]`` by (count desc, token asc).  Reorders
    ``tok``/``cnt`` in place (selection of the best to the front: no allocation)."""
    k = out_tok.shape[0]
    c = min(k, nd)
    for r in range(c):
        best = r
        for d in range(r + 1, nd):
            if cnt[d] > cnt[best] or (cnt[d] == cnt[best] and tok[d] < tok[best]):
                best = d
        if best != r:
            t = tok[r]
            tok[r] = tok[best]
            tok[best] = t
            x = cnt[r]
            cnt[r] = cnt[best]
            cnt[best] = x
        out_tok[r] = tok[r]
        out_cnt[r] = cnt[r]
    for r in range(c, k):
        out_tok[r] = EMPTY_TOKEN
        out_cnt[r] = 0


@njit(cache=True, nogil=True)
def add_candidate(tok, cnt, n_search, nd, t, c):
    """Add ``c`` observations of token ``t`` to the candidates ``tok[:nd]``: to the count of an
    equal token among the first ``n_search`` (saturating at 2^32 - 1), else as candidate
    ``nd``; returns the new number of candidates."""
    for d in range(n_search):
        if tok[d] == t:
            s = np.uint64(cnt[d]) + np.uint64(c)
            cnt[d] = np.uint32(min(s, np.uint64(0xFFFFFFFF)))
            return nd
    tok[nd] = t
    cnt[nd] = c
    return nd + 1


@njit(cache=True, nogil=True)
def merge_pairs(tok_a, cnt_a, tok_b, cnt_b, k, out_tok, out_cnt):
    """Merge two candidate lists (counts of equal tokens add, saturating); writes the best k into
    ``out_*`` and returns how many."""
    na = tok_a.shape[0]
    nb = tok_b.shape[0]
    tok = np.empty(na + nb, np.uint32)
    cnt = np.empty(na + nb, np.uint32)
    for i in range(na):
        tok[i] = tok_a[i]
        cnt[i] = cnt_a[i]
    nd = na
    for i in range(nb):
        nd = add_candidate(tok, cnt, na, nd, tok_b[i], cnt_b[i])
    c = min(nd, k)
    topk_into(tok, cnt, nd, out_tok[:c], out_cnt[:c])
    return c
