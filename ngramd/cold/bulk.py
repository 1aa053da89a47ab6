"""Bulk load: a whole corpus counted straight into one new run of the cold tier, bypassing the
log (the warm-up path of ``ngramd warm``, ``cold.ColdStore.bulk_load``; ARCHITECTURE §5).

Method (memory bounded by ``mem_mb``, every core, every row written once, no merges): the key
space is cut into P = 2^b partitions; a worker thread counts the WHOLE corpus restricted to one
partition in one ``count_rows`` call, which yields that partition's final rows directly (the
hashing is repeated per partition, ~0.12 µs a token a pass; the sorting is not); the calling
thread writes the partitions' pages in key order.  P is the smallest that keeps ``threads``
partitions' events (24 B) and rows (~37 B) in ``mem_mb``.

Its rate is in ARCHITECTURE §9 and bench/RESULTS.md.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ..kernels.count import count_span
from .rows import Counter
from .runs import Run, Runs
from ..wire.errors import StorageError
from ..wire.identity import TableIdentity

#: at most 2^12 partitions (a corpus too big for that many passes needs more memory)
MAX_PART_BITS = 12


def partition_bits(identity: TableIdentity, offsets: np.ndarray, threads: int,
                   mem_mb: int) -> tuple[int, int]:
    """``(bits, events)``: the partitions (2^bits) that keep ``threads`` partitions' events
    and rows in ``mem_mb``, and the corpus's events (the run's size hint)."""
    events = int(sum(count_span(int(b - a), 0, identity.n_min, identity.n_max)
                     for a, b in zip(offsets[:-1], offsets[1:])))
    budget = max(int(mem_mb), 64) << 20
    bits = max(0, (threads - 1).bit_length())
    # per thread: 24 B of events and ~37 B of rows per event of its partition
    while bits < MAX_PART_BITS and threads * 64 * events / (1 << bits) > budget:
        bits += 1
    return bits, events


def write_run(runs: Runs, identity: TableIdentity, tokens: np.ndarray, offsets: np.ndarray, *,
              threads: int, mem_mb: int, progress, closed: Callable[[], bool]
              ) -> tuple[Run | None, int]:
    """Count validated ``tokens``/``offsets`` into a new run's pages; returns ``(run, P)``,
    the run None when the corpus has no n-grams (nothing is left on disk then).  The run is
    not registered: the caller does that in one batch.  On any failure (``closed()`` turning
    true included) the run's pages are deleted and the error raised."""
    threads = max(1, int(threads))
    bits, events = partition_bits(identity, offsets, threads, mem_mb)
    run = runs.new_id()
    writer = runs.writer(run, max(1, int(events * 0.7)))
    try:
        with ThreadPoolExecutor(threads, "ngramd-bulk") as pool:
            _write_parts(identity, tokens, offsets, bits, writer, pool, threads, progress, closed)
            meta = writer.finish()
    except BaseException:
        writer.abort()
        runs.delete([run])
        raise
    if not meta.rows:
        runs.delete([run])
        return None, 1 << bits
    return meta, 1 << bits


def _write_parts(ident, tokens, offsets, bits, writer, pool, threads, progress, closed) -> None:
    """The partitions: counted and encoded ``threads`` at a time in ``pool``, written in key
    order by the calling thread."""
    n_parts = 1 << bits
    skips = np.zeros(offsets.size - 1, np.int64)
    local = threading.local()

    def count_part(p: int):
        """Count, encode and filter one partition in a worker thread."""
        if closed():
            raise StorageError("cold tier closed during a bulk load")
        c = getattr(local, "counter", None)
        if c is None:
            c = local.counter = Counter(ident)
            local.blobs, local.turn = [np.empty(0, np.uint64)] * 2, 0
        rows = c.count(tokens, offsets, skips, p, bits, copy=False)
        # two page buffers a thread, used in turn: the caller writes this partition's pages
        # while the thread may count the next one (never two more: the caller submits
        # partition p + threads only after taking partition p)
        local.turn ^= 1
        need = 2 + (len(rows) * 30 + 8 * int(rows.poff[-1])) // 8 + (1 << 16)
        if local.blobs[local.turn].shape[0] < need:
            local.blobs[local.turn] = np.empty(int(need * 1.25), np.uint64)
        return writer.encode(rows, local.blobs[local.turn])

    futs = {p: pool.submit(count_part, p) for p in range(min(threads, n_parts))}
    for p in range(n_parts):
        part = futs.pop(p).result()
        if p + threads < n_parts:
            futs[p + threads] = pool.submit(count_part, p + threads)
        writer.add(part)
        if progress is not None:
            progress(p + 1, n_parts)
