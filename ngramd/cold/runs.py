"""Runs of pages: the cold tier's immutable row sets on RocksDB, and how they are merged
(ARCHITECTURE §5; ``ngramd.cold.store``'s module doc gives the design and the measurements).

* **Format.**  A run of depth ``d`` puts the rows whose key has top-``d`` bits ``p`` into page
  ``p`` (``depth_for``); a page's bytes are ``kernels``' page format (``encode_pages``).  Page
  keys are run id (u32 BE) + page id (u64 BE) in the ``pages`` family; a run's Bloom filter
  follows its pages in 16 MiB chunks keyed run id + ``BLOOM_PAGE | chunk``.  ``Run`` is the
  descriptor (JSON in ``meta``) with the filter in RAM.
* **Writing.**  ``RunWriter`` writes one run as SST files and ingests them (it says why).
* **Views.**  ``Views`` publishes what readers see (runs + delta parts) and counts the
  readers of each view, so pages of runs merged away are deleted only once nobody reads them.
* **Reading and merging.**  ``Runs`` streams the merged rows of runs and delta parts slice
  by slice (``slices``), picks and runs size-tier merges, and deletes retired runs,
  reclaiming their disk space one run at a time (``delete``).

``Runs`` works on the handles of the store's ``Rocks`` (``ngramd.cold.rocks``), which a reopen
replaces in place: it reads them at each call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
from rocksdict import WriteBatch

from ..kernels.bloom import BB_BLOCK_WORDS, bbloom_add
from ..kernels.pages import pages_check, pages_decode_into, pages_dims, pages_fill, pages_plan
from ..kernels.rowset import rows_copy_into, rows_gather, rows_range
from ..wire.constants import MAX_ORDER
from ..config import ColdOptions
from .rows import RowSet, slice_rows
from .sstwriter import SstHelper, helpers, remove_files
from ..wire.errors import UNAVAILABLE, NgramError, StorageError

log = logging.getLogger("ngramd.cold")

META_RETIRED = b"retired"
META_NEXT_RUN = b"next_run"
RUN_PREFIX = b"run/"
BLOOM_PAGE = 0xFFFFFFFF00000000  # page ids of a run's filter chunks (after its pages)
BLOOM_CHUNK_WORDS = 2 << 20  # 16 MiB of filter a value


@contextlib.contextmanager
def storage(what: str):
    """Turn RocksDB/rocksdict failures into ``StorageError`` with our message (API edge)."""
    try:
        yield
    except NgramError:
        raise
    except Exception as e:  # rocksdict raises bare Exception("IO error: ...")
        raise StorageError(f"cold tier: {what} failed: {e}") from None


# ---------------------------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One immutable run: descriptor (persisted as JSON) + its Bloom filter (in RAM)."""

    id: int
    depth: int
    rows: int
    pages: int
    bytes: int
    orders: list  # rows per order, index = order
    nprobe: int = 0  # Bloom probes (0 = no filter)
    created: float = 0.0
    bloom_words: int = 0  # uint64 words of the filter
    bloom: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64), repr=False)

    def descriptor(self) -> bytes:
        d = {k: getattr(self, k) for k in ("id", "depth", "rows", "pages", "bytes", "orders",
                                           "nprobe", "created", "bloom_words")}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_descriptor(cls, raw: bytes) -> "Run":
        return cls(**json.loads(raw))


def run_key(run_id: int) -> bytes:
    return int(run_id).to_bytes(4, "big")


def page_key(run_id: int, page: int) -> bytes:
    return int(run_id).to_bytes(4, "big") + int(page).to_bytes(8, "big")


def depth_for(rows: int, page_rows: int) -> int:
    """Smallest depth whose pages hold at most ``page_rows`` rows on average."""
    return max(0, math.ceil(math.log2(max(rows, 1) / page_rows))) if rows > page_rows else 0


