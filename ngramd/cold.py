"""Cold tier: the full n-gram table and the ingest log in RocksDB (DESIGN §5).

One RocksDB database (``rocksdict``, raw mode) per table, three column families:

``ngrams``
    key   = 1 byte order ``n`` + the ``n`` context tokens as big-endian uint32, oldest first, so
            one order is one contiguous key range and keys sort like the token tuples;
    value = total (uint32 LE, every observation of the context) + up to ``cold_k`` pairs
            (token uint32 LE, count uint32 LE), count desc, ties smaller token first.  Counts and
            totals saturate at 2**32 - 1.  8 + 4n + 8k' bytes before compression.
``log``
    key = sequence number (uint64 BE), value = the raw uint32 LE tokens of one ingested sequence.
``meta``
    ``identity`` (``TableIdentity.to_json()``), ``applied`` (uint64 LE: last log seq whose
    tokens are in ``ngrams``) and ``entries`` (uint64 LE × (MAX_ORDER + 1): exact number of
    ``ngrams`` keys per order).

Durability and crash safety
---------------------------
``append_log`` writes all sequences of one call in one WriteBatch (WAL on, fsynced when
``sync_log``) and returns only after RocksDB acknowledged it: an acked ingest survives kill -9.
``apply`` (one writer) reads log records above the watermark, counts them, merges them into the
stored values and writes the new values, the new watermark, the entry counts and the deletion of
the applied log records in ONE WriteBatch.  RocksDB applies a WriteBatch atomically and recovers
the WAL to a consistent prefix, so after a crash either the batch is there in full (the records
are gone and the watermark covers them) or not at all (the records are still above the
watermark and are applied again): no sequence is counted twice or dropped.  The apply batch is
not fsynced: a later synced ``append_log`` (or ``flush``) syncs it, and losing it on power
failure only means re-applying records that are still in the log.

Why WriteBatch and not SstFileWriter + ingest_external_file (DESIGN §5 suggests the latter)
-----------------------------------------------------------------------------------------
Measured here (2 vCPU VM, rocksdict 0.3.29): ``SstFileWriter[k] = v`` costs ~1.0 µs/key from
Python; ``WriteBatch.put`` ~0.5-0.9 µs/key plus ``db.write`` 0.4 µs/key *when the keys are
sorted* (1M 33-byte keys: 0.42 µs/key sorted, 1.6 sorted by the first two tokens only, 4.9 in
hash order: memtable skiplist inserts lose locality; ``apply`` therefore writes in key order).
One Python call per key is the floor either way, so the SST path saves little, while an ingested
file lives in one column family: the watermark would have to move out of ``meta`` into
``ngrams`` to stay atomic with the counts.  What the SST path would buy is GIL behaviour (below).

Throughput (real code, orders 1..16, cold_k 8: ~10 distinct contexts per token per 250k-token
batch): apply ran at 15-25k tokens/s on this shared 2 vCPU VM, ~3-5 µs per context: count_ngrams
~1 µs (its top-k aggregation), key sort ~0.3-0.6, put + write ~1.2, reading existing values
~3 (get) or ~1-3 per stored entry (range scan).  ≥ 500k tokens/s (DESIGN §9) needs a native
bulk path (arrays in, SST out); through rocksdict's per-key API it is out of reach.  On disk
after compaction (zstd): 16 bytes per stored context.

GIL (measured with a spinning Python thread)
--------------------------------------------
``Rdict.get([keys])`` releases the GIL between keys (the other thread kept ~70% of its speed);
``Rdict.write(batch)`` holds it for the whole call (~0.4 µs per sorted key, ~1.5 µs per key
under load): an apply of 2.7M contexts (250k tokens of code) stalls every Python thread of the
process for 1-4 s.  ``apply(max_tokens)`` bounds that stall: a daemon that serves cold reads
while applying should call it with a few thousand tokens at a time (≈10 contexts per token).
``ingest_external_file`` and ``flush`` release the GIL; a Python loop of puts yields it every
switch interval (5 ms).

Reads never take the writer's locks: RocksDB gives every get/iterator a consistent view.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Iterator

import numpy as np
from numba import njit
from rocksdict import (
    BlockBasedOptions, Cache, DBCompressionType, Options, ReadOptions, Rdict, WriteBatch,
    WriteOptions,
)

from .errors import BadInput, NgramError, StorageError
from .identity import TableIdentity
from .kernels import EMPTY_TOKEN, MAX_ORDER, context_hashes, count_ngrams, merge_rows
from .validate import as_tokens

log = logging.getLogger(__name__)

CF_NGRAMS = "ngrams"
CF_LOG = "log"
CF_META = "meta"
COLUMN_FAMILIES = (CF_NGRAMS, CF_LOG, CF_META)

META_IDENTITY = b"identity"
META_APPLIED = b"applied"
META_ENTRIES = b"entries"

U32_MAX = 0xFFFFFFFF
_COMPRESSION = {
    "zstd": DBCompressionType.zstd(), "lz4": DBCompressionType.lz4(),
    "none": DBCompressionType.none(),
}


@dataclass(frozen=True)
class ColdOptions:
    """Every RocksDB knob of the cold tier, in one place (DESIGN §5)."""

    block_cache_mb: int = 256  # shared LRU block cache of all column families, MiB
    bloom_bits_per_key: float = 10.0  # ~1% false positives: a miss costs no data-block read
    direct_reads: bool = False  # O_DIRECT: measure the disk, not the page cache (seed lesson 4)
    compression: str = "zstd"  # "zstd" | "lz4" | "none" (ngrams CF; the log CF uses lz4)
    block_size_kb: int = 4  # data block size: bigger compresses better, point reads read more
    sync_log: bool = True  # fsync the WAL before append_log returns (acked = durable)
    read_threads: int = 4  # thread pool for batched gets (rocksdict's get([keys]) is serial)
    read_chunk: int = 2048  # keys per get([keys]) call handed to one pool thread
    write_buffer_mb: int = 64  # memtable size per column family, MiB
    max_background_jobs: int = 2  # flush + compaction threads
    # apply(): read an order's existing values by one range scan (0.7-3 µs per stored entry)
    # instead of point gets (3-5 µs/key) when the table holds <= scan_ratio x the batch's keys of
    # that order (low orders, early warm-up)
    scan_ratio: float = 2.0

    def __post_init__(self):
        if self.compression not in _COMPRESSION:
            raise BadInput(f"compression must be one of {sorted(_COMPRESSION)}, "
                           f"got {self.compression!r}")
        for name in ("block_cache_mb", "read_threads", "read_chunk", "write_buffer_mb",
                     "max_background_jobs", "block_size_kb"):
            if int(getattr(self, name)) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.bloom_bits_per_key < 0 or self.scan_ratio < 0:
            raise BadInput("bloom_bits_per_key and scan_ratio must be >= 0")


@dataclass
class ApplyResult:
    """What one ``apply()`` changed, so the hot tier can refresh without a rescan.

    Rows are the contexts whose stored value changed, sorted by (order, context tokens); the
    ``total``/``tok``/``cnt`` are the merged values now stored (``tok`` padded with
    ``EMPTY_TOKEN``, ``cnt`` with 0, shape ``(m, cold_k)``).
    """

    first_seq: int
    last_seq: int
    tokens: int  # tokens read from the log
    key: np.ndarray  # uint64 kernels key hash
    parent: np.ndarray  # uint64 hash of the order-1 suffix (0 for order 1)
    order: np.ndarray  # uint8
    total: np.ndarray  # uint32
    tok: np.ndarray  # uint32 (m, cold_k)
    cnt: np.ndarray  # uint32 (m, cold_k)
    new_entries: int = 0  # rows that did not exist before

    def __len__(self) -> int:
        return int(self.key.shape[0])


# ---------------------------------------------------------------------------------------------
# encoding (vectorised; one call per order or per chunk, not per key)
# ---------------------------------------------------------------------------------------------
def _be64(n: int) -> bytes:
    return int(n).to_bytes(8, "big")


def encode_keys(order: int, ctx: np.ndarray) -> list[bytes]:
    """Keys of ``m`` contexts of one order: ``ctx`` is uint32 ``(m, order)``, oldest first."""
    m = ctx.shape[0]
    width = 1 + 4 * order
    raw = np.empty((m, width), np.uint8)
    raw[:, 0] = order
    raw[:, 1:] = np.ascontiguousarray(ctx, dtype=">u4").view(np.uint8).reshape(m, 4 * order)
    # a void view turns each row into one bytes object without a Python loop ("S" would strip
    # trailing NUL bytes and corrupt keys that end in a zero byte)
    return raw.view(f"V{width}").reshape(m).tolist()


def decode_keys(keys: list[bytes], width: int) -> np.ndarray:
    """Context tokens ``(m, (width - 1) // 4)`` of keys that all have ``width`` bytes."""
    raw = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), width)
    return raw[:, 1:].copy().view(">u4").astype(np.uint32)


