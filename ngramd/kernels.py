"""Array-in, array-out kernels of the n-gram table.

Everything on the hot path lives here as plain numba functions over numpy arrays, so that the
daemon, every ``HotReader`` in a generator process, the request-local table and the tests all run
the very same code.  Classes elsewhere only own resources (segments, databases, sockets).

Definitions used throughout
---------------------------
* **Token ids** are ``uint32``.
* **Key hash.**  The 64-bit key of an order-``n`` context (the last ``n`` tokens) is computed from
  the *most recent* token backwards, so all orders of one context come out of a single pass::

      s_0 = HASH_SEED
      s_k = rotl64((s_{k-1} ^ t[-k]) * HASH_MUL, 31)          k = 1..n
      key(n) = fmix64(s_n ^ (n * HASH_ORDER_MUL))              (0 is remapped to 1)

  ``fmix64`` is MurmurHash3's 64-bit finaliser.  The mix is fixed and documented: every process
  that reads a hot segment must compute the same keys.  ``0`` marks an empty slot.
* **Slot** (hot tier and request-local table): 8 ``uint32`` words = 32 bytes::

      w0,w1  key hash (low, high)
      w2..w4 the top ``HOT_K`` = 3 next tokens, best first (unused: ``EMPTY_TOKEN``)
      w5     count[0] | count[1] << 16           (saturating uint16 counts, see below)
      w6     count[2] | total << 16
      w7     order | flags << 8

  Counts and the total (all observations of the context) are scaled together when the total
  does not fit 16 bits, so the share ``count / total`` survives saturation.
* **Table geometry.**  Open addressing with linear probing over a power-of-two capacity; a key
  lives at most ``max_probe - 1`` slots after its home slot, so a miss costs at most
  ``max_probe`` slot reads.

Drafting returns, for every drafted token, the order and the tier that produced it and its
confidence (share), so acceptance can be attributed per order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# ---------------------------------------------------------------------------------------------
# constants (part of the on-disk / shared-memory format: change them and bump the format version)
# ---------------------------------------------------------------------------------------------
HASH_SEED = np.uint64(0x9E3779B97F4A7C15)
HASH_MUL = np.uint64(0xFF51AFD7ED558CCD)
HASH_ORDER_MUL = np.uint64(0xC4CEB9FE1A85EC53)
SLOT_WORDS = 8
SLOT_BYTES = SLOT_WORDS * 4
HOT_K = 3
EMPTY_TOKEN = np.uint32(0xFFFFFFFF)
MAX_ORDER = 32
U16_MAX = 0xFFFF
#: the share rule is ``count >= s_min * total * SHARE_SLACK``: thresholds travel as float32, and
#: float32(0.6) * 10 > 6 would reject a share of exactly 6/10 (found by hypothesis)
SHARE_SLACK = 1.0 - 1e-6

TIER_LOCAL = 0
TIER_HOT = 1
TIER_COLD = 2
TIER_NAMES = ("local", "hot", "cold")

_M32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, inline="always")
def _fmix64(k):
    k ^= k >> np.uint64(33)
    k *= np.uint64(0xFF51AFD7ED558CCD)
    k ^= k >> np.uint64(33)
    k *= np.uint64(0xC4CEB9FE1A85EC53)
    k ^= k >> np.uint64(33)
    return k


@njit(cache=True, inline="always")
def _step(s, tok):
    return _rotl((s ^ np.uint64(tok)) * HASH_MUL, 31)


@njit(cache=True, inline="always")
def _finish(s, n):
    k = _fmix64(s ^ (np.uint64(n) * HASH_ORDER_MUL))
    if k == np.uint64(0):
        k = np.uint64(1)
    return k


@njit(cache=True)
def suffix_hashes(tokens, end, n_max, out):
    """Keys of the suffixes ``tokens[end-n:end]`` for n = 1..n_max into ``out[n]``.

    ``out`` has at least ``n_max + 1`` entries; orders longer than the available context get 0.
    Returns the longest order computed.
    """
    s = HASH_SEED
    avail = min(end, n_max)
    for n in range(1, avail + 1):
        s = _step(s, tokens[end - n])
        out[n] = _finish(s, n)
    for n in range(avail + 1, n_max + 1):
        out[n] = np.uint64(0)
    return avail


@njit(cache=True)
def key_hash(tokens):
    """Key of the whole array ``tokens`` taken as one context (order = len(tokens))."""
    s = HASH_SEED
    n = tokens.shape[0]
    for k in range(1, n + 1):
        s = _step(s, tokens[n - k])
    return _finish(s, n)


# ---------------------------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------------------------
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
                s = _step(s, tokens[i - n])
                hs[n] = _finish(s, n)
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
        _topk_into(sc_tok, sc_cnt, nd, out_tok[g], out_cnt[g])
        i = j
    return out_key, out_parent, out_order, out_pos, out_total, out_tok, out_cnt


@njit(cache=True)
def _topk_into(tok, cnt, nd, out_tok, out_cnt):
    """Write the best ``len(out_tok)`` of ``tok[:nd]`` by (count desc, token asc)."""
    k = out_tok.shape[0]
    used = np.zeros(nd, np.bool_)
    for r in range(min(k, nd)):
        best = -1
        for d in range(nd):
            if used[d]:
                continue
            if best < 0 or cnt[d] > cnt[best] or (cnt[d] == cnt[best] and tok[d] < tok[best]):
                best = d
        used[best] = True
        out_tok[r] = tok[best]
        out_cnt[r] = cnt[best]
    for r in range(min(k, nd), k):
        out_tok[r] = EMPTY_TOKEN
        out_cnt[r] = 0


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


@njit(cache=True)
def merge_topk(tot_a, tok_a, cnt_a, tot_b, tok_b, cnt_b, out_tok, out_cnt):
    """Merge two (total, top-k) summaries of the same context; returns the merged total.

    Counts of equal tokens add; the best ``len(out_tok)`` survive.  Tokens that fell out of an
    earlier top-k are forgotten (their observations stay in the total, so shares stay honest).
    """
    ka = tok_a.shape[0]
    kb = tok_b.shape[0]
    tok = np.empty(ka + kb, np.uint32)
    cnt = np.empty(ka + kb, np.uint32)
    nd = 0
    for i in range(ka):
        if tok_a[i] != EMPTY_TOKEN:
            tok[nd] = tok_a[i]
            cnt[nd] = cnt_a[i]
            nd += 1
    for i in range(kb):
        t = tok_b[i]
        if t == EMPTY_TOKEN:
            continue
        found = False
        for d in range(nd):
            if tok[d] == t:
                s = np.uint64(cnt[d]) + np.uint64(cnt_b[i])
                cnt[d] = np.uint32(min(s, np.uint64(0xFFFFFFFF)))
                found = True
                break
        if not found:
            tok[nd] = t
            cnt[nd] = cnt_b[i]
            nd += 1
    _topk_into(tok, cnt, nd, out_tok, out_cnt)
    s = np.uint64(tot_a) + np.uint64(tot_b)
    return np.uint32(min(s, np.uint64(0xFFFFFFFF)))


# ---------------------------------------------------------------------------------------------
# slots: encode, build, probe
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _pack_counts(tok, cnt, total, out3_tok, out3_cnt):
    """Scale (counts, total) so the total fits 16 bits; returns the stored total."""
    if total <= U16_MAX:
        scale_num = np.uint64(1)
        scale_den = np.uint64(1)
    else:
        scale_num = np.uint64(U16_MAX)
        scale_den = np.uint64(total)
    for r in range(HOT_K):
        if r < tok.shape[0]:
            out3_tok[r] = tok[r]
            c = np.uint64(cnt[r]) * scale_num // scale_den
            if c == 0 and cnt[r] > 0:
                c = np.uint64(1)
            out3_cnt[r] = np.uint32(c)
        else:
            out3_tok[r] = EMPTY_TOKEN
            out3_cnt[r] = 0
    t = np.uint64(total) * scale_num // scale_den
    return np.uint32(max(t, np.uint64(1)))


@njit(cache=True)
def write_slot(slots, idx, key, order, tok, cnt, total):
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    tt = _pack_counts(tok, cnt, total, t3, c3)
    slots[idx, 0] = np.uint32(key & _M32)
    slots[idx, 1] = np.uint32(key >> np.uint64(32))
    slots[idx, 2] = t3[0]
    slots[idx, 3] = t3[1]
    slots[idx, 4] = t3[2]
    slots[idx, 5] = c3[0] | (c3[1] << np.uint32(16))
    slots[idx, 6] = c3[2] | (tt << np.uint32(16))
    slots[idx, 7] = np.uint32(order)


@njit(cache=True, inline="always")
def _slot_key(slots, idx):
    return np.uint64(slots[idx, 0]) | (np.uint64(slots[idx, 1]) << np.uint64(32))


@njit(cache=True)
def probe(slots, max_probe, key):
    """Index of ``key`` in the slot array, or -1.  At most ``max_probe`` slot reads."""
    if slots.shape[0] == 0:  # an absent table (e.g. before the first hot generation)
        return np.int64(-1)
    mask = np.uint64(slots.shape[0] - 1)
    i = key & mask
    for _ in range(max_probe):
        sk = _slot_key(slots, i)
        if sk == key:
            return np.int64(i)
        if sk == np.uint64(0):
            return np.int64(-1)
        i = (i + np.uint64(1)) & mask
    return np.int64(-1)


@njit(cache=True)
def probe_batch(slots, max_probe, keys, out):
    """``out[i] = probe(keys[i])`` for a batch of keys (0 keys are misses)."""
    for i in range(keys.shape[0]):
        if keys[i] == np.uint64(0):
            out[i] = -1
        else:
            out[i] = probe(slots, max_probe, keys[i])


@njit(cache=True)
def build_slots(capacity, max_probe, keys, orders, tok, cnt, total):
    """Build a slot array from rows given in priority order (most valuable first).

    A row whose key cannot be placed within ``max_probe`` slots of its home is dropped; a row
    whose key is already present is dropped (the earlier, more valuable row wins).  Returns
    ``(slots, placed_mask)``.
    """
    slots = np.zeros((capacity, SLOT_WORDS), np.uint32)
    mask = np.uint64(capacity - 1)
    placed = np.zeros(keys.shape[0], np.bool_)
    for r in range(keys.shape[0]):
        key = keys[r]
        if key == np.uint64(0):
            continue
        i = key & mask
        for _ in range(max_probe):
            sk = _slot_key(slots, i)
            if sk == key:
                break
            if sk == np.uint64(0):
                write_slot(slots, i, key, orders[r], tok[r], cnt[r], total[r])
                placed[r] = True
                break
            i = (i + np.uint64(1)) & mask
    return slots, placed


@njit(cache=True)
def slot_decode(slots, idx, out_tok, out_cnt):
    """Decode slot ``idx`` into ``out_tok[3]``/``out_cnt[3]``; returns (order, total)."""
    out_tok[0] = slots[idx, 2]
    out_tok[1] = slots[idx, 3]
    out_tok[2] = slots[idx, 4]
    out_cnt[0] = slots[idx, 5] & np.uint32(0xFFFF)
    out_cnt[1] = slots[idx, 5] >> np.uint32(16)
    out_cnt[2] = slots[idx, 6] & np.uint32(0xFFFF)
    return np.int64(slots[idx, 7] & np.uint32(0xFF)), np.int64(slots[idx, 6] >> np.uint32(16))


@njit(cache=True)
def checksum(slots):
    """64-bit checksum of a slot array (readers in tests validate it to detect torn tables)."""
    flat = slots.reshape(-1)
    h = HASH_SEED
    for i in range(flat.shape[0]):
        h = _step(h, flat[i])
    return _fmix64(h)


# ---------------------------------------------------------------------------------------------
# request-local table: incremental, exact counts (until a slot's candidates overflow)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def local_add(slots, max_probe, tokens, start, end, n_min, n_max):
    """Add the events whose next token is ``tokens[i]`` for i in [start, end) to a mutable slot
    table (the request-local table).  Returns the number of events dropped because their key
    could not be placed within ``max_probe``.

    When a context already has HOT_K candidates and a new token arrives, the weakest candidate
    is replaced only if the new one ties it (space-saving style), keeping the table bounded.
    """
    mask = np.uint64(slots.shape[0] - 1)
    hs = np.zeros(n_max + 1, np.uint64)
    dropped = 0
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    for i in range(max(start, 1), end):
        avail = suffix_hashes(tokens, i, n_max, hs)
        nt = tokens[i]
        for n in range(n_min, avail + 1):
            key = hs[n]
            j = key & mask
            placed = False
            for _ in range(max_probe):
                sk = _slot_key(slots, j)
                if sk == np.uint64(0):
                    slots[j, 0] = np.uint32(key & _M32)
                    slots[j, 1] = np.uint32(key >> np.uint64(32))
                    slots[j, 2] = nt
                    slots[j, 3] = EMPTY_TOKEN
                    slots[j, 4] = EMPTY_TOKEN
                    slots[j, 5] = np.uint32(1)
                    slots[j, 6] = np.uint32(1) << np.uint32(16)
                    slots[j, 7] = np.uint32(n)
                    placed = True
                    break
                if sk == key:
                    _, total = slot_decode(slots, j, t3, c3)
                    hit = -1
                    for r in range(HOT_K):
                        if t3[r] == nt:
                            hit = r
                            break
                    if hit < 0:
                        worst = HOT_K - 1
                        if t3[worst] == EMPTY_TOKEN:
                            for r in range(HOT_K):
                                if t3[r] == EMPTY_TOKEN:
                                    worst = r
                                    break
                            t3[worst] = nt
                            c3[worst] = 0
                        else:
                            t3[worst] = nt  # space-saving: inherit the evicted count
                        hit = worst
                    c3[hit] += 1
                    total += 1
                    # keep candidates sorted by count (bubble the updated one up)
                    r = hit
                    while r > 0 and c3[r] > c3[r - 1]:
                        tt = t3[r]
                        t3[r] = t3[r - 1]
                        t3[r - 1] = tt
                        cc = c3[r]
                        c3[r] = c3[r - 1]
                        c3[r - 1] = cc
                        r -= 1
                    if total > U16_MAX or c3[0] > U16_MAX:
                        for r in range(HOT_K):
                            c3[r] = c3[r] // 2
                        total = total // 2
                    slots[j, 2] = t3[0]
                    slots[j, 3] = t3[1]
                    slots[j, 4] = t3[2]
                    slots[j, 5] = c3[0] | (c3[1] << np.uint32(16))
                    slots[j, 6] = c3[2] | (np.uint32(total) << np.uint32(16))
                    placed = True
                    break
                j = (j + np.uint64(1)) & mask
            if not placed:
                dropped += 1
    return dropped


# ---------------------------------------------------------------------------------------------
# drafting: chained longest match over up to two slot tables (primary first, e.g. local, hot)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def _best_at(slots, max_probe, hs, lo, hi, c_min, s_min, t3, c3):
    """Longest order in [lo, hi] (descending) whose key is present and whose best candidate
    passes the confidence rule.  Returns (order, total, probes) with the candidates decoded
    into ``t3``/``c3``, or (0, 0, probes)."""
    probes = 0
    if slots.shape[0] == 0:
        return 0, np.int64(0), 0
    for n in range(hi, lo - 1, -1):
        key = hs[n]
        if key == np.uint64(0):
            continue
        probes += 1
        idx = probe(slots, max_probe, key)
        if idx < 0:
            continue
        order, total = slot_decode(slots, idx, t3, c3)
        if order != n or t3[0] == EMPTY_TOKEN:
            continue  # a colliding key of another order: not ours
        if c3[0] < c_min[n] or c3[0] < s_min[n] * total * SHARE_SLACK:
            continue
        return n, total, probes
    return 0, np.int64(0), probes


@njit(cache=True)
def draft_chain(
    slots_a, slots_b, max_probe, ctx, n_min, n_max, max_len, c_min, s_min, p_cum, f_cap,
    tier_a, tier_b, out_tok, out_order, out_tier, out_conf, full_a=False, full_b=False,
):
    """Draft up to ``max_len`` tokens after ``ctx``; returns (length, probes).

    Per step: the longest order whose key passes ``count >= c_min[n]`` and
    ``count >= s_min[n] * total`` in either table; on equal orders ``slots_a`` wins (pass an
    empty ``(0, 8)`` array to use one table).  Taking the longer match rather than "a first"
    matters for a request-local ``a`` and a global ``b``: a weak order-1 match in the request
    would otherwise hide an order-16 match in the global table.  After a match at order n the next step starts at
    n + 1: with a complete table no longer order can match (the context grew by one token), so
    a draft costs about two probes per token.  That holds for *complete* tables (every suffix of
    a stored context is stored, e.g. the request-local table); a table that omits entries, such
    as the hot tier with redundant rows pruned, must restart every step at n_max
    (``full_a``/``full_b`` = True): measured on held-out code, the n + 1 rule over a pruned
    table lost 14-23% of accepted tokens.  Stops when nothing passes, when the product of
    shares falls below ``p_cum``, or (``f_cap > 0``) when the draft reaches ``f_cap`` times
    the order of its first match.
    """
    buf_len = n_max + max_len
    buf = np.empty(buf_len, np.uint32)
    c = min(ctx.shape[0], n_max)
    for i in range(c):
        buf[i] = ctx[ctx.shape[0] - c + i]
    end = c
    hs = np.zeros(n_max + 1, np.uint64)
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    t3b = np.empty(HOT_K, np.uint32)
    c3b = np.empty(HOT_K, np.uint32)
    start_a = n_max
    start_b = n_max
    pcum = 1.0
    length = 0
    probes = 0
    cap = max_len
    while length < max_len:
        avail = suffix_hashes(buf, end, n_max, hs)
        hi_a = min(start_a, avail)
        n_a, total, p = _best_at(slots_a, max_probe, hs, n_min, hi_a, c_min, s_min, t3, c3)
        probes += p
        # b only matters where it knows a longer context than a: probe it above n_a only
        hi_b = min(start_b, avail)
        n_b, total_b, p = _best_at(slots_b, max_probe, hs, max(n_min, n_a + 1), hi_b, c_min,
                                   s_min, t3b, c3b)
        probes += p
        if n_b > 0:
            n, tier, total = n_b, tier_b, total_b
            for r in range(HOT_K):
                t3[r] = t3b[r]
                c3[r] = c3b[r]
        elif n_a > 0:
            n, tier = n_a, tier_a
        else:
            break
        # next step's first order per table: its longest match + 1 (complete tables only)
        start_a = n_max if (full_a or n_a == 0) else min(n_a + 1, n_max)
        if full_b:
            start_b = n_max
        elif n_b > 0:
            start_b = min(n_b + 1, n_max)
        else:  # b has nothing above n_a here
            start_b = min(n_a + 1, n_max) if n_a > 0 else n_max
        share = c3[0] / max(total, 1)
        pcum *= share
        if length > 0 and pcum < p_cum:
            break
        if length == 0 and f_cap > 0:
            cap = min(max_len, max(1, int(f_cap * n)))
        out_tok[length] = t3[0]
        out_order[length] = n
        out_tier[length] = tier
        out_conf[length] = share
        length += 1
        if length >= cap:
            break
        # append and slide the window so it always holds the last n_max tokens
        if end == buf_len:
            for i in range(n_max - 1):
                buf[i] = buf[end - n_max + 1 + i]
            end = n_max - 1
        buf[end] = t3[0]
        end += 1
    return length, probes


@njit(cache=True)
def draft_batch(
    slots_a, slots_b, max_probe, tokens, offsets, n_min, n_max, max_len, c_min, s_min, p_cum,
    f_cap, tier_a, tier_b, out_tok, out_order, out_tier, out_conf, out_len, full_a=False,
    full_b=False,
):
    """``draft_chain`` for each context ``tokens[offsets[i]:offsets[i+1]]``; outputs are
    ``(B, max_len)`` arrays plus ``out_len[B]``.  Returns the total number of probes."""
    probes = 0
    for b in range(offsets.shape[0] - 1):
        ctx = tokens[offsets[b]:offsets[b + 1]]
        ln, p = draft_chain(
            slots_a, slots_b, max_probe, ctx, n_min, n_max, max_len, c_min, s_min, p_cum, f_cap,
            tier_a, tier_b, out_tok[b], out_order[b], out_tier[b], out_conf[b], full_a, full_b,
        )
        out_len[b] = ln
        probes += p
    return probes


@njit(cache=True)
def lookup_batch(slots, max_probe, tokens, offsets, n_min, n_max, out_tok, out_cnt, out_total):
    """Top-3 candidates for every order of every context (no chaining).

    Outputs: ``out_tok/out_cnt`` of shape ``(B, n_max + 1, 3)`` and ``out_total (B, n_max+1)``;
    orders that miss have total 0.  Returns the number of hits.
    """
    hs = np.zeros(n_max + 1, np.uint64)
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    hits = 0
    for b in range(offsets.shape[0] - 1):
        ctx = tokens[offsets[b]:offsets[b + 1]]
        avail = suffix_hashes(ctx, ctx.shape[0], n_max, hs)
        for n in range(n_min, n_max + 1):
            out_total[b, n] = 0
            for r in range(HOT_K):
                out_tok[b, n, r] = EMPTY_TOKEN
                out_cnt[b, n, r] = 0
            if n > avail:
                continue
            idx = probe(slots, max_probe, hs[n])
            if idx < 0:
                continue
            order, total = slot_decode(slots, idx, t3, c3)
            if order != n:
                continue
            for r in range(HOT_K):
                out_tok[b, n, r] = t3[r]
                out_cnt[b, n, r] = c3[r]
            out_total[b, n] = total
            hits += 1
    return hits


# ---------------------------------------------------------------------------------------------
# daemon-side helpers (cold tier and Table).  They live here, not beside their callers, because
# numba's on-disk cache of a function is invalidated only by changes to its own source file: a
# kernel in table.py that inlines ``probe`` from this file would keep a stale copy after
# ``probe`` changed.  One file, one cache stamp.
# ---------------------------------------------------------------------------------------------
BLOOM_K = 7  # hash functions; with 10 bits a key: ~1% false positives
BLOOM_BITS_PER_KEY = 10


@njit(cache=True)
def bloom_build(keys, bits_per_key):
    """A Bloom filter (uint64 words) of ``keys`` (double hashing over the 64-bit key)."""
    n_words = max(1, (keys.shape[0] * bits_per_key + 63) // 64)
    bits = np.zeros(n_words, np.uint64)
    m = np.uint64(n_words * 64)
    for key in keys:
        h2 = _fmix64(key ^ np.uint64(0x5BD1E9955BD1E995)) | np.uint64(1)
        for i in range(BLOOM_K):
            b = (key + np.uint64(i) * h2) % m
            bits[b >> np.uint64(6)] |= np.uint64(1) << (b & np.uint64(63))
    return bits


@njit(cache=True)
def bloom_has(bits, key):
    m = np.uint64(bits.shape[0] * 64)
    h2 = _fmix64(key ^ np.uint64(0x5BD1E9955BD1E995)) | np.uint64(1)
    for i in range(BLOOM_K):
        b = (key + np.uint64(i) * h2) % m
        if not (bits[b >> np.uint64(6)] >> (b & np.uint64(63))) & np.uint64(1):
            return False
    return True


@njit(cache=True, inline="always")
def load_tail(ctx, n_max, buf):
    """Copy the last (up to) ``n_max`` tokens of ``ctx`` to the front of ``buf``; returns how
    many: the drafted tokens are appended after them."""
    c = min(ctx.shape[0], n_max)
    for i in range(c):
        buf[i] = ctx[ctx.shape[0] - c + i]
    return c


@njit(cache=True)
def cold_candidates(tokens, offsets, d_tok, d_order, d_len, n_min, n_max, warm, hot,
                     max_probe, skip, out_ctx, out_order, out_key, out_pos):
    """Keys a cold read could add to the current drafts: at every step of each context's draft
    (and one step past its end when the draft is shorter than ``d_tok.shape[1]``), the orders longer than the one the fast path matched that are
    absent from both the hot tier and the warm cache, and not known to be redundant (``skip``:
    a Bloom filter of the keys the hot builder pruned because their parent drafts the same
    token — reading those from RocksDB would add latency and nothing else).

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
                if skip.shape[0] and bloom_has(skip, key):
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


