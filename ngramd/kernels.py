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
from .wire.constants import (  # noqa: E402,F401 (re-exported: the kernels' users read them here)
    EMPTY_TOKEN, HASH_MUL, HASH_ORDER_MUL, HASH_SEED, HOT_K, MAX_ORDER, SHARE_SLACK,
    SLOT_BYTES, SLOT_WORDS, TIER_COLD, TIER_HOT, TIER_LOCAL, TIER_NAMES, TIER_RECENT, U16_MAX,
)

_M32 = np.uint64(0xFFFFFFFF)
#: a slot table of no slots (an absent tier); shared, and never written (it has nothing to write)
EMPTY_SLOTS = np.zeros((0, SLOT_WORDS), np.uint32)


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


@njit(cache=True, nogil=True)
def _topk_into(tok, cnt, nd, out_tok, out_cnt):
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
def _add_candidate(tok, cnt, n_search, nd, t, c):
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


# ---------------------------------------------------------------------------------------------
# slots: encode, build, probe
# ---------------------------------------------------------------------------------------------
@njit(cache=True, inline="always")
def _scaled(c, num, den):
    x = np.uint64(c) * num // den
    if x == 0 and c > 0:
        x = np.uint64(1)
    return np.uint32(x)


@njit(cache=True)
def write_slot(slots, idx, key, order, tok, cnt, total):
    """Write one slot: the first ``HOT_K`` of ``tok``/``cnt`` (best first) and ``total``.
    Counts and total are scaled together so the total fits 16 bits (the share survives).
    No allocation (it runs once per row of every hot build and recent update)."""
    if total <= U16_MAX:
        num = np.uint64(1)
        den = np.uint64(1)
    else:
        num = np.uint64(U16_MAX)
        den = np.uint64(total)
    n = tok.shape[0]
    t0 = tok[0] if n > 0 else EMPTY_TOKEN
    t1 = tok[1] if n > 1 else EMPTY_TOKEN
    t2 = tok[2] if n > 2 else EMPTY_TOKEN
    c0 = _scaled(cnt[0], num, den) if n > 0 else np.uint32(0)
    c1 = _scaled(cnt[1], num, den) if n > 1 else np.uint32(0)
    c2 = _scaled(cnt[2], num, den) if n > 2 else np.uint32(0)
    tt = np.uint64(total) * num // den
    tt = np.uint32(max(tt, np.uint64(1)))
    slots[idx, 0] = np.uint32(key & _M32)
    slots[idx, 1] = np.uint32(key >> np.uint64(32))
    slots[idx, 2] = t0
    slots[idx, 3] = t1
    slots[idx, 4] = t2
    slots[idx, 5] = c0 | (c1 << np.uint32(16))
    slots[idx, 6] = c2 | (tt << np.uint32(16))
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
    placed = np.zeros(keys.shape[0], np.bool_)
    for r in range(keys.shape[0]):
        placed[r] = _place_new(slots, max_probe, keys[r], orders[r], tok[r], cnt[r], total[r])
    return slots, placed


@njit(cache=True, nogil=True, inline="always")
def _place_new(slots, max_probe, key, order, tok, cnt, total):
    """Write a row into the first free slot within ``max_probe`` of its home, unless its key is
    0, already present there, or finds no free slot; returns whether it was written."""
    if key == np.uint64(0):
        return False
    i = _slot_for(slots, max_probe, key)
    if i < 0 or _slot_key(slots, i) != np.uint64(0):
        return False
    write_slot(slots, i, key, order, tok, cnt, total)
    return True


@njit(cache=True, nogil=True, inline="always")
def _slot_for(slots, max_probe, key):
    """The slot within ``max_probe`` of ``key``'s home that holds ``key``, else the first free
    one before it; -1 if neither."""
    mask = np.uint64(slots.shape[0] - 1)
    i = key & mask
    for _ in range(max_probe):
        sk = _slot_key(slots, i)
        if sk == key or sk == np.uint64(0):
            return np.int64(i)
        i = (i + np.uint64(1)) & mask
    return np.int64(-1)


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


