"""Reads of the cold tier: lookups, scans and figures over its current view (ARCHITECTURE §5).

``ColdReader`` is the read half of ``cold.store.ColdStore``: everything here takes the view of
the moment (runs + delta parts, ``runs.Views``) once and never a writer's lock, so any number
of threads may call it beside the writer, the spiller and the merger.  Python works per run
and per page, never per key: a run's Bloom filter rules keys out without I/O, and the pages of
the rest are fetched with one ``get([...])`` per run (in ``read_chunk`` pieces across the read
pool) and searched by ``kernels.pages.pages_lookup``.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from ..kernels.bloom import bbloom_may_batch
from ..kernels.hashing import key_hash
from ..kernels.pages import pages_lookup
from ..kernels.rowset import rows_lookup
from ..wire.constants import EMPTY_TOKEN, MAX_ORDER
from ..config import ColdOptions
from .rows import Lookup, RowSet, slice_rows, take_rows, unique_inverse
from .runs import Run, Runs, View, Views, page_buffer, page_key, run_key
from .runs import storage as _storage
from ..wire.errors import BadInput, StorageError
from ..wire.identity import TableIdentity
from ..wire.validate import as_offsets, as_tokens


@dataclass(eq=False)
class ColdReader:
    """Lookups, scans and figures of one cold tier (thread-safe: see the module docstring).

    It shares the store's parts: ``rocks`` (``rocks.Rocks``: its handles are read at each call,
    since a reopen replaces them), ``views`` and ``runs`` (``runs.Views``/``runs.Runs``), the
    read pool, and ``check_open`` (raises ``StorageError`` once the store is closed or while it
    reopens)."""

    path: Path
    rocks: object
    views: Views
    runs: Runs
    identity: TableIdentity
    options: ColdOptions
    pool: ThreadPoolExecutor
    check_open: Callable[[], None]
    #: (when, figures, runs, deletions) of the last ``dir_sizes``
    _sizes: tuple | None = field(default=None, init=False, repr=False)

    def lookup(self, keys: np.ndarray) -> Lookup:
        """Counts of the contexts with these kernel keys (uint64), summed over the delta and
        every run.  Python work is per run and per page, not per key."""
        self.check_open()
        keys = np.ascontiguousarray(keys, np.uint64)
        out = Lookup.empty(keys.shape[0], self.identity.cold_k)
        if not keys.shape[0]:
            return out
        with self.views.reading() as view:
            self._lookup_view(view, keys, out)
        return out

    def _lookup_view(self, view: View, keys: np.ndarray, out: Lookup) -> None:
        m, k = keys.shape[0], self.identity.cold_k
        for p in view.delta:
            rows_lookup(p.key, p.order, p.total, p.poff, p.tok, p.cnt, keys, k, *out)
        may = np.empty(m, np.bool_)
        for run in view.runs:
            if run.nprobe:
                if not bbloom_may_batch(run.bloom, keys, run.nprobe, may):
                    continue
                idx = np.flatnonzero(may)
            else:
                idx = np.arange(m)
            sub = keys[idx]
            pages = sub >> np.uint64(64 - run.depth) if run.depth else np.zeros(idx.size, np.uint64)
            uniq, inv = unique_inverse(pages)
            vals = self._get_pages([page_key(run.id, p) for p in uniq.tolist()])
            buf, pstart, where = page_buffer(vals)
            qpage = np.asarray(where, np.int64)[inv]
            sub_out = [a[idx] for a in out]
            pages_lookup(sub, qpage, pstart, buf.view(np.uint8), buf.view(np.uint32), buf, k,
                         *sub_out)
            for a, b in zip(out, sub_out):
                a[idx] = b

    def _get_pages(self, keys: list[bytes]) -> list:
        chunk = self.options.read_chunk
        pg = self.rocks.pg
        with _storage("reading pages"):
            if len(keys) <= chunk:
                return pg.get(keys)
            parts = self.pool.map(pg.get, [keys[i:i + chunk] for i in range(0, len(keys), chunk)])
            out = []
            for p in parts:
                out.extend(p)
            return out

    def may_exist(self, keys: np.ndarray) -> np.ndarray:
        """False where a key is certainly absent, decided without I/O (delta and filters)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.zeros(keys.shape[0], bool)
        view = self.views.current
        may = np.empty(keys.shape[0], np.bool_)
        for p in view.delta:
            idx = np.searchsorted(p.key, keys)
            ok = idx < p.key.shape[0]
            ok[ok] = p.key[idx[ok]] == keys[ok]
            out |= ok
        for run in view.runs:
            if not run.nprobe:
                out[:] = True
                break
            bbloom_may_batch(run.bloom, keys, run.nprobe, may)
            out |= may
        return out

    def _check_order(self, order) -> int:
        if isinstance(order, (bool, np.bool_)) or not isinstance(order, (int, np.integer)):
            raise BadInput(f"order must be an integer, got {type(order).__name__}")
        o = int(order)
        if not self.identity.n_min <= o <= self.identity.n_max:
            raise BadInput(f"order {o} outside the table's orders "
                           f"{self.identity.n_min}..{self.identity.n_max}")
        return o

    def get(self, order: int, ctx) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(total, tok[k'], cnt[k'])`` for the last ``order`` tokens of ``ctx``, or None."""
        self.check_open()
        o = self._check_order(order)
        ctx = as_tokens(ctx, self.identity.vocab_size, what="ctx")
        if ctx.size < o:
            raise BadInput(f"ctx: {ctx.size} tokens is shorter than the order {o}")
        key = np.array([key_hash(ctx[ctx.size - o:])], np.uint64)
        return self.lookup(key).row(0)

    def get_many(self, orders, tokens, offsets) -> list[tuple[int, np.ndarray, np.ndarray] | None]:
        """``get(orders[i], tokens[offsets[i]:offsets[i+1]])`` for every i, in one lookup."""
        keys = self.keys_for(orders, tokens, offsets)
        res = self.lookup(keys)
        return [res.row(i) for i in range(keys.shape[0])]

    def keys_for(self, orders, tokens, offsets) -> np.ndarray:
        """Validated kernel keys of the last ``orders[i]`` tokens of each context."""
        self.check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = as_offsets(offsets, tokens.size, min_len=1)
        orders = np.asarray(orders)
        if orders.ndim != 1 or orders.size != offsets.size - 1 or orders.dtype.kind not in "iu":
            raise BadInput(f"orders: expected {offsets.size - 1} integers, "
                           f"got shape {orders.shape} dtype {orders.dtype}")
        orders = orders.astype(np.int64)
        lo, hi = self.identity.n_min, self.identity.n_max
        if orders.size and (orders.min() < lo or orders.max() > hi):
            raise BadInput(f"orders must lie in {lo}..{hi}")
        lens = np.diff(offsets)
        short = np.flatnonzero(lens < orders)
        if short.size:
            i = int(short[0])
            raise BadInput(f"context {i}: {int(lens[i])} tokens is shorter than its order "
                           f"{int(orders[i])}")
        keys = np.empty(orders.size, np.uint64)
        for i in range(orders.size):
            b = int(offsets[i + 1])
            keys[i] = key_hash(tokens[b - int(orders[i]):b])
        return keys

    def scan(self, order: int | None = None, chunk: int = 65536) -> Iterator[dict]:
        """Every entry (of one order, or all) in key order, as dicts of arrays of up to
        ``chunk`` rows: ``key``, ``parent``, ``order``, ``total``, ``tok``/``cnt``
        ``(m, cold_k)``.  Reads the view of the moment it starts; memory is bounded by
        ``slice_rows``."""
        self.check_open()
        if chunk < 1:
            raise BadInput(f"chunk must be >= 1, got {chunk}")
        o = None if order is None else self._check_order(order)
        return self._scan(o, int(chunk))

    def _scan(self, order, chunk) -> Iterator[dict]:
        k = self.identity.cold_k
        for rows in self.scan_rows():
            self.check_open()
            if order is not None:
                sel = np.flatnonzero(rows.order == order)
                if sel.size != len(rows):
                    rows = take_rows(rows, sel)
            for a in range(0, len(rows), chunk):
                self.check_open()
                part = slice_rows(rows, a, min(a + chunk, len(rows)))
                tok, cnt = part.padded(k)
                yield dict(key=part.key, parent=part.parent, order=part.order,
                           total=part.total, tok=tok, cnt=cnt)

    def scan_rows(self, stop: threading.Event | None = None) -> Iterator[RowSet]:
        """The whole table as merged row sets, slice by slice (the hot builder's input); reads
        the view of the moment it starts."""
        with self.views.reading() as view:
            total = sum(r.rows for r in view.runs) + sum(len(p) for p in view.delta)
            yield from self.runs.slices(view.runs, view.delta, total, stop)

    def top(self, order: int, n: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """The ``n`` contexts of ``order`` with the largest totals, most frequent first, as
        ``(key, total, tok[k'], cnt[k'])``.  A full scan.  Contexts are stored as their keys
        (hashes), so the context tokens themselves are not available."""
        o = self._check_order(order)
        if n < 1:
            return []
        best = None
        for ch in self.scan(o):
            cand = ch if best is None else {f: np.concatenate([best[f], ch[f]]) for f in ch}
            idx = np.argsort(-cand["total"].astype(np.int64), kind="stable")[:n]
            best = {f: v[idx] for f, v in cand.items()}
        if best is None:
            return []
        out = []
        for i in range(best["total"].size):
            kk = int((best["tok"][i] != EMPTY_TOKEN).sum())
            out.append((int(best["key"][i]), int(best["total"][i]), best["tok"][i, :kk].copy(),
                        best["cnt"][i, :kk].copy()))
        return out

    # ---- figures ----------------------------------------------------------------------------
    def dir_sizes(self) -> tuple[int, int, int]:
        """(RocksDB's WAL bytes, SST bytes of the registered runs, all bytes) of the table's
        directory and its subdirectories (ingest log, quarantine), at most once a second: a
        stats call runs on the daemon's serving thread, and a big table has hundreds of files.
        Measured again after runs were deleted."""
        now, runs_now, deletions = time.monotonic(), self.views.current.runs, self.runs.deletions
        cached = self._sizes
        if cached is not None and now - cached[0] < 1.0 and cached[2] is runs_now \
                and cached[3] == deletions:
            return cached[1]
        wal = total = 0
        for top, _dirs, files in os.walk(self.path):
            for name in files:
                with contextlib.suppress(OSError):
                    size = os.stat(os.path.join(top, name)).st_size
                    total += size
                    if top == str(self.path) and name.endswith(".log"):
                        wal += size
        live = {run_key(r.id) for r in runs_now}
        runs = 0
        with contextlib.suppress(Exception):  # the DB may be reopening: count no runs then
            for f in self.rocks.db.live_files():  # a page key: run id (4 bytes) + page id (8)
                a, b = f["start_key"], f["end_key"]
                if len(a) == len(b) == 12 and a[:4] == b[:4] and a[:4] in live:
                    runs += int(f["size"])
        self._sizes = (now, (wal, runs, total), runs_now, deletions)
        return wal, runs, total

    def run_list(self) -> list[Run]:
        return list(self.views.current.runs)

    def probe(self) -> None:
        """Raise ``StorageError`` unless the cold tier reads now (``health.Probes``): RocksDB
        is open, one page of a run picked at random reads through the path drafts take, and
        4 KiB of one of its SST files, picked at random, read from the file itself (RocksDB's
        block cache may answer the page without the disk).  A few small reads; ``os.pread``
        releases the GIL."""
        self.check_open()
        runs = self.views.current.runs
        if runs:
            run = random.choice(runs)
            page = random.randrange(1 << run.depth) if run.depth else 0
            with _storage("probing a read"):
                self.rocks.pg_scan.get([page_key(run.id, page)])
        try:
            ssts = [e.path for e in os.scandir(self.path) if e.name.endswith(".sst")]
            random.shuffle(ssts)
            for path in ssts[:2]:  # one deleted by a merge meanwhile: the next
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    size = os.fstat(fd).st_size
                    os.pread(fd, 4096, random.randrange(max(size - 4096, 0) + 1))
                finally:
                    os.close(fd)
                break
        except OSError as e:
            raise StorageError(f"cold tier: reading {self.path} failed: "
                               f"{e.strerror or e}") from None

    def entries(self) -> dict[int, int]:
        """Rows per order summed over runs and the delta: the exact number of distinct
        contexts when the table is one run (after ``compact`` or a bulk warm-up), an upper
        bound otherwise (a context in two runs counts twice until they are merged)."""
        view = self.views.current
        e = np.zeros(MAX_ORDER + 1, np.int64)
        for r in view.runs:
            e += np.asarray(r.orders, np.int64)
        for p in view.delta:
            e += p.per_order()
        return {o: int(e[o]) for o in range(self.identity.n_min, self.identity.n_max + 1)}

    def memory(self) -> dict:
        """Bytes of RAM this store holds by design: delta, filters, block cache capacity."""
        view = self.views.current
        return {"delta_bytes": sum(p.nbytes for p in view.delta),
                "filter_bytes": sum(int(r.bloom.nbytes) for r in view.runs),
                "block_cache_bytes": self.options.block_cache_mb << 20}