@njit(cache=True)
def draft_keys(tokens, offsets, out_tok, out_order, out_len, n_max, out_keys):
    """Key of the entry behind every drafted token (context + draft so far, at its order);
    returns how many were written.  Used to credit lookup hits to hot candidates."""
    m = 0
    buf = np.empty(n_max + out_tok.shape[1], np.uint32)
    for b in range(offsets.shape[0] - 1):
        end = load_tail(tokens[offsets[b]:offsets[b + 1]], n_max, buf)
        for j in range(out_len[b]):
            n = out_order[b, j]
            out_keys[m] = key_hash(buf[end - n:end])
            m += 1
            buf[end] = out_tok[b, j]
            end += 1
    return m


@njit(cache=True)
def context_hashes(ctx, order, out_key, out_parent):
    """Kernel key hash of each left-aligned context ``ctx[i, :order[i]]`` and of its order-1
    suffix (0 for order 1); identical to what ``kernels.ngram_events`` yields."""
    hs = np.zeros(MAX_ORDER + 1, np.uint64)
    for i in range(ctx.shape[0]):
        o = order[i]
        suffix_hashes(ctx[i], o, o, hs)
        out_key[i] = hs[o]
        out_parent[i] = hs[o - 1] if o > 1 else np.uint64(0)


@njit(cache=True)
def merge_rows(rows, old_idx, old_total, old_tok, old_cnt, new_total, new_tok, new_cnt,
               out_total, out_tok, out_cnt):
    """``out[i]`` = stored value ``old[old_idx[i]]`` (if >= 0) merged by ``kernels.merge_topk``
    with the batch's counts ``new[rows[i]]``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        j = old_idx[i]
        if j >= 0:
            out_total[i] = merge_topk(old_total[j], old_tok[j], old_cnt[j], new_total[r],
                                      new_tok[r], new_cnt[r], out_tok[i], out_cnt[i])
        else:
            out_total[i] = new_total[r]
            out_tok[i] = new_tok[r]
            out_cnt[i] = new_cnt[r]


@njit(cache=True)
def tally_drafts(out_tier, out_order, out_len, counts):
    """``counts[tier, order] += 1`` for every drafted token (np.add.at costs ~40 µs a call)."""
    for b in range(out_len.shape[0]):
        for j in range(out_len[b]):
            counts[out_tier[b, j], out_order[b, j]] += 1