@njit(cache=True, nogil=True)
def checksum(slots):
    """64-bit checksum of a slot array (readers in tests validate it to detect torn tables)."""
    flat = slots.reshape(-1)
    h = HASH_SEED
    for i in range(flat.shape[0]):
        h = _step(h, flat[i])
    return _fmix64(h)


# ---------------------------------------------------------------------------------------------
# request-local table: incremental counts that are exact until a context has more than HOT_K
# distinct next tokens, and lower bounds after that (never above the truth)
# ---------------------------------------------------------------------------------------------
@njit(cache=True)
def local_add(slots, max_probe, tokens, start, end, n_min, n_max, limit=U16_MAX):
    """Add the events whose next token is ``tokens[i]`` for i in [start, end) to a mutable slot
    table (the request-local table).  Returns the number of events dropped because their key
    could not be placed within ``max_probe``.

    A slot keeps at most HOT_K candidates (best first) and the context's ``total``, which counts
    every event, kept or not.  When all HOT_K are taken and another token arrives:

    * if the weakest candidate's count is 1 (or 0, after halving) it is replaced by the new token
      with count 1: the newcomer ties it, so nothing is ranked above what it has earned;
    * otherwise the weakest count is decremented by one and the new token is not stored
      (a Misra-Gries decrement, applied to the weakest candidate only).

    Why: the drafter and the draft-length policy read ``count / total`` as a confidence.  The
    old space-saving rule (the newcomer inherits the evicted count) let a token seen once
    outrank tokens seen twice and inflated that share.  Under this rule every stored count is a
    lower bound of the true count and ``total`` is exact, so a share is never inflated.  Only
    the weakest candidate pays for misses, so the leader's share stays exact (full Misra-Gries
    would lower it on every unseen token); and the weakest drains by one per miss, so a token
    that becomes frequent later still gets in (replace-only-at-1 alone would lock it out).

    When ``total`` exceeds ``limit`` (the 16-bit field; tests pass a small one to reach this
    branch) counts are halved rounding down and the total rounding up, so halving never raises
    a share either.  Reference: ``tests/reference.py::local_table``.
    """
    hs = np.zeros(n_max + 1, np.uint64)
    dropped = 0
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    for i in range(max(start, 1), end):
        avail = suffix_hashes(tokens, i, n_max, hs)
        nt = tokens[i]
        for n in range(n_min, avail + 1):
            key = hs[n]
            j = _slot_for(slots, max_probe, key)
            if j < 0:
                dropped += 1
            elif _slot_key(slots, j) == np.uint64(0):
                _local_new(slots, j, key, n, nt)
            else:
                _local_count(slots, j, nt, limit, t3, c3)
    return dropped


@njit(cache=True, inline="always")
def _local_new(slots, j, key, n, nt):
    """Slot ``j`` becomes the order-``n`` context ``key``, seen once, followed by ``nt``."""
    slots[j, 0] = np.uint32(key & _M32)
    slots[j, 1] = np.uint32(key >> np.uint64(32))
    slots[j, 2] = nt
    slots[j, 3] = EMPTY_TOKEN
    slots[j, 4] = EMPTY_TOKEN
    slots[j, 5] = np.uint32(1)
    slots[j, 6] = np.uint32(1) << np.uint32(16)
    slots[j, 7] = np.uint32(n)


@njit(cache=True, inline="always")
def _local_count(slots, j, nt, limit, t3, c3):
    """One more event ``nt`` of the context in slot ``j``, by ``local_add``'s rule (its
    docstring); ``t3``/``c3`` are scratch."""
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
            hit = worst
        elif c3[worst] <= 1:  # the newcomer ties the weakest: it takes its place
            t3[worst] = nt
            c3[worst] = 0
            hit = worst
        else:  # decrement the weakest; the newcomer is not stored
            c3[worst] -= 1
    if hit >= 0:
        c3[hit] += 1
    total += 1
    # keep candidates sorted by count (bubble the updated one up)
    r = hit
    while r > 0 and c3[r] > c3[r - 1]:  # (hit < 0: nothing moves)
        tt = t3[r]
        t3[r] = t3[r - 1]
        t3[r - 1] = tt
        cc = c3[r]
        c3[r] = c3[r - 1]
        c3[r - 1] = cc
        r -= 1
    if total > limit:  # counts never exceed total (lower bounds)
        for r in range(HOT_K):
            c3[r] = c3[r] // 2
        total = (total + 1) // 2
    slots[j, 2] = t3[0]
    slots[j, 3] = t3[1]
    slots[j, 4] = t3[2]
    slots[j, 5] = c3[0] | (c3[1] << np.uint32(16))
    slots[j, 6] = c3[2] | (np.uint32(total) << np.uint32(16))


