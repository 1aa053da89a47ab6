"""The key hash: one fixed, documented mix every process computes the same way.

The 64-bit key of an order-``n`` context (the last ``n`` tokens) is computed from the *most
recent* token backwards, so all orders of one context come out of a single pass::

    s_0 = HASH_SEED
    s_k = rotl64((s_{k-1} ^ t[-k]) * HASH_MUL, 31)          k = 1..n
    key(n) = fmix64(s_n ^ (n * HASH_ORDER_MUL))              (0 is remapped to 1)

``fmix64`` is MurmurHash3's 64-bit finaliser.  Every process that reads a hot segment, the
daemon's cold tier and the request-local table must compute the same keys; ``0`` marks an
empty slot.  The constants are part of the format (``ngramd/wire/constants.py``).  Token ids
are ``uint32``.  ``load_tail`` is here too: a key only ever sees the last ``n_max`` tokens of
a context, and every kernel that hashes a context as it grows starts from that window.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import HASH_MUL, HASH_ORDER_MUL, HASH_SEED


@njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, inline="always")
def fmix64(k):
    k ^= k >> np.uint64(33)
    k *= np.uint64(0xFF51AFD7ED558CCD)
    k ^= k >> np.uint64(33)
    k *= np.uint64(0xC4CEB9FE1A85EC53)
    k ^= k >> np.uint64(33)
    return k


@njit(cache=True, inline="always")
def hash_step(s, tok):
    return _rotl((s ^ np.uint64(tok)) * HASH_MUL, 31)


@njit(cache=True, inline="always")
def hash_finish(s, n):
    k = fmix64(s ^ (np.uint64(n) * HASH_ORDER_MUL))
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
        s = hash_step(s, tokens[end - n])
        out[n] = hash_finish(s, n)
    for n in range(avail + 1, n_max + 1):
        out[n] = np.uint64(0)
    return avail


@njit(cache=True)
def key_hash(tokens):
    """Key of the whole array ``tokens`` taken as one context (order = len(tokens))."""
    s = HASH_SEED
    n = tokens.shape[0]
    for k in range(1, n + 1):
        s = hash_step(s, tokens[n - k])
    return hash_finish(s, n)


@njit(cache=True, inline="always")
def load_tail(ctx, n_max, buf):
    """Copy the last (up to) ``n_max`` tokens of ``ctx`` to the front of ``buf``; returns how
    many: the drafted tokens are appended after them."""
    c = min(ctx.shape[0], n_max)
    for i in range(c):
        buf[i] = ctx[ctx.shape[0] - c + i]
    return c
