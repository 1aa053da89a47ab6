"""Cold tier: the full n-gram table in RocksDB, and the ingest log beside it (ARCHITECTURE §5).

The write path is the heart of this module: it must count ~16 events a token (orders 1..16)
at fleet rate without one Python call per key, never stall the daemon's serving thread, and
keep "acknowledged ⇒ counted exactly once" through kill -9.

Design: an LSM of *runs* of *pages*, on top of RocksDB
-----------------------------------------------------
* **Rows.**  What counting produces (``ngramd.kernels.count_rows``): one row per distinct
  context, ``key`` (the documented 64-bit hash, order included), ``parent`` (hash of its order-1
  suffix), ``order``, ``total`` (observations) and the top ``cold_k`` next tokens with counts.
  A *row set* keeps them sorted by key (``RowSet``).
* **Runs.**  An immutable row set stored as pages.  A run of depth ``d`` puts the rows whose key
  has top-``d`` bits ``p`` into page ``p`` (``d`` is chosen so a page holds ~``page_rows`` = 128
  rows, ~4 KiB, one data block of the ``pages`` column family).  The table = some runs + the
  in-memory delta; a key's counts are the sum over all of them.
* **Delta (L0).**  The single writer (``apply``) reads log records above the *counted*
  watermark, counts them in numba (nogil) and keeps the row sets in RAM: one part a writer
  step, merged in RAM by size tiers (``compact_delta``, a binary counter).  Reads see them at
  once.  When the daemon says so (``delta_mb`` reached, the rows' age, idle ingest: see
  ``ngramd.table``) or on ``spill``/``flush``, the delta is written as a new run; the run's
  registration and the *applied* watermark are ONE synced WriteBatch, after which the log
  segments it covers are deleted (``ngramd.ingestlog``).
* **Merges.**  ``maybe_merge`` (the daemon's merger thread) merges runs by size tiers: the
  newest runs are merged while the next older one is at most ``merge_ratio`` (1) x their sum
  (and whenever there are more than ``max_runs``), so a row is rewritten O(log) times and a
  read checks few runs.  A merge streams the inputs slice by slice (bounded memory), writes the
  output run, then registers it and retires the inputs in one batch; retired pages are deleted
  ``retire_s`` later (readers that still hold the old view keep working), and their disk space
  is given back at once (below: "Reclaiming disk space").
* **Reads.**  Per run, a blocked Bloom filter in RAM (``filter_bits_per_key``, capped by
  ``filter_budget_mb``) rules keys out without I/O; the pages of the rest are fetched with one
  ``get([...])`` call per run and searched by ``kernels.pages_lookup``: Python runs per page and
  per batch, never per key.

Why pages and not one RocksDB key per context (the first build)
---------------------------------------------------------------
Measured here (2 vCPU VM): through rocksdict, one Python call per key costs ~0.5-1 µs (put) and
~3-5 µs (get); orders 1..16 give ~10-12 distinct contexts per token in a batch, so the per-key
design topped out at 11-46k tokens/s.  A 4 KiB page costs ~9.5 µs to put (lz4; ~75 ns a row) and
~8 µs to get, counting in numba ~80 ns an event (``count_rows``), merging two row sets ~45 ns a
row: the write path becomes numba-bound and scales with cores (``count_rows`` by key range).
lz4 over zstd: 2.3x faster puts and 1.9x faster gets for 8% more bytes (measured on pages).
Runs are written as SST files and ingested (``_RunWriter`` says why: the GIL).

Why runs and not read-modify-write of pages: hash order scatters a batch over every page, so
updating pages in place rewrites the whole table for any batch smaller than it (measured
equivalent: ~4.8 KB written per ingested token at 40M rows).  Runs turn that into sequential
merges whose cost is amortised by the size tiers.

Reclaiming disk space (issue 19)
--------------------------------
A merge rewrites its inputs as one run; the inputs' pages must then leave the disk, while the
daemon serves.  A range tombstone alone (the first build) frees nothing: the inputs' SST files
sit at the bottom level, which no automatic compaction visits, so one ``ngram-client ingest``
of 30 copies of a 3 MB text left 13 GB on disk for 483 MB of live runs until the offline
``ngramd compact``.  Measured here (``bench/bench_reclaim.py``, 2 vCPU VM, runs of 97 MiB):

* ``compact_range`` over exactly one dead run's key range, right after its tombstone (the
  memtable then holds only that tombstone, so the file it is flushed to spans that run alone
  and no live run's files are pulled in): 180-250 ms a run, reading that run's 97 MiB once
  (not the live run between two dead ones), 0.1-0.15 CPU-s; it releases the GIL (a thread
  sleeping 1 ms saw gaps of at most 6-9 ms);
* one column family per run, dropped whole: no I/O at all, but ``create_column_family`` and
  ``drop_column_family`` held the GIL 18-28 ms each (manifest and OPTIONS file syncs): a
  serving-thread stall at every spill and every merge (the stall target is 20 ms).

So retired runs are compacted away one at a time (``_delete_runs``): the reclaim reads each
dead byte once more (at most what its merge read), on the merger thread, paced to at most half
its time.  Disk use is then the live runs, plus runs retiring (``retire_s``, 5 s), plus, during
a merge, its output so far.

Formats
-------
Column families:

``pages``
    key = run id (u32 BE) + page id (u64 BE); value = one page (``kernels`` documents it).
``log``
    unused since the ingest log moved to files (``ngramd.ingestlog``: why, and its format);
    records an older table holds there are moved to the file log at open.  A log record is
    u32 LE ``skip`` + the raw u32 LE tokens.  A sequence longer than ``max_record_tokens`` is
    split into several records that overlap by ``n_max`` tokens; ``skip`` is the number of
    leading tokens that are context only, so no event is counted twice and no apply is
    unbounded.
``meta``
    ``identity`` (``TableIdentity.to_json()``, ``format`` 2), ``table_id`` (32 hex chars, random
    when the table is created or first opened without one: tells a table from a later one at
    the same path, e.g. a client's ingest resume state), ``applied`` (u64 LE: the last log
    seq whose tokens are in runs), ``next_run`` (u64 LE), ``run/<id>`` (u32 BE id; JSON run
    descriptor) and ``retired`` (JSON list of run ids whose pages await deletion).

A run's Bloom filter is stored after its pages in the ``pages`` family, in 16 MiB chunks
keyed run id + ``BLOOM_PAGE | chunk`` (page ids stay far below), so it is ingested with the
pages and deleted with them.

Crash safety: a run's pages and filter are written before the batch that registers it; after a
crash, pages and filters of unregistered ids are deleted at open, and the log above
``applied`` is counted again.  So an acknowledged sequence is counted exactly once whatever the
moment of the kill (tested by SIGKILL in tests/test_cold.py).

GIL (measured with a spinning Python thread)
--------------------------------------------
``Rdict.write`` holds the GIL for the whole call, fsync included (13 ms gaps with sync=True on a
1 MiB batch), and so does a write that waits for a memtable flush (240-360 ms stalls measured
when runs went through memtables); ``flush_wal(True)`` releases it.  A write blocked by a
frozen or stalled disk holds it for as long as the disk does (~40 s with ``fsfreeze``, issue
9).  So ``append_log`` writes the ingest log with ``os.write``/``os.fsync`` (which release it,
``ngramd.ingestlog``); runs go through ``SstFileWriter`` (a put holds
the GIL ~7 µs) and ``ingest_external_file``; every numba kernel of the write path is ``nogil``;
merges and scans work in slices of ``slice_rows`` so no numpy call holds the GIL for long.

Reads never take the writer's locks: a reader takes the current view (runs + delta parts) once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
from rocksdict import (
    BlockBasedOptions, Cache, Checkpoint, DBCompressionType, IngestExternalFileOptions, Options,
    ReadOptions, Rdict, SstFileWriter, WriteBatch, WriteOptions,
)

from . import kernels as K
from .config import ColdOptions  # noqa: F401 (defined with the config; re-exported)
from .wire.errors import UNAVAILABLE, BadInput, NgramError, StorageError
from .wire.identity import FORMAT_VERSION, TableIdentity
from .ingestlog import IngestLog
from .wire.validate import as_offsets, as_tokens

_SCAN_READ = ReadOptions()
_SCAN_READ.fill_cache(False)  # see ColdStore._slices
log = logging.getLogger(__name__)

CF_PAGES = "pages"
CF_LOG = "log"
CF_META = "meta"
COLUMN_FAMILIES = (CF_PAGES, CF_LOG, CF_META)

META_IDENTITY = b"identity"
META_APPLIED = b"applied"
META_TABLE_ID = b"table_id"
META_NEXT_RUN = b"next_run"
META_RETIRED = b"retired"
#: per origin host (fleet): the last seq of its log counted into runs, u64 LE; written with
#: ``applied`` in one batch, so a restart knows exactly which remote records its runs hold
META_ORIGIN = b"origin/"
#: a log record whose skip word has this bit came from another host (appended by the fleet's
#: consumer): the word is followed by the 16-byte origin id and the u64 LE seq the record had
#: in the origin's log, then the tokens.  Per record, so a torn append still tells exactly
#: which remote records made it (their redeliveries are recognised by (origin, seq)).
ORIGIN_FLAG = 1 << 31
ORIGIN_HEAD = 24
#: a table restored from a fleet snapshot: the stream sequence the snapshot covers (u64 LE)
META_FLEET_SEQ = b"fleet_stream_seq"
RUN_PREFIX = b"run/"
BLOOM_PAGE = 0xFFFFFFFF00000000  # page ids of a run's filter chunks (after its pages)
BLOOM_CHUNK_WORDS = 2 << 20  # 16 MiB of filter a value

U32_MAX = 0xFFFFFFFF
_COMPRESSION = {
    "zstd": DBCompressionType.zstd(), "lz4": DBCompressionType.lz4(),
    "none": DBCompressionType.none(),
}
#: bytes of RAM a delta row takes (key, parent, order, total, offsets, ~1.1 candidates)
DELTA_ROW_BYTES = 40


# ---------------------------------------------------------------------------------------------
# row sets
# ---------------------------------------------------------------------------------------------
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
        tok = np.full((m, k), K.EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((m, k), np.uint32)
        n = np.diff(self.poff)
        col = np.arange(self.tok.shape[0]) - np.repeat(self.poff[:-1], n)
        row = np.repeat(np.arange(m), n)
        keep = col < k
        tok[row[keep], col[keep]] = self.tok[keep]
        cnt[row[keep], col[keep]] = self.cnt[keep]
        return tok, cnt

    def per_order(self) -> np.ndarray:
        out = np.zeros(K.MAX_ORDER + 1, np.int64)
        K.order_counts(self.order, out)
        return out


def merge_rowsets(parts: list[RowSet], k: int) -> RowSet:
    """One row set holding the sum of ``parts``: concatenate, one stable argsort (a merge of
    the sorted parts: 14-28 ns a row here for 2-16 parts) and ``kernels.rows_gather``."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return RowSet.empty()
    if len(parts) == 1:
        return parts[0]
    cat = _concat(parts)
    perm = np.argsort(cat.key, kind="stable")
    return RowSet(*K.rows_gather(perm, *cat, k))