@njit(cache=True)
def _pack_values(total, tok, cnt):
    """Group rows by their number of candidates p: returns ``(npairs, order, blocks)`` where
    ``order`` lists the rows grouped by p (ascending, stable) and ``blocks`` holds, group after
    group, each row's words (total, tok0, cnt0, ...) compactly."""
    m, k = tok.shape
    npairs = np.zeros(m, np.int64)
    n_of = np.zeros(k + 2, np.int64)
    for i in range(m):
        p = 0
        while p < k and tok[i, p] != EMPTY_TOKEN:
            p += 1
        npairs[i] = p
        n_of[p + 1] += 1
    row_start = np.cumsum(n_of)  # first slot in ``order`` of each group
    word_start = np.zeros(k + 2, np.int64)
    for p in range(k + 1):
        word_start[p + 1] = word_start[p] + n_of[p + 1] * (1 + 2 * p)
    order = np.empty(m, np.int64)
    blocks = np.empty(word_start[k + 1], np.uint32)
    fill = row_start[: k + 1].copy()
    wfill = word_start[: k + 1].copy()
    for i in range(m):
        p = npairs[i]
        order[fill[p]] = i
        fill[p] += 1
        w = wfill[p]
        blocks[w] = total[i]
        for j in range(p):
            blocks[w + 1 + 2 * j] = tok[i, j]
            blocks[w + 2 + 2 * j] = cnt[i, j]
        wfill[p] = w + 1 + 2 * p
    return npairs, order, row_start, word_start, blocks


