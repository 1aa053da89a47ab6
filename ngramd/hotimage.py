"""The hot tier's image on disk: the newest published generation, kept beside the table so that
a daemon whose shared memory is empty (a reboot, a restore, a new fleet host, a rescheduled
container) serves from a full hot tier at once instead of after a rebuild that ranks the whole
table (minutes on a 40M-row table: issue 28).  RocksDB's habit: state that can be rebuilt is
still checkpointed when rebuilding it costs minutes.  ARCHITECTURE §4.8.

File ``<data_dir>/<table>/hot.image`` (beside RocksDB's files, so a snapshot carries it)::

    [0, 4096)              header (little-endian, ``struct`` format ``_HEADER``)
    [4096, 4096 + 32*cap)  the slot array, exactly as in a shm segment (ngramd.kernels layout)
    then 8*filter_words    the pruned filter (hotshm's module docstring)

    header                       offset  type
      magic  b"NGRAMIMG"           0     8s
      format version               8     u32   (IMAGE_VERSION; readers refuse others)
      header size                  12    u32   (4096: the slots start page-aligned)
      applied seq                  16    u64   (ingest-log seq the counts include)
      capacity (slots, 2^k)        24    u64
      max_probe                    32    u32
      pruned filter probes         36    u32
      pruned filter words          40    u64
      entries (occupied slots)     48    u64
      table rows at the build      56    u64   (what "the tier reflects half the table" uses)
      created                      64    u64   (time.time_ns() of the write)
      payload crc32                72    u32   (zlib.crc32 of everything after the header)
      identity JSON length         76    u32
      identity sha256              80    32s   (hotshm.identity_digest)
      slot bytes                   112   u32   (32; guards the slot layout)
      header crc32                 116   u32   (of the 4096 header bytes with this word zero)
      slot checksum                120   u64   (kernels.slots.slots_checksum: what the shm
                                                segment header records, so a start skips it)
      identity JSON                256   bytes

Invariants: the file is written to ``.hot.image.tmp``, fsynced, renamed over ``hot.image`` and
the directory fsynced, so the name always holds a whole image (the old one or the new one);
a temp file left by a crash is removed at the next start.  An image is used only when its
header, both checksums, its identity (the table's, digest-equal) and its sequence (not ahead
of what the table holds durably: runs and ingest log) all check; anything else is refused
with one log line and the daemon rebuilds.  The image never changes what the table counts:
it is a cache of a ranking.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kernels.bloom import BB_BLOCK_WORDS
from .kernels.slots import slots_checksum
from .wire.constants import SLOT_BYTES, SLOT_WORDS
from .hotshm import identity_digest, map_read_only
from .wire.identity import TableIdentity

log = logging.getLogger("ngramd.hotimage")

IMAGE_NAME = "hot.image"
IMAGE_MAGIC = b"NGRAMIMG"
IMAGE_VERSION = 1
HEADER_SIZE = 4096
IDENTITY_JSON_OFFSET = 256
_HEADER = struct.Struct("<8sIIQQIIQQQQII32sIIQ")  # 128 bytes, see the module docstring
_HEADER_CRC_OFFSET = 116
#: bytes written (and checksummed) a call: each call releases the GIL, none holds it long
CHUNK_BYTES = 8 << 20


class ImageRefused(Exception):
    """The image cannot serve this table (damaged, truncated, another table or format, ahead
    of the table); the message says why in one line."""


@dataclass
class HotImage:
    """A validated image, mapped read-only: ``slots`` and ``pruned`` are views of the file's
    mapping (valid until ``close``)."""

    slots: np.ndarray
    pruned: np.ndarray
    pruned_nprobe: int
    max_probe: int
    slot_checksum: int
    applied_seq: int
    table_rows: int
    entries: int
    created_ns: int
    bytes: int
    _mm: mmap.mmap | None = None

    def close(self) -> None:
        self.slots = self.pruned = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view: the mapping goes with it
                pass
            self._mm = None


def image_path(table_dir: str | os.PathLike) -> Path:
    return Path(table_dir) / IMAGE_NAME


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def remove_leftover(path: Path) -> bool:
    """Remove a temp image a crash left mid-write (the next write starts it over); True when
    there was one."""
    try:
        _tmp_path(path).unlink()
    except FileNotFoundError:
        return False
    log.info("removed a hot image left half-written by a crash (%s)", _tmp_path(path))
    return True


def _header(identity: TableIdentity, *, applied_seq: int, capacity: int, max_probe: int,
            nprobe: int, filter_words: int, entries: int, table_rows: int, crc: int,
            slot_checksum: int) -> bytes:
    ident = identity.to_json()
    if IDENTITY_JSON_OFFSET + len(ident) > HEADER_SIZE:
        raise ValueError(f"identity JSON of {len(ident)} bytes does not fit the image header")
    buf = bytearray(HEADER_SIZE)
    _HEADER.pack_into(buf, 0, IMAGE_MAGIC, IMAGE_VERSION, HEADER_SIZE, applied_seq, capacity,
                      max_probe, nprobe, filter_words, entries, table_rows, time.time_ns(), crc,
                      len(ident), identity_digest(identity), SLOT_BYTES, 0, slot_checksum)
    buf[IDENTITY_JSON_OFFSET:IDENTITY_JSON_OFFSET + len(ident)] = ident
    struct.pack_into("<I", buf, _HEADER_CRC_OFFSET, zlib.crc32(buf))
    return bytes(buf)


def _crc(payload: list[memoryview]) -> int:
    crc = 0
    for part in payload:
        for a in range(0, len(part), CHUNK_BYTES):
            crc = zlib.crc32(part[a:a + CHUNK_BYTES], crc)  # releases the GIL past 5 KiB
    return crc


def write_image(path: str | os.PathLike, identity: TableIdentity, slots: np.ndarray,
                max_probe: int, applied_seq: int, pruned: np.ndarray | None = None,
                pruned_nprobe: int = 0, table_rows: int = 0,
                slot_checksum: int | None = None) -> dict:
    """Write ``slots`` (and the pruned filter) as the table's image, atomically and durably;
    returns ``{"bytes", "seconds", "applied_seq", "entries"}``.

    Called from a background thread (the rebuilder, ``ngramd warm``): every write, checksum
    and fsync works on at most ``CHUNK_BYTES`` at a time with the GIL released, so serving
    threads keep running.  A crash at any point leaves the old image (or none) under the name.
    ``slot_checksum``: ``slots_checksum(slots)`` when known (the published segment's)."""
    t0 = time.perf_counter()
    path = Path(path)
    slots = np.ascontiguousarray(slots, np.uint32)
    if pruned is None or not pruned_nprobe:
        pruned, pruned_nprobe = np.zeros(0, np.uint64), 0
    pruned = np.ascontiguousarray(pruned, np.uint64)
    payload = [memoryview(slots).cast("B"), memoryview(pruned).cast("B")]
    entries = int(np.count_nonzero(slots[:, 0] | slots[:, 1]))
    head = _header(identity, applied_seq=int(applied_seq), capacity=slots.shape[0],
                   max_probe=int(max_probe), nprobe=int(pruned_nprobe),
                   filter_words=pruned.shape[0], entries=entries, table_rows=int(table_rows),
                   crc=_crc(payload),
                   slot_checksum=int(slots_checksum(slots) if slot_checksum is None
                                     else slot_checksum))
    tmp = _tmp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, head)
        for part in payload:
            for a in range(0, len(part), CHUNK_BYTES):
                chunk = part[a:a + CHUNK_BYTES]
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the rename itself is durable
    finally:
        os.close(dfd)
    size = HEADER_SIZE + sum(len(p) for p in payload)
    return {"bytes": size, "seconds": round(time.perf_counter() - t0, 3),
            "applied_seq": int(applied_seq), "entries": entries}


