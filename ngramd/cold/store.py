"""``ColdStore``: the cold tier's façade, the full n-gram table in RocksDB with the ingest log
beside it (ARCHITECTURE §5: the design, its formats and the measurements behind it).

The write path must count every order of every token at fleet rate without one Python call
per key, never stall the serving thread, and keep "acknowledged => counted exactly once"
through kill -9.  So the table is an LSM of immutable *runs* of hash-range *pages* (many rows
a RocksDB value, written as SST files) plus an in-memory *delta*: the single writer
(``apply``) counts log records above the *counted* watermark into the delta in numba; a spill
writes the delta as a run and registers it with the *applied* watermark in one synced batch,
after which the log segments it covers go; runs are merged by size tiers and the disk space
of the runs a merge replaced is given back at once.  Reads take the current view (runs +
delta parts) once and never take the writer's locks.

Crash safety: a run's pages and filter are written before the batch that registers it;
pages of unregistered ids are deleted at open and the log above ``applied`` is counted again.

The store owns its parts: ``log`` (``cold.log.ColdLog``, the ingest log and its quarantine),
``runs`` (``cold.runs.Runs``: writes, merges, reclaim), ``reader`` (``cold.reader.ColdReader``:
every read), ``rocks`` (``cold.rocks.Rocks``: the handles and meta keys) and ``policies``
(``cold.policies.PolicyStates``); it keeps the watermarks and the delta, and its locks say
who may call what.
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

import numpy as np
from rocksdict import Checkpoint, WriteBatch

from .bulk import write_run
from .log import (ColdLog, decode_records, max_merge, remote_records, split_counts,
                  split_records)
from .reader import ColdReader
from .ingestlog import write_probe
from ..config import ColdOptions  # noqa: F401 (defined with the config; re-exported)
from .policies import PolicyStates
from .rocks import META_APPLIED, META_FLEET_SEQ, META_ORIGIN, META_TABLE_ID, Rocks
from .rows import Counter, RowDigest, RowSet, add_part, concat_rows, count_batch
from .runs import (META_NEXT_RUN, META_RETIRED, RUN_PREFIX, Run, Runs, View, Views, probe_disk,
                   reserve_bytes, run_key)
from .runs import storage as _storage
from ..wire.errors import BadInput, StorageError
from ..wire.identity import TableIdentity
from ..wire.validate import as_offsets, as_tokens

log = logging.getLogger("ngramd.cold")  # the room's name (its other parts log so)


# ---------------------------------------------------------------------------------------------
# the store
# ---------------------------------------------------------------------------------------------
class ColdStore:
    """The cold tier of one table: runs of pages, the in-memory delta and the ingest log.

    Thread model: any number of readers (``reader``, a ``cold.reader.ColdReader`` that callers
    hold and call directly: lookups, scans, ``top``; and ``stats``); one writer (``apply``);
    one spiller (``spill``, ``compact_delta``) and one merger (``maybe_merge``, ``compact``)
    that may run beside the writer and each other; ``append_log`` and ``policies`` from any
    thread.
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
        #: the ingest log (``cold.log.ColdLog``: appends, the fleet's hold, the quarantine)
        self.log: ColdLog | None = None
        #: the runs of pages (``cold.runs.Runs``: writes, merges, the merge policy)
        self.runs: Runs | None = None
        #: generators' policy states in meta (``cold.policies.PolicyStates``)
        self.policies: PolicyStates | None = None
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
        #: every read of the current view (``cold.reader.ColdReader``): callers use it directly
        self.reader = ColdReader(self.path, self.rocks, self._views, self.runs, self.identity,
                                 options, self._pool, self._check_open)
        self._counters: list[Counter] = []  # the writer's count buffers, kept across applies
        log.info("cold tier open at %s: orders %d..%d, cold_k %d, %d runs (%d rows), applied "
                 "seq %d, last seq %d", self.path, self.identity.n_min, self.identity.n_max,
                 self.identity.cold_k, len(self._view.runs),
                 sum(r.rows for r in self._view.runs), self._applied, self.log.last)

    @property
    def _view(self) -> View:
        """The current view (runs + delta parts): taken once by a reader."""
        return self._views.current

    # ---- setup ------------------------------------------------------------------------------
    def _load_meta(self, identity: TableIdentity) -> None:
        self.identity = self.rocks.load_identity(identity)
        self.table_id = self.rocks.load_table_id()
        meta = self.rocks.meta
        with _storage("reading meta"):
            applied = meta.get(META_APPLIED)
            next_run = meta.get(META_NEXT_RUN)
            retired = json.loads(meta.get(META_RETIRED) or b"[]")
            runs = [Run.from_descriptor(v) for _, v in self.rocks.meta_range(RUN_PREFIX)]
            self._origins = {k[len(META_ORIGIN):]: int.from_bytes(v, "little")
                             for k, v in self.rocks.meta_range(META_ORIGIN)}
            self._origins_applied = self._origins  # what the runs hold (spill updates it)
            seq = meta.get(META_FLEET_SEQ)
            self.fleet_stream_seq = None if seq is None else int.from_bytes(seq, "little")
            self.policies = PolicyStates(self.rocks, self._check_open)
        if applied is None or next_run is None:
            raise StorageError(f"cold tier: meta column family of {self.path} is incomplete")
        self._applied = int.from_bytes(applied, "little")
        self._counted = self._applied  # the delta is empty: the log above is counted again
        self.log = ColdLog(self.path, self._applied, sync=self.options.sync_log,
                            vocab_size=self.identity.vocab_size)
        with _storage("migrating the ingest log"):
            self.log.migrate_cf(self.rocks.log, self._applied,
                                 lambda: self.rocks.db.flush_wal(True))
        runs.sort(key=lambda r: r.id)
        self.runs = Runs(self.rocks, self.options, self.identity.cold_k, self.path,
                          int.from_bytes(next_run, "little"), self._check_open)
        self.runs.collect_garbage({r.id for r in runs}, retired)
        for r in runs:
            if r.nprobe:
                r.bloom = self.runs.read_filter(r)
        self.runs.next_run = max([self.runs.next_run] + [r.id + 1 for r in runs])
        self._views = self.runs.views = Views(tuple(runs))

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
        none = contextlib.nullcontext()
        log_lock = self.log.lock if self.log is not None else none
        policy_lock = self.policies.lock if self.policies is not None else none
        with self._write_lock, self._spill_lock, self._merge_lock, policy_lock, log_lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.log is not None:
                self.log.close()
            with _storage("closing"):
                self.rocks.close()
            log.info("cold tier closed at %s", self.path)

    def _check_not_closed(self) -> None:
        """What the ingest log and counting need: the log is files, and the delta is RAM, so
        both go on while RocksDB is being reopened (else ingests would answer ``storage``
        and health stay degraded after the fault, until the next ingest)."""
        if self._closed:
            raise StorageError(f"cold tier at {self.path} is closed")

    def _check_open(self) -> None:
        self._check_not_closed()
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
                self.runs.merge(list(runs))
            self.runs.collect_retired(force=True)
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
        A sequence becomes ``split_counts`` records.

        The batch is trusted: ids below the vocab size as uint32, offsets as int64 from 0 to
        ``tokens.size`` over non-empty sequences.  The wire validated it once
        (``protocol.unpack_batch``, the only way an ingest comes in); checking again here cost
        a pass over every token of every ingest."""
        self._check_not_closed()
        assert tokens.dtype == np.uint32 and offsets.dtype == np.int64, "validated at the wire"
        recs = split_records(tokens, offsets, self.options.max_record_tokens,
                             self.identity.n_max)
        return self.log.append(recs, self._check_not_closed)

    def append_remote(self, records: list[tuple[bytes, int, bytes]]) -> tuple[int, int]:
        """Append other hosts' log records ``(origin id (16 bytes), seq in the origin's log,
        record)`` in one durable write, each marked with its origin (see ``cold.log.ORIGIN_FLAG``);
        returns ``(first_seq, last_seq)`` in this log."""
        self._check_not_closed()
        return self.log.append(remote_records(records), self._check_not_closed)

    def origin_watermarks(self) -> dict[bytes, int]:
        """Per origin host, the last seq of its log that this table holds (counted, or waiting
        in the log): the fleet's consumer skips redeliveries at or below it."""
        with self._views.lock:
            origins, counted = self._origins, self._counted
        return self.log.origin_watermarks(origins, counted)

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
        for rs in self.reader.scan_rows(stop):
            digest.add(rs)
        return digest.result()

    def applied_seq(self) -> int:
        """Last log sequence number whose tokens are in runs (durable)."""
        return self._applied

    def counted_seq(self) -> int:
        """Last log sequence number whose tokens are counted (in runs or the delta: visible to
        reads)."""
        return self._counted

    def last_seq(self) -> int:
        """Last log sequence number handed out (lag = last_seq() - counted_seq())."""
        return self.log.last

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
            self._check_not_closed()
            seqs, recs = self.log.read(self._counted, max_tokens)
            if not seqs:
                return None
            recs = [self.log.quarantine(q, r) for q, r in zip(seqs, recs)]
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

    def probe_writes(self) -> None:
        """``StorageError`` unless a spill or a merge could write now (``health.Probes``): the
        data directory takes a write (``probe_disk``: one byte) and more is free than the space
        runs leave to the ingest log (``runs.reserve_bytes``, the bound their pages never
        cross).  It writes no more than that byte: a probe must never take the space an
        ingest needs (``statvfs`` releases the GIL)."""
        self.probe_disk()
        try:
            st = os.statvfs(self.path)
        except OSError as e:
            raise StorageError(f"cold tier: statvfs of {self.path} failed: "
                               f"{e.strerror or e}") from None
        free = st.f_bavail * st.f_frsize
        reserve = reserve_bytes(st.f_blocks * st.f_frsize)
        if free <= reserve:
            raise StorageError(f"cold tier: the disk is nearly full ({free >> 10} KiB free, "
                               f"{reserve >> 10} KiB kept for the ingest log)")

    def _probe_space(self, nbytes: int = 1 << 20) -> None:
        """Raise ``StorageError`` unless ``nbytes`` can be written and synced in the data
        directory now (then they are given back)."""
        try:
            write_probe(self.path / ".probe-space", nbytes)
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
        with self._write_lock, self._spill_lock, self._merge_lock, self.policies.lock:
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
                try:
                    rk.close()  # drops every handle even when closing fails
                except Exception as e:  # flushing a read-only database: expected, not hidden
                    log.info("cold tier: closing RocksDB before a reopen: %s", e)
            self._probe_space()
            self._open_again()
            log.info("cold tier reopened at %s", self.path)

    def _open_again(self) -> None:
        """``Rocks.open`` after a close.  A reader in the middle of a call still holds the old
        handle for that call (and with it RocksDB's LOCK): the open is tried again for up to
        2 s before it counts as a failure (the caller retries later in any case)."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                with _storage("reopening RocksDB"):
                    self.rocks.open()
                return
            except StorageError as e:
                if "lock" not in str(e).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

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
                meta = self.runs.write_new(self.runs.slices((), parts, n), n)
            self._register_spill(meta, counted, origins)
            self.log.ilog.release(counted)
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
            items[META_NEXT_RUN] = self.runs.next_run.to_bytes(8, "little")
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
        spill to bound them (without this, counting stalled at a few hundred parts until
        ingest paused for ``spill_idle_s``).  Sliced like a spill (no long GIL-holding call);
        returns the parts merged (0: none)."""
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
            merged = concat_rows(list(self.runs.slices((), pick, sum(len(p) for p in pick))))
            with self._views.lock:  # apply only appends meanwhile: parts is a prefix
                v = self._view
                self._views.publish(v.runs, parts[:j] + (merged,) + v.delta[len(parts):])
            return len(pick)

    # ---- bulk load (offline warm-up) --------------------------------------------------------
    def bulk_load(self, tokens: np.ndarray, offsets: np.ndarray, *, threads: int = 2,
                  mem_mb: int = 2048, progress=None) -> Run | None:
        """Count a whole corpus straight into ONE new run, bypassing the log: the warm-up path
        of ``ngramd warm`` (a stopped table; RocksDB's lock keeps a daemon out).  How, in
        bounded memory on every core: ``cold.bulk.write_run``.

        All or nothing: the run is registered by one batch at the end, so a kill leaves the
        table as it was (its pages are collected at the next open) and a success means every
        token is counted exactly once.  ``progress(done_partitions, partitions)`` is called as
        partitions finish."""
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = as_offsets(offsets, tokens.size, min_len=1)
        t0 = time.perf_counter()
        with self._write_lock:
            meta, parts = write_run(self.runs, self.identity, tokens, offsets,
                                    threads=threads, mem_mb=mem_mb, progress=progress,
                                    closed=lambda: self._closed)
        if meta is None:
            return None
        with _storage("registering a bulk run"):
            self.rocks.put_meta({RUN_PREFIX + run_key(meta.id): meta.descriptor(),
                                 META_NEXT_RUN: self.runs.next_run.to_bytes(8, "little")})
        with self._views.lock:
            v = self._view
            self._views.publish(v.runs + (meta,), v.delta)
        log.info("bulk load: %d tokens -> run %d: %d rows, %d pages, %.1f MiB, %d partitions, "
                 "%.1f s", int(tokens.size), meta.id, meta.rows, meta.pages, meta.bytes / 2**20,
                 parts, time.perf_counter() - t0)
        return meta

    # ---- merges ----------------------------------------------------------------------------
    def maybe_merge(self) -> Run | None:
        """Merge runs if the policy says so (one merge); also deletes retired runs whose grace
        period is over.  Returns the new run, or None."""
        with self._merge_lock:
            self._check_open()
            self.runs.collect_retired()
            pick = self.runs.pick()
            if pick is None:
                return None
            return self.runs.merge(pick)

    # ---- figures ----------------------------------------------------------------------------
    # reads (lookups, scans, ``top``, ``entries``, ``memory``, ``run_list``) are the reader's:
    # callers hold ``self.reader`` (``cold.reader.ColdReader``) and call it directly
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
        wal, run_sst, total = self.reader.dir_sizes()
        view = self._view
        entries = self.reader.entries()
        n = sum(entries.values())
        run_rows = sum(r.rows for r in view.runs)
        last, log_bytes = self.log.last, self.log.ilog.bytes_total
        return dict(
            entries=entries, entries_total=n, runs=len(view.runs), run_rows=run_rows,
            run_bytes=sum(r.bytes for r in view.runs), delta_rows=self.delta_rows(),
            delta_parts=len(view.delta), sst_bytes=sst, run_sst_bytes=run_sst,
            # what the table needs on disk (its runs and its log) against what it holds
            live_bytes=run_sst + log_bytes, disk_bytes=total,
            memtable_bytes=mem, wal_bytes=wal, total_bytes=total,
            bytes_per_entry=(run_sst / run_rows if run_rows else 0.0),
            applied_seq=self._applied, counted_seq=self._counted, last_seq=last,
            log_lag=last - self._counted, memory=self.reader.memory(),
            log_bytes=log_bytes, quarantined=self.log.quarantined,
            # background disk work still owed: merged-away runs whose pages are not deleted
            # yet, and whether the size-tier policy would merge now (both 0 once quiet)
            retiring_runs=sum(len(g) for _, g, _ in self.runs.retiring),
            merge_pending=int(self.runs.pick(view.runs) is not None),
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
