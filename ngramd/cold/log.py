"""The cold tier's side of the ingest log: the record format, and the log a ``ColdStore`` keeps.

``ngramd.cold.ingestlog`` stores opaque payloads durably; this module says what a payload is and
owns the log's place in the table (ARCHITECTURE §5.5):

* **A record** is u32 LE ``skip`` + the raw u32 LE tokens.  A sequence longer than
  ``max_record_tokens`` is split into several records that overlap by ``n_max`` tokens;
  ``skip`` is the number of leading tokens that are context only, so no event is counted twice
  and no apply is unbounded (``split_records``).
* **Other hosts' records** (appended by the fleet's consumer) carry ``ORIGIN_FLAG`` in the skip
  word, followed by the 16-byte origin id and the u64 LE seq the record had in the origin's
  log, then the tokens.  Per record, so a torn append still tells exactly which remote records
  made it (their redeliveries are recognised by (origin, seq)).
* **A record that cannot be counted** is copied to ``quarantine/<seq>.rec`` with the reason
  beside it and counted as empty (``ColdLog.quarantine``): one bad record must not stop the
  writer, nor send a restarted daemon into the same failure again.

``ColdLog`` holds the ``IngestLog``, the last seq handed out and the lock appends take.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from .ingestlog import IngestLog
from ..wire.errors import BadInput, StorageError

log = logging.getLogger("ngramd.cold")

#: a log record whose skip word has this bit came from another host (see the module doc)
ORIGIN_FLAG = 1 << 31
ORIGIN_HEAD = 24
_EMPTY_RECORD = b"\0\0\0\0"


def origin_of(rec: bytes) -> tuple[bytes, int] | None:
    """``(origin id, seq in the origin's log)`` of a log record from another host, else None
    (a local record, or one too short to carry its head: the quarantine deals with it)."""
    if len(rec) < 4 + ORIGIN_HEAD or not int.from_bytes(rec[:4], "little") & ORIGIN_FLAG:
        return None
    return rec[4:20], int.from_bytes(rec[20:28], "little")


def strip_origins(recs: list[bytes]) -> tuple[list[bytes], dict]:
    """Records without their origin heads (``ORIGIN_FLAG``), and per origin the last seq."""
    out, origins = [], {}
    for r in recs:
        head = origin_of(r)
        if head is not None:
            o, q = head
            if q > origins.get(o, -1):
                origins[o] = q
            r = r[:4] + r[4 + ORIGIN_HEAD:]
        out.append(r)
    return out, origins


def max_merge(a: dict, b: dict) -> dict:
    """Per key the larger value of ``a`` and ``b`` (per origin watermarks), as a new dict."""
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, -1):
            out[k] = v
    return out


def split_counts(lengths: np.ndarray, max_record_tokens: int, n_max: int) -> np.ndarray:
    """Records each sequence of these lengths becomes (1 unless it is longer than
    ``max_record_tokens``)."""
    R, ov = max_record_tokens, n_max
    lengths = np.asarray(lengths, np.int64)
    extra = np.maximum(lengths - R, 0)
    return 1 + (extra + (R - ov) - 1) // (R - ov)


def split_records(tokens: np.ndarray, offsets: np.ndarray, max_record_tokens: int,
                  n_max: int) -> list[bytes]:
    """The log records of sequences ``tokens[offsets[i]:offsets[i+1]]`` (``split_counts`` of
    them a sequence)."""
    R, ov = max_record_tokens, n_max
    out = []
    raw = tokens.astype("<u4", copy=False)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        if b - a <= R:
            out.append(_EMPTY_RECORD + raw[a:b].tobytes())
            continue
        out.append(_EMPTY_RECORD + raw[a:a + R].tobytes())
        st = a + R
        while st < b:
            lo = max(a, st - ov)
            hi = min(b, st + R - ov)
            out.append((st - lo).to_bytes(4, "little") + raw[lo:hi].tobytes())
            st = hi
    return out


def remote_records(records: list[tuple[bytes, int, bytes]]) -> list[bytes]:
    """Other hosts' records ``(origin id (16 bytes), seq in the origin's log, record)``, each
    marked with its origin (``ORIGIN_FLAG``)."""
    out = []
    for origin, oseq, rec in records:
        if len(origin) != 16 or len(rec) < 4 or len(rec) % 4 or \
                int.from_bytes(rec[:4], "little") & ORIGIN_FLAG:
            raise BadInput("remote log record: expected a 16-byte origin and a local "
                           "record (skip word + whole tokens)")
        word = int.from_bytes(rec[:4], "little") | ORIGIN_FLAG
        out.append(word.to_bytes(4, "little") + origin + int(oseq).to_bytes(8, "little")
                   + rec[4:])
    return out


def decode_records(recs: list[bytes]):
    """``(tokens, offsets, skips, origins)`` of countable records: the sequences to count,
    how many leading tokens of each are context only, and per other host the last seq among
    them (None when every record is local)."""
    words = np.frombuffer(b"".join(r[:4] for r in recs), "<u4")
    origins = None
    if np.any(words & ORIGIN_FLAG):
        recs, origins = strip_origins(recs)
    skips = (words & ~np.uint32(ORIGIN_FLAG)).astype(np.int64)
    lens = np.fromiter((len(r) // 4 - 1 for r in recs), np.int64, count=len(recs))
    tokens = np.frombuffer(b"".join(r[4:] for r in recs), "<u4").astype(np.uint32)
    offsets = np.zeros(len(recs) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return tokens, offsets, skips, origins


def why_uncountable(rec: bytes, vocab_size: int) -> str | None:
    """Why a record cannot be counted, or None when it can."""
    word = int.from_bytes(rec[:4], "little") if len(rec) >= 4 else 0
    head = 4 + (ORIGIN_HEAD if word & ORIGIN_FLAG else 0)
    if len(rec) < head or len(rec) % 4:
        return f"{len(rec)} bytes, not a skip word, its origin and whole tokens"
    skip, n = word & ~ORIGIN_FLAG, (len(rec) - head) // 4
    if skip > n:
        return f"skip {skip} beyond its {n} tokens"
    if n and int(np.frombuffer(rec, "<u4", offset=head).max()) >= vocab_size:
        return f"a token id >= vocab_size {vocab_size}"
    return None


class ColdLog:
    """The ingest log of one table (``<table>/ingest-log``), as the cold tier uses it: appends
    under one lock (``lock``, which ``ColdStore.close`` takes too), the last seq handed out,
    reads above the counted watermark and the quarantine of what cannot be counted.  The
    files are ``ilog`` (``IngestLog``: the fleet's hold is its ``hold``/``set_hold``)."""

    def __init__(self, table_dir: Path, applied: int, *, sync: bool, vocab_size: int):
        self.table_dir = table_dir
        self.vocab_size = vocab_size
        self.ilog = IngestLog(table_dir / "ingest-log", applied, sync=sync)
        self.lock = threading.Lock()
        # the log may be empty after every record was applied: never reuse a seq <= applied
        self.last = max(applied, self.ilog.last_seq())
        self.quarantined = 0  # log records that could not be counted (see quarantine)
        self.closed = False

    def close(self) -> None:
        """Close the log's files (the store does, under ``lock``)."""
        self.closed = True
        self.ilog.close()

    def probe(self) -> None:
        """``StorageError`` unless the log's directory takes a write now (``IngestLog.probe``;
        ``health.Probes``: a failed append)."""
        if self.closed:
            raise StorageError(f"cold tier at {self.table_dir} is closed")
        self.ilog.probe()

    def append(self, recs: list[bytes], check_open) -> tuple[int, int]:
        """One durable write of ``recs`` (``IngestLog.append``: the GIL is free while the disk
        works); ``check_open()`` runs under the lock first.  Returns ``(first, last)`` seq."""
        with self.lock:
            check_open()
            first, self.last = self.ilog.append(recs)
            return first, self.last

    def read(self, counted: int, max_tokens: int) -> tuple[list[int], list[bytes]]:
        """Whole records above ``counted``, about ``max_tokens`` tokens (at least one)."""
        seqs, recs = self.ilog.read(counted, max_tokens)
        if any(len(r) < 4 or len(r) % 4 for r in recs):
            raise StorageError("cold tier: corrupt record in the ingest log")
        return seqs, recs

    def local_records(self, after: int, max_bytes: int = 512 << 10) -> tuple[int, list]:
        """This host's own records above ``after`` still kept (the fleet's publisher reads
        them): ``(last seq looked at, [(seq, record), ...])`` (records from other hosts are
        passed over)."""
        seqs, recs = self.ilog.records(after, max_bytes)
        mine = [(q, r) for q, r in zip(seqs, recs)
                if not int.from_bytes(r[:4], "little") & ORIGIN_FLAG]
        return (seqs[-1] if seqs else after), mine

    def origin_watermarks(self, origins: dict, counted: int) -> dict[bytes, int]:
        """``origins`` (what is counted) raised by the remote records waiting above
        ``counted``."""
        out, after = dict(origins), counted
        while True:
            seqs, recs = self.ilog.records(after, 8 << 20)
            if not seqs:
                return out
            for head in filter(None, map(origin_of, recs)):
                o, q = head
                out[o] = max(out.get(o, 0), q)
            after = seqs[-1]

    def quarantine(self, seq: int, rec: bytes) -> bytes:
        """``rec`` if it can be counted; otherwise it is copied to ``quarantine/<seq>.rec`` with
        the reason beside it, reported, and counted as an empty record."""
        why = why_uncountable(rec, self.vocab_size)
        if why is None:
            return rec
        qdir = self.table_dir / "quarantine"
        try:
            qdir.mkdir(exist_ok=True)
            (qdir / f"{seq:020d}.rec").write_bytes(rec)
            (qdir / f"{seq:020d}.why").write_text(why + "\n")
        except OSError as e:
            log.error("could not keep quarantined log record %d: %s", seq, e)
        self.quarantined += 1
        log.error("ingest log record %d cannot be counted (%s): quarantined in %s, skipped",
                  seq, why, qdir)
        return _EMPTY_RECORD

    def migrate_cf(self, cf, applied: int, flush_wal) -> None:
        """Tables written before the file log kept the ingest log in the ``log`` column family
        ``cf``: move its records above ``applied`` into the file log (same seqs), then drop
        them (``flush_wal()`` makes the deletion durable)."""
        recs = [(int.from_bytes(k, "big"), v) for k, v in cf.items()]
        if not recs:
            return
        pending = [(q, v) for q, v in recs if q > applied]
        if pending:
            if self.ilog.last_seq() != applied or pending[0][0] != applied + 1:
                raise StorageError(f"cold tier: cannot migrate the ingest log of "
                                   f"{self.table_dir}: both logs hold records")
            first, last = self.ilog.append([v for _, v in pending])
            if (first, last) != (pending[0][0], pending[-1][0]):
                raise StorageError("cold tier: the old ingest log has gaps; not migrated")
            self.last = max(self.last, last)
        cf.delete_range((0).to_bytes(8, "big"), (recs[-1][0] + 1).to_bytes(8, "big"))
        flush_wal()
        log.info("moved %d ingest log records to the file log %s", len(pending),
                 self.ilog.path)
