"""The durable ingest log: append-only segment files of checksummed records (ARCHITECTURE §5.5).

Every acknowledged ingest is a record here before the daemon answers; the writer counts
records above the *counted* watermark, and records at or below the *applied* watermark (their
counts are in runs) are deleted a segment at a time.  So "acknowledged => counted exactly
once" rests on this file and on the ``applied`` key in RocksDB's meta family.

Why files and not a RocksDB column family (the first build)
----------------------------------------------------------
``Rdict.write`` holds the GIL for the whole call.  A write into the page cache is fast, until
the disk stalls: then one ingest's WAL write blocks inside ``Rdict.write`` and no draft is
answered until the disk comes back (the figures: ARCHITECTURE §5.5).  ``os.write``, ``os.pwrite``,
``os.pread`` and ``os.fsync`` release the GIL, so an ingest stuck on the disk blocks only the
ingest thread: the serving thread keeps answering drafts.  Storage errors are not sticky
either: a failed append truncates the segment back to its last whole record and the next
append tries again (RocksDB stays read-only after a failed WAL write until it is reopened).

Format
------
Segment files ``<dir>/<first seq, 20 digits>.log``; a new one starts when the current one
passes ``segment_bytes``.  A record is a 16-byte header, ``seq`` (u64 LE), ``length`` (u32 LE,
of the payload) and ``crc`` (u32 LE: zlib.crc32 of the seq bytes and the payload), then the
payload: u32 LE ``skip`` + the raw u32 LE tokens (``ngramd.cold.log`` says what skip is).
Sequence numbers are contiguous across segments.

Recovery at open: every segment is read in order and each record's checksum verified; a torn
or corrupt tail of the last segment (a crash in the middle of an append) is cut off, since
its append was never acknowledged.  A bad record anywhere else is damage after the fact: the
log refuses to open (``StorageError``), it does not guess.

The hold (many hosts, ``ngramd/fleet.py``)
-------------------------------------------
A daemon in a fleet publishes its records from this log.  Its *published* watermark, the hold,
is a small file ``<dir>/published`` (8 bytes, written by rename: the GIL stays free); records
above the hold are kept (not released, still readable with ``records``) even once counted, so
a crash between the local acknowledgement and the publish loses nothing.  No file, no hold.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import struct
import threading
import zlib
from pathlib import Path

from ..wire.errors import StorageError

log = logging.getLogger("ngramd.ingestlog")  # the name operators know (kept)

_HEAD = struct.Struct("<QII")  # seq, payload length, crc32
MAX_RECORD_BYTES = 1 << 30


def _append_error(e: OSError) -> StorageError:
    """The ``storage`` error of a failed append, with the disk's reason."""
    return StorageError(f"ingest log: append failed: {e.strerror or e}"
                        + (" (disk full)" if e.errno == errno.ENOSPC else ""))


def _crc(seq_bytes: bytes, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(seq_bytes))



def write_probe(f: Path, nbytes: int) -> None:
    """Write ``nbytes`` to ``f``, sync them and remove the file: whether a directory takes a
    durable write now (``OSError`` if not).  ``os`` calls: the GIL is free while the disk works."""
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, bytes(nbytes))
        os.fsync(fd)
    finally:
        os.close(fd)
        f.unlink()

