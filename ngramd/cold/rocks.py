"""The RocksDB of a cold tier: its column families, the meta keys and their readers, and the
handles the store's parts share (ARCHITECTURE §5; the formats are documented in
``ngramd.cold.store``'s module docstring)."""

from __future__ import annotations

import gc
import logging
import uuid
from pathlib import Path

from rocksdict import (
    BlockBasedOptions, Cache, DBCompressionType, IngestExternalFileOptions, Options, ReadOptions,
    Rdict, WriteBatch, WriteOptions,
)

from ..config import ColdOptions
from .runs import META_NEXT_RUN
from .runs import storage as _storage
from .sstwriter import COMPRESSION
from ..wire.errors import StorageError
from ..wire.identity import FORMAT_VERSION, TableIdentity

_SCAN_READ = ReadOptions()
_SCAN_READ.fill_cache(False)  # see Runs.slices
log = logging.getLogger("ngramd.cold")

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
#: per key, a generator's draft-length-policy state (``cold.policies``): msgpack
#: ``{"state": bytes, "saved_at": unix seconds}`` (``PolicyStates.save``)
META_POLICY = b"policy/"

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
        # runs are written as SST files (by a helper process) and ingested: runs.RunWriter
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
        # obsolete files (a deleted run's, after its compaction) are unlinked by RocksDB's
        # background threads, not inside the call that made them obsolete: ``compact_range``
        # holds the GIL, and an unlink on a filesystem mounted with ``discard`` waits for the
        # device to trim the file's extents (0.2-0.9 s per file measured beside a busy writer)
        o.set_avoid_unnecessary_blocking_io(True)
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
            o.set_compression_type(COMPRESSION[opt.compression]())
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
        """Close the handles and RocksDB, and drop every reference this object holds to them,
        whatever fails on the way (``db`` is None afterwards; the first error is raised after).

        Why all of them, always: a rocksdict handle keeps the database alive (and RocksDB's
        ``LOCK`` held by this process) until the last handle to it is gone, and ``close``
        flushes first, which fails on a database that turned read-only after an I/O error.
        The first build let the first failing ``close`` leave the other handles set: every
        reopen then failed with "lock hold by current process" until a restart (issue 29)."""
        first = None
        handles = [getattr(self, n) for n in ("pg", "pg_scan", "log", "meta")]
        self.pg = self.pg_scan = self.log = self.meta = None
        self.h_pg = self.h_log = self.h_meta = None
        db, self.db = self.db, None
        for h in handles + [db]:
            if h is None:
                continue
            try:
                h.close()
            except Exception as e:  # a flush of a read-only database: drop the handle anyway
                first = first or e
        h = handles = db = None  # noqa: F841 (the loop's last handle, too)
        gc.collect()  # a cycle (a traceback's frame) may still hold a handle: free it now
        if first is not None:
            raise first

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

    def meta_range(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The ``meta`` items whose keys start with ``prefix`` (which ends in ``/``).  Read
        here, while the ``ReadOptions`` that bound the iterator are alive: with them dropped
        before the iterator was read, a reopen found no runs and collected every run's pages
        as garbage (seen in tests/test_cold.py's SIGKILL test while this was being split)."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix[:-1] + b"0")  # "run/" .. "run0"
        return list(self.meta.items(from_key=prefix, read_opt=ro))

    def load_identity(self, identity: TableIdentity) -> TableIdentity:
        """The table's identity: recorded at creation, checked (and upgraded) at every open."""
        with _storage("reading meta"):
            raw = self.meta.get(META_IDENTITY)
        if raw is None:
            with _storage("recording the identity"):
                self.put_meta({META_IDENTITY: identity.to_json(),
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
                self.put_meta({META_IDENTITY: ident.to_json()})
            log.info("cold tier %s: tokenizer fingerprint upgraded to version %d",
                     self.path, ident.fingerprint_version)
        return ident

    def load_table_id(self) -> str:
        with _storage("reading meta"):
            table_id = self.meta.get(META_TABLE_ID)
        if table_id is None:  # a new table, or one created before table ids
            table_id = uuid.uuid4().hex.encode()
            with _storage("recording the table id"):
                self.put_meta({META_TABLE_ID: table_id})
        return table_id.decode()
