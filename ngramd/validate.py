"""Validation of token input at the edges (in-process API and wire alike).

Everything that arrives from a user or a socket goes through these functions once; kernels then
trust their arguments.  Errors are ``BadInput``/``TooLarge`` with a message that names the problem.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .errors import BadInput, TooLarge

_INT_KINDS = "iu"


def as_tokens(arr, vocab_size: int, *, what: str = "tokens", allow_empty: bool = False) -> np.ndarray:
    """Return ``arr`` as a contiguous ``uint32`` array of ids in ``[0, vocab_size)``.

    Accepts integer numpy arrays of any width, lists/tuples of ints and ``bytes`` holding raw
    little-endian uint32.  Rejects floats, bools, negative ids, ids >= vocab_size and 2-D input.
    """
    if isinstance(arr, (bytes, bytearray, memoryview)):
        buf = memoryview(arr)
        if buf.nbytes % 4:
            raise BadInput(f"{what}: raw token bytes must be a multiple of 4 (got {buf.nbytes})")
        a = np.frombuffer(buf, dtype="<u4")
    else:
        a = np.asarray(arr)
        if a.dtype == object:
            raise BadInput(f"{what}: expected integers, got mixed or non-numeric values")
        if a.ndim != 1:
            raise BadInput(f"{what}: expected a 1-D array of token ids, got shape {a.shape}")
        if a.size and a.dtype.kind not in _INT_KINDS:
            raise BadInput(f"{what}: expected integer token ids, got dtype {a.dtype}")
        if a.size and a.dtype.kind == "i" and int(a.min()) < 0:
            raise BadInput(f"{what}: negative token id {int(a.min())}")
    if not a.size:
        if allow_empty:
            return np.zeros(0, np.uint32)
        raise BadInput(f"{what}: empty")
    hi = int(a.max())
    if hi >= vocab_size:
        raise BadInput(f"{what}: token id {hi} out of range (vocab size {vocab_size})")
    return np.ascontiguousarray(a, dtype=np.uint32)


def as_batch(
    seqs: Sequence | Iterable, vocab_size: int, *, max_batch: int, max_tokens: int,
    min_len: int = 1, what: str = "batch",
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch of sequences; returns ``(tokens, offsets)`` (concatenated uint32 ids and
    int64 bounds).  ``min_len`` rejects sequences shorter than e.g. the table's n_min."""
    seqs = list(seqs)
    if not seqs:
        raise BadInput(f"{what}: empty batch")
    if len(seqs) > max_batch:
        raise TooLarge(f"{what}: {len(seqs)} sequences exceeds the limit of {max_batch}")
    arrs = [as_tokens(s, vocab_size, what=f"{what}[{i}]") for i, s in enumerate(seqs)]
    lens = np.fromiter((a.size for a in arrs), dtype=np.int64, count=len(arrs))
    total = int(lens.sum())
    if total > max_tokens:
        raise TooLarge(f"{what}: {total} tokens exceeds the limit of {max_tokens}")
    short = np.flatnonzero(lens < min_len)
    if short.size:
        i = int(short[0])
        raise BadInput(f"{what}[{i}]: {int(lens[i])} tokens is shorter than the minimum {min_len}")
    offsets = np.zeros(len(arrs) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return np.concatenate(arrs), offsets
