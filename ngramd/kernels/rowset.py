"""Row sets: the counted form of a batch of sequences, and their merges and lookups.

A *row set* holds one row per distinct context as parallel arrays, sorted by key hash, keys
unique::

    key u64[m], parent u64[m], order u8[m], total u32[m], poff i64[m+1], tok u32[P], cnt u32[P]

Row i's candidates are tok/cnt[poff[i]:poff[i+1]] (at most K, count desc, ties smaller token
first; ``ngramd.kernels.topk``); ``total`` counts every observation.  Counts and totals
saturate at 2**32 - 1.  Counting produces them (``ngramd.kernels.count``), the cold tier
stores them as pages (``ngramd.kernels.pages``) and merges them; ``ngramd/cold/rows.py`` and
``ngramd/cold/store.py`` hold the classes around them.  These kernels release the GIL (``nogil``):
the daemon's serving thread keeps running while its writer merges.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN
from .topk import merge_pairs, topk_into


@njit(cache=True, nogil=True)
def rows_gather(perm, ck, cp, co, ct, cq, ctok, ccnt, k):
    """Merge row sets given as one concatenation (``ck`` ... ``ccnt``, ``cq`` the pair offsets
    of all rows) and a permutation ``perm`` that sorts ``ck`` (e.g. a stable argsort, which
    merges the sorted parts in O(n log parts)): rows of equal keys add their totals and
    candidate counts (the best k kept, saturating).  Returns the merged row set."""
    m = perm.shape[0]
    o_key = np.empty(m, np.uint64)
    o_par = np.empty(m, np.uint64)
    o_ord = np.empty(m, np.uint8)
    o_tot = np.empty(m, np.uint32)
    o_poff = np.zeros(m + 1, np.int64)
    o_tok = np.empty(ctok.shape[0], np.uint32)
    o_cnt = np.empty(ctok.shape[0], np.uint32)
    sc_tok = np.empty(64, np.uint32)
    sc_cnt = np.empty(64, np.uint32)
    tk = np.empty(k, np.uint32)
    kc = np.empty(k, np.uint32)
    g = 0
    pp = 0
    i = 0
    while i < m:
        r = perm[i]
        key = ck[r]
        j = i + 1
        while j < m and ck[perm[j]] == key:
            j += 1
        o_key[g] = key
        o_par[g] = cp[r]
        o_ord[g] = co[r]
        if j == i + 1:
            o_tot[g] = ct[r]
            for q in range(cq[r], cq[r + 1]):
                o_tok[pp] = ctok[q]
                o_cnt[pp] = ccnt[q]
                pp += 1
        else:
            tot = np.uint64(0)
            nd = 0
            for e in range(i, j):
                r = perm[e]
                tot += np.uint64(ct[r])
                for q in range(cq[r], cq[r + 1]):
                    t = ctok[q]
                    found = False
                    for d in range(nd):
                        if sc_tok[d] == t:
                            s = np.uint64(sc_cnt[d]) + np.uint64(ccnt[q])
                            sc_cnt[d] = np.uint32(min(s, np.uint64(0xFFFFFFFF)))
                            found = True
                            break
                    if not found:
                        if nd == sc_tok.shape[0]:
                            nt = np.empty(2 * nd, np.uint32)
                            nc = np.empty(2 * nd, np.uint32)
                            nt[:nd] = sc_tok
                            nc[:nd] = sc_cnt
                            sc_tok = nt
                            sc_cnt = nc
                        sc_tok[nd] = t
                        sc_cnt[nd] = ccnt[q]
                        nd += 1
            o_tot[g] = np.uint32(min(tot, np.uint64(0xFFFFFFFF)))
            c = min(nd, k)
            topk_into(sc_tok, sc_cnt, nd, tk[:c], kc[:c])
            for q in range(c):
                o_tok[pp] = tk[q]
                o_cnt[pp] = kc[q]
                pp += 1
        g += 1
        o_poff[g] = pp
        i = j
    return (o_key[:g].copy(), o_par[:g].copy(), o_ord[:g].copy(), o_tot[:g].copy(),
            o_poff[:g + 1].copy(), o_tok[:pp].copy(), o_cnt[:pp].copy())


@njit(cache=True, nogil=True)
def order_counts(order, out):
    """``out[o] += number of rows of order o``."""
    for i in range(order.shape[0]):
        out[order[i]] += 1


@njit(cache=True, nogil=True)
def rows_lookup(rk, ro, rt, rq, rtok, rcnt, keys, k, found, o_ord, o_tot, o_tok, o_cnt):
    """Look ``keys`` up in a row set and merge what is found into the per-key outputs
    (``found`` bool, ``o_ord`` u8, ``o_tot`` u32, ``o_tok``/``o_cnt`` (m, k) padded with
    EMPTY_TOKEN/0), so several sources (row sets, pages of several runs) accumulate into one
    answer.  Returns the number of keys found in this source."""
    hits = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        j = np.searchsorted(rk, key)
        if j < rk.shape[0] and rk[j] == key:
            hits += 1
            accumulate_row(i, ro[j], rt[j], rtok[rq[j]:rq[j + 1]], rcnt[rq[j]:rq[j + 1]], k,
                        found, o_ord, o_tot, o_tok, o_cnt)
    return hits


@njit(cache=True, nogil=True)
def accumulate_row(i, order, total, tok, cnt, k, found, o_ord, o_tot, o_tok, o_cnt):
    """Merge one source's row for key ``i`` into the per-key outputs of ``rows_lookup`` and
    ``pages_lookup``: the first source found sets them, a later one adds its total and merges
    its candidates (the best ``k`` kept)."""
    if not found[i]:
        found[i] = True
        o_ord[i] = order
        o_tot[i] = total
        _set_candidates(o_tok, o_cnt, i, tok, cnt, min(tok.shape[0], k), k)
        return
    na = 0
    while na < k and o_tok[i, na] != EMPTY_TOKEN:
        na += 1
    t2 = np.empty(k, np.uint32)
    c2 = np.empty(k, np.uint32)
    c = merge_pairs(o_tok[i, :na].copy(), o_cnt[i, :na].copy(), tok, cnt, k, t2, c2)
    _set_candidates(o_tok, o_cnt, i, t2, c2, c, k)
    s = np.uint64(o_tot[i]) + np.uint64(total)
    o_tot[i] = np.uint32(min(s, np.uint64(0xFFFFFFFF)))


@njit(cache=True, nogil=True, inline="always")
def _set_candidates(o_tok, o_cnt, i, tok, cnt, c, k):
    """Row ``i`` of ``o_tok``/``o_cnt``: the first ``c`` of ``tok``/``cnt``, then empty up to
    ``k``."""
    for r in range(c):
        o_tok[i, r] = tok[r]
        o_cnt[i, r] = cnt[r]
    for r in range(c, k):
        o_tok[i, r] = EMPTY_TOKEN
        o_cnt[i, r] = 0


@njit(cache=True, nogil=True)
def rows_range(rk, lo, hi, bounded):
    """Index range [a, b) of the rows with ``lo <= key < hi`` (``bounded=False``: no upper
    bound, for the last slice of the key space)."""
    a = np.searchsorted(rk, lo)
    b = np.searchsorted(rk, hi) if bounded else rk.shape[0]
    return a, b


@njit(cache=True, nogil=True)
def rows_copy_into(rk, rp, ro, rt, rq, rtok, rcnt, a, b, o_key, o_par, o_ord, o_tot, o_poff,
                   o_tok, o_cnt, g, pp):
    """Append rows [a, b) of a row set to row-set arrays (as ``pages_decode_into``)."""
    for i in range(a, b):
        o_key[g] = rk[i]
        o_par[g] = rp[i]
        o_ord[g] = ro[i]
        o_tot[g] = rt[i]
        for q in range(rq[i], rq[i + 1]):
            o_tok[pp] = rtok[q]
            o_cnt[pp] = rcnt[q]
            pp += 1
        g += 1
        o_poff[g] = pp
    return g, pp