def encode_pages(rows: RowSet, depth: int, buf: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(page ids, byte offsets (len + 1), blob uint8)`` of a row set at ``depth``; the blob
    is a view of ``buf`` (uint64) when it is large enough."""
    ids, rstart, bstart = pages_plan(rows.key, rows.poff, depth)
    words = int(bstart[-1]) // 8
    if buf is None or buf.shape[0] < words:
        buf = np.empty(words, np.uint64)
    buf = buf[:words]
    buf[:] = 0
    pages_fill(*rows, rstart, bstart, buf.view(np.uint8), buf.view(np.uint32), buf)
    return ids, bstart, buf.view(np.uint8)


_NO_PAGES = np.frombuffer(b"", np.uint64)


def page_buffer(vals: list) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Concatenate fetched pages (None = missing) into one buffer: ``(buf u64, byte offsets of
    the present pages (len + 1), index of each value in those offsets or -1)``.  The joined
    bytes are used in place (pages are multiples of 8 bytes and bytes objects 16-aligned), so
    a page is copied once, by the join."""
    present = [v for v in vals if v]
    sizes = np.fromiter((len(v) for v in present), np.int64, count=len(present))
    pstart = np.zeros(len(present) + 1, np.int64)
    np.cumsum(sizes, out=pstart[1:])
    if sizes.size and np.any(sizes % 8):
        raise StorageError("cold tier: corrupt page in the pages column family (size)")
    buf = np.frombuffer(b"".join(present), np.uint64) if present else _NO_PAGES
    if not buf.flags.aligned:  # never seen; keeps the kernels' aligned loads honest
        buf = buf.copy()
    if not pages_check(pstart, buf.view(np.uint32), int(pstart[-1])):
        raise StorageError("cold tier: corrupt page in the pages column family (header)")
    where, j = [], 0
    for v in vals:
        if v:
            where.append(j)
            j += 1
        else:
            where.append(-1)
    return buf, pstart, where


def pick_merge(runs: list, merge_ratio: float, max_runs: int) -> list[Run] | None:
    """The runs (oldest first) the size-tier policy would merge now, or None: the newest runs
    while the next older one is at most ``merge_ratio`` x their sum, and whenever there are
    more than ``max_runs``."""
    if len(runs) < 2:
        return None
    acc, j = runs[-1].rows, len(runs) - 1
    while j > 0 and runs[j - 1].rows <= merge_ratio * acc:
        acc += runs[j - 1].rows
        j -= 1
    if len(runs) - j >= 2:
        return runs[j:]
    if len(runs) > max_runs:
        return runs[-(len(runs) - max_runs + 1):]
    return None


# ---------------------------------------------------------------------------------------------
# views
# ---------------------------------------------------------------------------------------------
class View(NamedTuple):
    runs: tuple  # of Run, oldest first
    delta: tuple  # of RowSet (the in-memory delta, counted but not yet in a run)
    epoch: int = 0  # increases with every change: readers register the epoch they read


class Views:
    """The current view of a table (``current``) and the readers of each view's epoch.

    ``lock`` serialises swaps of the view (writer, spiller and merger); readers take
    ``current`` once, without it, and register while they read pages (``reading``)."""

    def __init__(self, runs: tuple):
        self.lock = threading.Lock()
        self._epoch = 0
        self._readers: dict[int, int] = {}  # view epoch -> readers using it
        self._read_lock = threading.Lock()
        self.current = View(tuple(runs), (), 0)

    def publish(self, runs: tuple, delta: tuple) -> None:
        """Publish a new view (caller holds ``lock``)."""
        self._epoch += 1
        self.current = View(runs, delta, self._epoch)

    @contextlib.contextmanager
    def reading(self):
        """The current view, registered while the caller reads its pages: pages of runs merged
        away are deleted only once no reader of an older view is left."""
        with self._read_lock:
            v = self.current
            self._readers[v.epoch] = self._readers.get(v.epoch, 0) + 1
        try:
            yield v
        finally:
            with self._read_lock:
                n = self._readers[v.epoch] - 1
                if n:
                    self._readers[v.epoch] = n
                else:
                    del self._readers[v.epoch]

    def oldest_reader(self) -> int:
        """The oldest epoch a reader still holds (a huge number when none does)."""
        with self._read_lock:
            return min(self._readers, default=1 << 62)


def probe_disk(path: Path) -> None:
    """Write one byte in the data directory ``path`` (``os.pwrite``: the GIL is free
    meanwhile).  Spills and merges call it first: on a frozen filesystem it waits here, where
    waiting costs the serving thread nothing, instead of inside an ``SstFileWriter`` or
    ``Rdict.write`` call that would hold the GIL for the length of the freeze."""
    try:
        fd = os.open(path / ".probe", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, b"p", 0)
        finally:
            os.close(fd)
    except OSError as e:  # read-only (EROFS, EPERM), full, or failing (EIO)
        raise StorageError(f"cold tier: the data directory is not writable: "
                           f"{e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# the runs of a table
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False, repr=False)
class Runs:
    """Writing, reading, merging and deleting the runs of one table.

    ``rocks`` holds the RocksDB handles (``cold.rocks.Rocks``); ``check_open()`` raises when the
    store is closed or reopening; ``views`` is set by the store once the runs are loaded.  The
    store's locks decide who calls what: one spiller, one merger (``merge``, ``collect_retired``),
    any number of readers (``slices``)."""

    rocks: Any
    options: ColdOptions
    cold_k: int
    path: Path
    next_run: int
    check_open: Callable[[], None]
    views: Views | None = field(default=None, init=False)
    #: set while the owner closes: a run being written (a long merge) stops at its next
    #: slice, so closing never waits for it
    interrupted: bool = field(default=False, init=False)
    #: (since, run ids, view epoch)
    retiring: list[tuple[float, list[int], int]] = field(default_factory=list, init=False)
    #: calls of ``delete`` (the store's disk figures are measured anew)
    deletions: int = field(default=0, init=False)

    # ---- setup ------------------------------------------------------------------------------
    def read_filter(self, r: Run) -> np.ndarray:
        n_chunks = -(-r.bloom_words // BLOOM_CHUNK_WORDS)
        keys = [page_key(r.id, BLOOM_PAGE | c) for c in range(n_chunks)]
        with storage("reading a run filter"):
            vals = self.rocks.pg.get(keys)
        if any(v is None for v in vals) or sum(len(v) for v in vals) != 8 * r.bloom_words:
            raise StorageError(f"cold tier: filter of run {r.id} is missing or torn")
        return np.frombuffer(b"".join(vals), np.uint64).copy()

    def collect_garbage(self, live: set, retired: list) -> None:
        """Delete pages and filters of runs that are not registered (a crash while writing
        them) or retired (merged away before a restart)."""
        dead = set(int(x) for x in retired)
        with storage("collecting unregistered runs"):
            it = self.rocks.pg.iter()
            rid = 0
            while True:
                it.seek(run_key(rid))
                if not it.valid():
                    break
                rid = int.from_bytes(it.key()[:4], "big")
                if rid not in live:
                    dead.add(rid)
                rid += 1
            del it
        if not dead and not retired:
            return
        self.delete(sorted(dead))
        log.info("cold tier: removed %d unregistered or retired runs", len(dead))

    def delete(self, ids: list[int], pace: bool = False) -> None:
        """Delete the pages and filters of runs ``ids`` and give their disk space back now (see
        "Reclaiming disk space" in ``ngramd.cold.store``): per run, a range tombstone and a
        compaction of exactly its key range, one run at a time.  ``pace``: after each run,
        wait as long as its compaction took (the merger's reclaims use at most half a
        core's time and of the disk's)."""
        rk = self.rocks
        with storage("deleting retired runs"):
            for i, rid in enumerate(ids):
                wb = WriteBatch(raw_mode=True)
                wb.delete_range(run_key(rid), run_key(rid + 1), rk.h_pg)
                rk.db.write(wb, rk.wo)
                t0 = time.monotonic()
                # the memtable holds only this tombstone: the file it is flushed to spans this
                # run alone, so the compaction reads this run's files and no live one's
                rk.pg.compact_range(run_key(rid), run_key(rid + 1))
                if pace and i + 1 < len(ids):
                    time.sleep(time.monotonic() - t0)
            wb = WriteBatch(raw_mode=True)
            still = [r for _, ids2, _ in self.retiring for r in ids2 if r not in ids]
            wb.put(META_RETIRED, json.dumps(still).encode(), rk.h_meta)
            rk.db.write(wb, rk.wo)
        self.deletions += 1

    # ---- writing ----------------------------------------------------------------------------
    def new_id(self) -> int:
        with self.views.lock:
            rid = self.next_run
            self.next_run += 1
            return rid

    def filter_bits(self, rows: int) -> float:
        """Bits per key of a new run's filter: the configured value, less when the filters of
        the whole table would pass ``filter_budget_mb``."""
        bits = self.options.filter_bits_per_key
        if bits <= 0:
            return 0.0
        total = rows + sum(r.rows for r in self.views.current.runs)
        budget = (self.options.filter_budget_mb << 20) * 8
        return max(0.0, min(bits, budget / max(total, 1)))

    def writer(self, run_id: int, rows_hint: int) -> "RunWriter":
        """A ``RunWriter`` for run ``run_id`` of about ``rows_hint`` rows."""
        rk = self.rocks
        return RunWriter(run_id, rows_hint, page_rows=self.options.page_rows,
                         bits=self.filter_bits(rows_hint), ingest_dir=rk.ingest_dir,
                         options=self.options, ingest=self._ingest)

    def _ingest(self, files: list[str]) -> None:
        # durable once ingested (RocksDB syncs the files and its manifest); moved, not copied
        self.rocks.pg.ingest_external_file(files, self.rocks.ingest_opts)

    def write(self, run_id: int, slices, rows_hint: int, between=None) -> Run:
        """Write row sets (an iterable of row sets in increasing, disjoint key ranges) as run
        ``run_id``.  Not registered yet.  ``between()`` is called after each slice (a merge
        deletes the runs retired before it meanwhile: a long merge must not keep them)."""
        w = self.writer(run_id, rows_hint)
        try:
            for rows in slices:
                if between is not None:
                    between()
                self.check_open()
                if self.interrupted:
                    raise NgramError(f"cold tier at {self.path}: run {run_id} interrupted "
                                     "(closing)", UNAVAILABLE)
                w.add(w.encode(rows))
            return w.finish()
        except BaseException:
            w.abort()
            raise

    def write_new(self, slices, rows_hint: int, between=None) -> Run:
        """``write`` under a new run id; a failure deletes what was written of it."""
        run = self.new_id()
        try:
            return self.write(run, slices, rows_hint, between)
        except BaseException:
            self.delete([run])
            raise

    # ---- merges -----------------------------------------------------------------------------
    def pick(self, runs: tuple | None = None) -> list[Run] | None:
        """The runs the size-tier policy would merge now (``pick_merge``), or None."""
        runs = list(self.views.current.runs if runs is None else runs)
        return pick_merge(runs, self.options.merge_ratio, self.options.max_runs)

    def merge(self, inputs: list[Run]) -> Run:
        """Merge ``inputs`` into one new run, register it and retire them (one batch); their
        pages are deleted by ``collect_retired`` once no reader holds them."""
        t0 = time.perf_counter()
        probe_disk(self.path)
        total = sum(r.rows for r in inputs)
        meta = self.write_new(self.slices(tuple(inputs), (), total), total,
                              between=self.collect_retired)
        ids = [r.id for r in inputs]
        pending = [r for _, g, _ in self.retiring for r in g] + ids
        rk = self.rocks
        wb = WriteBatch(raw_mode=True)
        wb.put(RUN_PREFIX + run_key(meta.id), meta.descriptor(), rk.h_meta)
        for rid in ids:
            wb.delete(RUN_PREFIX + run_key(rid), rk.h_meta)
        wb.put(META_RETIRED, json.dumps(pending).encode(), rk.h_meta)
        wb.put(META_NEXT_RUN, self.next_run.to_bytes(8, "little"), rk.h_meta)
        with storage("registering a merged run"):
            rk.db.write(wb, rk.wo)
        views = self.views
        with views.lock:
            v = views.current
            keep = [r for r in v.runs if r.id not in ids]
            # the merged run takes the place of its newest input: runs stay ordered by age
            pos = max(i for i, r in enumerate(v.runs) if r.id in ids) - (len(ids) - 1)
            keep.insert(pos, meta)
            views.publish(tuple(keep), v.delta)
        self.retiring.append((time.monotonic(), ids, views.current.epoch))
        log.info("merged runs %s (%d rows) into run %d: %d rows, %d pages, %.1f MiB, %.2f s",
                 ids, total, meta.id, meta.rows, meta.pages, meta.bytes / 2**20,
                 time.perf_counter() - t0)
        return meta

    def collect_retired(self, force: bool = False) -> None:
        """Delete the pages of merged-away runs once ``retire_s`` passed and no reader still
        holds a view from before their retirement (``force``: at compaction and close)."""
        now = time.monotonic()
        oldest = self.views.oldest_reader()

        def due(t, epoch):
            return force or (now - t >= self.options.retire_s and oldest >= epoch)
        ready = [(t, g, e) for t, g, e in self.retiring if due(t, e)]
        if not ready:
            return
        # they stay listed until their pages are gone: ``stats`` counts them as retiring
        # meanwhile, and a delete that fails is tried again at the next call
        self.delete([r for _, g, _ in ready for r in g], pace=not force)
        self.retiring = [x for x in self.retiring if x not in ready]

    # ---- slices: merged streams over runs and delta ---------------------------------------
    # Scans (spills, merges, hot builds) read every page once: through the block cache they
    # evicted what lookups reuse, and filled it to its capacity in the middle of a hot build
    # (measured: +256 MiB of the daemon's +525 MiB peak while building a 64 MiB hot tier).
    # So they read through ``rocks.pg_scan``, whose reads do not fill the cache.
    def slices(self, runs: tuple, delta: tuple, total_rows: int,
               stop: threading.Event | None = None) -> Iterator[RowSet]:
        """The merged rows of ``runs`` + ``delta`` parts, slice by slice in key order (each a
        row set of about ``slice_rows`` rows).  Per slice: every source is decoded into one
        buffer, then one stable argsort merges the sorted sources and ``rows_gather`` adds up
        equal keys."""
        ds = max(0, math.ceil(math.log2(max(total_rows, 1) / self.options.slice_rows))) \
            if total_rows > self.options.slice_rows else 0
        ds = min(ds, 32)
        # run id -> (page id, buf, pstart) of a page wider than a slice
        cache: dict[int, tuple] = {}
        for s in range(1 << ds):
            if stop is not None and stop.is_set():
                return
            lo = np.uint64(s << (64 - ds)) if ds else np.uint64(0)
            bounded = s != (1 << ds) - 1
            hi = np.uint64(((s + 1) << (64 - ds)) & 0xFFFFFFFFFFFFFFFF) if bounded else np.uint64(0)
            pages, rows = [], []
            for run in runs:
                got = self._run_pages(run, s, ds, cache)
                if got is not None:
                    pages.append(got)
            for p in delta:
                a, b = rows_range(p.key, lo, hi, bounded)
                if b > a:
                    rows.append((p, int(a), int(b)))
            yield self._gather(pages, rows, lo, hi, bounded)

    def _run_pages(self, run: Run, s: int, ds: int, cache):
        """``(buf, pstart)`` of the pages of ``run`` that hold slice ``s`` (of depth ``ds``), or
        None when there are none.  One ``get([keys])`` per run and slice (the page ids of a
        slice are known: no iterator, no Python call per page)."""
        if run.depth >= ds:
            shift = run.depth - ds
            first, end = s << shift, (s + 1) << shift
            prefix = run_key(run.id)
            keys = [prefix + p.to_bytes(8, "big") for p in range(first, end)]
            with storage("reading pages"):
                vals = self.rocks.pg_scan.get(keys)
            buf, pstart, _ = page_buffer(vals)
            return (buf, pstart) if pstart.shape[0] > 1 else None
        pid = s >> (ds - run.depth)
        got = cache.get(run.id)
        if got is None or got[0] != pid:
            with storage("reading pages"):
                val = self.rocks.pg_scan.get(page_key(run.id, pid))
            got = cache[run.id] = (pid,) + (page_buffer([val])[:2] if val else (None, None))
        return None if got[1] is None else got[1:]

    def _gather(self, pages: list, rows: list, lo, hi, bounded: bool) -> RowSet:
        m = P = 0
        for buf, pstart in pages:
            a, b = pages_dims(pstart, buf.view(np.uint32))
            m += a
            P += b
        for p, a, b in rows:
            m += b - a
            P += int(p.poff[b] - p.poff[a])
        if m == 0:
            return RowSet.empty()
        out = RowSet(np.empty(m, np.uint64), np.empty(m, np.uint64), np.empty(m, np.uint8),
                     np.empty(m, np.uint32), np.zeros(m + 1, np.int64), np.empty(P, np.uint32),
                     np.empty(P, np.uint32))
        g = pp = 0
        for buf, pstart in pages:
            g, pp = pages_decode_into(pstart, buf.view(np.uint8), buf.view(np.uint32), buf, lo,
                                      hi, bounded, *out, g, pp)
        for p, a, b in rows:
            g, pp = rows_copy_into(*p, a, b, *out, g, pp)
        out = slice_rows(out, 0, g) if g < m else out
        if len(pages) + len(rows) < 2:
            return out
        perm = np.argsort(out.key, kind="stable")
        return RowSet(*rows_gather(perm, *out, self.cold_k))


def reserve_bytes(fs_bytes: int) -> int:
    """Free space a run never takes on a filesystem of ``fs_bytes``, kept for the ingest log:
    1% of it, at most 256 MiB (minutes of ingest at the write path's target rate)."""
    return min(256 << 20, fs_bytes // 100)


class Encoded(NamedTuple):
    """A row set encoded as pages (see ``RunWriter.encode``)."""

    ids: np.ndarray  # page ids
    bstart: np.ndarray  # byte offsets (len + 1)
    blob: np.ndarray  # uint8
    rows: int
    orders: np.ndarray  # rows per order


class RunWriter:
    """Writes one run: its pages into SST files, ingested into the pages family in one step
    (``ingest(files)``, files moved), then its Bloom filter.

    Why SST files and not WriteBatches: a ``write`` into a full memtable waits for RocksDB's
    flush WITH the GIL held, which stalled the daemon's serving thread 240-360 ms under ingest
    (measured by its stall monitor).  Run ids only grow, so a run's keys are past every
    existing key: RocksDB places the files without compacting them.

    Why a helper process writes the files (``ngramd.cold.sstwriter``, one per writer at a time,
    reused): an ``SstFileWriter`` call holds the GIL, and RocksDB's writer asks the kernel to
    drop its file's pages each MiB it writes, a call that waited 1-30 s beside busy processes;
    the whole daemon waited with it.  Here the writing thread waits on a pipe, GIL released.
    The files' names are ``{ingest_dir}/run{id}-{k}.sst``; ``FILE_BYTES`` of pages a file,
    ``fdatasync``ed each ``SYNC_BYTES`` (the page cache holds little of a run dirty).

    ``encode`` (numba, may run in worker threads: it adds the keys to the filter under a lock)
    and ``add`` (puts, one thread) are separate so bulk loads can encode in parallel.
    Registering the run is the caller's batch."""

    FILE_BYTES = 256 << 20  # pages per SST file
    SYNC_BYTES = 8 << 20  # written to a file between two fdatasyncs (class doc)

    def __init__(self, run_id: int, rows_hint: int, *, page_rows: int, bits: float,
                 ingest_dir: Path, options: ColdOptions, ingest):
        self.run_id = run_id
        self.depth = depth_for(rows_hint, page_rows)
        self.nprobe = max(1, min(8, round(bits * 0.69))) if bits >= 1 else 0
        n_words = max(1, math.ceil(rows_hint * bits / 512)) * BB_BLOCK_WORDS if self.nprobe else 0
        self.bloom = np.zeros(n_words, np.uint64)
        self._bloom_lock = threading.Lock()
        self.orders = np.zeros(MAX_ORDER + 1, np.int64)
        self.rows = self.pages = self.bytes = 0
        self._prefix = run_key(run_id)
        self._stem = str(ingest_dir / f"run{run_id}")
        self._options = options
        self._ingest = ingest
        self._helper: SstHelper | None = None
        self._finished: list[str] = []  # the files ``finish`` had the helper close

    def encode(self, rows: RowSet, buf: np.ndarray | None = None) -> Encoded:
        """Pages of a row set (in ``buf`` if given and large enough)."""
        ids, bstart, blob = encode_pages(rows, self.depth, buf) if len(rows) else (
            np.zeros(0, np.uint64), np.zeros(1, np.int64), np.zeros(0, np.uint8))
        if self.nprobe and len(rows):
            with self._bloom_lock:
                bbloom_add(self.bloom, rows.key, self.nprobe)
        return Encoded(ids, bstart, blob, len(rows), rows.per_order())

    def add(self, enc: Encoded) -> None:
        self.orders += enc.orders
        self.rows += enc.rows
        self.pages += enc.ids.shape[0]
        self.bytes += int(enc.bstart[-1])
        if enc.ids.shape[0]:
            self._put(np.ascontiguousarray(enc.ids, np.uint64),
                      np.ascontiguousarray(enc.bstart, np.int64),
                      enc.blob[:int(enc.bstart[-1])])

    def _put(self, ids: np.ndarray, bstart: np.ndarray, blob: np.ndarray) -> None:
        self._check_room(blob.nbytes)
        with storage("writing pages"):
            if self._helper is None:
                self._helper = helpers.acquire()
                o = self._options
                self._helper.call({"op": "begin", "stem": self._stem,
                                   "file_bytes": self.FILE_BYTES, "sync_bytes": self.SYNC_BYTES,
                                   "compression": o.compression,
                                   "block_size_kb": o.block_size_kb})
            self._helper.call({"op": "put", "prefix": self._prefix}, ids, bstart,
                              np.ascontiguousarray(blob))

    def _check_room(self, nbytes: int) -> None:
        """Refuse pages that would leave less than ``reserve_bytes`` free on the data dir's
        filesystem, before a byte of them is written.  Why: the ingest log needs the last free
        space more than a run does.  A spill on a nearly full disk fails either way, but its
        partial file first took the last free bytes, and ingests failed (ENOSPC) until the
        helper had removed it (issue 31: a fresh-clone run beside 2 busy processes failed so;
        ``statvfs`` releases the GIL)."""
        st = os.statvfs(os.path.dirname(self._stem))
        free = st.f_bavail * st.f_frsize
        reserve = reserve_bytes(st.f_blocks * st.f_frsize)
        if free - nbytes < reserve:
            raise StorageError(
                f"cold tier: writing pages: the disk is nearly full ({free >> 10} KiB free; "
                f"{nbytes >> 10} KiB more pages would leave less than the {reserve >> 10} KiB "
                f"kept for the ingest log)")

    def abort(self) -> None:
        """Remove the files of a run that will not be registered."""
        h, self._helper = self._helper, None
        if h is None:  # finished: the files, if the ingest did not take them
            for f in self._finished:
                with contextlib.suppress(OSError):
                    os.unlink(f)
            return
        try:
            h.call({"op": "abort"})
        except Exception:  # noqa: BLE001 -- a helper that died cannot remove them: we do
            remove_files(self._stem)
        helpers.release(h)

    def finish(self) -> Run:
        if self.nprobe and self.rows:  # the filter goes last, in the same files
            words = self.bloom
            n = -(-words.shape[0] // BLOOM_CHUNK_WORDS)
            ids = np.uint64(BLOOM_PAGE) | np.arange(n, dtype=np.uint64)
            bstart = np.minimum(np.arange(n + 1, dtype=np.int64) * (BLOOM_CHUNK_WORDS * 8),
                                words.nbytes)
            self._put(ids, bstart, words.view(np.uint8))
        if self._helper is not None:
            with storage("writing pages"):
                files = self._helper.call({"op": "finish"})["files"]
                helpers.release(self._helper)
                self._helper, self._finished = None, files
                if files:
                    self._ingest(files)
        return Run(id=self.run_id, depth=self.depth, rows=self.rows, pages=self.pages,
                   bytes=self.bytes, orders=self.orders.tolist(),
                   nprobe=self.nprobe if self.rows else 0, created=time.time(),
                   bloom_words=int(self.bloom.shape[0]) if self.rows else 0,
                   bloom=self.bloom if self.rows else np.zeros(0, np.uint64))
