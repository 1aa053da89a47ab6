"""The *recent* table: a slot table the daemon's writer adds what it counts to, in place.

Every drafter reads it in-process (``ngramd/hot/shm.py`` documents the segment), so what is
acknowledged becomes draftable before the next hot rebuild.  Rows arrive as row sets
(``ngramd.kernels.rowset``); each slot keeps the best ``HOT_K`` candidates of its old and new
counts (``ngramd.kernels.topk``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, HOT_K, SLOT_WORDS
from .slots import slot_decode, slot_key, write_slot
from .topk import add_candidate, topk_into


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
            sk = slot_key(slots, j)
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
                    nd = add_candidate(st, sc, na, nd, rtok[q], rcnt[q])
                c = min(nd, HOT_K)
                topk_into(st, sc, nd, t3[:c], c3[:c])
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