def encode_values(total: np.ndarray, tok: np.ndarray, cnt: np.ndarray) -> list[bytes]:
    """Values of ``m`` rows: total + the non-empty (token, count) pairs (see module doc).

    Rows with the same number of candidates share one width, so each group becomes bytes
    objects through one void view (~0.05 µs/row) instead of a Python loop of slices."""
    m, k = tok.shape
    _, order, row_start, word_start, blocks = _pack_values(
        np.ascontiguousarray(total, np.uint32), np.ascontiguousarray(tok, np.uint32),
        np.ascontiguousarray(cnt, np.uint32))
    raw = blocks.astype("<u4", copy=False).view(np.uint8)
    out = np.empty(m, dtype=object)
    for p in range(k + 1):
        r0, r1 = int(row_start[p]), int(row_start[p + 1])
        if r1 == r0:
            continue
        width = 4 * (1 + 2 * p)
        seg = raw[4 * int(word_start[p]): 4 * int(word_start[p + 1])]
        out[order[r0:r1]] = seg.view(f"V{width}").tolist()
    return out.tolist()


def decode_values(vals: list, k: int):
    """Decode values (``None`` = missing) into ``(has, total, tok (m, k), cnt (m, k))``."""
    m = len(vals)
    lens = np.fromiter((len(v) if v is not None else 0 for v in vals), np.int64, count=m)
    has = lens > 0
    total = np.zeros(m, np.uint32)
    tok = np.full((m, k), EMPTY_TOKEN, np.uint32)
    cnt = np.zeros((m, k), np.uint32)
    if not has.any():
        return has, total, tok, cnt
    present = lens[has]
    npairs = (present - 4) // 8
    if np.any(present < 4) or np.any((present - 4) % 8) or np.any(npairs > k):
        raise StorageError("cold tier: corrupt value in the ngrams column family "
                           f"(lengths {np.unique(present)[:8].tolist()} bytes, cold_k={k})")
    words = np.frombuffer(b"".join(v for v in vals if v is not None), "<u4")
    start = np.zeros(present.size, np.int64)
    np.cumsum(present[:-1] // 4, out=start[1:])
    idx = np.flatnonzero(has)
    total[idx] = words[start]
    for j in range(int(npairs.max())):
        sel = npairs > j
        tok[idx[sel], j] = words[start[sel] + 1 + 2 * j]
        cnt[idx[sel], j] = words[start[sel] + 2 + 2 * j]
    return has, total, tok, cnt


def _lexsort_ctx(ctx: np.ndarray, vocab_size: int) -> np.ndarray:
    """Permutation sorting contexts ``(m, n)`` lexicographically (= their key bytes).

    Tokens are packed several to a uint64 (18 bits each for Qwen3's vocabulary: 3 per word),
    so ``np.lexsort`` makes ceil(n / per_word) passes instead of n (0.35 µs/row for order 8)."""
    m, n = ctx.shape
    bits = max(1, int(vocab_size - 1).bit_length())
    per = max(1, 64 // bits)
    if n <= per:
        cols = [_pack_cols(ctx, 0, n, bits)]
    else:
        cols = [_pack_cols(ctx, j, min(j + per, n), bits) for j in range(0, n, per)]
    if len(cols) == 1:
        return np.argsort(cols[0], kind="stable")
    return np.lexsort(cols[::-1])


def _pack_cols(ctx, a, b, bits):
    w = np.zeros(ctx.shape[0], np.uint64)
    for j in range(a, b):
        w = (w << np.uint64(bits)) | ctx[:, j].astype(np.uint64)
    return w


def _rows_of(total, tok, cnt):
    """``(total, tok[k'], cnt[k'])`` of one decoded row, trimmed to its real candidates."""
    kk = int((tok != EMPTY_TOKEN).sum())
    return int(total), tok[:kk].copy(), cnt[:kk].copy()


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
    """The cold tier of one table: full counts of every order plus the durable ingest log.

    Thread model: any number of reader threads (``get``, ``get_many``, ``scan``, ``top``,
    ``stats``); one ``apply`` at a time; ``append_log`` may run concurrently with ``apply``.
    """

    def __init__(self, path, identity: TableIdentity, options: ColdOptions = ColdOptions()):
        self.path = Path(path)
        self.options = options
        self._apply_lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._closed = True
        self._scans: weakref.WeakSet = weakref.WeakSet()
        self._cache = Cache(options.block_cache_mb << 20)
        with _storage(f"opening {self.path}"):
            self.path.mkdir(parents=True, exist_ok=True)
            # the reopen trap: table options (bloom, block cache) of an existing column family
            # are ignored unless that family is opened with them, so always pass all three
            self._db = Rdict(str(self.path), self._db_options(),
                             column_families={name: self._cf_options(name)
                                              for name in COLUMN_FAMILIES})
            self._closed = False
        try:
            with _storage(f"opening {self.path}"):
                self._ng = self._db.get_column_family(CF_NGRAMS)
                self._log = self._db.get_column_family(CF_LOG)
                self._meta = self._db.get_column_family(CF_META)
                self._h_ng = self._db.get_column_family_handle(CF_NGRAMS)
                self._h_log = self._db.get_column_family_handle(CF_LOG)
                self._h_meta = self._db.get_column_family_handle(CF_META)
                self._wo_log = WriteOptions()
                self._wo_log.sync = options.sync_log
                self._wo_apply = WriteOptions()  # not synced: see the module doc
            self._load_meta(identity)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=options.read_threads,
                                        thread_name_prefix="cold-read")
        log.info("cold tier open at %s: orders %d..%d, cold_k %d, %d entries, applied seq %d, "
                 "last seq %d", self.path, self.identity.n_min, self.identity.n_max,
                 self.identity.cold_k, int(self._entries.sum()), self._applied, self._last)

    # ---- setup ------------------------------------------------------------------------------
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
        if name == CF_NGRAMS:
            if opt.bloom_bits_per_key > 0:
                bb.set_bloom_filter(opt.bloom_bits_per_key, False)
            bb.set_cache_index_and_filter_blocks(True)
            bb.set_pin_l0_filter_and_index_blocks_in_cache(True)
            o.set_compression_type(_COMPRESSION[opt.compression])
            o.set_write_buffer_size(opt.write_buffer_mb << 20)
            # level sizes follow the data: bounded space amplification whatever the table size
            # (no optimize_filters_for_hits: misses are common at high orders)
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
            # new table (or one whose creation never finished: nothing else can be in it)
            with _storage("recording the identity"):
                wb = WriteBatch(raw_mode=True)
                wb.put(META_IDENTITY, identity.to_json(), self._h_meta)
                wb.put(META_APPLIED, (0).to_bytes(8, "little"), self._h_meta)
                wb.put(META_ENTRIES, np.zeros(MAX_ORDER + 1, "<u8").tobytes(), self._h_meta)
                wo = WriteOptions()
                wo.sync = True
                self._db.write(wb, wo)
            self.identity = identity
            log.info("cold tier created at %s", self.path)
        else:
            try:
                stored = TableIdentity.from_json(raw)
            except Exception as e:
                raise StorageError(f"cold tier: unreadable identity in {self.path}: {e}") from None
            stored.check_compatible(identity)
            self.identity = stored
        with _storage("reading meta"):
            applied = self._meta.get(META_APPLIED)
            entries = self._meta.get(META_ENTRIES)
            last_key = next(iter(self._log.keys(backwards=True)), None)
        if applied is None or entries is None or len(entries) != 8 * (MAX_ORDER + 1):
            raise StorageError(f"cold tier: meta column family of {self.path} is incomplete")
        self._applied = int.from_bytes(applied, "little")
        self._entries = np.frombuffer(entries, "<u8").astype(np.int64)
        # the log may be empty after every record was applied: never reuse a seq <= applied
        self._last = max(self._applied, int.from_bytes(last_key, "big") if last_key else 0)

    # ---- context manager / lifecycle --------------------------------------------------------
    def __enter__(self) -> "ColdStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the database (idempotent).  Waits for a running ``apply``/``append_log``."""
        if self._closed:
            return
        with self._apply_lock, self._log_lock:
            if self._closed:
                return
            self._closed = True
            for gen in list(self._scans):
                with contextlib.suppress(ValueError):  # "generator already executing"
                    gen.close()
            pool = getattr(self, "_pool", None)
            if pool is not None:
                pool.shutdown(wait=True)
            with _storage("closing"):
                # column-family Rdicts keep the DB (and its LOCK file) alive: close them first
                # (and so do the handles, which cannot be closed: drop our references)
                for name in ("_ng", "_log", "_meta"):
                    cf = getattr(self, name, None)
                    if cf is not None:
                        cf.close()
                        setattr(self, name, None)
                self._h_ng = self._h_log = self._h_meta = None
                self._db.close()
            log.info("cold tier closed at %s", self.path)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"cold tier at {self.path} is closed")

    def flush(self) -> None:
        """Flush memtables to SST files and fsync the WAL (tests, shutdown)."""
        self._check_open()
        with _storage("flush"):
            self._db.flush_wal(True)
            for cf in (self._ng, self._log, self._meta):
                cf.flush(True)

    def compact(self) -> None:
        """Compact the ngrams and log families fully (drops deleted log records' tombstones)."""
        self._check_open()
        with _storage("compaction"):
            self._ng.compact_range(None, None)
            self._log.compact_range(None, None)

    # ---- the ingest log ---------------------------------------------------------------------
    def append_log(self, tokens: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
        """Append sequences ``tokens[offsets[i]:offsets[i+1]]`` to the log, one record each, in
        one WriteBatch; returns ``(first_seq, last_seq)`` once durable (WAL, fsynced if
        ``sync_log``).  Sequences must be non-empty."""
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = self._as_offsets(offsets, tokens.size)
        raw = tokens.astype("<u4", copy=False).tobytes()
        bounds = (offsets * 4).tolist()
        with self._log_lock:
            self._check_open()
            first = self._last + 1
            wb = WriteBatch(raw_mode=True)
            for i in range(len(bounds) - 1):
                wb.put(_be64(first + i), raw[bounds[i]:bounds[i + 1]], self._h_log)
            with _storage("appending to the ingest log"):
                self._db.write(wb, self._wo_log)
            self._last = first + len(bounds) - 2
            return first, self._last

    @staticmethod
    def _as_offsets(offsets, n_tokens: int) -> np.ndarray:
        a = np.asarray(offsets)
        if a.ndim != 1 or a.size < 2 or (a.size and a.dtype.kind not in "iu"):
            raise BadInput(f"offsets: expected a 1-D integer array of >= 2 bounds, "
                           f"got shape {a.shape} dtype {a.dtype}")
        a = a.astype(np.int64)
        if a[0] != 0 or a[-1] != n_tokens:
            raise BadInput(f"offsets must start at 0 and end at {n_tokens} (the token count), "
                           f"got {int(a[0])}..{int(a[-1])}")
        if np.any(np.diff(a) <= 0):
            raise BadInput("offsets must be strictly increasing (no empty sequences)")
        return a

    def applied_seq(self) -> int:
        """Last log sequence number whose tokens are counted in ``ngrams``."""
        return self._applied

    def last_seq(self) -> int:
        """Last log sequence number handed out (log lag = last_seq() - applied_seq())."""
        return self._last

    # ---- the writer -------------------------------------------------------------------------
    def apply(self, max_tokens: int = 1_000_000) -> ApplyResult | None:
        """Count log records above the watermark (whole records, at least one, until about
        ``max_tokens`` tokens) into ``ngrams``; returns what changed, or None if nothing was
        pending.  One writer: concurrent calls are serialised."""
        if max_tokens < 1:
            raise BadInput(f"max_tokens must be >= 1, got {max_tokens}")
        with self._apply_lock:
            self._check_open()
            return self._apply_locked(int(max_tokens))

    def _read_log(self, max_tokens: int):
        seqs, recs, n = [], [], 0
        with _storage("reading the ingest log"):
            for key, val in self._log.items(from_key=_be64(self._applied + 1)):
                if len(key) != 8 or len(val) % 4:
                    raise StorageError(f"cold tier: corrupt log record {key!r} "
                                       f"({len(val)} bytes)")
                seqs.append(int.from_bytes(key, "big"))
                recs.append(val)
                n += len(val) // 4
                if n >= max_tokens:
                    break
        return seqs, recs, n

    def _apply_locked(self, max_tokens: int) -> ApplyResult | None:
        seqs, recs, n_tok = self._read_log(max_tokens)
        if not seqs:
            return None
        ident = self.identity
        k = ident.cold_k
        tokens = np.frombuffer(b"".join(recs), "<u4").astype(np.uint32)
        offsets = np.zeros(len(recs) + 1, np.int64)
        np.cumsum([len(r) // 4 for r in recs], out=offsets[1:])
        c = count_ngrams(tokens, offsets, ident.n_min, ident.n_max, k)
        m = c["key"].shape[0]
        # Rows go to RocksDB in key order (order, then tokens): sorted memtable inserts cost
        # 0.4 µs/key here against 4.9 µs/key in hash order (1M keys, measured).
        by_order = np.argsort(c["order"], kind="stable")
        bounds = np.searchsorted(c["order"][by_order], np.arange(MAX_ORDER + 2))
        rows_all = np.empty(m, np.int64)  # final row order -> row of ``c``
        old_idx = np.full(m, -1, np.int64)  # final row -> index into the stored values read
        old_parts, keys_all, n_old = [], [], 0
        new_entries = np.zeros(MAX_ORDER + 1, np.int64)
        for o in range(ident.n_min, ident.n_max + 1):
            lo, hi = int(bounds[o]), int(bounds[o + 1])
            if hi == lo:
                continue
            rows = by_order[lo:hi]
            ctx = tokens[c["pos"][rows, None] - o + np.arange(o)]
            srt = _lexsort_ctx(ctx, ident.vocab_size)
            rows_all[lo:hi] = rows[srt]
            keys = encode_keys(o, ctx[srt])
            found, ot, otok, ocnt = self._read_existing(o, keys)
            if found.size:
                old_idx[lo + found] = n_old + np.arange(found.size)
                old_parts.append((ot, otok, ocnt))
                n_old += found.size
            new_entries[o] = (hi - lo) - found.size
            keys_all.extend(keys)
        if old_parts:
            ot, otok, ocnt = (np.concatenate(x) for x in zip(*old_parts))
        else:
            ot, otok, ocnt = (np.zeros(1, np.uint32), np.zeros((1, k), np.uint32),
                              np.zeros((1, k), np.uint32))
        mt = np.empty(m, np.uint32)
        mtok = np.empty((m, k), np.uint32)
        mcnt = np.empty((m, k), np.uint32)
        merge_rows(rows_all, old_idx, ot, otok, ocnt, c["total"], c["tok"], c["cnt"],
                   mt, mtok, mcnt)
        vals_all = encode_values(mt, mtok, mcnt)
        entries = self._entries + new_entries

        wb = WriteBatch(raw_mode=True)
        # map() instead of a for loop: ~0.1 µs/key less Python overhead (measured)
        deque(map(wb.put, keys_all, vals_all, repeat(self._h_ng, m)), maxlen=0)
        wb.put(META_APPLIED, seqs[-1].to_bytes(8, "little"), self._h_meta)
        wb.put(META_ENTRIES, entries.astype("<u8").tobytes(), self._h_meta)
        for s in seqs:
            wb.delete(_be64(s), self._h_log)
        with _storage("writing counts"):
            self._db.write(wb, self._wo_apply)
        self._applied = seqs[-1]
        self._entries = entries

        res = ApplyResult(
            first_seq=seqs[0], last_seq=seqs[-1], tokens=n_tok, key=c["key"][rows_all],
            parent=c["parent"][rows_all], order=c["order"][rows_all], total=mt, tok=mtok,
            cnt=mcnt, new_entries=int(new_entries.sum()),
        )
        log.debug("applied log %d..%d: %d tokens, %d contexts (%d new)", res.first_seq,
                  res.last_seq, n_tok, m, res.new_entries)
        return res

    def _read_existing(self, order: int, keys: list[bytes]):
        """Stored values for ``keys`` (all of one order): ``(found, total, tok, cnt)`` where
        ``found`` are the indices into ``keys`` that exist and the arrays their values.

        The per-key ``get`` (~3-5 µs here) dominates apply on a warm table, so: an order with no
        entries is not read at all (the first batches of a warm-up); an order whose entries are
        few compared with the batch's keys (low orders) is read by one range scan (~0.7 µs per
        stored entry); otherwise batched gets over the read pool.
        """
        k = self.identity.cold_k
        stored = int(self._entries[order])
        if stored == 0:
            return (np.zeros(0, np.int64), np.zeros(0, np.uint32), np.zeros((0, k), np.uint32),
                    np.zeros((0, k), np.uint32))
        if stored <= self.options.scan_ratio * len(keys):
            index = {kb: i for i, kb in enumerate(keys)}
            found, vals = [], []
            ro = ReadOptions()
            ro.set_iterate_upper_bound(bytes([order + 1]))
            with _storage("scanning existing counts"):
                for kb, vb in self._ng.items(from_key=bytes([order]), read_opt=ro):
                    i = index.get(kb)
                    if i is not None:
                        found.append(i)
                        vals.append(vb)
            found = np.array(found, np.int64)
        else:
            got = self._get_keys(keys)
            found = np.flatnonzero(np.fromiter((v is not None for v in got), bool, len(got)))
            vals = [got[i] for i in found.tolist()]
        _, total, tok, cnt = decode_values(vals, k)
        return found, total, tok, cnt

    def _get_keys(self, keys: list[bytes]) -> list:
        """``get`` many keys: chunks over the read pool (rocksdict's get([keys]) is serial but
        releases the GIL between keys)."""
        chunk = self.options.read_chunk
        with _storage("reading counts"):
            if len(keys) <= chunk:
                return self._ng.get(keys)
            parts = self._pool.map(self._ng.get,
                                   [keys[i:i + chunk] for i in range(0, len(keys), chunk)])
            out = []
            for p in parts:
                out.extend(p)
            return out

    # ---- readers ----------------------------------------------------------------------------
    def _check_order(self, order) -> int:
        if isinstance(order, (bool, np.bool_)) or not isinstance(order, (int, np.integer)):
            raise BadInput(f"order must be an integer, got {type(order).__name__}")
        o = int(order)
        if not self.identity.n_min <= o <= self.identity.n_max:
            raise BadInput(f"order {o} outside the table's orders "
                           f"{self.identity.n_min}..{self.identity.n_max}")
        return o

    def get(self, order: int, ctx) -> tuple[int, np.ndarray, np.ndarray] | None:
        """``(total, tok[k'], cnt[k'])`` stored for the last ``order`` tokens of ``ctx``, or
        None.  ``k'`` <= cold_k is the number of candidates seen."""
        self._check_open()
        o = self._check_order(order)
        ctx = as_tokens(ctx, self.identity.vocab_size, what="ctx")
        if ctx.size < o:
            raise BadInput(f"ctx: {ctx.size} tokens is shorter than the order {o}")
        key = encode_keys(o, ctx[None, ctx.size - o:])[0]
        with _storage("reading counts"):
            val = self._ng.get(key)
        if val is None:
            return None
        _, total, tok, cnt = decode_values([val], self.identity.cold_k)
        return _rows_of(total[0], tok[0], cnt[0])

    def get_many(self, orders, tokens, offsets) -> list[tuple[int, np.ndarray, np.ndarray] | None]:
        """``get(orders[i], tokens[offsets[i]:offsets[i+1]])`` for every i, batched: keys are
        built per order with numpy and read in chunks over the read pool."""
        keys = self._keys_for(orders, tokens, offsets)
        has, total, tok, cnt = decode_values(self._get_keys(keys), self.identity.cold_k)
        return [_rows_of(total[i], tok[i], cnt[i]) if has[i] else None for i in range(len(keys))]

    def may_exist(self, orders, tokens, offsets) -> np.ndarray:
        """For each context as in ``get_many``: False when the key is certainly absent, decided
        without I/O (memtables and the Bloom filters in the block cache); True = maybe.  Lets
        a reader skip a round of reads for keys that do not exist (~1 µs a key)."""
        keys = self._keys_for(orders, tokens, offsets)
        with _storage("checking keys"):
            return np.fromiter((self._ng.key_may_exist(k) for k in keys), bool, count=len(keys))

    def _keys_for(self, orders, tokens, offsets) -> list[bytes]:
        """Validated, encoded keys of the last ``orders[i]`` tokens of each context."""
        self._check_open()
        tokens = as_tokens(tokens, self.identity.vocab_size, what="tokens")
        offsets = self._as_offsets(offsets, tokens.size)
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
        n = orders.size
        arr = np.empty(n, dtype=object)
        for o in np.unique(orders).tolist():
            rows = np.flatnonzero(orders == o)
            ctx = tokens[offsets[rows + 1, None] - o + np.arange(o)]
            arr[rows] = encode_keys(o, ctx)
        return arr.tolist()

    def scan(self, order: int | None = None, chunk: int = 65536) -> Iterator[dict]:
        """Every entry (of one order, or all), in key order, in chunks of up to ``chunk`` rows.

        Each chunk is a dict of arrays: ``key`` (uint64 kernels hash of the context, equal to
        what ``kernels.ngram_events``/``count_ngrams`` give), ``parent`` (hash of the order-1
        suffix, 0 for order 1), ``order`` (uint8), ``ctx`` (uint32 ``(m, n_max)``: the context
        left-aligned, oldest first, padded with ``EMPTY_TOKEN``), ``total`` (uint32), ``tok``
        and ``cnt`` (uint32 ``(m, cold_k)``).  The scan reads one consistent snapshot.
        """
        self._check_open()
        if chunk < 1:
            raise BadInput(f"chunk must be >= 1, got {chunk}")
        o = None if order is None else self._check_order(order)
        gen = self._scan(o, int(chunk))
        # a live RocksDB iterator keeps the whole DB (and its LOCK) open: close() ends scans
        self._scans.add(gen)
        return gen

    def _scan(self, order: int | None, chunk: int) -> Iterator[dict]:
        ro = ReadOptions()
        if order is None:
            start = bytes([1])
        else:
            start = bytes([order])
            ro.set_iterate_upper_bound(bytes([order + 1]))
        ks, vs = [], []
        with _storage("scanning"):
            it = self._ng.items(from_key=start, read_opt=ro)
        while True:
            self._check_open()
            with _storage("scanning"):
                for kb, vb in it:
                    ks.append(kb)
                    vs.append(vb)
                    if len(ks) >= chunk:
                        break
            if not ks:
                return
            yield self._decode_chunk(ks, vs)
            ks, vs = [], []

    def _decode_chunk(self, ks: list[bytes], vs: list[bytes]) -> dict:
        ident = self.identity
        m = len(ks)
        klen = np.fromiter(map(len, ks), np.int64, count=m)
        if np.any((klen - 1) % 4) or np.any(klen < 5):
            raise StorageError("cold tier: corrupt key in the ngrams column family")
        order = ((klen - 1) // 4).astype(np.uint8)
        ctx = np.full((m, ident.n_max), EMPTY_TOKEN, np.uint32)
        for o in np.unique(order).tolist():
            if o > ident.n_max:
                raise StorageError(f"cold tier: key of order {o} > n_max {ident.n_max}")
            rows = np.flatnonzero(order == o)
            ctx[rows, :o] = decode_keys([ks[i] for i in rows.tolist()], 1 + 4 * o)
        key = np.empty(m, np.uint64)
        parent = np.empty(m, np.uint64)
        context_hashes(ctx, order, key, parent)
        _, total, tok, cnt = decode_values(vs, ident.cold_k)
        return dict(key=key, parent=parent, order=order, ctx=ctx, total=total, tok=tok, cnt=cnt)

    def top(self, order: int, n: int) -> list[tuple[np.ndarray, int, np.ndarray, np.ndarray]]:
        """The ``n`` contexts of ``order`` with the largest totals (ties: key order), as
        ``(ctx[order], total, tok[k'], cnt[k'])``, most frequent first.  A full scan."""
        o = self._check_order(order)
        if n < 1:
            return []
        best = None
        for ch in self.scan(o):
            # keep at most n rows across chunks; stable sort keeps scan (key) order among ties
            cand = ch if best is None else {f: np.concatenate([best[f], ch[f]]) for f in ch}
            idx = np.argsort(-cand["total"].astype(np.int64), kind="stable")[:n]
            best = {f: v[idx] for f, v in cand.items()}
        if best is None:
            return []
        out = []
        for i in range(best["total"].size):
            total, tok, cnt = _rows_of(best["total"][i], best["tok"][i], best["cnt"][i])
            out.append((best["ctx"][i, :o].copy(), total, tok, cnt))
        return out

    def entries(self) -> dict[int, int]:
        """Exact number of stored contexts per order."""
        e = self._entries
        return {o: int(e[o]) for o in range(self.identity.n_min, self.identity.n_max + 1)}

    def stats(self) -> dict:
        """Entries per order, bytes on disk, log position.

        ``sst_bytes``/``memtable_bytes`` are RocksDB properties of the ngrams family;
        ``wal_bytes``/``total_bytes`` sum file sizes in the directory; ``bytes_per_entry`` is
        ngrams SST bytes per stored context (meaningful after ``flush``/``compact``).
        """
        self._check_open()
        with _storage("reading properties"):
            sst = int(self._ng.property_int_value("rocksdb.total-sst-files-size") or 0)
            mem = int(self._ng.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
            log_sst = int(self._log.property_int_value("rocksdb.total-sst-files-size") or 0)
        wal = total = 0
        for f in os.scandir(self.path):
            with contextlib.suppress(OSError):
                if f.is_file():
                    size = f.stat().st_size
                    total += size
                    if f.name.endswith(".log"):
                        wal += size
        n = int(self._entries.sum())
        return dict(
            entries=self.entries(), entries_total=n, sst_bytes=sst, memtable_bytes=mem,
            log_sst_bytes=log_sst, wal_bytes=wal, total_bytes=total,
            bytes_per_entry=(sst / n if n else 0.0),
            applied_seq=self._applied, last_seq=self._last, log_lag=self._last - self._applied,
        )
