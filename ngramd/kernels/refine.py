"""The daemon's cold refine: which keys a cold read could add to a fast draft, and the warm
cache that keeps what the cold tier answered.

After the fast draft over the hot, recent and warm tables (``ngramd.kernels.drafting``), the
daemon reads from RocksDB only the longer orders no in-memory table holds and the pruned-key
filter does not rule out (``cold_candidates``); answers, and misses as negative entries, go
into the warm cache, a slot table of its own (``warm_insert``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .bloom import bbloom_may
from .hashing import load_tail, suffix_hashes
from .slots import probe, write_slot


@njit(cache=True)
def cold_candidates(tokens, offsets, d_tok, d_order, d_len, n_min, n_max, warm, hot,
                     max_probe, skip, skip_nprobe, out_ctx, out_order, out_key, out_pos):
    """Keys a cold read could add to the current drafts: at every step of each context's draft
    (and one step past its end when the draft is shorter than ``d_tok.shape[1]``), the orders
    longer than the one the fast path matched that are absent from both the hot tier and the
    warm cache, and not known to be redundant (``skip``: a blocked Bloom filter of the keys the
    hot builder pruned because their parent drafts the same token — reading those from RocksDB
    would add latency and nothing else).

    Writes rows (context index, order, key, step) and returns their number (bounded by the
    output size).  ``out_pos`` is the draft step, so the caller can rebuild the context.
    """
    hs = np.zeros(n_max + 1, np.uint64)
    buf = np.empty(n_max + d_tok.shape[1] + 1, np.uint32)
    m = 0
    cap = out_ctx.shape[0]
    for b in range(offsets.shape[0] - 1):
        end = load_tail(tokens[offsets[b]:offsets[b + 1]], n_max, buf)
        # every drafted step, plus one past the end unless the draft is already full
        for j in range(min(d_len[b] + 1, d_tok.shape[1])):
            avail = suffix_hashes(buf, end, n_max, hs)
            matched = d_order[b, j] if j < d_len[b] else 0
            lo = max(matched + 1, n_min)
            for n in range(avail, lo - 1, -1):
                key = hs[n]
                if probe(hot, max_probe, key) >= 0 or probe(warm, max_probe, key) >= 0:
                    continue
                if skip.shape[0] and bbloom_may(skip, key, skip_nprobe):
                    continue
                if m == cap:
                    return m
                out_ctx[m] = b
                out_order[m] = n
                out_key[m] = key
                out_pos[m] = j
                m += 1
            if j < d_len[b]:
                buf[end] = d_tok[b, j]
                end += 1
    return m


@njit(cache=True)
def warm_insert(warm, max_probe, key, order, tok, cnt, total):
    """Insert one cold entry (or a negative entry when ``total`` is 0) into the warm cache.
    Returns False when the probe bound is exhausted (the caller then resets the cache)."""
    mask = np.uint64(warm.shape[0] - 1)
    i = key & mask
    for _ in range(max_probe):
        sk = np.uint64(warm[i, 0]) | (np.uint64(warm[i, 1]) << np.uint64(32))
        if sk == np.uint64(0) or sk == key:
            if total == 0:
                write_slot(warm, i, key, order, tok[:0], cnt[:0], 1)
            else:
                write_slot(warm, i, key, order, tok, cnt, total)
            return True
        i = (i + np.uint64(1)) & mask
    return False
