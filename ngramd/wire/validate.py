"""Validation of input at the edges (in-process API and wire alike): token ids, batch offsets,
per-order thresholds.

Everything that arrives from a user or a socket goes through these functions once; kernels then
trust their arguments.  Errors are ``BadInput``/``TooLarge`` with a message that names the problem.
Imports numpy only (the client loads this module through ``ngramd.wire.protocol``).
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


def as_offsets(offsets, n_tokens: int, *, min_len: int = 0, what: str = "offsets") -> np.ndarray:
    """Validate the bounds of a batch: sequence ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.

    One rule for every caller (the wire, the cold store, the hot reader), so that a batch valid
    in one place is valid in all:

    * a 1-D integer array of at least 2 bounds (a batch holds at least one sequence);
    * ``offsets[0] == 0`` and ``offsets[-1] == n_tokens``: every token belongs to a sequence
      (no caller has a use for trailing tokens; a mismatch means the two arrays do not belong
      together);
    * non-decreasing, and every sequence at least ``min_len`` tokens long: ``min_len=0``
      allows empty sequences (a context with nothing to draft from), ``1`` forbids them.

    The kernels do not bounds-check, so this is what keeps a bad offset from reading foreign
    memory.  Returns the offsets as a C-contiguous int64 array (no copy when they are one).
    Raises ``BadInput`` naming the rule that failed.
    """
    a = np.asarray(offsets)
    if a.ndim != 1 or a.size < 2 or a.dtype.kind not in _INT_KINDS:
        raise BadInput(f"{what}: expected a 1-D integer array of >= 2 bounds, "
                       f"got shape {a.shape} dtype {a.dtype}")
    if a.size <= 64:
        # Python ints: a draft holds a few contexts, where each numpy call (~1 µs) costs more
        # than the work (and uint64 bounds cannot wrap)
        o = a.tolist()
        lens = [y - x for x, y in zip(o, o[1:])]
        shortest = min(lens)
    else:
        o = a
        lens = np.diff(a.astype(np.int64))  # a uint64 bound >= 2^63 wraps negative: rejected
        shortest = int(lens.min())
    first, last = int(o[0]), int(o[-1])
    if first != 0 or last != n_tokens:
        raise BadInput(f"{what} must start at 0 and end at the token count {n_tokens}, "
                       f"got {first}..{last}")
    if shortest < 0:
        i = next(i for i, n in enumerate(lens) if n < 0)  # (the error path only)
        raise BadInput(f"{what} must be non-decreasing: bound {i + 1} ({int(o[i + 1])}) is "
                       f"below bound {i} ({int(o[i])})")
    if shortest < min_len:
        i = next(i for i, n in enumerate(lens) if n < min_len)
        raise BadInput(f"{what}: sequence {i} has {int(lens[i])} tokens, fewer than the "
                       f"minimum {min_len}")
    if a.dtype == np.int64 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=np.int64)


def per_order(value, n_max: int, dtype, what: str = "threshold", *,
              n_min: int | None = None) -> np.ndarray:
    """A per-order threshold (``c_min``, ``s_min``) as the array the kernels index by order:
    entry ``n`` for order ``n``, length ``n_max + 1`` (entry 0 is never read).

    ``value`` is a scalar (every order) or a sequence in one of two conventions:

    * ``n_min=None``: already indexed by order (length >= n_max + 1; a longer one keeps its
      length, the kernels read orders up to n_max only), as drafters pass them;
    * ``n_min`` given: one value per order ``n_min..n_max`` (length n_max - n_min + 1), as a
      config file lists them; the orders below n_min get 0 (the kernels never read them).

    Thresholds must be finite and >= 0; count thresholds (integer ``dtype``) round up:
    ``count >= 1.5`` is ``count >= 2``.  Always returns a fresh, writable, C-contiguous array.
    """
    a = np.asarray(value, dtype=np.float64)
    if a.ndim == 0:
        a = np.full(n_max + 1, float(a))
    elif n_min is not None:
        if a.ndim != 1 or a.shape[0] != n_max - n_min + 1:
            raise BadInput(f"{what}: need a scalar or one value per order {n_min}..{n_max}, "
                           f"got shape {a.shape}")
        a = np.concatenate([np.zeros(n_min), a])
    elif a.ndim != 1 or a.shape[0] < n_max + 1:
        raise BadInput(f"{what}: need a scalar or one value per order 0..{n_max}, "
                       f"got shape {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise BadInput(f"{what}: thresholds must be finite and >= 0")
    if np.dtype(dtype).kind in "iu":
        a = np.ceil(a)
    return np.array(a, dtype=dtype, copy=True)