class Counter:
    """``kernels.count_rows`` with its buffers kept across calls.

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
        """The row set of a batch (see ``kernels.count_rows``); with ``copy=False`` it is a
        view of this counter's buffers, valid until its next ``count``."""
        ident = self.ident
        tokens = np.ascontiguousarray(tokens, np.uint32)
        offsets = np.ascontiguousarray(offsets, np.int64)
        skips = np.ascontiguousarray(skips, np.int64)
        lens = np.diff(offsets)
        span = np.clip(np.minimum(lens - 1, ident.n_max) - ident.n_min + 1, 0, None)
        m_all = int((lens * span).sum())  # an upper bound is enough to pick the bucket count
        bits = K.count_bits(m_all >> part_bits, part_bits)
        counts = K.count_hist(tokens, offsets, skips, ident.n_min, ident.n_max, part, part_bits,
                              bits)
        m = int(counts[-1])
        self._ensure(m)
        g, pp = K.count_fill(tokens, offsets, skips, ident.n_min, ident.n_max, ident.cold_k,
                             part, part_bits, bits, counts, self._ev, *self._out)
        o = self._out
        rows = RowSet(o[0][:g], o[1][:g], o[2][:g], o[3][:g], o[4][:g + 1], o[5][:pp], o[6][:pp])
        return RowSet(*(a.copy() for a in rows)) if copy else rows


def _origin_of(rec: bytes) -> tuple[bytes, int] | None:
    """``(origin id, seq in the origin's log)`` of a log record from another host, else None
    (a local record, or one too short to carry its head: the quarantine deals with it)."""
    if len(rec) < 4 + ORIGIN_HEAD or not int.from_bytes(rec[:4], "little") & ORIGIN_FLAG:
        return None
    return rec[4:20], int.from_bytes(rec[20:28], "little")


def _strip_origins(recs: list[bytes]) -> tuple[list[bytes], dict]:
    """Records without their origin heads (``ORIGIN_FLAG``), and per origin the last seq."""
    out, origins = [], {}
    for r in recs:
        head = _origin_of(r)
        if head is not None:
            o, q = head
            if q > origins.get(o, -1):
                origins[o] = q
            r = r[:4] + r[4 + ORIGIN_HEAD:]
        out.append(r)
    return out, origins


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _max_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, -1):
            out[k] = v
    return out


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
    return _concat(parts) if len(parts) > 1 else RowSet(*(a.copy() for a in parts[0]))


def _concat(parts: list[RowSet]) -> RowSet:
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


# ---------------------------------------------------------------------------------------------
# runs
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
    ids, rstart, bstart = K.pages_plan(rows.key, rows.poff, depth)
    words = int(bstart[-1]) // 8
    if buf is None or buf.shape[0] < words:
        buf = np.empty(words, np.uint64)
    buf = buf[:words]
    buf[:] = 0
    K.pages_fill(*rows, rstart, bstart, buf.view(np.uint8), buf.view(np.uint32), buf)
    return ids, bstart, buf.view(np.uint8)


def _page_buffer(vals: list) -> tuple[np.ndarray, np.ndarray, list[int]]:
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
    if not K.pages_check(pstart, buf.view(np.uint32), int(pstart[-1])):
        raise StorageError("cold tier: corrupt page in the pages column family (header)")
    where, j = [], 0
    for v in vals:
        if v:
            where.append(j)
            j += 1
        else:
            where.append(-1)
    return buf, pstart, where


_NO_PAGES = np.frombuffer(b"", np.uint64)


class Lookup(NamedTuple):
    """Per-key answer of the cold tier: candidates padded to ``cold_k``."""

    found: np.ndarray  # bool (m,)
    order: np.ndarray  # uint8 (m,)
    total: np.ndarray  # uint32 (m,)
    tok: np.ndarray  # uint32 (m, k)
    cnt: np.ndarray  # uint32 (m, k)


@dataclass
class ApplyResult:
    """What one ``apply()`` counted (the rows are increments, for the recent table)."""

    first_seq: int
    last_seq: int
    tokens: int  # tokens whose events were counted (overlaps excluded)
    rows: RowSet

    def __len__(self) -> int:
        return len(self.rows)


class _View(NamedTuple):
    runs: tuple  # of Run, oldest first
    delta: tuple  # of RowSet (the in-memory delta, counted but not yet in a run)
    epoch: int = 0  # increases with every change: readers register the epoch they read


@contextlib.contextmanager
def _storage(what: str):
    """Turn RocksDB/rocksdict failures into ``StorageError`` with our message (API edge)."""
    try:
        yield
    except NgramError:
        raise
    except Exception as e:  # rocksdict raises bare Exception("IO error: ...")
        raise StorageError(f"cold tier: {what} failed: {e}") from None


