"""Slot tables: the 32-byte slot, and building, probing and reading tables of them.

The hot tier, the recent table, the daemon's warm cache and the request-local table are all
slot tables.  A **slot** is 8 ``uint32`` words = 32 bytes::

    w0,w1  key hash (low, high; ``ngramd.kernels.hashing``)
    w2..w4 the top ``HOT_K`` = 3 next tokens, best first (unused: ``EMPTY_TOKEN``)
    w5     count[0] | count[1] << 16           (saturating uint16 counts, see below)
    w6     count[2] | total << 16
    w7     order | flags << 8

Counts and the total (all observations of the context) are scaled together when the total
does not fit 16 bits, so the share ``count / total`` survives saturation.

**Table geometry.**  Open addressing with linear probing over a power-of-two capacity; a key
lives at most ``max_probe - 1`` slots after its home slot, so a miss costs at most
``max_probe`` slot reads.  The layout is part of the shared-memory format: change it and bump
the format version (``ngramd/wire/constants.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, HASH_SEED, HOT_K, SLOT_WORDS, U16_MAX
from .hashing import fmix64, hash_step, suffix_hashes

#: the low 32 bits of a key (slot word 0)
LOW32 = np.uint64(0xFFFFFFFF)
#: a slot table of no slots (an absent tier); shared, and never written (it has nothing to write)
EMPTY_SLOTS = np.zeros((0, SLOT_WORDS), np.uint32)


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
    slots[idx, 0] = np.uint32(key & LOW32)
    slots[idx, 1] = np.uint32(key >> np.uint64(32))
    slots[idx, 2] = t0
    slots[idx, 3] = t1
    slots[idx, 4] = t2
    slots[idx, 5] = c0 | (c1 << np.uint32(16))
    slots[idx, 6] = c2 | (tt << np.uint32(16))
    slots[idx, 7] = np.uint32(order)


@njit(cache=True, inline="always")
def slot_key(slots, idx):
    return np.uint64(slots[idx, 0]) | (np.uint64(slots[idx, 1]) << np.uint64(32))


@njit(cache=True)
def probe(slots, max_probe, key):
    """Index of ``key`` in the slot array, or -1.  At most ``max_probe`` slot reads."""
    if slots.shape[0] == 0:  # an absent table (e.g. before the first hot generation)
        return np.int64(-1)
    mask = np.uint64(slots.shape[0] - 1)
    i = key & mask
    for _ in range(max_probe):
        sk = slot_key(slots, i)
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
    i = slot_for(slots, max_probe, key)
    if i < 0 or slot_key(slots, i) != np.uint64(0):
        return False
    write_slot(slots, i, key, order, tok, cnt, total)
    return True


@njit(cache=True, nogil=True, inline="always")
def slot_for(slots, max_probe, key):
    """The slot within ``max_probe`` of ``key``'s home that holds ``key``, else the first free
    one before it; -1 if neither."""
    mask = np.uint64(slots.shape[0] - 1)
    i = key & mask
    for _ in range(max_probe):
        sk = slot_key(slots, i)
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
def slots_checksum(slots):
    """64-bit checksum of a slot array (readers in tests validate it to detect torn tables)."""
    flat = slots.reshape(-1)
    h = HASH_SEED
    for i in range(flat.shape[0]):
        h = hash_step(h, flat[i])
    return fmix64(h)


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
        i = slot_for(slots, max_probe, keys[r])
        if i < 0:
            dropped += 1
        else:
            write_slot(slots, i, keys[r], orders[r], tok[r], cnt[r], total[r])
    return dropped
