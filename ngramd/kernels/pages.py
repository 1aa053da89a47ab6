"""Pages: the on-disk form of a row set (one RocksDB value holds the rows of a key range).

A run of depth d stores the rows whose key has top-d bits p in page p.  Page layout (little
endian; every page is a multiple of 8 bytes so pages concatenated stay aligned)::

    u32 nrows, u32 npairs, u64 reserved (0)            16-byte header
    u64 key[n], u64 parent[n], u32 total[n], u32 tok[P], u32 cnt[P], u8 order[n], u8 npairs[n]
    zero padding to a multiple of 8 bytes

The row-set layout is ``ngramd.kernels.rowset``'s; the runs that hold pages are
``ngramd/cold/runs.py``'s.  A corrupt or truncated value must not send a kernel out of bounds:
``pages_check`` runs before any other kernel reads a blob.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .rowset import accumulate_row

PAGE_HEADER = 16


@njit(cache=True, nogil=True)
def _page_of(key, depth):
    if depth == 0:
        return np.uint64(0)
    return key >> np.uint64(64 - depth)


@njit(cache=True, nogil=True)
def pages_plan(rk, rq, depth):
    """Pages of a row set at ``depth``: ``(page ids, first row of each page (len + 1),
    byte offset of each page in the blob (len + 1))``."""
    m = rk.shape[0]
    n_pages = 0
    for i in range(m):
        if i == 0 or _page_of(rk[i], depth) != _page_of(rk[i - 1], depth):
            n_pages += 1
    ids = np.empty(n_pages, np.uint64)
    rstart = np.zeros(n_pages + 1, np.int64)
    bstart = np.zeros(n_pages + 1, np.int64)
    p = -1
    for i in range(m):
        pid = _page_of(rk[i], depth)
        if p < 0 or pid != ids[p]:
            p += 1
            ids[p] = pid
            rstart[p] = i
    rstart[n_pages] = m
    for p in range(n_pages):
        n = rstart[p + 1] - rstart[p]
        npairs = rq[rstart[p + 1]] - rq[rstart[p]]
        size = PAGE_HEADER + 22 * n + 8 * npairs
        bstart[p + 1] = bstart[p] + (size + 7) // 8 * 8
    return ids, rstart, bstart


@njit(cache=True, nogil=True)
def pages_fill(rk, rp, ro, rt, rq, rtok, rcnt, rstart, bstart, b8, b32, b64):
    """Write the pages planned by ``pages_plan`` into the blob (views u8/u32/u64 of one zeroed
    buffer of ``bstart[-1]`` bytes)."""
    for p in range(rstart.shape[0] - 1):
        r0 = rstart[p]
        n = rstart[p + 1] - r0
        q0 = rq[r0]
        npairs = rq[r0 + n] - q0
        base = bstart[p]
        b32[base // 4] = np.uint32(n)
        b32[base // 4 + 1] = np.uint32(npairs)
        w64 = (base + PAGE_HEADER) // 8
        for i in range(n):
            b64[w64 + i] = rk[r0 + i]
            b64[w64 + n + i] = rp[r0 + i]
        w32 = (base + PAGE_HEADER + 16 * n) // 4
        for i in range(n):
            b32[w32 + i] = rt[r0 + i]
        w32 += n
        for j in range(npairs):
            b32[w32 + j] = rtok[q0 + j]
            b32[w32 + npairs + j] = rcnt[q0 + j]
        o8 = base + PAGE_HEADER + 20 * n + 8 * npairs
        for i in range(n):
            b8[o8 + i] = ro[r0 + i]
            b8[o8 + n + i] = np.uint8(rq[r0 + i + 1] - rq[r0 + i])


@njit(cache=True, nogil=True)
def _page_dims(b32, base):
    return np.int64(b32[base // 4]), np.int64(b32[base // 4 + 1])


@njit(cache=True, nogil=True)
def pages_check(pstart, b32, size):
    """True when the pages at ``pstart`` (byte offsets, len + 1) are consistent with their
    headers (a corrupt or truncated value must not send a kernel out of bounds)."""
    for p in range(pstart.shape[0] - 1):
        base = pstart[p]
        if base % 8 or pstart[p + 1] > size or pstart[p + 1] - base < PAGE_HEADER:
            return False
        n, npairs = _page_dims(b32, base)
        need = PAGE_HEADER + 22 * n + 8 * npairs
        if (need + 7) // 8 * 8 != pstart[p + 1] - base:
            return False
    return True


@njit(cache=True, nogil=True)
def pages_lookup(keys, qpage, pstart, b8, b32, b64, k, found, o_ord, o_tot, o_tok, o_cnt):
    """For each key i whose page was fetched (``qpage[i]`` = index into ``pstart``, -1 = none),
    binary-search the page and merge the row found into the outputs (as ``rows_lookup``).
    Returns the number of keys found."""
    hits = 0
    for i in range(keys.shape[0]):
        p = qpage[i]
        if p < 0:
            continue
        base = pstart[p]
        n, npairs = _page_dims(b32, base)
        w64 = (base + PAGE_HEADER) // 8
        lo = 0
        hi = n
        key = keys[i]
        while lo < hi:
            mid = (lo + hi) // 2
            if b64[w64 + mid] < key:
                lo = mid + 1
            else:
                hi = mid
        if lo >= n or b64[w64 + lo] != key:
            continue
        hits += 1
        # offsets of row ``lo``'s candidates: sum of npairs before it
        o8 = base + PAGE_HEADER + 20 * n + 8 * npairs
        q = 0
        for r in range(lo):
            q += b8[o8 + n + r]
        c = b8[o8 + n + lo]
        w32 = (base + PAGE_HEADER + 16 * n) // 4
        total = b32[w32 + lo]
        tok = b32[w32 + n + q:w32 + n + q + c]
        cnt = b32[w32 + n + npairs + q:w32 + n + npairs + q + c]
        accumulate_row(i, b8[o8 + lo], total, tok, cnt, k, found, o_ord, o_tot, o_tok, o_cnt)
    return hits


@njit(cache=True, nogil=True)
def pages_dims(pstart, b32):
    """Total rows and candidate pairs of the pages at ``pstart``."""
    m = 0
    P = 0
    for p in range(pstart.shape[0] - 1):
        n, npairs = _page_dims(b32, pstart[p])
        m += n
        P += npairs
    return m, P


@njit(cache=True, nogil=True)
def pages_decode_into(pstart, b8, b32, b64, lo, hi, bounded, o_key, o_par, o_ord, o_tot, o_poff,
                      o_tok, o_cnt, g, pp):
    """Append every row with ``lo <= key < hi`` (``bounded=False``: no upper bound) of the pages
    at ``pstart`` to row-set arrays sized by ``pages_dims``, from row ``g`` and pair ``pp`` on
    (``o_poff[g]`` must already be ``pp``).  Returns the new ``(g, pp)``."""
    for p in range(pstart.shape[0] - 1):
        base = pstart[p]
        n, npairs = _page_dims(b32, base)
        w64 = (base + PAGE_HEADER) // 8
        w32 = (base + PAGE_HEADER + 16 * n) // 4
        o8 = base + PAGE_HEADER + 20 * n + 8 * npairs
        q = 0
        for r in range(n):
            c = b8[o8 + n + r]
            key = b64[w64 + r]
            if key >= lo and (not bounded or key < hi):
                o_key[g] = key
                o_par[g] = b64[w64 + n + r]
                o_ord[g] = b8[o8 + r]
                o_tot[g] = b32[w32 + r]
                for j in range(c):
                    o_tok[pp] = b32[w32 + n + q + j]
                    o_cnt[pp] = b32[w32 + n + npairs + q + j]
                    pp += 1
                g += 1
                o_poff[g] = pp
            q += c
    return g, pp
