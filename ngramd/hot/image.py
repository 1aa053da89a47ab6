"""The hot tier's image on disk: the newest published generation, kept beside the table so that
a daemon whose shared memory is empty (a reboot, a restore, a new fleet host, a rescheduled
container) serves from a full hot tier at once instead of after a rebuild that ranks the whole
table (minutes on a large table).  RocksDB's habit: state that can be rebuilt is
still checkpointed when rebuilding it costs minutes.  ARCHITECTURE §4.8.

File ``<data_dir>/<table>/hot.image`` (beside RocksDB's files, so a snapshot carries it)::

    [0, 4096)              header (little-endian, ``struct`` format ``_HEADER``)
    [4096, 4096 + 32*cap)  the slot array, exactly as in a shm segment (ngramd.kernels layout)
    then 8*filter_words    the pruned filter (shm.py's module docstring)

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
      payload crc32                72    u32   (format 1: zlib.crc32 of everything after the
                                                header; 0 in format 2)
      identity JSON length         76    u32
      identity sha256              80    32s   (hot.shm.identity_digest)
      slot bytes                   112   u32   (32; guards the slot layout)
      header crc32                 116   u32   (of the 4096 header bytes with this word zero)
      slot checksum                120   u64   (kernels.slots.slots_checksum: what the shm
                                                segment header records, so a start skips it)
      payload checksum             128   u64   (format 2: ``PayloadSum`` of everything
                                                after the header)
      identity JSON                256   bytes

Invariants: the file is written to ``.hot.image.tmp``, fsynced, renamed over ``hot.image`` and
the directory fsynced, so the name always holds a whole image (the old one or the new one);
a temp file left by a crash is removed at the next start.  An image is used only when its
header, both checksums, its identity (the table's, digest-equal) and its sequence (not ahead
of what the table holds durably: runs and ingest log) all check; anything else is refused
with one log line and the daemon rebuilds.  The image never changes what the table counts:
it is a cache of a ranking.

A start reads the payload once (``HotImage.copy_to``): 1 MiB at a time from the file, into
the checksum and on into the new shm segment, which is published only when the checksum
matched.  Format 2 replaced format 1's crc32 by ``PayloadSum`` to make that pass cheap.
Format 1 images are still read (crc32), and replaced at the next publication.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import TableConfig
from ..wire.constants import BB_BLOCK_WORDS, SLOT_BYTES
from .segments import HotPublisher, identity_digest, write_all
from ..wire.identity import TableIdentity

log = logging.getLogger("ngramd.hotimage")

IMAGE_NAME = "hot.image"
IMAGE_MAGIC = b"NGRAMIMG"
IMAGE_VERSION = 2
#: formats this daemon reads (1: the payload checked by crc32)
READ_VERSIONS = (1, 2)
HEADER_SIZE = 4096
IDENTITY_JSON_OFFSET = 256
_HEADER = struct.Struct("<8sIIQQIIQQQQII32sIIQ")  # 128 bytes, see the module docstring
_PAYLOAD_SUM = struct.Struct("<Q")  # at 128, format 2
_PAYLOAD_SUM_OFFSET = 128
_HEADER_CRC_OFFSET = 116
#: bytes written (and checksummed) a call: each call releases the GIL, none holds it long
CHUNK_BYTES = 8 << 20
#: the write's pace (RocksDB's ``bytes_per_sync`` and rate limiter, for work that is never
#: urgent): its pages are handed to the disk every ``SYNC_BYTES`` as it goes, and it writes at
#: most ``WRITE_BYTES_PER_S``, so a serving thread's cold read never queues behind a whole
#: image's writeback at the final fsync
SYNC_BYTES = 32 << 20
WRITE_BYTES_PER_S = 128 << 20
#: bytes a start reads, checksums and copies at a time (stays in the CPU's cache between);
#: also format 2's checksum block (``PayloadSum``)
STREAM_BYTES = 1 << 20
_BLOCK_WORDS = STREAM_BYTES // 8
_M64 = (1 << 64) - 1


class ImageRefused(Exception):
    """The image cannot serve this table (damaged, truncated, another table or format, ahead
    of the table); the message says why in one line."""


def _weights(n: int) -> np.ndarray:
    """Format 2's word weights: odd 64-bit numbers (splitmix64 of the word's index in its
    block), fixed by this formula, not by a random generator whose stream may change."""
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


class PayloadSum:
    """Format 2's payload checksum: the payload as 1 MiB blocks of uint64 words; a block's sum
    is ``sum(w_i * x_i) mod 2**64`` over its words with odd weights ``w`` (``_weights``), and
    the blocks' sums are folded in order with the payload's length.  A changed word always
    changes its block's sum (odd weights are invertible mod 2**64), moved words and blocks
    almost always do.  For damage, not for adversaries.

    Why not crc32: this is two numpy passes over a block still in the CPU's cache, without the
    GIL and without numba (whose first call in a process costs ~0.2 s, at a start that is the
    time to the first hot draft): 587 MB in ~0.1 s against crc32's ~0.25 s on the dev box.
    ``update`` takes the payload in pieces of whole 32-byte units, in any chunking."""

    _w: np.ndarray | None = None

    def __init__(self):
        if PayloadSum._w is None:
            PayloadSum._w = _weights(_BLOCK_WORDS)
        self._tmp = np.empty(_BLOCK_WORDS, np.uint64)
        self._part = np.empty(_BLOCK_WORDS, np.uint64)  # a block's first words, until whole
        self._fill = 0
        self._h = 0x243F6A8885A308D3
        self._words = 0

    def update(self, words: np.ndarray) -> None:
        words = words.reshape(-1)
        self._words += words.shape[0]
        if self._fill:
            take = min(_BLOCK_WORDS - self._fill, words.shape[0])
            self._part[self._fill:self._fill + take] = words[:take]
            self._fill += take
            words = words[take:]
            if self._fill < _BLOCK_WORDS:
                return
            self._block(self._part)
            self._fill = 0
        whole = words.shape[0] - words.shape[0] % _BLOCK_WORDS
        for a in range(0, whole, _BLOCK_WORDS):
            self._block(words[a:a + _BLOCK_WORDS])
        rest = words.shape[0] - whole
        if rest:
            self._part[:rest] = words[whole:]
            self._fill = rest

    def _block(self, x: np.ndarray) -> None:
        n = x.shape[0]
        np.multiply(x, self._w[:n], out=self._tmp[:n])
        s = int(np.add.reduce(self._tmp[:n]))
        h = ((self._h ^ s) * 0x9E3779B185EBCA87) & _M64
        self._h = ((h << 31) | (h >> 33)) & _M64

    def digest(self) -> int:
        if self._fill:
            self._block(self._part[:self._fill])
            self._fill = 0
        h = (self._h ^ (self._words * 8)) & _M64
        h = ((h ^ (h >> 33)) * 0xFF51AFD7ED558CCD) & _M64
        return h ^ (h >> 33)


@dataclass
class HotImage:
    """An image whose header, identity, size and sequence checked, its file open: the payload
    is checked as it is read (``copy_to``, ``verify``).  ``close`` when done."""

    capacity: int
    filter_words: int
    pruned_nprobe: int
    max_probe: int
    slot_checksum: int
    applied_seq: int
    table_rows: int
    entries: int
    created_ns: int
    bytes: int
    version: int
    payload_sum: int  # format 2: PayloadSum; format 1: crc32
    _fd: int = -1

    def copy_to(self, out_fd: int | None) -> None:
        """Stream the payload (slot array, then pruned filter) to ``out_fd`` (None: read only),
        checking it on the way: ``ImageRefused`` when it does not match its checksum or cannot
        be read, after which what was written to ``out_fd`` must be thrown away."""
        if self._fd < 0:
            raise ValueError("copy_to on a closed HotImage")
        n = self.bytes - HEADER_SIZE
        buf = np.empty(STREAM_BYTES // 8, np.uint64)
        view = memoryview(buf).cast("B")
        summer, crc, done = PayloadSum(), 0, 0
        try:
            os.posix_fadvise(self._fd, HEADER_SIZE, n, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass  # advice only
        try:
            while done < n:
                want, got = min(STREAM_BYTES, n - done), 0
                while got < want:  # a short read is read on; none at all is a truncation
                    try:
                        k = os.preadv(self._fd, [view[got:want]], HEADER_SIZE + done + got)
                    except OSError as e:
                        raise ImageRefused(f"cannot read: {e.strerror or e}") from None
                    if k <= 0:
                        raise ImageRefused(f"truncated while read ({HEADER_SIZE + done + got} "
                                           f"of {self.bytes} bytes)")
                    got += k
                if self.version == 1:
                    crc = zlib.crc32(view[:got], crc)
                else:
                    summer.update(buf[:got // 8])
                if out_fd is not None:
                    write_all(out_fd, view[:got])
                done += got
        finally:
            view.release()
        got_sum = crc if self.version == 1 else summer.digest()
        if got_sum != self.payload_sum:
            raise ImageRefused("payload checksum mismatch (damaged)")

    def verify(self) -> None:
        """Read the whole payload and check it (``ImageRefused`` when damaged)."""
        self.copy_to(None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


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
            nprobe: int, filter_words: int, entries: int, table_rows: int, payload_sum: int,
            slot_checksum: int) -> bytes:
    ident = identity.to_json()
    if IDENTITY_JSON_OFFSET + len(ident) > HEADER_SIZE:
        raise ValueError(f"identity JSON of {len(ident)} bytes does not fit the image header")
    buf = bytearray(HEADER_SIZE)
    _HEADER.pack_into(buf, 0, IMAGE_MAGIC, IMAGE_VERSION, HEADER_SIZE, applied_seq, capacity,
                      max_probe, nprobe, filter_words, entries, table_rows, time.time_ns(), 0,
                      len(ident), identity_digest(identity), SLOT_BYTES, 0, slot_checksum)
    _PAYLOAD_SUM.pack_into(buf, _PAYLOAD_SUM_OFFSET, payload_sum)
    buf[IDENTITY_JSON_OFFSET:IDENTITY_JSON_OFFSET + len(ident)] = ident
    struct.pack_into("<I", buf, _HEADER_CRC_OFFSET, zlib.crc32(buf))
    return bytes(buf)


def _payload_sum(payload: list[np.ndarray]) -> int:
    """``PayloadSum`` of the payload's parts (uint64 arrays) as one stream: what
    ``HotImage.copy_to`` computes of the file."""
    summer = PayloadSum()
    for part in payload:
        summer.update(part)
    return summer.digest()


def _sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``fd``'s bytes ``offset .. offset + nbytes`` to the disk now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, as RocksDB's
    ``bytes_per_sync``); nothing where it is missing (the final fsync makes the file
    durable either way)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_image(path: str | os.PathLike, identity: TableIdentity, slots: np.ndarray,
                max_probe: int, applied_seq: int, pruned: np.ndarray | None = None,
                pruned_nprobe: int = 0, table_rows: int = 0,
                slot_checksum: int | None = None,
                bytes_per_s: float | None = WRITE_BYTES_PER_S) -> dict:
    """Write ``slots`` (and the pruned filter) as the table's image, atomically and durably;
    returns ``{"bytes", "seconds", "applied_seq", "entries"}``.

    Called from a background thread (the rebuilder, ``ngramd warm``): every write, checksum
    and fsync works on at most ``CHUNK_BYTES`` at a time with the GIL released, so serving
    threads keep running, and the write is paced (``SYNC_BYTES``; ``bytes_per_s``, None: as
    fast as the disk takes it).  A crash at any point leaves the old image (or none) under the
    name.  ``slot_checksum``: ``slots_checksum(slots)`` when known (the published segment's)."""
    t0 = time.perf_counter()
    path = Path(path)
    slots = np.ascontiguousarray(slots, np.uint32)
    if pruned is None or not pruned_nprobe:
        pruned, pruned_nprobe = np.zeros(0, np.uint64), 0
    pruned = np.ascontiguousarray(pruned, np.uint64)
    payload = [memoryview(slots).cast("B"), memoryview(pruned).cast("B")]
    entries = int(np.count_nonzero(slots[:, 0] | slots[:, 1]))
    if slot_checksum is None:
        from ..kernels.slots import slots_checksum  # numba's: this module loads without it

        slot_checksum = slots_checksum(slots)
    head = _header(identity, applied_seq=int(applied_seq), capacity=slots.shape[0],
                   max_probe=int(max_probe), nprobe=int(pruned_nprobe),
                   filter_words=pruned.shape[0], entries=entries, table_rows=int(table_rows),
                   payload_sum=_payload_sum([slots.view(np.uint64), pruned]),
                   slot_checksum=int(slot_checksum))
    tmp = _tmp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, head)
        done, synced, t_write = HEADER_SIZE, 0, time.monotonic()
        for part in payload:
            for a in range(0, len(part), CHUNK_BYTES):
                chunk = part[a:a + CHUNK_BYTES]
                write_all(fd, chunk)
                done += len(chunk)
                if done - synced >= SYNC_BYTES:
                    _start_writeback(fd, synced, done - synced)
                    synced = done
                if bytes_per_s:
                    ahead = done / bytes_per_s - (time.monotonic() - t_write)
                    if ahead > 0:
                        time.sleep(ahead)
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
    """The image at ``path`` opened and checked for a table of ``identity`` that holds log
    records up to ``max_seq`` durably (header, identity, size, sequence; the payload is
    checked as ``HotImage.copy_to`` reads it); None when there is no image.  Raises
    ``ImageRefused`` (one line: why) when it exists but cannot be used."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ImageRefused(f"cannot open: {e.strerror or e}") from None
    try:
        return _validate(fd, identity, max_seq)
    except BaseException:
        os.close(fd)
        raise


def _validate(fd: int, identity: TableIdentity, max_seq: int) -> HotImage:
    try:
        size = os.fstat(fd).st_size
        head = bytearray(os.pread(fd, HEADER_SIZE, 0))
    except OSError as e:
        raise ImageRefused(f"cannot read: {e.strerror or e}") from None
    if len(head) < HEADER_SIZE:
        raise ImageRefused(f"truncated ({size} bytes, shorter than its header)")
    (magic, version, hsize, seq, cap, max_probe, nprobe, fwords, entries, rows, created, crc,
     ident_len, digest, slot_bytes, head_crc, slot_sum) = _HEADER.unpack_from(head, 0)
    if magic != IMAGE_MAGIC:
        raise ImageRefused("not a hot image (bad magic)")
    if version not in READ_VERSIONS:
        raise ImageRefused(f"image format {version}, this daemon reads "
                           f"{', '.join(map(str, READ_VERSIONS))}")
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
    payload_sum = crc if version == 1 else _PAYLOAD_SUM.unpack_from(head, _PAYLOAD_SUM_OFFSET)[0]
    return HotImage(int(cap), int(fwords), int(nprobe), int(max_probe), int(slot_sum), int(seq),
                    int(rows), int(entries), int(created), size, int(version), int(payload_sum),
                    fd)


def _short(ident_json: bytes) -> str:
    """An identity JSON in a few words for a log line."""
    try:
        d = json.loads(ident_json)
        return (f"orders {d.get('n_min')}..{d.get('n_max')}, cold_k {d.get('cold_k')}, "
                f"vocab {d.get('vocab_size')}, tokenizer {str(d.get('tokenizer') or '-')[:12]}")
    except (ValueError, AttributeError):
        return "unreadable"


def publish_image(publisher: HotPublisher, path: Path, identity: TableIdentity,
                  max_probe: int, max_seq: int) -> dict | None:
    """Validate the table's image on disk at ``path`` (``hot.image.read_image``: at most
    ``max_seq``) and publish it as the next generation; returns what ``stats`` shows of it
    (``state`` loaded or refused), None when there is none.  A damaged or mismatched image is
    refused with one log line (the daemon rebuilds).  Touches the publisher only (a start
    calls it before RocksDB opens); ``HotCycle.adopt`` serves it."""
    remove_leftover(path)
    t0 = time.perf_counter()
    img = None
    try:
        img = read_image(path, identity, max_seq)
        if img is None:
            return None
        if img.max_probe > max_probe:
            raise ImageRefused(f"built with max_probe {img.max_probe}, above this table's "
                               f"hot_max_probe {max_probe}")
        # one pass: read, checked and copied into the segment, published only when it checked
        publisher.publish_stream(img.capacity, max_probe, img.applied_seq, img.entries,
                                 img.slot_checksum, img.filter_words, img.pruned_nprobe,
                                 img.copy_to)
    except (ImageRefused, OSError) as e:
        log.warning("hot image %s refused: %s; rebuilding the hot tier", path, e)
        return {"state": "refused", "reason": str(e)}
    finally:
        if img is not None:
            img.close()
    return {"state": "loaded", "bytes": img.bytes, "applied_seq": img.applied_seq,
            "entries": img.entries, "table_rows": img.table_rows,
            "seconds": round(time.perf_counter() - t0, 3),
            "built_at": round(img.created_ns / 1e9, 3)}


def start_publisher(config: TableConfig,
                    identity: TableIdentity) -> tuple[HotPublisher, dict | None]:
    """What a daemon does first: take the table's hot publisher (its lock refuses a second
    daemon for the table) and, when shared memory holds no generation (a reboot, a restore, a
    new host), publish the table's image on disk (``publish_image``, any sequence: the table
    checks it once RocksDB is open).  Returns the publisher and what ``publish_image``
    returned (None: none published).  Loads neither numba nor RocksDB, so ``ngramd`` calls it
    before the rest of the daemon loads: generators draft from the hot tier while it does."""
    publisher = HotPublisher(config.shm_dir, config.name, identity, grace_s=config.hot_grace_s)
    if publisher.generation:
        return publisher, None
    try:
        path = image_path(Path(config.data_dir) / config.name)
        return publisher, publish_image(publisher, path, identity, config.hot_max_probe,
                                        1 << 63)
    except BaseException:
        publisher.close(unlink=False)
        raise
