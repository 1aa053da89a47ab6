"""Row sets: the cold tier's row algebra, pure functions over numpy arrays (ARCHITECTURE §5).

A *row* is what counting produces for one context (``ngramd.kernels.count.count_rows``): its
``key`` (the documented 64-bit hash, order included), ``parent`` (the hash of its order-1
suffix), ``order``, ``total`` (observations) and its top ``cold_k`` next tokens with counts.
A *row set* (``RowSet``) keeps rows sorted by key, candidates in CSR form.  Everything here is
array in, array out: counting a batch (``Counter``, ``count_batch``), merging, concatenating,
slicing and selecting row sets, the per-key answer of a lookup (``Lookup``) and the digest of a
row stream (``RowDigest``).  No storage: ``ngramd.cold.runs`` writes row sets as runs of pages,
``ngramd.cold.store`` keeps the in-memory delta as row sets.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from ..kernels.count import count_bits, count_fill, count_hist
from ..kernels.rowset import order_counts, rows_gather
from ..wire.constants import EMPTY_TOKEN, MAX_ORDER
from ..wire.errors import BadInput
from ..wire.identity import TableIdentity


class RowSet(NamedTuple):
    """Counted rows sorted by key (see ``ngramd.kernels``): row i's candidates are
    ``tok/cnt[poff[i]:poff[i+1]]``."""

    key: np.ndarray  # uint64 (m,)
    parent: np.ndarray  # uint64 (m,)
    order: np.ndarray  # uint8 (m,)
    total: np.ndarray  # uint32 (m,)
    poff: np.ndarray  # int64 (m + 1,)
    tok: np.ndarray  # uint32 (P,)
    cnt: np.ndarray  # uint32 (P,)

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self)

    @staticmethod
    def empty() -> "RowSet":
        return RowSet(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint8),
                      np.zeros(0, np.uint32), np.zeros(1, np.int64), np.zeros(0, np.uint32),
                      np.zeros(0, np.uint32))

    def padded(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Candidates as ``(m, k)`` arrays padded with EMPTY_TOKEN / 0."""
        m = len(self)
        tok = np.full((m, k), EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((m, k), np.uint32)
        n = np.diff(self.poff)
        col = np.arange(self.tok.shape[0]) - np.repeat(self.poff[:-1], n)
        row = np.repeat(np.arange(m), n)
        keep = col < k
        tok[row[keep], col[keep]] = self.tok[keep]
        cnt[row[keep], col[keep]] = self.cnt[keep]
        return tok, cnt

    def per_order(self) -> np.ndarray:
        out = np.zeros(MAX_ORDER + 1, np.int64)
        order_counts(self.order, out)
        return out


def merge_rowsets(parts: list[RowSet], k: int) -> RowSet:
    """One row set holding the sum of ``parts``: concatenate, one stable argsort (a merge of
    the sorted parts: 14-28 ns a row here for 2-16 parts) and ``kernels.rowset.rows_gather``."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return RowSet.empty()
    if len(parts) == 1:
        return parts[0]
    cat = concat_rows(parts)
    perm = np.argsort(cat.key, kind="stable")
    return RowSet(*rows_gather(perm, *cat, k))


def concat_rows(parts: list[RowSet]) -> RowSet:
    """Concatenate row sets (sorted as a whole only when their key ranges are disjoint and
    increasing)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return RowSet.empty()
    if len(parts) == 1:
        return parts[0]
    base = np.cumsum([0] + [p.tok.shape[0] for p in parts[:-1]])
    poff = np.concatenate([parts[0].poff[:1]] + [p.poff[1:] + b for p, b in zip(parts, base)])
    return RowSet(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                    ("key", "parent", "order", "total")), poff,
                  np.concatenate([p.tok for p in parts]), np.concatenate([p.cnt for p in parts]))


def slice_rows(rows: RowSet, a: int, b: int) -> RowSet:
    """Rows ``a:b`` of a row set, as views of its arrays (offsets rebased to 0)."""
    q0, q1 = int(rows.poff[a]), int(rows.poff[b])
    return RowSet(rows.key[a:b], rows.parent[a:b], rows.order[a:b], rows.total[a:b],
                  rows.poff[a:b + 1] - q0, rows.tok[q0:q1], rows.cnt[q0:q1])