# ---------------------------------------------------------------------------------------------
# drafting: chained longest match over up to four slot tables (ARCHITECTURE §3.4)
#
# One entry point, ``draft``, for every front end (HotReader, Table, NgramDrafter, the hot-size
# curve).  Its inputs travel as three plain tuples with a fixed layout, built by the helpers
# below (``draft_source``, ``draft_out``) and by ``wire.rules.DraftRules.kernel`` (the rules):
#
#   source = (t0, t1, t2, t3, tiers, restart_at_max, max_probe, pruned, pruned_nprobe,
#             pruned_table)
#       t0..t3          slot tables, earlier first (an absent one: an empty (0, 8) array);
#       tiers           int64[4], the tier id reported for a token each table drafts;
#       restart_at_max  bool[4], True for a table that omits rows (pruned): restart every step
#                       at n_max instead of n + 1 (see draft);
#       max_probe       int, the probe bound of every table (the largest one's is right for all);
#       pruned, pruned_nprobe, pruned_table  the pruned-key filter (uint64 words, probes) of
#                       table ``pruned_table`` (-1: none).
#   rules  = (n_min, n_max, c_min, s_min, p_cum, f_cap)
#       c_min uint32[MAX_ORDER + 1], s_min float32[MAX_ORDER + 1]: indexed by order
#       (validate.per_order); p_cum, f_cap floats (0: off).
#   out    = (tok uint32[B, L], order uint8[B, L], tier uint8[B, L], conf float32[B, L],
#             length int32[B]): the result buffers, L >= max_len.
#
# Plain tuples, not NamedTuples: numba types a plain tuple in its C dispatcher, a NamedTuple in
# Python (measured on this machine, a kernel that does nothing: 1.5 µs a call with these tuples,
# 3.5 µs with NamedTuples, 2.2 µs with the 22 positional arguments the kernel took before).  The
# helpers fix the dtypes, so one compiled specialisation serves a caller whatever thresholds it
# was given.
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


@njit(cache=True, inline="always")
def _next_starts(restart_at_max, got, lows, n_min, n_max, start):
    """Where each table's next step starts probing: n + 1 after its match at n in a complete
    table, n_max in one that omits rows (``restart_at_max``) or that matched nothing."""
    for ti in range(4):
        if restart_at_max[ti]:
            start[ti] = n_max
        elif got[ti] > 0:
            start[ti] = min(got[ti] + 1, n_max)
        elif lows[ti] > n_min:  # probed only above an earlier table's match
            start[ti] = min(lows[ti], n_max)
        else:
            start[ti] = n_max


