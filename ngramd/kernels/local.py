"""The request-local table: a slot table a generator counts its request into, token by token.

Counts are exact until a context has more than ``HOT_K`` distinct next tokens, and lower
bounds after that (never above the truth): ``local_add`` says why.  The table is *complete*
(every suffix of a stored context is stored), which lets ``draft`` restart each step at n + 1.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, HOT_K, U16_MAX
from .hashing import suffix_hashes
from .slots import LOW32, slot_decode, slot_for, slot_key


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
            j = slot_for(slots, max_probe, key)
            if j < 0:
                dropped += 1
            elif slot_key(slots, j) == np.uint64(0):
                _local_new(slots, j, key, n, nt)
            else:
                _local_count(slots, j, nt, limit, t3, c3)
    return dropped


@njit(cache=True, inline="always")
def _local_new(slots, j, key, n, nt):
    """Slot ``j`` becomes the order-``n`` context ``key``, seen once, followed by ``nt``."""
    slots[j, 0] = np.uint32(key & LOW32)
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