class IngestLog:
    """Append-only, checksummed, segmented log of ingest records.

    Thread model: one appender at a time (``append`` takes a lock), one reader (the writer
    thread: ``read``), ``release`` from the spill thread; ``read`` never waits for ``append``
    (it sees the records whose append returned)."""

    def __init__(self, path, applied: int, *, sync: bool = True,
                 segment_bytes: int = 64 << 20):
        self.path = Path(path)
        self.sync = sync
        self.segment_bytes = int(segment_bytes)
        self._lock = threading.Lock()  # appends and segment changes
        self._idx_lock = threading.Lock()  # the index of records not yet released
        # per segment: first seq -> [path, last seq, read fd]
        self._segments: dict[int, list] = {}
        self._index: list[tuple[int, int, int, int]] = []  # (seq, segment, offset, length)
        self._head = 0  # index entries before this were read (counted) already
        self._fd = -1  # the segment appends go to
        self._fd_first = 0
        self._size = 0
        self.bytes_total = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.hold = self._read_hold()
            self._last = self._recover(applied if self.hold is None else min(applied,
                                                                               self.hold))
        except OSError as e:
            raise StorageError(f"ingest log at {self.path}: {e.strerror or e}") from None

    # ---- recovery ---------------------------------------------------------------------------
    def _recover(self, applied: int) -> int:
        files = sorted(self.path.glob("*.log"))
        last = applied
        for n, f in enumerate(files):
            data = f.read_bytes()
            pos, first_seq, seg_last = 0, None, None
            while pos + _HEAD.size <= len(data):
                seq, ln, crc = _HEAD.unpack_from(data, pos)
                end = pos + _HEAD.size + ln
                if ln > MAX_RECORD_BYTES or end > len(data) or \
                        _crc(data[pos:pos + 8], data[pos + _HEAD.size:end]) != crc:
                    break
                if seg_last is not None and seq != seg_last + 1:
                    break
                first_seq = seq if first_seq is None else first_seq
                seg_last = seq
                if seq > applied:
                    self._index.append((seq, first_seq, pos + _HEAD.size, ln))
                pos = end
            if pos != len(data):
                if n != len(files) - 1:
                    raise StorageError(f"ingest log: damaged record in {f} at byte {pos} "
                                       "(not the tail of the last segment)")
                log.warning("ingest log: cutting a torn tail of %d bytes off %s (an append "
                            "that was never acknowledged)", len(data) - pos, f)
                with open(f, "r+b") as fh:
                    fh.truncate(pos)
                    os.fsync(fh.fileno())
            if first_seq is None:
                f.unlink()
                continue
            if seg_last <= applied:
                f.unlink()  # every record counted into runs: the spill that did it crashed
                continue    # before it could delete the segment
            self._segments[first_seq] = [f, seg_last, -1]
            self.bytes_total += pos
            last = max(last, seg_last)
        if self._index and self._index[0][0] != applied + 1:
            raise StorageError(f"ingest log: records {applied + 1}..{self._index[0][0] - 1} "
                               "are missing (applied watermark ahead of the log?)")
        return last

    # ---- the hold -----------------------------------------------------------------------------
    def _read_hold(self) -> int | None:
        try:
            raw = (self.path / "published").read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) != 8:
            raise StorageError(f"ingest log: {self.path / 'published'} is damaged "
                               f"({len(raw)} bytes, not 8)")
        return int.from_bytes(raw, "little")

    def set_hold(self, seq: int | None) -> None:
        """Keep records above ``seq`` (durably: a file written by rename); None drops the hold.
        The hold only grows while it is set."""
        f = self.path / "published"
        try:
            if seq is None:
                f.unlink(missing_ok=True)
            else:
                tmp = f.with_suffix(".tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, int(seq).to_bytes(8, "little"))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, f)
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise StorageError(f"ingest log: cannot write the published watermark: "
                               f"{e.strerror or e}") from None
        self.hold = None if seq is None else int(seq)

    # ---- appends ----------------------------------------------------------------------------
    def last_seq(self) -> int:
        return self._last

    def append(self, payloads: list[bytes]) -> tuple[int, int]:
        """Append records (one write, one fsync); returns (first_seq, last_seq) once durable.
        On failure nothing is appended (the segment is cut back) and ``StorageError`` says
        why; the next call tries again (a new segment file if the old one is unusable)."""
        with self._lock:
            first = self._last + 1
            parts, entries, off = [], [], 0
            if self._fd < 0 or self._size >= self.segment_bytes:
                try:  # a new segment file: refused on a read-only or full disk like a write
                    self._open_segment(first)
                except OSError as e:
                    self._close_fd()
                    raise _append_error(e) from None
            for i, p in enumerate(payloads):
                sb = (first + i).to_bytes(8, "little")
                parts.append(_HEAD.pack(first + i, len(p), _crc(sb, p)))
                parts.append(p)
                entries.append((first + i, self._fd_first, self._size + off + _HEAD.size,
                                len(p)))
                off += _HEAD.size + len(p)
            buf = b"".join(parts)
            try:
                view, done = memoryview(buf), 0
                while done < len(buf):  # os.write releases the GIL (a stalled disk waits here)
                    done += os.write(self._fd, view[done:])
                if self.sync:
                    os.fsync(self._fd)
            except OSError as e:
                self._cut_back()
                raise _append_error(e) from None
            self._size += len(buf)
            self.bytes_total += len(buf)
            self._last = first + len(payloads) - 1
            self._segments[self._fd_first][1] = self._last
            with self._idx_lock:
                self._index.extend(entries)
            return first, self._last

    def probe(self, nbytes: int = 4096) -> None:
        """Raise ``StorageError`` unless the log's directory takes a write now: ``nbytes`` are
        written to a file beside the segments, synced and removed (``health.Probes``: an append
        that failed is retried by no one until the next ingest).  ``os`` calls: the GIL is
        free while the disk works."""
        try:
            write_probe(self.path / ".probe", nbytes)
        except OSError as e:
            raise StorageError(f"ingest log at {self.path}: the disk does not take writes yet: "
                               f"{e.strerror or e}"
                               + (" (disk full)" if e.errno == errno.ENOSPC else "")) from None

    def _close_fd(self) -> None:
        """Close the append fd (a failing close is the disk's error already reported)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def _open_segment(self, first: int) -> None:
        self._close_fd()
        f = self.path / f"{first:020d}.log"
        self._fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size
        self._fd_first = first
        if first not in self._segments:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)  # the new file's name is durable before any record in it
            finally:
                os.close(dfd)
            self._segments[first] = [f, first - 1, -1]

    def _cut_back(self) -> None:
        """After a failed write: drop a partial record, and let the next append start a fresh
        segment (the file may sit on a filesystem that went read-only and came back)."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            pass  # the recovery at the next open cuts a torn tail off anyway
        self._close_fd()
        seg = self._segments.get(self._fd_first)
        if seg is not None and seg[1] < self._fd_first:  # nothing in it: forget the file
            del self._segments[self._fd_first]
            try:
                seg[0].unlink()
            except OSError:
                pass

    # ---- reads ------------------------------------------------------------------------------
    def read(self, after: int, max_tokens: int) -> tuple[list[int], list[bytes]]:
        """Records with seq > ``after`` (whole records, at least one, about ``max_tokens``
        tokens); ``after`` only grows between calls (the counted watermark)."""
        with self._idx_lock:
            while self._head < len(self._index) and self._index[self._head][0] <= after:
                self._head += 1
            cut = self._head if self.hold is None else min(self._head, bisect.bisect_right(
                self._index, self.hold, key=lambda e: e[0]))
            if cut > 4096 and cut * 2 > len(self._index):
                del self._index[:cut]
                self._head -= cut
            todo, n = [], 0
            for e in self._index[self._head:]:
                todo.append(e)
                n += e[3] // 4 - 1
                if n >= max_tokens:
                    break
        return self._pread(todo)

    def records(self, after: int, max_bytes: int) -> tuple[list[int], list[bytes]]:
        """Records with seq > ``after`` that are still kept (whole records, at least one, about
        ``max_bytes`` of payload), for a second reader (the fleet's publisher, a scan at
        open); unlike ``read`` it moves nothing."""
        with self._idx_lock:
            i = bisect.bisect_right(self._index, after, key=lambda e: e[0])
            if self._index and self._index[0][0] > after + 1:
                raise StorageError(f"ingest log: records {after + 1}..{self._index[0][0] - 1} "
                                   "are no longer kept")
            todo, n = [], 0
            for e in self._index[i:]:
                todo.append(e)
                n += e[3]
                if n >= max_bytes:
                    break
        return self._pread(todo)

    def _pread(self, todo: list) -> tuple[list[int], list[bytes]]:
        seqs, recs = [], []
        try:
            for seq, seg, off, ln in todo:
                rec = os.pread(self._read_fd(seg), ln, off)  # releases the GIL
                if len(rec) != ln:
                    raise StorageError(f"ingest log: record {seq} is cut short")
                seqs.append(seq)
                recs.append(rec)
        except OSError as e:
            raise StorageError(f"ingest log: read failed: {e.strerror or e}") from None
        return seqs, recs

    def _read_fd(self, first: int) -> int:
        seg = self._segments[first]
        if seg[2] < 0:
            seg[2] = os.open(seg[0], os.O_RDONLY | os.O_CLOEXEC)
        return seg[2]

    # ---- retention --------------------------------------------------------------------------
    def release(self, applied: int) -> int:
        """Delete the segments whose records are all at or below ``applied`` (counted into
        durable runs) and the hold, except the one appends go to; returns how many were
        deleted."""
        if self.hold is not None:
            applied = min(applied, self.hold)
        with self._lock:
            gone = [f for f, s in self._segments.items()
                    if s[1] <= applied and f != self._fd_first]
            for f in gone:
                path, _, fd = self._segments.pop(f)
                try:
                    if fd >= 0:
                        os.close(fd)
                    self.bytes_total -= path.stat().st_size
                    path.unlink()
                except OSError as e:  # a later release or the next open deletes it
                    log.warning("ingest log: could not delete %s: %s", path, e)
            return len(gone)

    def close(self) -> None:
        """Close every file (never raises: on a failing disk, closing reports nothing new)."""
        with self._lock:
            self._close_fd()
            for s in self._segments.values():
                if s[2] >= 0:
                    try:
                        os.close(s[2])
                    except OSError:
                        pass
                    s[2] = -1