@njit(cache=True)
def _draft_one(source, rules, ctx, max_len, out_tok, out_order, out_tier, out_conf, scratch):
    """One context of ``draft`` (rules there); returns (length, probes).  ``scratch``: the
    buffers of ``draft``, reused by every context.  The step's match over the four tables is
    written out here, not in a helper: as an inlined helper (``inline="always"``) it made
    every draft 25-40% slower (issue 20; bench/bench_draft.py), as a called one slower still."""
    t0, t1, t2, t3, tiers, restart_at_max, max_probe, pruned, pruned_nprobe, pruned_table = source
    n_min, n_max, c_min, s_min, p_cum, f_cap = rules
    buf, hs, t3_, c3_, tb, cb, start, got, lows = scratch
    buf_len = n_max + max_len
    end = load_tail(ctx, n_max, buf)
    start[:] = n_max
    pcum, length, probes, cap = 1.0, 0, 0, max_len
    while length < max_len:
        avail = suffix_hashes(buf, end, n_max, hs)
        # the longest order that passes in any table (the earlier table on equal orders),
        # each table probed only above the best order found in the earlier ones
        best, best_tier, best_total = 0, 0, np.int64(0)
        for ti in range(4):
            if ti == 0:
                tab = t0
            elif ti == 1:
                tab = t1
            elif ti == 2:
                tab = t2
            else:
                tab = t3
            lo = max(n_min, best + 1)
            lows[ti] = lo
            got[ti] = 0
            if tab.shape[0] == 0:
                continue
            hi = min(start[ti], avail)
            n_i, total, p = _best_at(tab, max_probe, hs, lo, hi, c_min, s_min, t3_, c3_)
            probes += p
            if ti == pruned_table and n_i == 0 and pruned.shape[0] > 0 and lo > n_min:
                # nothing stored above lo: does a pruned chain reach past it from below?
                n_a, tot_a, p = _best_at(tab, max_probe, hs, n_min, lo - 1, c_min, s_min, t3_,
                                         c3_)
                probes += p
                if n_a > 0:
                    top = n_a
                    while top < avail and bbloom_may(pruned, hs[top + 1], pruned_nprobe):
                        top += 1
                    if top >= lo:
                        n_i, total = top, tot_a
            got[ti] = n_i
            if n_i > best:
                best, best_tier, best_total = n_i, tiers[ti], total
                for r in range(HOT_K):
                    tb[r] = t3_[r]
                    cb[r] = c3_[r]
        if best == 0:
            break
        _next_starts(restart_at_max, got, lows, n_min, n_max, start)
        share = cb[0] / max(best_total, 1)
        pcum *= share
        if length > 0 and pcum < p_cum:
            break
        if length == 0 and f_cap > 0:
            cap = min(max_len, max(1, int(f_cap * best)))
        out_tok[length] = tb[0]
        out_order[length] = best
        out_tier[length] = best_tier
        out_conf[length] = share
        length += 1
        if length >= cap:
            break
        # append and slide the window so it always holds the last n_max tokens
        if end == buf_len:
            for i in range(n_max - 1):
                buf[i] = buf[end - n_max + 1 + i]
            end = n_max - 1
        buf[end] = tb[0]
        end += 1
    return length, probes


@njit(cache=True)
def draft(source, rules, tokens, offsets, max_len, out):
    """Draft up to ``max_len`` tokens after each context ``tokens[offsets[b]:offsets[b+1]]``
    (only its last n_max tokens matter) from the tables of ``source`` into ``out`` (layouts
    above); returns the slot-table probes spent.  The one drafting kernel of every front end:
    a single draft is a batch of one (``offsets = [0, len(ctx)]``).

    Per step, the longest match across the tables: the rule is ``count >= c_min[n]`` and
    ``count >= s_min[n] * total``; on equal orders the earlier table wins.  Taking the longer
    match rather than "a first" matters for a request-local table and a global one: a weak
    order-1 match in the request would otherwise hide an order-16 match in the global table.
    After a match at order n the next step starts at n + 1 in a *complete* table (every suffix
    of a stored context is stored, e.g. the request-local table): no longer order can match,
    so a draft costs about two probes per token.  A table that omits entries, such as the hot
    tier with redundant rows pruned, restarts every step at n_max (``restart_at_max``):
    measured on held-out code, the n + 1 rule over a pruned table lost 14-23% of accepted
    tokens.  Stops when nothing passes, when the product of shares falls below ``p_cum``, or
    (``f_cap > 0``) when the draft reaches ``f_cap`` times the order of its first match.

    ``pruned`` (a blocked Bloom filter, ``bbloom_*``, of the keys the hot builder left out as
    redundant) makes table ``pruned_table`` answer at the order the whole table would: a
    pruned key drafts the same token as its hot ancestor (its longest stored suffix), so when
    every order from the ancestor's up to p is stored or pruned, the match counts as order p.
    Without it a pruned order-12 row lost to an order-8 match of the request-local table that
    drafts something else (issue 8: 2.02 -> 2.09 accepted tokens on cold code, pruning off).
    Requiring the whole chain keeps a filter false positive at one order from inflating it.

    The scratch buffers are allocated once per call, not per context (batch drafts 10% faster
    per context, bench/bench_draft.py)."""
    n_max = rules[1]
    out_tok, out_order, out_tier, out_conf, out_len = out
    scratch = (np.empty(n_max + max_len, np.uint32), np.zeros(n_max + 1, np.uint64),
               np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32),
               np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32),
               np.full(4, n_max, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64))
    probes = 0
    for b in range(offsets.shape[0] - 1):
        ln, p = _draft_one(source, rules, tokens[offsets[b]:offsets[b + 1]], max_len,
                           out_tok[b], out_order[b], out_tier[b], out_conf[b], scratch)
        out_len[b] = ln
        probes += p
    return probes