def copy_image(table_dir: str | os.PathLike, dest_dir: str | os.PathLike, max_seq: int) -> bool:
    """Copy a table's image into ``dest_dir`` (a snapshot being packed) when its header says
    it reflects at most ``max_seq`` (what the snapshot holds); True when copied.  Safe while
    the daemon writes a new image: that one is a new file renamed over the name, so the file
    opened here stays whole."""
    src = image_path(table_dir)
    try:
        with open(src, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or head[:8] != IMAGE_MAGIC \
                    or _HEADER.unpack(head)[3] > max_seq:
                return False
            f.seek(0)
            with open(image_path(dest_dir), "wb") as out:
                shutil.copyfileobj(f, out, CHUNK_BYTES)
    except FileNotFoundError:
        return False
    return True


def read_image(path: str | os.PathLike, identity: TableIdentity, max_seq: int
               ) -> HotImage | None:
    """The image at ``path`` mapped and validated for a table of ``identity`` that holds log
    records up to ``max_seq`` durably; None when there is no image.  Raises ``ImageRefused``
    (one line: why) when it exists but cannot be used."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ImageRefused(f"cannot open: {e.strerror or e}") from None
    mm, size = map_read_only(fd, HEADER_SIZE)
    if mm is None:
        raise ImageRefused(f"truncated ({size} bytes, shorter than its header)")
    try:
        img = _validate(mm, size, identity, max_seq)
    except BaseException:
        mm.close()
        raise
    return img


def _validate(mm: mmap.mmap, size: int, identity: TableIdentity, max_seq: int) -> HotImage:
    head = bytearray(mm[:HEADER_SIZE])
    (magic, version, hsize, seq, cap, max_probe, nprobe, fwords, entries, rows, created, crc,
     ident_len, digest, slot_bytes, head_crc, slot_sum) = _HEADER.unpack_from(head, 0)
    if magic != IMAGE_MAGIC:
        raise ImageRefused("not a hot image (bad magic)")
    if version != IMAGE_VERSION:
        raise ImageRefused(f"image format {version}, this daemon reads {IMAGE_VERSION}")
    struct.pack_into("<I", head, _HEADER_CRC_OFFSET, 0)
    if zlib.crc32(head) != head_crc:
        raise ImageRefused("header checksum mismatch (damaged)")
    if digest != identity_digest(identity):
        theirs = bytes(head[IDENTITY_JSON_OFFSET:IDENTITY_JSON_OFFSET + ident_len])
        raise ImageRefused(f"another table identity ({_short(theirs)}), this table is "
                           f"{_short(identity.to_json())}")
    if (hsize != HEADER_SIZE or slot_bytes != SLOT_BYTES or cap < 1 or cap & (cap - 1)
            or fwords % BB_BLOCK_WORDS or not 1 <= max_probe <= cap):
        raise ImageRefused("inconsistent header (damaged)")
    want = HEADER_SIZE + cap * SLOT_BYTES + 8 * fwords
    if size != want:
        raise ImageRefused(f"truncated or padded: {size} bytes, the header says {want}")
    if seq > max_seq:
        raise ImageRefused(f"built at log seq {seq}, ahead of what the table holds ({max_seq}): "
                           f"not this table's past")
    view = memoryview(mm)
    try:
        ok = _crc([view[HEADER_SIZE:]]) == crc
    finally:
        view.release()
    if not ok:
        raise ImageRefused("payload checksum mismatch (damaged)")
    slots = np.frombuffer(mm, np.uint32, count=cap * SLOT_WORDS, offset=HEADER_SIZE)
    pruned = np.frombuffer(mm, np.uint64, count=fwords,
                           offset=HEADER_SIZE + cap * SLOT_BYTES)
    return HotImage(slots.reshape(cap, SLOT_WORDS), pruned, int(nprobe), int(max_probe),
                    int(slot_sum), int(seq), int(rows), int(entries), int(created), size, mm)


def _short(ident_json: bytes) -> str:
    """An identity JSON in a few words for a log line."""
    try:
        d = json.loads(ident_json)
        return (f"orders {d.get('n_min')}..{d.get('n_max')}, cold_k {d.get('cold_k')}, "
                f"vocab {d.get('vocab_size')}, tokenizer {str(d.get('tokenizer') or '-')[:12]}")
    except (ValueError, AttributeError):
        return "unreadable"
