"""Blocked Bloom filters over 64-bit keys (the hot tier's pruned-key filter, the runs' filters).

One 512-bit block (a cache line) per key, ``nprobe`` bits in it.  The block comes from the
key's high 32 bits (multiply-shift range reduction), the bit positions from 9-bit slices of
the key times an odd constant.  ~1% false positives at 10 bits a key with 7 probes (a little
above a classic filter's 0.8%), one cache miss a lookup.  The word layout is part of the hot
segment's format (``ngramd/hot/shm.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import BB_BLOCK_WORDS


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