#: a pruned-key filter of no keys (a source without one)
NO_FILTER = np.zeros(0, np.uint64)


def draft_source(tables, tiers, restart_at_max, max_probe: int, pruned=NO_FILTER,
                 pruned_nprobe: int = 0, pruned_table: int = -1) -> tuple:
    """The ``source`` tuple of ``draft`` (layout above) from up to four slot tables, their tier
    ids and restart flags, earlier first; missing tables are empty."""
    n = len(tables)
    if not 1 <= n <= 4 or len(tiers) != n or len(restart_at_max) != n:
        raise ValueError("draft_source: 1..4 tables, one tier and one restart flag each")
    t = list(tables) + [EMPTY_SLOTS] * (4 - n)
    return (t[0], t[1], t[2], t[3], np.array(list(tiers) + [0] * (4 - n), np.int64),
            np.array(list(restart_at_max) + [True] * (4 - n), np.bool_), int(max_probe),
            np.ascontiguousarray(pruned, np.uint64), int(pruned_nprobe), int(pruned_table))


def draft_out(batch: int, max_len: int) -> tuple:
    """Result buffers of ``draft`` for ``batch`` contexts of up to ``max_len`` tokens."""
    shape = (batch, max_len)
    return (np.zeros(shape, np.uint32), np.zeros(shape, np.uint8), np.zeros(shape, np.uint8),
            np.zeros(shape, np.float32), np.zeros(batch, np.int32))


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
                     max_probe, skip, skip_nprobe, out_ctx, out_order, out_key, out_pos):
    """Keys a cold read could add to the current drafts: at every step of each context's draft
    (and one step past its end when the draft is shorter than ``d_tok.shape[1]``), the orders longer than the one the fast path matched that are
    absent from both the hot tier and the warm cache, and not known to be redundant (``skip``:
    a blocked Bloom filter of the keys the hot builder pruned because their parent drafts the same
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
def tally_drafts(out_tier, out_order, out_len, counts):
    """``counts[tier, order] += 1`` for every drafted token (np.add.at costs ~40 µs a call)."""
    for b in range(out_len.shape[0]):
        for j in range(out_len[b]):
            counts[out_tier[b, j], out_order[b, j]] += 1


# ---------------------------------------------------------------------------------------------
# bulk counting into row sets (the cold tier's write path; see ngramd/cold.py for the design)
#
# A *row set* is the counted form of a batch of sequences: parallel arrays, one row per distinct
# context, sorted by key hash, keys unique::
#
#     key u64[m], parent u64[m], order u8[m], total u32[m], poff i64[m+1], tok u32[P], cnt u32[P]
#
# Row i's candidates are tok/cnt[poff[i]:poff[i+1]] (at most K, count desc, ties smaller token
# first); ``total`` counts every observation.  Counts and totals saturate at 2**32 - 1.
# These kernels release the GIL (``nogil``): the daemon's serving thread keeps running while its
# writer counts and merges.
# ---------------------------------------------------------------------------------------------
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
            _topk_into(sc[0], sc[1], nd, top[0], top[1])
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
            nd = _add_candidate(tok, cnt, nd, nd, t, 1)
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
    one batch into disjoint key ranges.  Returns the row set (see above), sorted by key.

    Method (``count_hist`` then ``count_fill``): hash every context twice (a histogram pass,
    then a scatter pass into ~32k-event buckets on the top key bits), sort each bucket in cache
    and aggregate the runs of equal keys.  An event is 24 bytes (key; next token and order;
    parent key: recomputing the parent from a position instead cost a cache miss a row,
    ~50 ns, measured).  ``ngramd.rows.Counter`` does the same with reused buffers.
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


@njit(cache=True, nogil=True)
def _merge_pairs(tok_a, cnt_a, tok_b, cnt_b, k, out_tok, out_cnt):
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
        nd = _add_candidate(tok, cnt, na, nd, tok_b[i], cnt_b[i])
    c = min(nd, k)
    _topk_into(tok, cnt, nd, out_tok[:c], out_cnt[:c])
    return c


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
            _topk_into(sc_tok, sc_cnt, nd, tk[:c], kc[:c])
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
            _accumulate(i, ro[j], rt[j], rtok[rq[j]:rq[j + 1]], rcnt[rq[j]:rq[j + 1]], k,
                        found, o_ord, o_tot, o_tok, o_cnt)
    return hits


@njit(cache=True, nogil=True)
def _accumulate(i, order, total, tok, cnt, k, found, o_ord, o_tot, o_tok, o_cnt):
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
    c = _merge_pairs(o_tok[i, :na].copy(), o_cnt[i, :na].copy(), tok, cnt, k, t2, c2)
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


# ---------------------------------------------------------------------------------------------
# pages: the on-disk form of a row set (one RocksDB value holds the rows of a key range)
#
# A run of depth d stores the rows whose key has top-d bits p in page p.  Page layout (little
# endian; every page is a multiple of 8 bytes so pages concatenated stay aligned)::
#
#     u32 nrows, u32 npairs, u64 reserved (0)            16-byte header
#     u64 key[n], u64 parent[n], u32 total[n], u32 tok[P], u32 cnt[P], u8 order[n], u8 npairs[n]
#     zero padding to a multiple of 8 bytes
# ---------------------------------------------------------------------------------------------
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
        _accumulate(i, b8[o8 + lo], total, tok, cnt, k, found, o_ord, o_tot, o_tok, o_cnt)
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


# ---------------------------------------------------------------------------------------------
# blocked Bloom filter over 64-bit keys: one 512-bit block (a cache line) per key, ``nprobe``
# bits in it.  The block comes from the key's high 32 bits (multiply-shift range reduction), the
# bit positions from 9-bit slices of the key times an odd constant.  ~1% false positives at 10
# bits a key with 7 probes (a little above a classic filter's 0.8%), one cache miss a lookup.
# ---------------------------------------------------------------------------------------------
BB_BLOCK_WORDS = 8


@njit(cache=True, nogil=True, inline="always")
def _bb_block(key, n_blocks):
    return ((key >> np.uint64(32)) * np.uint64(n_blocks)) >> np.uint64(32)


@njit(cache=True, nogil=True)
def bbloom_add(words, keys, nprobe):
    n_blocks = words.shape[0] // BB_BLOCK_WORDS
    for key in keys:
        base = _bb_block(key, n_blocks) * np.uint64(BB_BLOCK_WORDS)
        h = key * np.uint64(0x9E3779B97F4A7C15)
        for i in range(nprobe):
            bit = (h >> np.uint64(9 * i)) & np.uint64(511)
            words[base + (bit >> np.uint64(6))] |= np.uint64(1) << (bit & np.uint64(63))


@njit(cache=True, nogil=True, inline="always")
def bbloom_may(words, key, nprobe):
    n_blocks = words.shape[0] // BB_BLOCK_WORDS
    if n_blocks == 0:
        return True
    base = _bb_block(key, n_blocks) * np.uint64(BB_BLOCK_WORDS)
    h = key * np.uint64(0x9E3779B97F4A7C15)
    for i in range(nprobe):
        bit = (h >> np.uint64(9 * i)) & np.uint64(511)
        if not (words[base + (bit >> np.uint64(6))] >> (bit & np.uint64(63))) & np.uint64(1):
            return False
    return True


@njit(cache=True, nogil=True)
def bbloom_may_batch(words, keys, nprobe, out):
    """``out[i] = bbloom_may(keys[i])``; returns how many may be present."""
    c = 0
    for i in range(keys.shape[0]):
        out[i] = bbloom_may(words, keys[i], nprobe)
        c += out[i]
    return c


# ---------------------------------------------------------------------------------------------
# the "recent" table: a slot table updated in place by the daemon's writer with what it counts,
# read in-process by every drafter (ngramd/hotshm.py documents the segment)
# ---------------------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def recent_add(slots, max_probe, rk, ro, rt, rq, rtok, rcnt):
    """Add a row set's counts (increments) to a slot table in place; returns the number of
    rows that found no slot within ``max_probe`` and the number of slots newly taken.  A new
    slot gets its data before its key, so a concurrent reader that sees the key sees the row
    (on x86-64's ordered stores; elsewhere a torn read costs one wrong draft token, which
    verification rejects).  No allocation per row."""
    mask = np.uint64(slots.shape[0] - 1)
    t3 = np.empty(HOT_K, np.uint32)
    c3 = np.empty(HOT_K, np.uint32)
    st = np.empty(2 * HOT_K + 64, np.uint32)  # scratch: merged candidates
    sc = np.empty(2 * HOT_K + 64, np.uint32)
    tmp = np.zeros((1, SLOT_WORDS), np.uint32)
    dropped = 0
    inserted = 0
    for i in range(rk.shape[0]):
        key = rk[i]
        q0 = rq[i]
        q1 = rq[i + 1]
        j = key & mask
        done = False
        for _ in range(max_probe):
            sk = _slot_key(slots, j)
            if sk == np.uint64(0):
                inserted += 1
                write_slot(tmp, 0, key, ro[i], rtok[q0:q1], rcnt[q0:q1], rt[i])
                for w in range(2, SLOT_WORDS):
                    slots[j, w] = tmp[0, w]
                slots[j, 1] = tmp[0, 1]
                slots[j, 0] = tmp[0, 0]
                done = True
                break
            if sk == key:
                order, total = slot_decode(slots, j, t3, c3)
                nd = 0
                for r in range(HOT_K):
                    if t3[r] != EMPTY_TOKEN:
                        st[nd] = t3[r]
                        sc[nd] = c3[r]
                        nd += 1
                na = nd
                for q in range(q0, min(q1, q0 + 64)):
                    nd = _add_candidate(st, sc, na, nd, rtok[q], rcnt[q])
                c = min(nd, HOT_K)
                _topk_into(st, sc, nd, t3[:c], c3[:c])
                tot = np.uint64(total) + np.uint64(rt[i])
                write_slot(tmp, 0, key, order, t3[:c], c3[:c],
                           np.uint32(min(tot, np.uint64(0xFFFFFFFF))))
                for w in range(2, SLOT_WORDS):
                    slots[j, w] = tmp[0, w]
                done = True
                break
            j = (j + np.uint64(1)) & mask
        if not done:
            dropped += 1
    return dropped, inserted


# ---------------------------------------------------------------------------------------------
# hot build (ngramd/hotset.py documents the rules): the loops in numba without the GIL, the sorts
# numpy's, which release it too (the first numpy version held the GIL 1-2 s for 3M rows in its
# other steps), so ranking millions of candidates never holds the daemon's GIL for long
# ---------------------------------------------------------------------------------------------
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


@njit(cache=True, nogil=True)
def gather_slots(capacity, max_probe, idx, keys, orders, tok, cnt, total):
    """``build_slots`` over the rows ``idx`` (in that order) without gathering them first."""
    slots = np.zeros((capacity, SLOT_WORDS), np.uint32)
    placed = np.zeros(idx.shape[0], np.bool_)
    for j in range(idx.shape[0]):
        r = idx[j]
        placed[j] = _place_new(slots, max_probe, keys[r], orders[r], tok[r], cnt[r], total[r])
    return slots, placed


@njit(cache=True, nogil=True)
def insert_rows(slots, max_probe, keys, orders, tok, cnt, total):
    """Insert rows into an existing slot table (a key already present is overwritten); returns
    how many found no slot within ``max_probe``.  Builds large tables slice by slice."""
    dropped = 0
    for r in range(keys.shape[0]):
        i = _slot_for(slots, max_probe, keys[r])
        if i < 0:
            dropped += 1
        else:
            write_slot(slots, i, keys[r], orders[r], tok[r], cnt[r], total[r])
    return dropped