# ---------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------
class ColdStore:
    """The cold tier of one table: runs of pages, the in-memory delta and the ingest log.

    Thread model: any number of readers (``lookup``, ``get``, ``get_many``, ``may_exist``,
    ``scan``, ``top``, ``stats``); one writer (``apply``); one spiller (``spill``,
    ``compact_delta``) and one merger (``maybe_merge``, ``compact``) that may run beside the
    writer and each other; ``append_log`` from any thread.
    """

    def __init__(self, path, identity: TableIdentity, options: ColdOptions = ColdOptions()):
        self.path = Path(path)
        self.options = options
        self._write_lock = threading.Lock()  # apply
        self._spill_lock = threading.Lock()  # spill
        #: ``apply`` spills the delta itself once it outgrows ``delta_mb``; a daemon that spills
        #: from another thread (so counting never waits for a spill) turns this off
        self.auto_spill = True
        self._merge_lock = threading.Lock()  # maybe_merge / compact
        #: set while the owner closes: a run being written (a long merge) stops at its next
        #: slice, so closing never waits for it
        self.interrupted = False
        self._log_lock = threading.Lock()
        self._view_lock = threading.Lock()  # swaps of the view (writer vs merger)
        self._closed = True
        self._cache = Cache(options.block_cache_mb << 20)
        self._db = None
        with _storage(f"opening {self.path}"):
            self.path.mkdir(parents=True, exist_ok=True)
            self._check_format()
        try:
            with _storage(f"opening {self.path}"):
                self._closed = False  # from here on, a failure closes what was opened
                self._open_db()
                self._wo = WriteOptions()  # never sync inside write(): it holds the GIL
                # runs are written as SST files and ingested (see _RunWriter)
                self._sst_options = self._cf_options(CF_PAGES)
                self._ingest_opts = IngestExternalFileOptions()
                self._ingest_opts.set_move_files(True)
                self._ingest_dir = self.path / "ingest"
                if self._ingest_dir.exists():  # files of runs a crash left unfinished
                    for f in self._ingest_dir.iterdir():
                        f.unlink()
                self._ingest_dir.mkdir(exist_ok=True)
            self._load_meta(identity)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=options.read_threads,
                                        thread_name_prefix="cold-read")
        self._counters: list[Counter] = []  # the writer's count buffers, kept across applies
        self.quarantined = 0  # log records that could not be counted (see _quarantine)
        log.info("cold tier open at %s: orders %d..%d, cold_k %d, %d runs (%d rows), applied "
                 "seq %d, last seq %d", self.path, self.identity.n_min, self.identity.n_max,
                 self.identity.cold_k, len(self._view.runs),
                 sum(r.rows for r in self._view.runs), self._applied, self._last)

    # ---- setup ------------------------------------------------------------------------------
    def _check_format(self) -> None:
        """A table written by the first build (one key per context) cannot be read here."""
        cur = self.path / "CURRENT"
        if not cur.exists():
            return
        try:
            cfs = Rdict.list_cf(str(self.path), Options(raw_mode=True))
        except Exception:
            return
        if "ngrams" in cfs and CF_PAGES not in cfs:
            raise StorageError(
                f"cold tier at {self.path} uses format 1 (one RocksDB key per context); this "
                f"ngramd reads format {FORMAT_VERSION} (pages).  Rebuild the table from its "
                f"corpus (`ngramd warm`) into a new data directory")

    def _db_options(self) -> Options:
        o = self._cf_options(CF_META)
        o.create_if_missing(True)
        o.create_missing_column_families(True)
        o.set_max_background_jobs(self.options.max_background_jobs)
        o.set_use_direct_reads(self.options.direct_reads)
        return o

    def _cf_options(self, name: str) -> Options:
        opt = self.options
        o = Options(raw_mode=True)
        bb = BlockBasedOptions()
        bb.set_block_cache(self._cache)
        bb.set_block_size(opt.block_size_kb << 10)
        if name == CF_PAGES:
            # page keys always exist: a RocksDB Bloom filter would cost memory and save nothing
            bb.set_cache_index_and_filter_blocks(True)
            bb.set_pin_l0_filter_and_index_blocks_in_cache(True)
            o.set_compression_type(_COMPRESSION[opt.compression])
            o.set_write_buffer_size(opt.write_buffer_mb << 20)
            o.set_level_compaction_dynamic_level_bytes(True)
        else:
            o.set_compression_type(DBCompressionType.lz4())
            o.set_write_buffer_size(min(opt.write_buffer_mb, 16) << 20)
        o.set_block_based_table_factory(bb)
        return o

    def _load_meta(self, identity: TableIdentity) -> None:
        with _storage("reading meta"):
            raw = self._meta.get(META_IDENTITY)
        if raw is None:
            with _storage("recording the identity"):
                wb = WriteBatch(raw_mode=True)
                wb.put(META_IDENTITY, identity.to_json(), self._h_meta)
                wb.put(META_APPLIED, (0).to_bytes(8, "little"), self._h_meta)
                wb.put(META_NEXT_RUN, (1).to_bytes(8, "little"), self._h_meta)
                self._db.write(wb, self._wo)
                self._db.flush_wal(True)
            self.identity = identity
            log.info("cold tier created at %s", self.path)
        else:
            try:
                stored = TableIdentity.from_json(raw)
            except Exception as e:
                raise StorageError(f"cold tier: unreadable identity in {self.path}: {e}") from None
            self.identity = stored.upgrade(identity)  # raises IdentityMismatch
            if self.identity is not stored:  # an old tokenizer fingerprint, rewritten
                with _storage("upgrading the identity"):
                    wb = WriteBatch(raw_mode=True)
                    wb.put(META_IDENTITY, self.identity.to_json(), self._h_meta)
                    self._db.write(wb, self._wo)
                    self._db.flush_wal(True)
                log.info("cold tier %s: tokenizer fingerprint upgraded to version %d",
                         self.path, self.identity.fingerprint_version)
        with _storage("reading meta"):
            table_id = self._meta.get(META_TABLE_ID)
        if table_id is None:  # a new table, or one created before table ids
            table_id = uuid.uuid4().hex.encode()
            with _storage("recording the table id"):
                wb = WriteBatch(raw_mode=True)
                wb.put(META_TABLE_ID, table_id, self._h_meta)
                self._db.write(wb, self._wo)
                self._db.flush_wal(True)
        self.table_id = table_id.decode()
        with _storage("reading meta"):
            applied = self._meta.get(META_APPLIED)
            next_run = self._meta.get(META_NEXT_RUN)
            retired = json.loads(self._meta.get(META_RETIRED) or b"[]")
            runs = []
            ro = ReadOptions()
            ro.set_iterate_upper_bound(RUN_PREFIX[:-1] + b"0")  # "run/" .. "run0"
            for k, v in self._meta.items(from_key=RUN_PREFIX, read_opt=ro):
                runs.append(Run.from_descriptor(v))
            ro = ReadOptions()
            ro.set_iterate_upper_bound(META_ORIGIN[:-1] + b"0")
            self._origins = {k[len(META_ORIGIN):]: int.from_bytes(v, "little")
                             for k, v in self._meta.items(from_key=META_ORIGIN, read_opt=ro)}
            self._origins_applied = self._origins  # what the runs hold (spill updates it)
            seq = self._meta.get(META_FLEET_SEQ)
            self.fleet_stream_seq = None if seq is None else int.from_bytes(seq, "little")
        if applied is None or next_run is None:
            raise StorageError(f"cold tier: meta column family of {self.path} is incomplete")
        self._applied = int.from_bytes(applied, "little")
        self._counted = self._applied  # the delta is empty: the log above is counted again
        self._next_run = int.from_bytes(next_run, "little")
        self._ilog = IngestLog(self.path / "ingest-log", self._applied,
                               sync=self.options.sync_log)
        self._migrate_cf_log()
        # the log may be empty after every record was applied: never reuse a seq <= applied
        self._last = max(self._applied, self._ilog.last_seq())
        runs.sort(key=lambda r: r.id)
        live = {r.id for r in runs}
        self._collect_garbage(live, retired)
        for r in runs:
            if r.nprobe:
                r.bloom = self._read_filter(r)
        self._next_run = max([self._next_run] + [r.id + 1 for r in runs])
        self._epoch = 0
        self._readers: dict[int, int] = {}  # view epoch -> readers using it
        self._read_lock = threading.Lock()
        self._view = _View(tuple(runs), (), 0)
        self._retiring: list[tuple[float, list[int]]] = []

    def _migrate_cf_log(self) -> None:
        """Tables written before the file log kept the ingest log in the ``log`` column family:
        move its records above ``applied`` into the file log (same seqs), then drop them."""
        with _storage("migrating the ingest log"):
            recs = [(int.from_bytes(k, "big"), v) for k, v in self._log.items()]
        if not recs:
            return
        pending = [(q, v) for q, v in recs if q > self._applied]
        if pending:
            if self._ilog.last_seq() != self._applied or pending[0][0] != self._applied + 1:
                raise StorageError(f"cold tier: cannot migrate the ingest log of {self.path}: "
                                   "both logs hold records")
            first, last = self._ilog.append([v for _, v in pending])
            if (first, last) != (pending[0][0], pending[-1][0]):
                raise StorageError("cold tier: the old ingest log has gaps; not migrated")
        with _storage("migrating the ingest log"):
            self._log.delete_range((0).to_bytes(8, "big"), (recs[-1][0] + 1).to_bytes(8, "big"))
            self._db.flush_wal(True)
        log.info("moved %d ingest log records to the file log %s", len(pending),
                 self._ilog.path)

    def _read_filter(self, r: Run) -> np.ndarray:
        n_chunks = -(-r.bloom_words // BLOOM_CHUNK_WORDS)
        keys = [page_key(r.id, BLOOM_PAGE | c) for c in range(n_chunks)]
        with _storage("reading a run filter"):
            vals = self._pg.get(keys)
        if any(v is None for v in vals) or sum(len(v) for v in vals) != 8 * r.bloom_words:
            raise StorageError(f"cold tier: filter of run {r.id} is missing or torn")
        return np.frombuffer(b"".join(vals), np.uint64).copy()

    def _collect_garbage(self, live: set, retired: list) -> None:
        """Delete pages and filters of runs that are not registered (a crash while writing
        them) or retired (merged away before a restart)."""
        dead = set(int(x) for x in retired)
        with _storage("collecting unregistered runs"):
            it = self._pg.iter()
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
        self._delete_runs(sorted(dead))
        log.info("cold tier: removed %d unregistered or retired runs", len(dead))

    def _delete_runs(self, ids: list[int], pace: bool = False) -> None:
        """Delete the pages and filters of runs ``ids`` and give their disk space back now (see
        "Reclaiming disk space" in the module doc): per run, a range tombstone and a
        compaction of exactly its key range, one run at a time.  ``pace``: after each run,
        wait as long as its compaction took (the merger's reclaims use at most half a
        core's time and of the disk's)."""
        with _storage("deleting retired runs"):
            for i, rid in enumerate(ids):
                wb = WriteBatch(raw_mode=True)
                wb.delete_range(run_key(rid), run_key(rid + 1), self._h_pg)
                self._db.write(wb, self._wo)
                t0 = time.monotonic()
                # the memtable holds only this tombstone: the file it is flushed to spans this
                # run alone, so the compaction reads this run's files and no live one's
                self._pg.compact_range(run_key(rid), run_key(rid + 1))
                if pace and i + 1 < len(ids):
                    time.sleep(time.monotonic() - t0)
            wb = WriteBatch(raw_mode=True)
            still = [r for _, ids2, _ in getattr(self, "_retiring", []) for r in ids2
                     if r not in ids]
            wb.put(META_RETIRED, json.dumps(still).encode(), self._h_meta)
            self._db.write(wb, self._wo)
        self._sizes = None  # the next stats call measures the directory again

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "ColdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the database (idempotent).  Waits for a running write or merge.  The delta in
        RAM is not written: its records are still in the log and are counted again on open
        (call ``spill`` first to make a restart cheaper)."""
        if self._closed:
            return
        with self._write_lock, self._spill_lock, self._merge_lock, self._log_lock:
            if self._closed:
                return
            self._closed = True
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
            ilog = getattr(self, "_ilog", None)
            if ilog is not None:
                ilog.close()
            with _storage("closing"):
                self._close_db()
            log.info("cold tier closed at %s", self.path)

    def _open_db(self) -> None:
        """Open RocksDB and the column-family handles (at open and at ``reopen``)."""
        # the reopen trap: table options of an existing column family are ignored unless
        # that family is opened with them, so always pass all three
        self._db = Rdict(str(self.path), self._db_options(),
                         column_families={name: self._cf_options(name)
                                          for name in COLUMN_FAMILIES})
        self._pg = self._db.get_column_family(CF_PAGES)
        # scans read through their own handle: rocksdict's get([keys]) ignores a read_opt
        # argument but honours options preset on the handle (measured)
        self._pg_scan = self._db.get_column_family(CF_PAGES)
        self._pg_scan.set_read_options(_SCAN_READ)
        self._log = self._db.get_column_family(CF_LOG)
        self._meta = self._db.get_column_family(CF_META)
        self._h_pg = self._db.get_column_family_handle(CF_PAGES)
        self._h_log = self._db.get_column_family_handle(CF_LOG)
        self._h_meta = self._db.get_column_family_handle(CF_META)

    def _close_db(self) -> None:
        """Close the handles and RocksDB (``_db`` None: not open, or a reopen that failed)."""
        for name in ("_pg", "_pg_scan", "_log", "_meta"):
            cf = getattr(self, name, None)
            if cf is not None:
                cf.close()
                setattr(self, name, None)
        self._h_pg = self._h_log = self._h_meta = None
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"cold tier at {self.path} is closed")
        if self._db is None:
            raise StorageError(f"cold tier at {self.path} is being reopened after a "
                               "storage error")

    def _set_view(self, runs: tuple, delta: tuple) -> None:
        """Publish a new view (caller holds ``_view_lock``)."""
        self._epoch += 1
        self._view = _View(runs, delta, self._epoch)

    @contextlib.contextmanager
    def _reading(self):
        """The current view, registered while the caller reads its pages: pages of runs merged
        away are deleted only once no reader of an older view is left."""
        with self._read_lock:
            v = self._view
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

    def flush(self) -> None:
        """Count the whole log, write the delta as a run and flush RocksDB's memtables: after
        this, everything acknowledged is in runs (tests, shutdown)."""
        self._check_open()
        while self.apply(1 << 22) is not None:
            pass
        self.spill()
        with _storage("flush"):
            self._db.flush_wal(True)
            for cf in (self._pg, self._log, self._meta):
                cf.flush(True)

    def compact(self) -> None:
        """Count the whole log, write the delta as a run, merge every run into one (exact entry
        counts, fewest reads) and let RocksDB compact the pages and log families."""
        self._check_open()
        while self.apply(1 << 22) is not None:
            pass
        self.spill()
        with self._merge_lock:
            runs = self._view.runs
            if len(runs) > 1:
                self._merge(list(runs))
            self._collect_retired(force=True)
        with _storage("compaction"):
            self._pg.compact_range(None, None)
            self._log.compact_range(None, None)

    # ---- the ingest log ---------------------------------------------------------------------
    def split_counts(self, lengths: np.ndarray) -> np.ndarray:
        """Records each sequence of these lengths becomes (1 unless it is longer than
        ``max_record_tokens``)."""
        R, ov = self.options.max_record_tokens, self.identity.n_max
        lengths = np.asarray(lengths, np.int64)
        extra = np.maximum(lengths - R, 0)
        return 1 + (extra + (R - ov) - 1) // (R - ov)

    def _records(self, tokens: np.ndarray, offsets: np.ndarray) -> list[bytes]:
        R, ov = self.options.max_record_tokens, self.identity.n_max
        out = []
        raw = tokens.astype("<u4", copy=False)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            if b - a <= R:
                out.append(b"\0\0\0\0" + raw[a:b].tobytes())
                continue
            out.append(b"\0\0\0\0" + raw[a:a + R].tobytes())
            st = a + R
            while st < b:
                lo = max(a, st - ov)
                hi = min(b, st + R - ov)
                out.append((st - lo).to_bytes(4, "little") + raw[lo:hi].tobytes())
                st = hi
        return out

    def append_log(self, tokens: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
        """Append sequences ``tokens[offsets[i]:offsets[i+1]]`` to the ingest log in one write
        (``IngestLog.append``: one ``os.write`` to the current segment file, then one fsync if
        ``sync_log``); returns ``(first_seq, last_seq)`` of the records written once durable.
        A sequence becomes ``split_counts`` records.  Sequences must be non-empty."""
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = as_offsets(offsets, tokens.size, min_len=1)
        recs = self._records(tokens, offsets)
        with self._log_lock:
            self._check_open()
            first, self._last = self._ilog.append(recs)  # the GIL is free while the disk works
            return first, self._last

    def append_remote(self, records: list[tuple[bytes, int, bytes]]) -> tuple[int, int]:
        """Append other hosts' log records ``(origin id (16 bytes), seq in the origin's log,
        record)`` in one durable write, each marked with its origin (see ``ORIGIN_FLAG``);
        returns ``(first_seq, last_seq)`` in this log."""
        self._check_open()
        out = []
        for origin, oseq, rec in records:
            if len(origin) != 16 or len(rec) < 4 or len(rec) % 4 or \
                    int.from_bytes(rec[:4], "little") & ORIGIN_FLAG:
                raise BadInput("remote log record: expected a 16-byte origin and a local "
                               "record (skip word + whole tokens)")
            word = int.from_bytes(rec[:4], "little") | ORIGIN_FLAG
            out.append(word.to_bytes(4, "little") + origin + int(oseq).to_bytes(8, "little")
                       + rec[4:])
        with self._log_lock:
            self._check_open()
            first, self._last = self._ilog.append(out)
            return first, self._last

    def local_records(self, after: int, max_bytes: int = 512 << 10) -> tuple[int, list]:
        """This host's own log records above ``after`` that are still kept (the fleet's
        publisher reads them; records from other hosts are passed over): returns the last seq
        looked at and ``[(seq, record), ...]``."""
        seqs, recs = self._ilog.records(after, max_bytes)
        mine = [(q, r) for q, r in zip(seqs, recs)
                if not int.from_bytes(r[:4], "little") & ORIGIN_FLAG]
        return (seqs[-1] if seqs else after), mine

    def origin_watermarks(self) -> dict[bytes, int]:
        """Per origin host, the last seq of its log that this table holds (counted, or waiting
        in the log): the fleet's consumer skips redeliveries at or below it."""
        with self._view_lock:
            out, after = dict(self._origins), self._counted
        while True:
            seqs, recs = self._ilog.records(after, 8 << 20)
            if not seqs:
                return out
            for head in filter(None, map(_origin_of, recs)):
                o, q = head
                out[o] = max(out.get(o, 0), q)
            after = seqs[-1]

    def checkpoint(self, dest) -> dict:
        """A consistent copy of the table's runs at ``dest`` (a RocksDB Checkpoint: hard links
        to the SST files, so it costs no time or space beyond the memtables it flushes; the
        ingest log is not part of it).  Returns what the copy holds: ``applied`` (this log's
        seq) and ``origins`` (per other host, the last seq of its log).  No spill or merge
        runs meanwhile, so the copy's meta and runs agree."""
        with self._spill_lock, self._merge_lock:
            self._check_open()
            with _storage("writing a checkpoint"):
                Checkpoint(self._db).create_checkpoint(str(dest))
            return {"applied": self._applied, "origins": dict(self._origins_applied)}

    def record_fleet(self, origins: dict[bytes, int], stream_seq: int | None, *,
                     new_table_id: bool = False) -> None:
        """Record in meta (one durable batch) what a fleet snapshot says this table holds: per
        origin host the last seq counted, and the stream sequence the snapshot covers; a
        restored copy also takes a new ``table_id`` (it is a new table)."""
        wb = WriteBatch(raw_mode=True)
        merged = _max_merge(self._origins_applied, origins)
        for origin, oseq in merged.items():
            wb.put(META_ORIGIN + origin, int(oseq).to_bytes(8, "little"), self._h_meta)
        if stream_seq is not None:
            wb.put(META_FLEET_SEQ, int(stream_seq).to_bytes(8, "little"), self._h_meta)
        if new_table_id:
            self.table_id = uuid.uuid4().hex
            wb.put(META_TABLE_ID, self.table_id.encode(), self._h_meta)
        with self._spill_lock, _storage("recording fleet state"):
            self._db.write(wb, self._wo)
            self._db.flush_wal(True)
            with self._view_lock:
                self._origins = _max_merge(self._origins, origins)
            self._origins_applied = merged
            if stream_seq is not None:
                self.fleet_stream_seq = int(stream_seq)

    def checksum(self, stop: threading.Event | None = None) -> dict:
        """Digests of the table's content, independent of how it was written (runs, delta,
        merge history), for comparing the tables of a fleet:

        * ``totals``: every context's key, order and total (exact on every host that counted
          the same records);
        * ``digest``: that and each context's candidates (token, count).  Candidates are a
          top-``cold_k`` summary: a context with more distinct next tokens than ``cold_k``
          keeps the best, and which ones survive can depend on how counts were merged, so two
          hosts with the same records agree here when no context overflowed
          (``capped_rows`` = 0), and usually otherwise.

        Each row hashes to 64 bits (splitmix64 of its fields); a digest is their sum mod 2^64."""
        rows = capped = 0
        tot_sum = all_sum = np.uint64(0)
        with np.errstate(over="ignore"):
            for rs in self.scan_rows(stop):
                n = len(rs)
                if not n:
                    continue
                rows += n
                deg = np.diff(rs.poff)
                capped += int((deg >= self.identity.cold_k).sum())
                h_tot = _mix64(rs.key ^ _mix64(rs.order.astype(np.uint64) << np.uint64(32)
                                               | rs.total.astype(np.uint64)))
                cand = _mix64(rs.tok.astype(np.uint64) << np.uint64(32)
                              | rs.cnt.astype(np.uint64))
                csum = np.add.reduceat(cand, rs.poff[:-1]) if cand.size else \
                    np.zeros(n, np.uint64)
                csum[deg == 0] = 0  # reduceat repeats an element for empty ranges
                tot_sum += h_tot.sum(dtype=np.uint64)
                all_sum += _mix64(h_tot ^ _mix64(csum)).sum(dtype=np.uint64)
        return {"rows": rows, "capped_rows": capped, "totals": f"{int(tot_sum):016x}",
                "digest": f"{int(all_sum):016x}"}

    def hold_log(self, seq: int | None) -> None:
        """Keep log records above ``seq`` (the fleet's published watermark); None: no hold."""
        self._ilog.set_hold(seq)

    @property
    def log_hold(self) -> int | None:
        return self._ilog.hold

    def applied_seq(self) -> int:
        """Last log sequence number whose tokens are in runs (durable)."""
        return self._applied

    def counted_seq(self) -> int:
        """Last log sequence number whose tokens are counted (in runs or the delta: visible to
        reads)."""
        return self._counted

    def last_seq(self) -> int:
        """Last log sequence number handed out (lag = last_seq() - counted_seq())."""
        return self._last

    # ---- the writer -------------------------------------------------------------------------
    def apply(self, max_tokens: int = 1 << 20, threads: int = 1,
              pool: ThreadPoolExecutor | None = None) -> ApplyResult | None:
        """Count log records above the counted watermark (whole records, at least one, until
        about ``max_tokens`` tokens) into the delta; returns what was counted, or None if
        nothing was pending.  With ``auto_spill`` it also spills the delta to a run when it
        outgrows ``delta_mb`` (the daemon turns that off and spills on its own thread).
        ``threads`` (a power of two, with ``pool``) count parts of the key space in parallel."""
        if max_tokens < 1:
            raise BadInput(f"max_tokens must be >= 1, got {max_tokens}")
        with self._write_lock:
            self._check_open()
            seqs, recs = self._read_log(max_tokens)
            if not seqs:
                return None
            recs = [self._quarantine(q, r) for q, r in zip(seqs, recs)]
            words = np.frombuffer(b"".join(r[:4] for r in recs), "<u4")
            origins = None
            if np.any(words & ORIGIN_FLAG):
                recs, origins = _strip_origins(recs)
            skips = (words & ~np.uint32(ORIGIN_FLAG)).astype(np.int64)
            lens = np.fromiter((len(r) // 4 - 1 for r in recs), np.int64, count=len(recs))
            tokens = np.frombuffer(b"".join(r[4:] for r in recs), "<u4").astype(np.uint32)
            offsets = np.zeros(len(recs) + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
            while len(self._counters) < threads:
                self._counters.append(Counter(self.identity))
            rows = count_batch(tokens, offsets, skips, self._counters[:threads], pool)
            with self._view_lock:
                v = self._view
                self._set_view(v.runs, _add_part(v.delta, rows))
                self._counted = seqs[-1]
                if origins:  # a new dict: spill reads the one of its moment without a copy
                    self._origins = _max_merge(self._origins, origins)
            res = ApplyResult(seqs[0], seqs[-1], int((lens - skips).sum()), rows)
        if self.auto_spill and self.delta_bytes() >= self.options.delta_mb << 20:
            self.spill()
        return res

    def _quarantine(self, seq: int, rec: bytes) -> bytes:
        """``rec`` if it can be counted; otherwise it is copied to ``quarantine/<seq>.rec`` with
        the reason beside it, reported, and counted as an empty record: one bad record must
        not stop the writer, nor send a restarted daemon into the same failure again."""
        why = None
        word = int.from_bytes(rec[:4], "little") if len(rec) >= 4 else 0
        head = 4 + (ORIGIN_HEAD if word & ORIGIN_FLAG else 0)
        if len(rec) < head or len(rec) % 4:
            why = f"{len(rec)} bytes, not a skip word, its origin and whole tokens"
        else:
            skip, n = word & ~ORIGIN_FLAG, (len(rec) - head) // 4
            if skip > n:
                why = f"skip {skip} beyond its {n} tokens"
            elif n and int(np.frombuffer(rec, "<u4", offset=head).max()) >= \
                    self.identity.vocab_size:
                why = f"a token id >= vocab_size {self.identity.vocab_size}"
        if why is None:
            return rec
        qdir = self.path / "quarantine"
        try:
            qdir.mkdir(exist_ok=True)
            (qdir / f"{seq:020d}.rec").write_bytes(rec)
            (qdir / f"{seq:020d}.why").write_text(why + "\n")
        except OSError as e:
            log.error("could not keep quarantined log record %d: %s", seq, e)
        self.quarantined += 1
        log.error("ingest log record %d cannot be counted (%s): quarantined in %s, skipped",
                  seq, why, qdir)
        return b"\0\0\0\0"

    def probe_disk(self) -> None:
        """Write one byte in the data directory (``os.pwrite``: the GIL is free meanwhile).
        Spills and merges call it first: on a frozen filesystem it waits here, where waiting
        costs the serving thread nothing, instead of inside an ``SstFileWriter`` or
        ``Rdict.write`` call that would hold the GIL for the length of the freeze."""
        try:
            fd = os.open(self.path / ".probe", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.pwrite(fd, b"p", 0)
            finally:
                os.close(fd)
        except OSError as e:  # read-only (EROFS, EPERM), full, or failing (EIO)
            raise StorageError(f"cold tier: the data directory is not writable: "
                               f"{e.strerror or e}") from None

    def _probe_space(self, nbytes: int = 1 << 20) -> None:
        """Raise ``StorageError`` unless ``nbytes`` can be written and synced in the data
        directory now (then they are given back)."""
        f = self.path / ".probe-space"
        try:
            fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, bytes(nbytes))
                os.fsync(fd)
            finally:
                os.close(fd)
                f.unlink()
        except OSError as e:
            raise StorageError(f"cold tier: the disk is not writable yet: "
                               f"{e.strerror or e}") from None

    def reopen(self) -> None:
        """Make RocksDB writable again after a failed write, keeping the runs, the delta and
        the log as they are.  RocksDB turns read-only after a failed write (disk full, I/O
        error) until it is reopened (rocksdict has no ``resume``).  The daemon calls this
        before retrying a failed spill or merge, so storage errors end when their cause does:

        * a small write to ``meta`` that works means there is nothing to do;
        * otherwise, only once 1 MiB can be written to the disk again, close and open
          (closing while the disk is still full could leave nothing open: the next call
          would then only try the open again).

        Readers that hold the old handles meanwhile get ``StorageError`` (drafts fall back
        to the in-memory tiers)."""
        with self._write_lock, self._spill_lock, self._merge_lock:
            if self._closed:
                raise StorageError(f"cold tier at {self.path} is closed")
            if self._db is not None:
                try:
                    wb = WriteBatch(raw_mode=True)
                    wb.put(b"probe", b"1", self._h_meta)
                    self._db.write(wb, self._wo)
                    return
                except Exception:
                    pass
                self._probe_space()
                with contextlib.suppress(Exception):
                    self._close_db()  # leaves _db None even if closing fails
            self._probe_space()
            with _storage("reopening RocksDB"):
                self._open_db()
            log.info("cold tier reopened at %s", self.path)

    def _read_log(self, max_tokens: int) -> tuple[list[int], list[bytes]]:
        seqs, recs = self._ilog.read(self._counted, max_tokens)
        if any(len(r) < 4 or len(r) % 4 for r in recs):
            raise StorageError("cold tier: corrupt record in the ingest log")
        return seqs, recs

    def delta_rows(self) -> int:
        return sum(len(p) for p in self._view.delta)

    def delta_bytes(self) -> int:
        return sum(p.nbytes for p in self._view.delta)

    def spill(self) -> Run | None:
        """Write the delta as a run (if it holds rows) and advance the applied watermark over
        what it counted (one synced batch registers both), then delete the ingest log's
        segments that batch covers (``IngestLog.release``).  Runs beside ``apply`` (the
        writer keeps counting into new delta parts meanwhile); returns the run or None."""
        with self._spill_lock:
            self._check_open()
            with self._view_lock:  # the delta's parts and the seq they count up to, together
                parts, counted, origins = self._view.delta, self._counted, self._origins
            if not parts and counted == self._applied:
                return None
            self.probe_disk()
            meta = None
            if parts:
                n = sum(len(p) for p in parts)
                run = self._new_run_id()
                try:  # merged slice by slice: bounded memory, no long GIL-holding call
                    meta = self._write_run(run, self._slices((), parts, n), n)
                except BaseException:
                    self._delete_runs([run])
                    raise
            wb = WriteBatch(raw_mode=True)
            if meta is not None:
                wb.put(RUN_PREFIX + run_key(meta.id), meta.descriptor(), self._h_meta)
                wb.put(META_NEXT_RUN, self._next_run.to_bytes(8, "little"), self._h_meta)
            wb.put(META_APPLIED, counted.to_bytes(8, "little"), self._h_meta)
            for origin, oseq in origins.items():
                wb.put(META_ORIGIN + origin, oseq.to_bytes(8, "little"), self._h_meta)
            with _storage("registering a run"):
                self._db.write(wb, self._wo)
                self._db.flush_wal(True)  # durable before the log records it covers go
            self._ilog.release(counted)
            self._origins_applied = origins
            with self._view_lock:
                v = self._view
                rest = tuple(p for p in v.delta if not any(p is q for q in parts))
                self._set_view(v.runs + ((meta,) if meta else ()), rest)
                self._applied = counted
            if meta is not None:
                log.info("spilled %d delta rows as run %d (%d pages, %.1f MiB), applied seq %d",
                         meta.rows, meta.id, meta.pages, meta.bytes / 2**20, counted)
            return meta

    def compact_delta(self, max_parts: int, max_bytes: int) -> int:
        """Merge the delta's newest parts in RAM once it has more than ``max_parts``: the
        newest parts while the next older one is at most their sum (size tiers, as runs are
        merged: a row is merged O(log) times), as long as they hold at most ``max_bytes`` (the
        merged copy is extra RAM until it replaces them: past that, the caller spills).  A
        part is what one ``apply`` counted, so a steady stream of small ingests adds one a
        writer step; merged here, reads search a few parts and the writer never waits for a
        spill to bound them (issue 21: counting stopped at 257 parts until ingest paused for
        ``spill_idle_s``).  Sliced like a spill (no long GIL-holding call); returns the parts
        merged (0: none)."""
        with self._spill_lock:  # a spill replaces the same parts: one at a time
            self._check_open()
            parts = self._view.delta
            if len(parts) <= max_parts:
                return 0
            j, acc, nbytes = len(parts) - 1, len(parts[-1]), parts[-1].nbytes
            while j > 0 and len(parts[j - 1]) <= acc and nbytes + parts[j - 1].nbytes <= max_bytes:
                j -= 1
                acc += len(parts[j])
                nbytes += parts[j].nbytes
            j = min(j, len(parts) - 2)  # sizes that double all the way: the newest two
            pick = parts[j:]
            if sum(p.nbytes for p in pick) > max_bytes:
                return 0
            merged = _concat(list(self._slices((), pick, sum(len(p) for p in pick))))
            with self._view_lock:  # apply only appends meanwhile: parts is a prefix
                v = self._view
                self._set_view(v.runs, parts[:j] + (merged,) + v.delta[len(parts):])
            return len(pick)

    def _new_run_id(self) -> int:
        with self._view_lock:
            rid = self._next_run
            self._next_run += 1
            return rid

    def _filter_bits(self, rows: int) -> float:
        """Bits per key of a new run's filter: the configured value, less when the filters of
        the whole table would pass ``filter_budget_mb``."""
        bits = self.options.filter_bits_per_key
        if bits <= 0:
            return 0.0
        total = rows + sum(r.rows for r in self._view.runs)
        budget = (self.options.filter_budget_mb << 20) * 8
        return max(0.0, min(bits, budget / max(total, 1)))

    def _write_run(self, run_id: int, slices, rows_hint: int, between=None) -> Run:
        """Write row sets (an iterable of row sets in increasing, disjoint key ranges) as run
        ``run_id``.  Not registered yet.  ``between()`` is called after each slice (a merge
        deletes the runs retired before it meanwhile: a long merge must not keep them)."""
        w = _RunWriter(self, run_id, rows_hint)
        try:
            for rows in slices:
                if between is not None:
                    between()
                self._check_open()
                if self.interrupted:
                    raise NgramError(f"cold tier at {self.path}: run {run_id} interrupted "
                                     "(closing)", UNAVAILABLE)
                w.add(w.encode(rows))
            return w.finish()
        except BaseException:
            w.abort()
            raise

    # ---- bulk load (offline warm-up) --------------------------------------------------------
    def bulk_load(self, tokens: np.ndarray, offsets: np.ndarray, *, threads: int = 2,
                  mem_mb: int = 2048, progress=None) -> Run | None:
        """Count a whole corpus straight into ONE new run, bypassing the log: the warm-up path
        of ``ngramd warm`` (a stopped table; RocksDB's lock keeps a daemon out).

        All or nothing: the run is registered by one batch at the end, so a kill leaves the
        table as it was (its pages are collected at the next open) and a success means every
        token is counted exactly once.

        Method (memory bounded by ``mem_mb``, both cores, every row written once, no merges):
        the key space is cut into P = 2^b partitions; a worker thread counts the WHOLE corpus
        restricted to one partition in one ``count_rows`` call, which yields that partition's
        final rows directly (the hashing is repeated per partition, ~0.12 µs a token a pass;
        the sorting is not); the calling thread writes the partitions' pages in key order.
        P is the smallest that keeps ``threads`` partitions' events (24 B) and rows (~37 B) in
        ``mem_mb``.  ``progress(done_partitions, partitions)`` is called as they finish.
        """
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = as_offsets(offsets, tokens.size, min_len=1)
        n_tok = int(tokens.size)
        threads = max(1, int(threads))
        ident = self.identity
        skips = np.zeros(offsets.size - 1, np.int64)
        events = int(sum(K._count_span(int(b - a), 0, ident.n_min, ident.n_max)
                         for a, b in zip(offsets[:-1], offsets[1:])))
        budget = max(int(mem_mb), 64) << 20
        bits = max(0, (threads - 1).bit_length())
        # per thread: 24 B of events and ~37 B of rows per event of its partition
        while bits < 12 and threads * 64 * events / (1 << bits) > budget:
            bits += 1
        n_parts = 1 << bits

        local = threading.local()
        run = self._new_run_id()
        writer = _RunWriter(self, run, max(1, int(events * 0.7)))

        def count_part(p: int):
            """Count, encode and filter one partition in a worker thread."""
            if self._closed:
                raise StorageError("cold tier closed during a bulk load")
            c = getattr(local, "counter", None)
            if c is None:
                c = local.counter = Counter(ident)
                local.blobs, local.turn = [np.empty(0, np.uint64)] * 2, 0
            rows = c.count(tokens, offsets, skips, p, bits, copy=False)
            # two page buffers a thread, used in turn: the caller writes this partition's
            # pages while the thread may count the next one (never two more: the caller
            # submits partition p + threads only after taking partition p)
            local.turn ^= 1
            need = 2 + (len(rows) * 30 + 8 * int(rows.poff[-1])) // 8 + (1 << 16)
            if local.blobs[local.turn].shape[0] < need:
                local.blobs[local.turn] = np.empty(int(need * 1.25), np.uint64)
            return writer.encode(rows, local.blobs[local.turn])

        t0 = time.perf_counter()
        try:
            with self._write_lock, ThreadPoolExecutor(threads, "ngramd-bulk") as pool:
                futs = {p: pool.submit(count_part, p) for p in range(min(threads, n_parts))}
                for p in range(n_parts):
                    part = futs.pop(p).result()
                    if p + threads < n_parts:
                        futs[p + threads] = pool.submit(count_part, p + threads)
                    writer.add(part)
                    if progress is not None:
                        progress(p + 1, n_parts)
                meta = writer.finish()
        except BaseException:
            writer.abort()
            self._delete_runs([run])
            raise
        if not meta.rows:
            self._delete_runs([run])
            return None
        wb = WriteBatch(raw_mode=True)
        wb.put(RUN_PREFIX + run_key(run), meta.descriptor(), self._h_meta)
        wb.put(META_NEXT_RUN, self._next_run.to_bytes(8, "little"), self._h_meta)
        with _storage("registering a bulk run"):
            self._db.write(wb, self._wo)
            self._db.flush_wal(True)
        with self._view_lock:
            v = self._view
            self._set_view(v.runs + (meta,), v.delta)
        log.info("bulk load: %d tokens -> run %d: %d rows, %d pages, %.1f MiB, %d partitions, "
                 "%.1f s", n_tok, run, meta.rows, meta.pages, meta.bytes / 2**20, n_parts,
                 time.perf_counter() - t0)
        return meta

    # ---- merges ----------------------------------------------------------------------------
    def pick_merge(self, runs: tuple | None = None) -> list[Run] | None:
        """The runs the size-tier policy would merge now (newest first accumulated), or None."""
        runs = list(self._view.runs if runs is None else runs)
        if len(runs) < 2:
            return None
        acc, j = runs[-1].rows, len(runs) - 1
        while j > 0 and runs[j - 1].rows <= self.options.merge_ratio * acc:
            acc += runs[j - 1].rows
            j -= 1
        if len(runs) - j >= 2:
            return runs[j:]
        if len(runs) > self.options.max_runs:
            return runs[-(len(runs) - self.options.max_runs + 1):]
        return None

    def maybe_merge(self) -> Run | None:
        """Merge runs if the policy says so (one merge); also deletes retired runs whose grace
        period is over.  Returns the new run, or None."""
        with self._merge_lock:
            self._check_open()
            self._collect_retired()
            pick = self.pick_merge()
            if pick is None:
                return None
            return self._merge(pick)

    def _merge(self, inputs: list[Run]) -> Run:
        t0 = time.perf_counter()
        self.probe_disk()
        total = sum(r.rows for r in inputs)
        run = self._new_run_id()
        try:
            meta = self._write_run(run, self._slices(tuple(inputs), (), total), total,
                                   between=self._collect_retired)
        except BaseException:
            self._delete_runs([run])
            raise
        ids = [r.id for r in inputs]
        pending = [r for _, g, _ in self._retiring for r in g] + ids
        wb = WriteBatch(raw_mode=True)
        wb.put(RUN_PREFIX + run_key(run), meta.descriptor(), self._h_meta)
        for rid in ids:
            wb.delete(RUN_PREFIX + run_key(rid), self._h_meta)
        wb.put(META_RETIRED, json.dumps(pending).encode(), self._h_meta)
        wb.put(META_NEXT_RUN, self._next_run.to_bytes(8, "little"), self._h_meta)
        with _storage("registering a merged run"):
            self._db.write(wb, self._wo)
        with self._view_lock:
            v = self._view
            keep = [r for r in v.runs if r.id not in ids]
            # the merged run takes the place of its newest input: runs stay ordered by age
            pos = max(i for i, r in enumerate(v.runs) if r.id in ids) - (len(ids) - 1)
            keep.insert(pos, meta)
            self._set_view(tuple(keep), v.delta)
        self._retiring.append((time.monotonic(), ids, self._view.epoch))
        log.info("merged runs %s (%d rows) into run %d: %d rows, %d pages, %.1f MiB, %.2f s",
                 ids, total, run, meta.rows, meta.pages, meta.bytes / 2**20,
                 time.perf_counter() - t0)
        return meta

    def _collect_retired(self, force: bool = False) -> None:
        """Delete the pages of merged-away runs once ``retire_s`` passed and no reader still
        holds a view from before their retirement (``force``: at compaction and close)."""
        now = time.monotonic()
        with self._read_lock:
            oldest = min(self._readers, default=1 << 62)

        def due(t, epoch):
            return force or (now - t >= self.options.retire_s and oldest >= epoch)
        ready = [g for t, g, e in self._retiring if due(t, e)]
        if not ready:
            return
        self._retiring = [(t, g, e) for t, g, e in self._retiring if not due(t, e)]
        self._delete_runs([r for g in ready for r in g], pace=not force)

    # ---- slices: merged streams over runs and delta ---------------------------------------
    # Scans (spills, merges, hot builds) read every page once: through the block cache they
    # evicted what lookups reuse, and filled it to its capacity in the middle of a hot build
    # (measured: +256 MiB of the daemon's +525 MiB peak while building a 64 MiB hot tier).
    def _slices(self, runs: tuple, delta: tuple, total_rows: int,
                stop: threading.Event | None = None) -> Iterator[RowSet]:
        """The merged rows of ``runs`` + ``delta`` parts, slice by slice in key order (each a
        row set of about ``slice_rows`` rows).  Per slice: every source is decoded into one
        buffer, then one stable argsort merges the sorted sources and ``rows_gather`` adds up
        equal keys."""
        ds = max(0, math.ceil(math.log2(max(total_rows, 1) / self.options.slice_rows))) \
            if total_rows > self.options.slice_rows else 0
        ds = min(ds, 32)
        cache: dict[int, tuple] = {}  # run id -> (page id, buf, pstart) of a page wider than a slice
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
                a, b = K.rows_range(p.key, lo, hi, bounded)
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
            with _storage("reading pages"):
                vals = self._pg_scan.get(keys)
            buf, pstart, _ = _page_buffer(vals)
            return (buf, pstart) if pstart.shape[0] > 1 else None
        pid = s >> (ds - run.depth)
        got = cache.get(run.id)
        if got is None or got[0] != pid:
            with _storage("reading pages"):
                val = self._pg_scan.get(page_key(run.id, pid))
            got = cache[run.id] = (pid,) + (_page_buffer([val])[:2] if val else (None, None))
        return None if got[1] is None else got[1:]

    def _gather(self, pages: list, rows: list, lo, hi, bounded: bool) -> RowSet:
        m = P = 0
        for buf, pstart in pages:
            a, b = K.pages_dims(pstart, buf.view(np.uint32))
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
            g, pp = K.pages_decode_into(pstart, buf.view(np.uint8), buf.view(np.uint32), buf, lo,
                                        hi, bounded, *out, g, pp)
        for p, a, b in rows:
            g, pp = K.rows_copy_into(*p, a, b, *out, g, pp)
        out = _slice_rows(out, 0, g) if g < m else out
        if len(pages) + len(rows) < 2:
            return out
        perm = np.argsort(out.key, kind="stable")
        return RowSet(*K.rows_gather(perm, *out, self.identity.cold_k))

    # ---- reads ------------------------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> Lookup:
        """Counts of the contexts with these kernel keys (uint64), summed over the delta and
        every run.  Python work is per run and per page, not per key."""
        self._check_open()
        keys = np.ascontiguousarray(keys, np.uint64)
        m, k = keys.shape[0], self.identity.cold_k
        out = Lookup(np.zeros(m, bool), np.zeros(m, np.uint8), np.zeros(m, np.uint32),
                     np.full((m, k), K.EMPTY_TOKEN, np.uint32), np.zeros((m, k), np.uint32))
        if not m:
            return out
        with self._reading() as view:
            self._lookup_view(view, keys, out)
        return out

    def _lookup_view(self, view: _View, keys: np.ndarray, out: Lookup) -> None:
        m, k = keys.shape[0], self.identity.cold_k
        for p in view.delta:
            K.rows_lookup(p.key, p.order, p.total, p.poff, p.tok, p.cnt, keys, k, *out)
        may = np.empty(m, np.bool_)
        for run in view.runs:
            if run.nprobe:
                if not K.bbloom_may_batch(run.bloom, keys, run.nprobe, may):
                    continue
                idx = np.flatnonzero(may)
            else:
                idx = np.arange(m)
            sub = keys[idx]
            pages = sub >> np.uint64(64 - run.depth) if run.depth else np.zeros(idx.size, np.uint64)
            uniq, inv = _unique_inverse(pages)
            vals = self._get_pages([page_key(run.id, p) for p in uniq.tolist()])
            buf, pstart, where = _page_buffer(vals)
            qpage = np.asarray(where, np.int64)[inv]
            sub_out = [a[idx] for a in out]
            K.pages_lookup(sub, qpage, pstart, buf.view(np.uint8), buf.view(np.uint32), buf, k,
                           *sub_out)
            for a, b in zip(out, sub_out):
                a[idx] = b

    def _get_pages(self, keys: list[bytes]) -> list:
        chunk = self.options.read_chunk
        with _storage("reading pages"):
            if len(keys) <= chunk:
                return self._pg.get(keys)
            parts = self._pool.map(self._pg.get,
                                   [keys[i:i + chunk] for i in range(0, len(keys), chunk)])
            out = []
            for p in parts:
                out.extend(p)
            return out

    def may_exist(self, keys: np.ndarray) -> np.ndarray:
        """False where a key is certainly absent, decided without I/O (delta and filters)."""
        keys = np.ascontiguousarray(keys, np.uint64)
        out = np.zeros(keys.shape[0], bool)
        view = self._view
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
            K.bbloom_may_batch(run.bloom, keys, run.nprobe, may)
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
        self._check_open()
        o = self._check_order(order)
        ctx = as_tokens(ctx, self.identity.vocab_size, what="ctx")
        if ctx.size < o:
            raise BadInput(f"ctx: {ctx.size} tokens is shorter than the order {o}")
        key = np.array([K.key_hash(ctx[ctx.size - o:])], np.uint64)
        return _rows_of(self.lookup(key), 0)

    def get_many(self, orders, tokens, offsets) -> list[tuple[int, np.ndarray, np.ndarray] | None]:
        """``get(orders[i], tokens[offsets[i]:offsets[i+1]])`` for every i, in one lookup."""
        keys = self.keys_for(orders, tokens, offsets)
        res = self.lookup(keys)
        return [_rows_of(res, i) for i in range(keys.shape[0])]

    def keys_for(self, orders, tokens, offsets) -> np.ndarray:
        """Validated kernel keys of the last ``orders[i]`` tokens of each context."""
        self._check_open()
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
            keys[i] = K.key_hash(tokens[b - int(orders[i]):b])
        return keys

    def scan(self, order: int | None = None, chunk: int = 65536) -> Iterator[dict]:
        """Every entry (of one order, or all) in key order, as dicts of arrays of up to
        ``chunk`` rows: ``key``, ``parent``, ``order``, ``total``, ``tok``/``cnt``
        ``(m, cold_k)``.  Reads the view of the moment it starts; memory is bounded by
        ``slice_rows``."""
        self._check_open()
        if chunk < 1:
            raise BadInput(f"chunk must be >= 1, got {chunk}")
        o = None if order is None else self._check_order(order)
        return self._scan(o, int(chunk))

    def _scan(self, order, chunk) -> Iterator[dict]:
        k = self.identity.cold_k
        for rows in self.scan_rows():
            self._check_open()
            if order is not None:
                sel = np.flatnonzero(rows.order == order)
                if sel.size != len(rows):
                    rows = _take_rows(rows, sel)
            for a in range(0, len(rows), chunk):
                self._check_open()
                part = _slice_rows(rows, a, min(a + chunk, len(rows)))
                tok, cnt = part.padded(k)
                yield dict(key=part.key, parent=part.parent, order=part.order,
                           total=part.total, tok=tok, cnt=cnt)

    def scan_rows(self, stop: threading.Event | None = None) -> Iterator[RowSet]:
        """The whole table as merged row sets, slice by slice (the hot builder's input); reads
        the view of the moment it starts."""
        with self._reading() as view:
            total = sum(r.rows for r in view.runs) + sum(len(p) for p in view.delta)
            yield from self._slices(view.runs, view.delta, total, stop)

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
            kk = int((best["tok"][i] != K.EMPTY_TOKEN).sum())
            out.append((int(best["key"][i]), int(best["total"][i]), best["tok"][i, :kk].copy(),
                        best["cnt"][i, :kk].copy()))
        return out

    # ---- figures ----------------------------------------------------------------------------
    def _dir_sizes(self) -> tuple[int, int, int]:
        """(RocksDB's WAL bytes, SST bytes of the registered runs, all bytes) of the table's
        directory and its subdirectories (ingest log, quarantine), at most once a second: a
        stats call runs on the daemon's serving thread, and a big table has hundreds of files."""
        now, runs_now = time.monotonic(), self._view.runs
        cached = getattr(self, "_sizes", None)
        if cached is not None and now - cached[0] < 1.0 and cached[2] is runs_now:
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
            for f in self._db.live_files():  # a page key: run id (4 bytes) + page id (8)
                a, b = f["start_key"], f["end_key"]
                if len(a) == len(b) == 12 and a[:4] == b[:4] and a[:4] in live:
                    runs += int(f["size"])
        self._sizes = (now, (wal, runs, total), runs_now)
        return wal, runs, total

    def runs(self) -> list[Run]:
        return list(self._view.runs)

    def entries(self) -> dict[int, int]:
        """Rows per order summed over runs and the delta: the exact number of distinct
        contexts when the table is one run (after ``compact`` or a bulk warm-up), an upper
        bound otherwise (a context in two runs counts twice until they are merged)."""
        view = self._view
        e = np.zeros(K.MAX_ORDER + 1, np.int64)
        for r in view.runs:
            e += np.asarray(r.orders, np.int64)
        for p in view.delta:
            e += p.per_order()
        return {o: int(e[o]) for o in range(self.identity.n_min, self.identity.n_max + 1)}

    def memory(self) -> dict:
        """Bytes of RAM this store holds by design: delta, filters, block cache capacity."""
        view = self._view
        return {"delta_bytes": sum(p.nbytes for p in view.delta),
                "filter_bytes": sum(int(r.bloom.nbytes) for r in view.runs),
                "block_cache_bytes": self.options.block_cache_mb << 20}

    def stats(self) -> dict:
        """Runs, entries, bytes on disk, log positions and RAM held."""
        try:  # what RocksDB says; the rest is ours and known even while it is reopened
            self._check_open()
            with _storage("reading properties"):
                sst = int(self._pg.property_int_value("rocksdb.total-sst-files-size") or 0)
                mem = int(self._pg.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
        except StorageError:
            sst = mem = 0
        wal, run_sst, total = self._dir_sizes()
        view = self._view
        entries = self.entries()
        n = sum(entries.values())
        run_rows = sum(r.rows for r in view.runs)
        return dict(
            entries=entries, entries_total=n, runs=len(view.runs), run_rows=run_rows,
            run_bytes=sum(r.bytes for r in view.runs), delta_rows=self.delta_rows(),
            delta_parts=len(view.delta), sst_bytes=sst, run_sst_bytes=run_sst,
            # what the table needs on disk (its runs and its log) against what it holds
            live_bytes=run_sst + self._ilog.bytes_total, disk_bytes=total,
            memtable_bytes=mem, wal_bytes=wal, total_bytes=total,
            bytes_per_entry=(run_sst / run_rows if run_rows else 0.0),
            applied_seq=self._applied, counted_seq=self._counted, last_seq=self._last,
            log_lag=self._last - self._counted, memory=self.memory(),
            log_bytes=self._ilog.bytes_total, quarantined=self.quarantined,
        )


class _Encoded(NamedTuple):
    """A row set encoded as pages (see ``_RunWriter.encode``)."""

    ids: np.ndarray  # page ids
    bstart: np.ndarray  # byte offsets (len + 1)
    blob: np.ndarray  # uint8
    rows: int
    orders: np.ndarray  # rows per order


class _RunWriter:
    """Writes one run: its pages into SST files (``SstFileWriter``), ingested into the pages
    family in one step (``ingest_external_file``, files moved), then its Bloom filter.

    Why SST files and not WriteBatches: a ``write`` into a full memtable waits for RocksDB's
    flush WITH the GIL held, which stalled the daemon's serving thread 240-360 ms under ingest
    (measured by its stall monitor); an SST put is ~7 µs a 4 KiB page and holds the GIL only
    for itself, ``finish`` ~7 ms a 100 MiB file, the ingest ~1 ms.  Run ids only grow, so a
    run's keys are past every existing key: RocksDB places the files without compacting them.

    ``encode`` (numba, may run in worker threads: it adds the keys to the filter under a lock)
    and ``add`` (puts, one thread) are separate so bulk loads can encode in parallel.
    Registering the run is the caller's batch."""

    FILE_BYTES = 256 << 20  # pages per SST file

    def __init__(self, store: "ColdStore", run_id: int, rows_hint: int):
        self.store = store
        self.run_id = run_id
        self.depth = depth_for(rows_hint, store.options.page_rows)
        bits = store._filter_bits(rows_hint)
        self.nprobe = max(1, min(8, round(bits * 0.69))) if bits >= 1 else 0
        n_words = max(1, math.ceil(rows_hint * bits / 512)) * K.BB_BLOCK_WORDS if self.nprobe else 0
        self.bloom = np.zeros(n_words, np.uint64)
        self._bloom_lock = threading.Lock()
        self.orders = np.zeros(K.MAX_ORDER + 1, np.int64)
        self.rows = self.pages = self.bytes = 0
        self._prefix = run_key(run_id)
        self._files: list[Path] = []
        self._sst = None
        self._sst_bytes = 0

    def encode(self, rows: RowSet, buf: np.ndarray | None = None) -> _Encoded:
        """Pages of a row set (in ``buf`` if given and large enough)."""
        ids, bstart, blob = encode_pages(rows, self.depth, buf) if len(rows) else (
            np.zeros(0, np.uint64), np.zeros(1, np.int64), np.zeros(0, np.uint8))
        if self.nprobe and len(rows):
            with self._bloom_lock:
                K.bbloom_add(self.bloom, rows.key, self.nprobe)
        return _Encoded(ids, bstart, blob, len(rows), rows.per_order())

    def add(self, enc: _Encoded) -> None:
        self.orders += enc.orders
        self.rows += enc.rows
        self.pages += enc.ids.shape[0]
        self.bytes += int(enc.bstart[-1])
        blob, bstart = enc.blob, enc.bstart.tolist()
        prefix = self._prefix
        with _storage("writing pages"):
            for i, pid in enumerate(enc.ids.tolist()):
                if self._sst is None or self._sst_bytes >= self.FILE_BYTES:
                    self._next_file()
                self._sst[prefix + pid.to_bytes(8, "big")] = blob[bstart[i]:bstart[i + 1]].tobytes()
                self._sst_bytes += bstart[i + 1] - bstart[i]

    def _next_file(self) -> None:
        self._close_file()
        path = self.store._ingest_dir / f"run{self.run_id}-{len(self._files)}.sst"
        self._sst = SstFileWriter(self.store._sst_options)
        self._sst.open(str(path))
        self._files.append(path)
        self._sst_bytes = 0

    def _close_file(self) -> None:
        if self._sst is not None:
            self._sst.finish()
            self._sst = None

    def abort(self) -> None:
        """Remove the files of a run that will not be registered."""
        self._sst = None
        for f in self._files:
            with contextlib.suppress(OSError):
                f.unlink()

    def finish(self) -> Run:
        st = self.store
        with _storage("writing pages"):
            if self.nprobe and self.rows:  # the filter goes last, in the same files
                if self._sst is None:
                    self._next_file()
                words = self.bloom
                for c in range(0, -(-words.shape[0] // BLOOM_CHUNK_WORDS)):
                    part = words[c * BLOOM_CHUNK_WORDS:(c + 1) * BLOOM_CHUNK_WORDS]
                    self._sst[self._prefix + (BLOOM_PAGE | c).to_bytes(8, "big")] = \
                        part.tobytes()
            self._close_file()
            if self._files:
                # durable once ingested (RocksDB syncs the files and its manifest); the files
                # are moved in, not copied
                st._pg.ingest_external_file([str(f) for f in self._files], st._ingest_opts)
        return Run(id=self.run_id, depth=self.depth, rows=self.rows, pages=self.pages,
                   bytes=self.bytes, orders=self.orders.tolist(),
                   nprobe=self.nprobe if self.rows else 0, created=time.time(),
                   bloom_words=int(self.bloom.shape[0]) if self.rows else 0,
                   bloom=self.bloom if self.rows else np.zeros(0, np.uint64))


def _add_part(delta: tuple, rows: RowSet) -> tuple:
    """Append a counted row set to the delta.  Parts are merged on the spilling thread
    (``compact_delta``, or when the delta is written as a run): the writer never pays for a
    merge, and a read searches each part (a binary search in numba, ~0.2 µs a part)."""
    return delta + (rows,) if len(rows) else delta


def _unique_inverse(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(a, return_inverse=True)`` by sorting (np.unique holds the GIL: seconds for
    millions of values; a sort releases it)."""
    perm = np.argsort(a, kind="stable")
    s = a[perm]
    new = np.r_[True, s[1:] != s[:-1]] if s.size else np.zeros(0, bool)
    inv = np.empty(a.size, np.int64)
    inv[perm] = np.cumsum(new) - 1
    return s[new], inv


def _slice_rows(rows: RowSet, a: int, b: int) -> RowSet:
    q0, q1 = int(rows.poff[a]), int(rows.poff[b])
    return RowSet(rows.key[a:b], rows.parent[a:b], rows.order[a:b], rows.total[a:b],
                  rows.poff[a:b + 1] - q0, rows.tok[q0:q1], rows.cnt[q0:q1])


def _take_rows(rows: RowSet, idx: np.ndarray) -> RowSet:
    n = np.diff(rows.poff)[idx]
    poff = np.zeros(idx.size + 1, np.int64)
    np.cumsum(n, out=poff[1:])
    pair = (np.repeat(rows.poff[:-1][idx], n) + np.arange(int(poff[-1]))
            - np.repeat(poff[:-1], n)) if idx.size else np.zeros(0, np.int64)
    return RowSet(rows.key[idx], rows.parent[idx], rows.order[idx], rows.total[idx], poff,
                  rows.tok[pair], rows.cnt[pair])


def _rows_of(res: Lookup, i: int):
    if not res.found[i]:
        return None
    kk = int((res.tok[i] != K.EMPTY_TOKEN).sum())
    return int(res.total[i]), res.tok[i, :kk].copy(), res.cnt[i, :kk].copy()
