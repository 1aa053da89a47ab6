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
Runs are written as SST files and ingested (``runs.RunWriter`` says why: the GIL).

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

So retired runs are compacted away one at a time (``runs.Runs.delete``): the reclaim reads each
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

The modules of the cold tier
----------------------------
``ngramd.rows`` (row sets: pure algebra over arrays, counting), ``ngramd.runs`` (runs of pages:
format, writing, views, merges, reclaim), ``ngramd.coldlog`` (the log records' format, the
quarantine, the ingest log as the store keeps it) and this module: ``Rocks`` (the RocksDB
handles) and ``ColdStore``, the façade that owns them, the meta family and the delta, and
whose locks say who may call what.
"""


from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from rocksdict import (
    BlockBasedOptions, Cache, Checkpoint, DBCompressionType, IngestExternalFileOptions, Options,
    ReadOptions, Rdict, WriteBatch, WriteOptions,
)

from . import kernels as K
from .coldlog import (ColdLog, decode_records, max_merge, remote_records, split_counts,
                      split_records)
from .config import ColdOptions  # noqa: F401 (defined with the config; re-exported)
from .rows import (Counter, Lookup, RowDigest, RowSet, add_part, concat_rows, count_batch,
                   slice_rows, take_rows, unique_inverse)
from .runs import (META_NEXT_RUN, META_RETIRED, RUN_PREFIX, Run, Runs, View, Views, page_buffer,
                   page_key, probe_disk, run_key)
from .runs import storage as _storage
from .wire.errors import BadInput, StorageError
from .wire.identity import FORMAT_VERSION, TableIdentity
from .wire.validate import as_offsets, as_tokens

_SCAN_READ = ReadOptions()
_SCAN_READ.fill_cache(False)  # see Runs.slices
log = logging.getLogger(__name__)

CF_PAGES = "pages"
CF_LOG = "log"
CF_META = "meta"
COLUMN_FAMILIES = (CF_PAGES, CF_LOG, CF_META)

META_IDENTITY = b"identity"
META_APPLIED = b"applied"
META_TABLE_ID = b"table_id"
#: per origin host (fleet): the last seq of its log counted into runs, u64 LE; written with
#: ``applied`` in one batch, so a restart knows exactly which remote records its runs hold
META_ORIGIN = b"origin/"
#: a table restored from a fleet snapshot: the stream sequence the snapshot covers (u64 LE)
META_FLEET_SEQ = b"fleet_stream_seq"

_COMPRESSION = {
    "zstd": DBCompressionType.zstd(), "lz4": DBCompressionType.lz4(),
    "none": DBCompressionType.none(),
}


class Rocks:
    """The RocksDB of one table and its column-family handles (public for the store's parts,
    benchmarks and tests): ``pages`` as ``pg`` (and ``pg_scan``, whose reads skip the block
    cache), ``log``, ``meta``, their write handles ``h_*``, the write options ``wo`` and what
    runs are ingested with.  ``open`` and ``close`` replace the handles in place (a reopen after
    a storage error), so holders read them at each call."""

    def __init__(self, path: Path, options: ColdOptions):
        self.path = path
        self.options = options
        self.cache = Cache(options.block_cache_mb << 20)
        self.db = self.pg = self.pg_scan = self.log = self.meta = None
        self.h_pg = self.h_log = self.h_meta = None
        self.wo = WriteOptions()  # never sync inside write(): it holds the GIL
        # runs are written as SST files and ingested (see runs.RunWriter)
        self.sst_options = self.cf_options(CF_PAGES)
        self.ingest_opts = IngestExternalFileOptions()
        self.ingest_opts.set_move_files(True)
        self.ingest_dir = path / "ingest"

    def check_format(self) -> None:
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
        o = self.cf_options(CF_META)
        o.create_if_missing(True)
        o.create_missing_column_families(True)
        o.set_max_background_jobs(self.options.max_background_jobs)
        o.set_use_direct_reads(self.options.direct_reads)
        return o

    def cf_options(self, name: str) -> Options:
        opt = self.options
        o = Options(raw_mode=True)
        bb = BlockBasedOptions()
        bb.set_block_cache(self.cache)
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

    def open(self) -> None:
        """Open RocksDB and the column-family handles (at open and at ``reopen``)."""
        # the reopen trap: table options of an existing column family are ignored unless
        # that family is opened with them, so always pass all three
        self.db = Rdict(str(self.path), self._db_options(),
                        column_families={name: self.cf_options(name)
                                         for name in COLUMN_FAMILIES})
        self.pg = self.db.get_column_family(CF_PAGES)
        # scans read through their own handle: rocksdict's get([keys]) ignores a read_opt
        # argument but honours options preset on the handle (measured)
        self.pg_scan = self.db.get_column_family(CF_PAGES)
        self.pg_scan.set_read_options(_SCAN_READ)
        self.log = self.db.get_column_family(CF_LOG)
        self.meta = self.db.get_column_family(CF_META)
        self.h_pg = self.db.get_column_family_handle(CF_PAGES)
        self.h_log = self.db.get_column_family_handle(CF_LOG)
        self.h_meta = self.db.get_column_family_handle(CF_META)

    def close(self) -> None:
        """Close the handles and RocksDB (``db`` None: not open, or a reopen that failed)."""
        for name in ("pg", "pg_scan", "log", "meta"):
            cf = getattr(self, name)
            if cf is not None:
                cf.close()
                setattr(self, name, None)
        self.h_pg = self.h_log = self.h_meta = None
        db, self.db = self.db, None
        if db is not None:
            db.close()

    def write_durable(self, wb: WriteBatch) -> None:
        """Write ``wb`` and sync the WAL (``flush_wal(True)`` releases the GIL; a synced
        ``write`` would hold it)."""
        self.db.write(wb, self.wo)
        self.db.flush_wal(True)

    def put_meta(self, items: dict) -> None:
        """Put ``items`` (bytes -> bytes) into ``meta`` in one durable batch."""
        wb = WriteBatch(raw_mode=True)
        for k, v in items.items():
            wb.put(k, v, self.h_meta)
        self.write_durable(wb)


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
        self._closed = True
        self.rocks = Rocks(self.path, options)
        self.clog: ColdLog | None = None  # the ingest log (coldlog.ColdLog), once open
        self._runs: Runs | None = None
        self._pool = None
        with _storage(f"opening {self.path}"):
            self.path.mkdir(parents=True, exist_ok=True)
            self.rocks.check_format()
        try:
            with _storage(f"opening {self.path}"):
                self._closed = False  # from here on, a failure closes what was opened
                self.rocks.open()
                ingest_dir = self.rocks.ingest_dir
                if ingest_dir.exists():  # files of runs a crash left unfinished
                    for f in ingest_dir.iterdir():
                        f.unlink()
                ingest_dir.mkdir(exist_ok=True)
            self._load_meta(identity)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=options.read_threads,
                                        thread_name_prefix="cold-read")
        self._counters: list[Counter] = []  # the writer's count buffers, kept across applies
        self._sizes = None  # (when, figures, runs) of the last _dir_sizes
        log.info("cold tier open at %s: orders %d..%d, cold_k %d, %d runs (%d rows), applied "
                 "seq %d, last seq %d", self.path, self.identity.n_min, self.identity.n_max,
                 self.identity.cold_k, len(self._view.runs),
                 sum(r.rows for r in self._view.runs), self._applied, self.clog.last)

    @property
    def _view(self) -> View:
        """The current view (runs + delta parts): taken once by a reader."""
        return self._views.current

    @property
    def interrupted(self) -> bool:
        """Set while the owner closes: a run being written (a long merge) stops at its next
        slice, so closing never waits for it."""
        return self._runs.interrupted

    @interrupted.setter
    def interrupted(self, value: bool) -> None:
        self._runs.interrupted = value

    @property
    def quarantined(self) -> int:
        """Log records that could not be counted (``coldlog.ColdLog.quarantine``)."""
        return self.clog.quarantined

    # ---- setup ------------------------------------------------------------------------------
    def _load_meta(self, identity: TableIdentity) -> None:
        self.identity = self._load_identity(identity)
        self.table_id = self._load_table_id()
        meta = self.rocks.meta
        with _storage("reading meta"):
            applied = meta.get(META_APPLIED)
            next_run = meta.get(META_NEXT_RUN)
            retired = json.loads(meta.get(META_RETIRED) or b"[]")
            runs = [Run.from_descriptor(v) for _, v in self._meta_range(RUN_PREFIX)]
            self._origins = {k[len(META_ORIGIN):]: int.from_bytes(v, "little")
                             for k, v in self._meta_range(META_ORIGIN)}
            self._origins_applied = self._origins  # what the runs hold (spill updates it)
            seq = meta.get(META_FLEET_SEQ)
            self.fleet_stream_seq = None if seq is None else int.from_bytes(seq, "little")
        if applied is None or next_run is None:
            raise StorageError(f"cold tier: meta column family of {self.path} is incomplete")
        self._applied = int.from_bytes(applied, "little")
        self._counted = self._applied  # the delta is empty: the log above is counted again
        self.clog = ColdLog(self.path, self._applied, sync=self.options.sync_log,
                            vocab_size=self.identity.vocab_size)
        with _storage("migrating the ingest log"):
            self.clog.migrate_cf(self.rocks.log, self._applied,
                                 lambda: self.rocks.db.flush_wal(True))
        runs.sort(key=lambda r: r.id)
        self._runs = Runs(self.rocks, self.options, self.identity.cold_k, self.path,
                          int.from_bytes(next_run, "little"), self._check_open)
        self._runs.collect_garbage({r.id for r in runs}, retired)
        for r in runs:
            if r.nprobe:
                r.bloom = self._runs.read_filter(r)
        self._runs.next_run = max([self._runs.next_run] + [r.id + 1 for r in runs])
        self._views = self._runs.views = Views(tuple(runs))

    def _meta_range(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The ``meta`` items whose keys start with ``prefix`` (which ends in ``/``).  Read
        here, while the ``ReadOptions`` that bound the iterator are alive: with them dropped
        before the iterator was read, a reopen found no runs and collected every run's pages
        as garbage (seen in tests/test_cold.py's SIGKILL test while this was being split)."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix[:-1] + b"0")  # "run/" .. "run0"
        return list(self.rocks.meta.items(from_key=prefix, read_opt=ro))

    def _load_identity(self, identity: TableIdentity) -> TableIdentity:
        """The table's identity: recorded at creation, checked (and upgraded) at every open."""
        with _storage("reading meta"):
            raw = self.rocks.meta.get(META_IDENTITY)
        if raw is None:
            with _storage("recording the identity"):
                self.rocks.put_meta({META_IDENTITY: identity.to_json(),
                                     META_APPLIED: (0).to_bytes(8, "little"),
                                     META_NEXT_RUN: (1).to_bytes(8, "little")})
            log.info("cold tier created at %s", self.path)
            return identity
        try:
            stored = TableIdentity.from_json(raw)
        except Exception as e:
            raise StorageError(f"cold tier: unreadable identity in {self.path}: {e}") from None
        ident = stored.upgrade(identity)  # raises IdentityMismatch
        if ident is not stored:  # an old tokenizer fingerprint, rewritten
            with _storage("upgrading the identity"):
                self.rocks.put_meta({META_IDENTITY: ident.to_json()})
            log.info("cold tier %s: tokenizer fingerprint upgraded to version %d",
                     self.path, ident.fingerprint_version)
        return ident

    def _load_table_id(self) -> str:
        with _storage("reading meta"):
            table_id = self.rocks.meta.get(META_TABLE_ID)
        if table_id is None:  # a new table, or one created before table ids
            table_id = uuid.uuid4().hex.encode()
            with _storage("recording the table id"):
                self.rocks.put_meta({META_TABLE_ID: table_id})
        return table_id.decode()

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
        log_lock = self.clog.lock if self.clog is not None else contextlib.nullcontext()
        with self._write_lock, self._spill_lock, self._merge_lock, log_lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.clog is not None:
                self.clog.ilog.close()
            with _storage("closing"):
                self.rocks.close()
            log.info("cold tier closed at %s", self.path)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"cold tier at {self.path} is closed")
        if self.rocks.db is None:
            raise StorageError(f"cold tier at {self.path} is being reopened after a "
                               "storage error")

    def flush(self) -> None:
        """Count the whole log, write the delta as a run and flush RocksDB's memtables: after
        this, everything acknowledged is in runs (tests, shutdown)."""
        self._check_open()
        while self.apply(1 << 22) is not None:
            pass
        self.spill()
        rk = self.rocks
        with _storage("flush"):
            rk.db.flush_wal(True)
            for cf in (rk.pg, rk.log, rk.meta):
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
                self._runs.merge(list(runs))
            self._runs.collect_retired(force=True)
        with _storage("compaction"):
            self.rocks.pg.compact_range(None, None)
            self.rocks.log.compact_range(None, None)

    # ---- the ingest log ---------------------------------------------------------------------
    def split_counts(self, lengths: np.ndarray) -> np.ndarray:
        """Records each sequence of these lengths becomes (1 unless it is longer than
        ``max_record_tokens``)."""
        return split_counts(lengths, self.options.max_record_tokens, self.identity.n_max)

    def append_log(self, tokens: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
        """Append sequences ``tokens[offsets[i]:offsets[i+1]]`` to the ingest log in one write
        (``IngestLog.append``: one ``os.write`` to the current segment file, then one fsync if
        ``sync_log``); returns ``(first_seq, last_seq)`` of the records written once durable.
        A sequence becomes ``split_counts`` records.  Sequences must be non-empty."""
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = as_offsets(offsets, tokens.size, min_len=1)
        recs = split_records(tokens, offsets, self.options.max_record_tokens,
                             self.identity.n_max)
        return self.clog.append(recs, self._check_open)

    def append_remote(self, records: list[tuple[bytes, int, bytes]]) -> tuple[int, int]:
        """Append other hosts' log records ``(origin id (16 bytes), seq in the origin's log,
        record)`` in one durable write, each marked with its origin (see ``coldlog.ORIGIN_FLAG``);
        returns ``(first_seq, last_seq)`` in this log."""
        self._check_open()
        return self.clog.append(remote_records(records), self._check_open)

    def local_records(self, after: int, max_bytes: int = 512 << 10) -> tuple[int, list]:
        """This host's own log records above ``after`` that are still kept (the fleet's
        publisher reads them; records from other hosts are passed over): returns the last seq
        looked at and ``[(seq, record), ...]``."""
        return self.clog.local_records(after, max_bytes)

    def origin_watermarks(self) -> dict[bytes, int]:
        """Per origin host, the last seq of its log that this table holds (counted, or waiting
        in the log): the fleet's consumer skips redeliveries at or below it."""
        with self._views.lock:
            origins, counted = self._origins, self._counted
        return self.clog.origin_watermarks(origins, counted)

    def checkpoint(self, dest) -> dict:
        """A consistent copy of the table's runs at ``dest`` (a RocksDB Checkpoint: hard links
        to the SST files, so it costs no time or space beyond the memtables it flushes; the
        ingest log is not part of it).  Returns what the copy holds: ``applied`` (this log's
        seq) and ``origins`` (per other host, the last seq of its log).  No spill or merge
        runs meanwhile, so the copy's meta and runs agree."""
        with self._spill_lock, self._merge_lock:
            self._check_open()
            with _storage("writing a checkpoint"):
                Checkpoint(self.rocks.db).create_checkpoint(str(dest))
            return {"applied": self._applied, "origins": dict(self._origins_applied)}

    def record_fleet(self, origins: dict[bytes, int], stream_seq: int | None, *,
                     new_table_id: bool = False) -> None:
        """Record in meta (one durable batch) what a fleet snapshot says this table holds: per
        origin host the last seq counted, and the stream sequence the snapshot covers; a
        restored copy also takes a new ``table_id`` (it is a new table)."""
        merged = max_merge(self._origins_applied, origins)
        items = {META_ORIGIN + origin: int(oseq).to_bytes(8, "little")
                 for origin, oseq in merged.items()}
        if stream_seq is not None:
            items[META_FLEET_SEQ] = int(stream_seq).to_bytes(8, "little")
        if new_table_id:
            self.table_id = uuid.uuid4().hex
            items[META_TABLE_ID] = self.table_id.encode()
        with self._spill_lock, _storage("recording fleet state"):
            self.rocks.put_meta(items)
            with self._views.lock:
                self._origins = max_merge(self._origins, origins)
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

        Each row hashes to 64 bits (splitmix64 of its fields); a digest is their sum mod 2^64
        (``rows.RowDigest``)."""
        digest = RowDigest(self.identity.cold_k)
        for rs in self.scan_rows(stop):
            digest.add(rs)
        return digest.result()

    def hold_log(self, seq: int | None) -> None:
        """Keep log records above ``seq`` (the fleet's published watermark); None: no hold."""
        self.clog.ilog.set_hold(seq)

    @property
    def log_hold(self) -> int | None:
        return self.clog.ilog.hold

    def applied_seq(self) -> int:
        """Last log sequence number whose tokens are in runs (durable)."""
        return self._applied

    def counted_seq(self) -> int:
        """Last log sequence number whose tokens are counted (in runs or the delta: visible to
        reads)."""
        return self._counted

    def last_seq(self) -> int:
        """Last log sequence number handed out (lag = last_seq() - counted_seq())."""
        return self.clog.last

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
            seqs, recs = self.clog.read(self._counted, max_tokens)
            if not seqs:
                return None
            recs = [self.clog.quarantine(q, r) for q, r in zip(seqs, recs)]
            tokens, offsets, skips, origins = decode_records(recs)
            while len(self._counters) < threads:
                self._counters.append(Counter(self.identity))
            rows = count_batch(tokens, offsets, skips, self._counters[:threads], pool)
            with self._views.lock:
                v = self._view
                self._views.publish(v.runs, add_part(v.delta, rows))
                self._counted = seqs[-1]
                if origins:  # a new dict: spill reads the one of its moment without a copy
                    self._origins = max_merge(self._origins, origins)
            res = ApplyResult(seqs[0], seqs[-1], int((np.diff(offsets) - skips).sum()), rows)
        if self.auto_spill and self.delta_bytes() >= self.options.delta_mb << 20:
            self.spill()
        return res

    def count_buffers_bytes(self) -> int:
        """Bytes of the writer's count buffers (``rows.Counter``), kept across applies."""
        return sum(c.nbytes for c in self._counters)

    def probe_disk(self) -> None:
        """``runs.probe_disk`` of the data directory: raises ``StorageError`` unless it is
        writable, waiting (without the GIL) while the disk is frozen."""
        probe_disk(self.path)

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
        rk = self.rocks
        with self._write_lock, self._spill_lock, self._merge_lock:
            if self._closed:
                raise StorageError(f"cold tier at {self.path} is closed")
            if rk.db is not None:
                try:
                    wb = WriteBatch(raw_mode=True)
                    wb.put(b"probe", b"1", rk.h_meta)
                    rk.db.write(wb, rk.wo)
                    return
                except Exception:
                    pass
                self._probe_space()
                with contextlib.suppress(Exception):
                    rk.close()  # leaves db None even if closing fails
            self._probe_space()
            with _storage("reopening RocksDB"):
                rk.open()
            log.info("cold tier reopened at %s", self.path)

    def delta_rows(self) -> int:
        return sum(len(p) for p in self._view.delta)

    def delta_bytes(self) -> int:
        return sum(p.nbytes for p in self._view.delta)

    def delta_parts(self) -> int:
        """Row sets the delta holds now (one a writer step until ``compact_delta`` merges
        them): a read searches each."""
        return len(self._view.delta)

    def spill(self) -> Run | None:
        """Write the delta as a run (if it holds rows) and advance the applied watermark over
        what it counted (one synced batch registers both), then delete the ingest log's
        segments that batch covers (``IngestLog.release``).  Runs beside ``apply`` (the
        writer keeps counting into new delta parts meanwhile); returns the run or None."""
        with self._spill_lock:
            self._check_open()
            with self._views.lock:  # the delta's parts and the seq they count up to, together
                parts, counted, origins = self._view.delta, self._counted, self._origins
            if not parts and counted == self._applied:
                return None
            self.probe_disk()
            meta = None
            if parts:
                n = sum(len(p) for p in parts)
                # merged slice by slice: bounded memory, no long GIL-holding call
                meta = self._runs.write_new(self._runs.slices((), parts, n), n)
            self._register_spill(meta, counted, origins)
            self.clog.ilog.release(counted)
            self._origins_applied = origins
            with self._views.lock:
                v = self._view
                rest = tuple(p for p in v.delta if not any(p is q for q in parts))
                self._views.publish(v.runs + ((meta,) if meta else ()), rest)
                self._applied = counted
            if meta is not None:
                log.info("spilled %d delta rows as run %d (%d pages, %.1f MiB), applied seq %d",
                         meta.rows, meta.id, meta.pages, meta.bytes / 2**20, counted)
            return meta

    def _register_spill(self, meta: Run | None, counted: int, origins: dict) -> None:
        """One synced batch: the spilled run (if any), the applied watermark and the origins'
        watermarks; durable before the log records it covers go."""
        items = {}
        if meta is not None:
            items[RUN_PREFIX + run_key(meta.id)] = meta.descriptor()
            items[META_NEXT_RUN] = self._runs.next_run.to_bytes(8, "little")
        items[META_APPLIED] = counted.to_bytes(8, "little")
        for origin, oseq in origins.items():
            items[META_ORIGIN + origin] = oseq.to_bytes(8, "little")
        with _storage("registering a run"):
            self.rocks.put_meta(items)

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
            merged = concat_rows(list(self._runs.slices((), pick, sum(len(p) for p in pick))))
            with self._views.lock:  # apply only appends meanwhile: parts is a prefix
                v = self._view
                self._views.publish(v.runs, parts[:j] + (merged,) + v.delta[len(parts):])
            return len(pick)

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
        threads = max(1, int(threads))
        ident = self.identity
        events = int(sum(K.count_span(int(b - a), 0, ident.n_min, ident.n_max)
                         for a, b in zip(offsets[:-1], offsets[1:])))
        budget = max(int(mem_mb), 64) << 20
        bits = max(0, (threads - 1).bit_length())
        # per thread: 24 B of events and ~37 B of rows per event of its partition
        while bits < 12 and threads * 64 * events / (1 << bits) > budget:
            bits += 1
        run = self._runs.new_id()
        writer = self._runs.writer(run, max(1, int(events * 0.7)))
        t0 = time.perf_counter()
        try:
            with self._write_lock, ThreadPoolExecutor(threads, "ngramd-bulk") as pool:
                self._bulk_parts(tokens, offsets, bits, writer, pool, threads, progress)
                meta = writer.finish()
        except BaseException:
            writer.abort()
            self._runs.delete([run])
            raise
        if not meta.rows:
            self._runs.delete([run])
            return None
        with _storage("registering a bulk run"):
            self.rocks.put_meta({RUN_PREFIX + run_key(run): meta.descriptor(),
                                 META_NEXT_RUN: self._runs.next_run.to_bytes(8, "little")})
        with self._views.lock:
            v = self._view
            self._views.publish(v.runs + (meta,), v.delta)
        log.info("bulk load: %d tokens -> run %d: %d rows, %d pages, %.1f MiB, %d partitions, "
                 "%.1f s", int(tokens.size), run, meta.rows, meta.pages, meta.bytes / 2**20,
                 1 << bits, time.perf_counter() - t0)
        return meta

    def _bulk_parts(self, tokens, offsets, bits, writer, pool, threads, progress) -> None:
        """``bulk_load``'s partitions: counted and encoded ``threads`` at a time in ``pool``,
        written in key order by the calling thread."""
        ident, n_parts = self.identity, 1 << bits
        skips = np.zeros(offsets.size - 1, np.int64)
        local = threading.local()

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

        futs = {p: pool.submit(count_part, p) for p in range(min(threads, n_parts))}
        for p in range(n_parts):
            part = futs.pop(p).result()
            if p + threads < n_parts:
                futs[p + threads] = pool.submit(count_part, p + threads)
            writer.add(part)
            if progress is not None:
                progress(p + 1, n_parts)

    # ---- merges ----------------------------------------------------------------------------
    def pick_merge(self, runs: tuple | None = None) -> list[Run] | None:
        """The runs the size-tier policy would merge now (newest first accumulated), or None."""
        return self._runs.pick(runs)

    def maybe_merge(self) -> Run | None:
        """Merge runs if the policy says so (one merge); also deletes retired runs whose grace
        period is over.  Returns the new run, or None."""
        with self._merge_lock:
            self._check_open()
            self._runs.collect_retired()
            pick = self._runs.pick()
            if pick is None:
                return None
            return self._runs.merge(pick)

    # ---- reads ------------------------------------------------------------------------------
    def lookup(self, keys: np.ndarray) -> Lookup:
        """Counts of the contexts with these kernel keys (uint64), summed over the delta and
        every run.  Python work is per run and per page, not per key."""
        self._check_open()
        keys = np.ascontiguousarray(keys, np.uint64)
        out = Lookup.empty(keys.shape[0], self.identity.cold_k)
        if not keys.shape[0]:
            return out
        with self._views.reading() as view:
            self._lookup_view(view, keys, out)
        return out

    def _lookup_view(self, view: View, keys: np.ndarray, out: Lookup) -> None:
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
            uniq, inv = unique_inverse(pages)
            vals = self._get_pages([page_key(run.id, p) for p in uniq.tolist()])
            buf, pstart, where = page_buffer(vals)
            qpage = np.asarray(where, np.int64)[inv]
            sub_out = [a[idx] for a in out]
            K.pages_lookup(sub, qpage, pstart, buf.view(np.uint8), buf.view(np.uint32), buf, k,
                           *sub_out)
            for a, b in zip(out, sub_out):
                a[idx] = b

    def _get_pages(self, keys: list[bytes]) -> list:
        chunk = self.options.read_chunk
        pg = self.rocks.pg
        with _storage("reading pages"):
            if len(keys) <= chunk:
                return pg.get(keys)
            parts = self._pool.map(pg.get, [keys[i:i + chunk] for i in range(0, len(keys), chunk)])
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
        return self.lookup(key).row(0)

    def get_many(self, orders, tokens, offsets) -> list[tuple[int, np.ndarray, np.ndarray] | None]:
        """``get(orders[i], tokens[offsets[i]:offsets[i+1]])`` for every i, in one lookup."""
        keys = self.keys_for(orders, tokens, offsets)
        res = self.lookup(keys)
        return [res.row(i) for i in range(keys.shape[0])]

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
                    rows = take_rows(rows, sel)
            for a in range(0, len(rows), chunk):
                self._check_open()
                part = slice_rows(rows, a, min(a + chunk, len(rows)))
                tok, cnt = part.padded(k)
                yield dict(key=part.key, parent=part.parent, order=part.order,
                           total=part.total, tok=tok, cnt=cnt)

    def scan_rows(self, stop: threading.Event | None = None) -> Iterator[RowSet]:
        """The whole table as merged row sets, slice by slice (the hot builder's input); reads
        the view of the moment it starts."""
        with self._views.reading() as view:
            total = sum(r.rows for r in view.runs) + sum(len(p) for p in view.delta)
            yield from self._runs.slices(view.runs, view.delta, total, stop)

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
        stats call runs on the daemon's serving thread, and a big table has hundreds of files.
        Measured again after runs were deleted."""
        now, runs_now, deletions = time.monotonic(), self._view.runs, self._runs.deletions
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
                pg = self.rocks.pg
                sst = int(pg.property_int_value("rocksdb.total-sst-files-size") or 0)
                mem = int(pg.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
        except StorageError:
            sst = mem = 0
        wal, run_sst, total = self._dir_sizes()
        view = self._view
        entries = self.entries()
        n = sum(entries.values())
        run_rows = sum(r.rows for r in view.runs)
        last, log_bytes = self.clog.last, self.clog.ilog.bytes_total
        return dict(
            entries=entries, entries_total=n, runs=len(view.runs), run_rows=run_rows,
            run_bytes=sum(r.bytes for r in view.runs), delta_rows=self.delta_rows(),
            delta_parts=len(view.delta), sst_bytes=sst, run_sst_bytes=run_sst,
            # what the table needs on disk (its runs and its log) against what it holds
            live_bytes=run_sst + log_bytes, disk_bytes=total,
            memtable_bytes=mem, wal_bytes=wal, total_bytes=total,
            bytes_per_entry=(run_sst / run_rows if run_rows else 0.0),
            applied_seq=self._applied, counted_seq=self._counted, last_seq=last,
            log_lag=last - self._counted, memory=self.memory(),
            log_bytes=log_bytes, quarantined=self.quarantined,
        )


@dataclass
class ApplyResult:
    """What one ``apply()`` counted (the rows are increments, for the recent table)."""

    first_seq: int
    last_seq: int
    tokens: int  # tokens whose events were counted (overlaps excluded)
    rows: RowSet

    def __len__(self) -> int:
        return len(self.rows)
