"""Counting: every (context, next token) event of a batch of sequences, aggregated.

Two ways to count:

* ``count_ngrams`` (``ngram_events`` then a sort): the plain method, one row per distinct
  context with its top-k candidates; the tests' and tools' reference for what counting means.
* ``count_rows`` (``count_hist`` then ``count_fill``): the cold tier's write path
  (ARCHITECTURE §5 documents the design), counting into a *row set* (``ngramd.kernels.rowset``
  documents the layout) in ~32k-event buckets sorted in cache.  These kernels release the GIL
  (``nogil``): the daemon's serving thread keeps running while its writer counts.

Sequences arrive as ``tokens`` (their concatenation) and ``offsets`` (their bounds, length =
sequences + 1); n-grams never span two sequences.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, HASH_SEED
from .hashing import hash_finish, hash_step, suffix_hashes
from .topk import add_candidate, topk_into


@njit(cache=True)
def _count_events(tokens, offsets, n_min, n_max):
    total = 0
    for q in range(offsets.shape[0] - 1):
        length = offsets[q + 1] - offsets[q]
        for n in range(n_min, n_max + 1):
            if length > n:
                total += length - n
    return total


@njit(cache=True)
def ngram_events(tokens, offsets, n_min, n_max):
    """Every (context, next token) event of orders n_min..n_max in a batch of sequences.

    ``tokens`` is the concatenation of sequences, ``offsets`` (len = sequences + 1) their bounds;
    n-grams never span two sequences.  Returns parallel arrays
    ``(key, parent, next, order, pos)``: ``parent`` is the key of the order-(n-1) suffix of the
    same context (0 for order 1) and ``pos`` the index in ``tokens`` of the next token, so the
    context is ``tokens[pos-order:pos]``.
    """
    m = _count_events(tokens, offsets, n_min, n_max)
    keys = np.empty(m, np.uint64)
    parents = np.empty(m, np.uint64)
    nxt = np.empty(m, np.uint32)
    orders = np.empty(m, np.uint8)
    pos = np.empty(m, np.int64)
    hs = np.zeros(n_max + 1, np.uint64)
    j = 0
    for q in range(offsets.shape[0] - 1):
        a = offsets[q]
        b = offsets[q + 1]
        for i in range(a + 1, b):
            avail = min(i - a, n_max)
            s = HASH_SEED
            for n in range(1, avail + 1):
                s = hash_step(s, tokens[i - n])
                hs[n] = hash_finish(s, n)
            for n in range(n_min, avail + 1):
                keys[j] = hs[n]
                parents[j] = hs[n - 1] if n > 1 else np.uint64(0)
                nxt[j] = tokens[i]
                orders[j] = n
                pos[j] = i
                j += 1
    return keys, parents, nxt, orders, pos


@njit(cache=True)
def _aggregate_sorted(keys, parents, nxt, orders, pos, perm, k):
    """Group events sorted (via ``perm``) by key; per key: total and top-k (token, count)."""
    m = perm.shape[0]
    n_keys = 0
    for i in range(m):
        if i == 0 or keys[perm[i]] != keys[perm[i - 1]]:
            n_keys += 1
    out_key = np.empty(n_keys, np.uint64)
    out_parent = np.empty(n_keys, np.uint64)
    out_order = np.empty(n_keys, np.uint8)
    out_pos = np.empty(n_keys, np.int64)
    out_total = np.zeros(n_keys, np.uint32)
    out_tok = np.full((n_keys, k), EMPTY_TOKEN, np.uint32)
    out_cnt = np.zeros((n_keys, k), np.uint32)
    # scratch for the distinct next tokens of one key
    cap = 64
    sc_tok = np.empty(cap, np.uint32)
    sc_cnt = np.empty(cap, np.uint32)
    g = -1
    i = 0
    while i < m:
        j = i
        key = keys[perm[i]]
        while j < m and keys[perm[j]] == key:
            j += 1
        g += 1
        e0 = perm[i]
        out_key[g] = key
        out_parent[g] = parents[e0]
        out_order[g] = orders[e0]
        out_pos[g] = pos[e0]
        out_total[g] = j - i
        nd = 0
        for e in range(i, j):
            t = nxt[perm[e]]
            found = False
            for d in range(nd):
                if sc_tok[d] == t:
                    sc_cnt[d] += 1
                    found = True
                    break
            if not found:
                if nd == cap:
                    cap2 = cap * 2
                    nt = np.empty(cap2, np.uint32)
                    nc = np.empty(cap2, np.uint32)
                    nt[:cap] = sc_tok
                    nc[:cap] = sc_cnt
                    sc_tok = nt
                    sc_cnt = nc
                    cap = cap2
                sc_tok[nd] = t
                sc_cnt[nd] = 1
                nd += 1
        topk_into(sc_tok, sc_cnt, nd, out_tok[g], out_cnt[g])
        i = j
    return out_key, out_parent, out_order, out_pos, out_total, out_tok, out_cnt


def count_ngrams(tokens, offsets, n_min, n_max, k):
    """Aggregate all n-grams of orders n_min..n_max of a batch of sequences.

    Returns a dict of parallel arrays, one row per distinct context (sorted by key hash):
    ``key, parent, order, pos, total, tok[:, k], cnt[:, k]`` where ``tok``/``cnt`` are the top-k
    next tokens by count (ties: smaller id first) and ``total`` counts every observation.
    """
    tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    keys, parents, nxt, orders, pos = ngram_events(tokens, offsets, n_min, n_max)
    perm = np.argsort(keys, kind="stable")
    names = ("key", "parent", "order", "pos", "total", "tok", "cnt")
    return dict(zip(names, _aggregate_sorted(keys, parents, nxt, orders, pos, perm, k)))


@njit(cache=True, nogil=True)
def count_span(s_len, skip, n_min, n_max):
    """Events of one sequence of ``s_len`` tokens whose first ``skip`` tokens are context only."""
    total = 0
    for i in range(max(1, skip), s_len):
        avail = min(i, n_max)
        if avail >= n_min:
            total += avail - n_min + 1
    return total


@njit(cache=True, nogil=True)
def _bucket_perm(keys, bits_done):
    """Permutation sorting ``keys`` (uniform hashes whose top ``bits_done`` bits are all equal):
    one counting pass into 2^b buckets on the next bits, then insertion sort inside each bucket
    (a few keys each).  ~10 ns a key in cache, against ~40 for a comparison argsort."""
    n = keys.shape[0]
    sub = 1
    while sub < 16 and (1 << sub) < n // 2:
        sub += 1
    nb = 1 << sub
    if bits_done + sub > 64:
        sub = 64 - bits_done
        nb = 1 << sub
    shift = np.uint64(64 - bits_done - sub)
    mask = np.uint64(nb - 1)
    cnt = np.zeros(nb + 1, np.int64)
    for i in range(n):
        cnt[((keys[i] >> shift) & mask) + np.uint64(1)] += 1
    for b in range(nb):
        cnt[b + 1] += cnt[b]
    fill = cnt[:nb].copy()
    perm = np.empty(n, np.int64)
    sk = np.empty(n, np.uint64)
    for i in range(n):
        b = (keys[i] >> shift) & mask
        j = fill[b]
        fill[b] = j + 1
        perm[j] = i
        sk[j] = keys[i]
    for b in range(nb):
        lo = cnt[b]
        for i in range(lo + 1, cnt[b + 1]):
            kk = sk[i]
            p = perm[i]
            j = i - 1
            while j >= lo and sk[j] > kk:
                sk[j + 1] = sk[j]
                perm[j + 1] = perm[j]
                j -= 1
            sk[j + 1] = kk
            perm[j + 1] = p
    return perm


@njit(cache=True, nogil=True, inline="always")
def _bucket_bits(part, part_bits, bits):
    """A key's partition is ``key >> pshift`` (``part_bits`` > 0), its bucket
    ``(key >> bshift) & bmask``: returns ``(pshift, bshift, bmask, part)`` as uint64."""
    pshift = np.uint64(64 - part_bits) if part_bits > 0 else np.uint64(0)
    return (pshift, np.uint64(64 - part_bits - bits), np.uint64((1 << bits) - 1),
            np.uint64(part))


@njit(cache=True, nogil=True)
def count_hist(tokens, offsets, skips, n_min, n_max, part, part_bits, bits):
    """First pass of ``count_rows``: events per bucket (2^bits buckets on the key bits below
    the ``part_bits`` partition bits) of the contexts of partition ``part``, as cumulative
    offsets (length 2^bits + 1; the last is the number of events)."""
    nb = 1 << bits
    pshift, bshift, bmask, upart = _bucket_bits(part, part_bits, bits)
    # slot nb + 1 collects the events of other partitions: no branch to mispredict
    counts = np.zeros(nb + 2, np.int64)
    other = np.uint64(nb + 1)
    hs = np.zeros(n_max + 1, np.uint64)
    for q in range(offsets.shape[0] - 1):
        seq = tokens[offsets[q]:offsets[q + 1]]
        for i in range(max(1, skips[q]), seq.shape[0]):
            for n in range(n_min, suffix_hashes(seq, i, n_max, hs) + 1):
                h = hs[n]
                mine = part_bits == 0 or (h >> pshift) == upart
                counts[((h >> bshift) & bmask) + np.uint64(1) if mine else other] += 1
    counts[nb + 1] = 0
    for j in range(nb):
        counts[j + 1] += counts[j]
    return counts[:nb + 1].copy()


@njit(cache=True, nogil=True)
def count_fill(tokens, offsets, skips, n_min, n_max, k, part, part_bits, bits, counts, ev,
               o_key, o_par, o_ord, o_tot, o_poff, o_tok, o_cnt):
    """Second pass of ``count_rows``: scatter the events into their buckets (``ev``: at least
    ``counts[-1]`` rows of 3 words; ``_count_scatter``), sort each bucket in cache
    (``_bucket_perm``) and aggregate runs of equal keys into the output row-set arrays (at
    least ``counts[-1]`` rows and pairs; ``_count_bucket``).  Returns ``(rows, pairs)``
    written."""
    _count_scatter(tokens, offsets, skips, n_min, n_max, part, part_bits, bits, counts, ev)
    nb = 1 << bits
    most = 0
    for bk in range(nb):
        most = max(most, counts[bk + 1] - counts[bk])
    # scratch for the largest bucket: its keys, and the next tokens of its longest run
    bkeys = np.empty(most, np.uint64)
    sc = np.empty((3, max(most, 256)), np.uint32)
    top = np.empty((2, k), np.uint32)
    g = 0
    pp = 0
    o_poff[0] = 0
    for bk in range(nb):
        a = counts[bk]
        n_ev = counts[bk + 1] - a
        if n_ev == 0:
            continue
        for e in range(n_ev):
            bkeys[e] = ev[a + e, 0]
        perm = _bucket_perm(bkeys[:n_ev], part_bits + bits)
        g, pp = _count_bucket(ev, a, bkeys, perm, sc, top, g, pp, o_key, o_par, o_ord, o_tot,
                              o_poff, o_tok, o_cnt)
    return g, pp


@njit(cache=True, nogil=True)
def _count_scatter(tokens, offsets, skips, n_min, n_max, part, part_bits, bits, counts, ev):
    """``count_fill``'s scatter: each event of partition ``part`` as 3 words (key; next token
    << 32 | order; parent key) at the next free row of its bucket (``counts``: the buckets'
    first rows, from ``count_hist``)."""
    nb = 1 << bits
    pshift, bshift, bmask, upart = _bucket_bits(part, part_bits, bits)
    fill = counts[:nb].copy()
    hs = np.zeros(n_max + 1, np.uint64)  # hs[0] stays 0: the parent of order 1
    for q in range(offsets.shape[0] - 1):
        seq = tokens[offsets[q]:offsets[q + 1]]
        for i in range(max(1, skips[q]), seq.shape[0]):
            t = np.uint64(seq[i]) << np.uint64(32)
            for n in range(n_min, suffix_hashes(seq, i, n_max, hs) + 1):
                h = hs[n]
                if part_bits == 0 or (h >> pshift) == upart:
                    bk = (h >> bshift) & bmask
                    j = fill[bk]
                    fill[bk] = j + 1
                    ev[j, 0] = h
                    ev[j, 1] = t | np.uint64(n)
                    ev[j, 2] = hs[n - 1]


@njit(cache=True, nogil=True)
def _count_bucket(ev, a, bkeys, perm, sc, top, g, pp, o_key, o_par, o_ord, o_tot, o_poff,
                  o_tok, o_cnt):
    """``count_fill``'s aggregation of one sorted bucket (events ``ev[a:]``, keys ``bkeys``
    in ``perm`` order): one output row a run of equal keys, from row ``g`` and pair ``pp`` on,
    with at most ``top.shape[1]`` candidates.  Returns the next ``(g, pp)``."""
    n_ev = perm.shape[0]
    i = 0
    while i < n_ev:
        key = bkeys[perm[i]]
        j = i
        while j < n_ev and bkeys[perm[j]] == key:
            j += 1
        nd = _run_candidates(ev, a, perm, i, j, sc)
        e0 = a + perm[i]
        o_key[g] = key
        n = np.uint8(ev[e0, 1] & np.uint64(255))
        o_ord[g] = n
        o_par[g] = ev[e0, 2] if n > 1 else np.uint64(0)
        o_tot[g] = np.uint32(min(j - i, 0xFFFFFFFF))
        if nd == 1:
            o_tok[pp] = sc[0, 0]
            o_cnt[pp] = sc[1, 0]
            pp += 1
        else:
            topk_into(sc[0], sc[1], nd, top[0], top[1])
            for r in range(min(nd, top.shape[1])):
                o_tok[pp] = top[0, r]
                o_cnt[pp] = top[1, r]
                pp += 1
        g += 1
        o_poff[g] = pp
        i = j
    return g, pp


@njit(cache=True, nogil=True)
def _run_candidates(ev, a, perm, i, j, sc):
    """The distinct next tokens of the events ``ev[a + perm[i:j]]`` and their counts, into
    ``sc[0]``/``sc[1]`` (``sc[2]``: scratch, at least ``j - i``); returns how many."""
    tok = sc[0]
    cnt = sc[1]
    run = j - i
    nd = 0
    if run > 32:  # a frequent context: sort its next tokens, count runs linearly
        nx = sc[2, :run]
        for e in range(run):
            nx[e] = np.uint32(ev[a + perm[i + e], 1] >> np.uint64(32))
        nx.sort()
        for e in range(run):
            if nd > 0 and tok[nd - 1] == nx[e]:
                cnt[nd - 1] += 1
            else:
                tok[nd] = nx[e]
                cnt[nd] = 1
                nd += 1
    else:
        for e in range(i, j):
            t = np.uint32(ev[a + perm[e], 1] >> np.uint64(32))
            nd = add_candidate(tok, cnt, nd, nd, t, 1)
    return nd


def count_bits(n_events: int, part_bits: int) -> int:
    """Bucket bits for ``n_events`` events: ~32k events (768 KiB of events) a bucket."""
    bits = 1
    while bits < 16 and (n_events >> (bits + 15)) > 0:
        bits += 1
    return min(bits, 62 - part_bits)


def count_rows(tokens, offsets, skips, n_min, n_max, k, part, part_bits):
    """Count every (context, next token) event of orders n_min..n_max into a row set.

    ``tokens``/``offsets``: sequences as in ``ngram_events``; ``skips[q]``: leading tokens of
    sequence q that are context only (a long sequence split with overlap: the events of the
    overlap were counted in the previous piece).  Only contexts whose key has ``part`` in its
    top ``part_bits`` bits are counted (``part_bits = 0``: all), so several threads can count
    one batch into disjoint key ranges.  Returns the row set (``ngramd.kernels.rowset``),
    sorted by key.

    Method (``count_hist`` then ``count_fill``): hash every context twice (a histogram pass,
    then a scatter pass into ~32k-event buckets on the top key bits), sort each bucket in cache
    and aggregate the runs of equal keys.  An event is 24 bytes (key; next token and order;
    parent key: recomputing the parent from a position instead cost a cache miss a row,
    ~50 ns, measured).  ``ngramd.cold.rows.Counter`` does the same with reused buffers.
    """
    tokens = np.ascontiguousarray(tokens, np.uint32)
    offsets = np.ascontiguousarray(offsets, np.int64)
    skips = np.ascontiguousarray(skips, np.int64)
    m_all = 0
    for q in range(offsets.shape[0] - 1):
        m_all += int(count_span(int(offsets[q + 1] - offsets[q]), int(skips[q]), n_min, n_max))
    bits = count_bits(m_all >> part_bits, part_bits)
    counts = count_hist(tokens, offsets, skips, n_min, n_max, part, part_bits, bits)
    m = int(counts[-1])
    ev = np.empty((m, 3), np.uint64)
    out = (np.empty(m, np.uint64), np.empty(m, np.uint64), np.empty(m, np.uint8),
           np.empty(m, np.uint32), np.empty(m + 1, np.int64), np.empty(m, np.uint32),
           np.empty(m, np.uint32))
    g, pp = count_fill(tokens, offsets, skips, n_min, n_max, k, part, part_bits, bits, counts,
                       ev, *out)
    return (out[0][:g].copy(), out[1][:g].copy(), out[2][:g].copy(), out[3][:g].copy(),
            out[4][:g + 1].copy(), out[5][:pp].copy(), out[6][:pp].copy())