def take_rows(rows: RowSet, idx: np.ndarray) -> RowSet:
    """The rows at indices ``idx`` (increasing, for a sorted result), copied."""
    n = np.diff(rows.poff)[idx]
    poff = np.zeros(idx.size + 1, np.int64)
    np.cumsum(n, out=poff[1:])
    pair = (np.repeat(rows.poff[:-1][idx], n) + np.arange(int(poff[-1]))
            - np.repeat(poff[:-1], n)) if idx.size else np.zeros(0, np.int64)
    return RowSet(rows.key[idx], rows.parent[idx], rows.order[idx], rows.total[idx], poff,
                  rows.tok[pair], rows.cnt[pair])


def add_part(delta: tuple, rows: RowSet) -> tuple:
    """Append a counted row set to the delta.  Parts are merged on the spilling thread
    (``ColdStore.compact_delta``, or when the delta is written as a run): the writer never pays
    for a merge, and a read searches each part (a binary search in numba, ~0.2 µs a part)."""
    return delta + (rows,) if len(rows) else delta


def unique_inverse(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` by sorting (np.unique holds the GIL: seconds for
    millions of values; a sort releases it)."""
    perm = np.argsort(a, kind="stable")
    s = a[perm]
    new = np.r_[True, s[1:] != s[:-1]] if s.size else np.zeros(0, bool)
    inv = np.empty(a.size, np.int64)
    inv[perm] = np.cumsum(new) - 1
    return s[new], inv


class Counter:
    """``kernels.count.count_rows`` with its buffers kept across calls.

    Fresh memory is expensive here: first-touch page faults ran at 0.45-2 GB/s on this VM
    against 13 GB/s for a copy into memory already mapped, and one 1M-token count touches
    ~1 GB of events and rows.  So the event and row buffers are allocated by numpy (which asks
    for transparent huge pages) once and grown by 1.5x when a batch needs more.
    """

    def __init__(self, ident: TableIdentity):
        self.ident = ident
        self._ev = np.empty((0, 3), np.uint64)
        self._out: tuple = ()
        self._cap = 0

    def _ensure(self, m: int) -> None:
        if m <= self._cap and self._out:
            return
        cap = max(m, int(self._cap * 1.5), 1 << 16)
        self._ev = np.empty((cap, 3), np.uint64)
        self._out = (np.empty(cap, np.uint64), np.empty(cap, np.uint64), np.empty(cap, np.uint8),
                     np.empty(cap, np.uint32), np.empty(cap + 1, np.int64),
                     np.empty(cap, np.uint32), np.empty(cap, np.uint32))
        self._cap = cap

    @property
    def nbytes(self) -> int:
        return self._ev.nbytes + sum(a.nbytes for a in self._out)

    def count(self, tokens: np.ndarray, offsets: np.ndarray, skips: np.ndarray, part: int = 0,
              part_bits: int = 0, copy: bool = True) -> RowSet:
        """The row set of a batch (see ``kernels.count.count_rows``); with ``copy=False`` it is a
        view of this counter's buffers, valid until its next ``count``."""
        ident = self.ident
        tokens = np.ascontiguousarray(tokens, np.uint32)
        offsets = np.ascontiguousarray(offsets, np.int64)
        skips = np.ascontiguousarray(skips, np.int64)
        lens = np.diff(offsets)
        span = np.clip(np.minimum(lens - 1, ident.n_max) - ident.n_min + 1, 0, None)
        m_all = int((lens * span).sum())  # an upper bound is enough to pick the bucket count
        bits = count_bits(m_all >> part_bits, part_bits)
        counts = count_hist(tokens, offsets, skips, ident.n_min, ident.n_max, part, part_bits,
                            bits)
        m = int(counts[-1])
        self._ensure(m)
        g, pp = count_fill(tokens, offsets, skips, ident.n_min, ident.n_max, ident.cold_k,
                           part, part_bits, bits, counts, self._ev, *self._out)
        o = self._out
        rows = RowSet(o[0][:g], o[1][:g], o[2][:g], o[3][:g], o[4][:g + 1], o[5][:pp], o[6][:pp])
        return RowSet(*(a.copy() for a in rows)) if copy else rows


def count_batch(tokens: np.ndarray, offsets: np.ndarray, skips: np.ndarray,
                counters: list[Counter], pool: ThreadPoolExecutor | None = None) -> RowSet:
    """Count a batch into a row set; with several counters (and a pool), each counts one part
    of the key space in its own thread (the kernels release the GIL)."""
    if len(counters) <= 1 or pool is None:
        return counters[0].count(tokens, offsets, skips)
    bits = (len(counters) - 1).bit_length()
    if 1 << bits != len(counters):
        raise BadInput("count_batch needs a power-of-two number of counters")
    futs = [pool.submit(c.count, tokens, offsets, skips, p, bits, False)
            for p, c in enumerate(counters)]
    parts = [f.result() for f in futs]
    return concat_rows(parts) if len(parts) > 1 else RowSet(*(a.copy() for a in parts[0]))


class Lookup(NamedTuple):
    """Per-key answer of the cold tier: candidates padded to ``cold_k``."""

    found: np.ndarray  # bool (m,)
    order: np.ndarray  # uint8 (m,)
    total: np.ndarray  # uint32 (m,)
    tok: np.ndarray  # uint32 (m, k)
    cnt: np.ndarray  # uint32 (m, k)

    @staticmethod
    def empty(m: int, k: int) -> "Lookup":
        """``m`` keys, none found yet."""
        return Lookup(np.zeros(m, bool), np.zeros(m, np.uint8), np.zeros(m, np.uint32),
                      np.full((m, k), EMPTY_TOKEN, np.uint32), np.zeros((m, k), np.uint32))

    def row(self, i: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(total, tok[k'], cnt[k'])`` of key ``i`` (its candidates, unpadded), or None."""
        if not self.found[i]:
            return None
        kk = int((self.tok[i] != EMPTY_TOKEN).sum())
        return int(self.total[i]), self.tok[i, :kk].copy(), self.cnt[i, :kk].copy()


#: splitmix64's finaliser: xor-shift and multiply twice, then a last xor-shift by 31
_SPLITMIX_STEPS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB))


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = x.astype(np.uint64, copy=True)
    for shift, mul in _SPLITMIX_STEPS:
        x ^= x >> np.uint64(shift)
        x *= np.uint64(mul)
    x ^= x >> np.uint64(31)
    return x



class RowDigest:
    """Digests of a stream of row sets, independent of how they were cut (``ColdStore.checksum``
    says what they mean): each row hashes to 64 bits (splitmix64 of its fields), and a digest is
    their sum mod 2^64."""

    def __init__(self, cold_k: int):
        self.cold_k = cold_k
        self.rows = self.capped = 0
        self._tot = self._all = np.uint64(0)

    def add(self, rs: RowSet) -> None:
        n = len(rs)
        if not n:
            return
        with np.errstate(over="ignore"):
            self.rows += n
            deg = np.diff(rs.poff)
            self.capped += int((deg >= self.cold_k).sum())
            h_tot = mix64(rs.key ^ mix64(rs.order.astype(np.uint64) << np.uint64(32)
                                         | rs.total.astype(np.uint64)))
            cand = mix64(rs.tok.astype(np.uint64) << np.uint64(32) | rs.cnt.astype(np.uint64))
            csum = np.add.reduceat(cand, rs.poff[:-1]) if cand.size else np.zeros(n, np.uint64)
            csum[deg == 0] = 0  # reduceat repeats an element for empty ranges
            self._tot += h_tot.sum(dtype=np.uint64)
            self._all += mix64(h_tot ^ mix64(csum)).sum(dtype=np.uint64)

    def result(self) -> dict:
        return {"rows": self.rows, "capped_rows": self.capped, "totals": f"{int(self._tot):016x}",
                "digest": f"{int(self._all):016x}"}
