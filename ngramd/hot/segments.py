"""The hot tier's files in shared memory and their publisher: names, the segment header, and
``HotPublisher``, which writes each generation and publishes it with one atomic store.

numpy only (no numba, no RocksDB): a start with empty shared memory publishes the table's image
on disk (``ngramd.hot.image.start_publisher``) before the rest of ``ngramd`` loads, ~0.3 s
quiet and about twice that on a busy host (ARCHITECTURE §4.8).  The formats and the
publication protocol are described in ``ngramd.hot.shm``'s module doc; its readers
(``HotReader``) and ``RecentTable`` use the names and the header defined here.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import struct
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import numpy as np

from ..wire.constants import SLOT_BYTES, SLOT_WORDS
from ..wire.errors import BadInput, NgramError, StorageError
from ..wire.identity import TableIdentity

log = logging.getLogger("ngramd.hotshm")


if sys.byteorder != "little":  # the segment and control formats are little-endian, mapped as is
    raise ImportError("ngramd.hot.segments supports little-endian hosts only")

# ---------------------------------------------------------------------------------------------
# format (change any of these and bump SEGMENT_VERSION / CTL_VERSION)
# ---------------------------------------------------------------------------------------------
SEGMENT_MAGIC = b"NGRAMHOT"
CTL_MAGIC = b"NGRAMCTL"
SEGMENT_VERSION = 2  # 2: the pruned filter after the slots
CTL_VERSION = 1
HEADER_SIZE = 4096
CTL_SIZE = 4096
IDENTITY_JSON_OFFSET = 256
DIR_MODE = 0o750
FILE_MODE = 0o640

_HEADER = struct.Struct("<8sIIQQIIIIIIQQQ32sQIIQII")  # 144 bytes, see the module docstring
_HEADER_FIELDS = (
    "magic", "version", "header_size", "generation", "capacity", "max_probe", "n_min", "n_max",
    "hot_k", "vocab_size", "slot_bytes", "entries", "checksum", "created_ns", "identity_sha256",
    "applied_seq", "identity_len", "_pad", "filter_words", "filter_nprobe", "_pad2",
)
_CTL = struct.Struct("<8sIIQQQ")  # magic, version, pad, generation, state, pid
_CTL_GEN = 2  # index of the generation word when the control file is viewed as uint64 words
_CTL_STATE = 3
_CTL_RECENT = 5  # current recent epoch (0 = none)
_CTL_RECENT_PREV = 6  # previous recent epoch (0 = none)
_ENTRIES_OFFSET = 56  # the entries word of a segment header (see the module docstring)
RECENT_MAGIC = b"NGRAMREC"
CTL_LIVE = 0
CTL_CLOSED = 1

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")

def segment_name(table: str, generation: int) -> str:
    return f"{table}.gen{generation}"


def ctl_name(table: str) -> str:
    return f"{table}.ctl"


def recent_name(table: str, epoch: int) -> str:
    return f"{table}.recent{epoch}"


def _check_name(table: str) -> str:
    if not isinstance(table, str) or not _NAME_RE.match(table):
        raise BadInput(f"invalid table name {table!r}: use letters, digits, '_', '.', '-'")
    return table


def identity_digest(identity: TableIdentity) -> bytes:
    """sha256 (32 bytes) of the identity's canonical JSON: what segments record and compare."""
    return hashlib.sha256(identity.to_json()).digest()


def pack_header(*, generation: int, capacity: int, max_probe: int, identity: TableIdentity,
                entries: int, checksum: int, applied_seq: int = 0,
                created_ns: int | None = None, magic: bytes = SEGMENT_MAGIC,
                filter_words: int = 0, filter_nprobe: int = 0) -> bytes:
    """The 4096-byte segment header (see the module docstring)."""
    ident = identity.to_json()
    if IDENTITY_JSON_OFFSET + len(ident) > HEADER_SIZE:
        raise BadInput(f"identity JSON of {len(ident)} bytes does not fit the segment header")
    head = _HEADER.pack(
        magic, SEGMENT_VERSION, HEADER_SIZE, generation, capacity, max_probe,
        identity.n_min, identity.n_max, identity.hot_k, identity.vocab_size, SLOT_BYTES,
        entries, checksum, time.time_ns() if created_ns is None else created_ns,
        identity_digest(identity), applied_seq, len(ident), 0, filter_words, filter_nprobe, 0,
    )
    buf = bytearray(HEADER_SIZE)
    buf[:len(head)] = head
    buf[IDENTITY_JSON_OFFSET:IDENTITY_JSON_OFFSET + len(ident)] = ident
    return bytes(buf)


def unpack_header(buf) -> dict:
    """Parse a segment header (any buffer of >= 4096 bytes); no validation beyond the layout.

    Returns a dict with the fields of the module docstring; ``identity`` is the recorded
    identity as a dict (None when it cannot be parsed)."""
    h = dict(zip(_HEADER_FIELDS, _HEADER.unpack_from(buf, 0)))
    del h["_pad"], h["_pad2"]
    n = h.pop("identity_len")
    h["identity"] = None
    if 0 < n <= HEADER_SIZE - IDENTITY_JSON_OFFSET:
        try:
            h["identity"] = json.loads(bytes(buf[IDENTITY_JSON_OFFSET:IDENTITY_JSON_OFFSET + n]))
        except ValueError:
            pass
    return h


def write_all(fd: int, data) -> None:
    """Write all of ``data`` (a bytes-like object) to ``fd``, however many calls it takes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def map_read_only(fd: int, min_size: int) -> tuple[mmap.mmap | None, int]:
    """Map the whole file open on ``fd`` read-only, and close ``fd`` (the map keeps the file):
    ``(map, size)``, or ``(None, size)`` when the file is shorter than ``min_size`` (its
    header), for the caller to refuse in its own words."""
    try:
        size = os.fstat(fd).st_size
        if size < min_size:
            return None, size
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), size
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# page faults (reader side)
# ---------------------------------------------------------------------------------------------
PREFAULT_CHUNK = 16 << 20  # bytes read at a time: the mapping may be dropped between chunks


class Prefaulter:
    """Maps the pages of newly mapped segments into this process, in the background.

    A fresh read-only mapping of a segment has no page-table entries: each first read of a
    page is a minor fault (~1-4 µs).  The drafting kernel's probes land on random pages, so a
    process that just mapped a generation pays a fault on most probes until it has touched
    the whole table once: measured, a fresh proposer at batch 1 took 47 faults a step and its
    one-row draft ~200 µs instead of ~10.  ``add(mm)`` queues the map; one daemon thread per
    process reads a byte of every page (numpy, the GIL released while it reads; ~15 ms per
    256 MiB on one core), newest maps last, and gives a map up when it is dropped (it holds
    only a weak reference between chunks).  Nothing waits for it: until it is done, drafting
    takes the faults it would have taken anyway."""

    def __init__(self):
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the thread is the parent's

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending = 0  # maps queued or being read
        self._thread: threading.Thread | None = None

    def add(self, mm: mmap.mmap) -> None:
        with self._cond:
            self._queue.append(weakref.ref(mm))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ngram-prefault")
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Wait until every map queued so far is read (or dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                ref = self._queue.popleft()
            try:
                self._read(ref)
            except Exception as e:  # a map closed under us: nothing to fault in
                log.debug("prefault stopped: %s", e)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _read(self, ref) -> None:
        off = 0
        while True:
            mm = ref()
            if mm is None or mm.closed or off >= len(mm):
                return
            n = min(PREFAULT_CHUNK, len(mm) - off)
            view = np.frombuffer(mm, np.uint8, count=n, offset=off)
            view[::mmap.PAGESIZE].sum()  # a read of every page; numpy releases the GIL
            del view, mm
            off += n


PREFAULT = Prefaulter()


def _ensure_dir(shm_dir: Path) -> None:
    if not shm_dir.is_dir():
        try:
            shm_dir.mkdir(mode=DIR_MODE, parents=True)
            os.chmod(shm_dir, DIR_MODE)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass
        except OSError as e:
            raise StorageError(f"cannot create hot-tier directory {shm_dir}: {e}") from None
    mode = shm_dir.stat().st_mode
    if mode & 0o007:
        log.warning("hot-tier directory %s is accessible by others (mode %o); segments are 0640",
                    shm_dir, mode & 0o777)


# ---------------------------------------------------------------------------------------------
# publisher (daemon side)
# ---------------------------------------------------------------------------------------------
class HotPublisher:
    """Owns the segments of one table: writes generations and publishes them atomically.

    One publisher per table (an exclusive ``flock`` on the control file enforces it).
    Generation numbers continue from the existing control file and segment files, so they keep
    increasing across daemon restarts; a restarted publisher unlinks temp files of a crashed
    predecessor and retires its older segments (unlinked ``grace_s`` later).
    ``clock`` (monotonic seconds) times the grace period: tests pass their own.
    """

    def __init__(self, shm_dir: str | os.PathLike, table_name: str, identity: TableIdentity, *,
                 grace_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._dir = Path(shm_dir)
        self._table = _check_name(table_name)
        self._identity = identity
        self._grace_s = float(grace_s)
        self._clock = clock
        self._retired: list[tuple[float, Path]] = []  # (retired at, monotonic s; path)
        self._closed = False
        _ensure_dir(self._dir)
        self._ctl_path = self._dir / ctl_name(self._table)
        self._open_ctl()
        self._current = int(self._ctl_words[_CTL_GEN])  # the published generation (0 = none)
        # a crash between rename and the control store leaves a newer, unpublished file: never
        # reuse its number (a reader may not tell two different tables with one name apart)
        existing = self._scan()
        self._last = max([self._current, *existing])  # the highest number ever used
        now = self._clock()
        for g in existing:
            if g != self._current:
                self._retired.append((now, self._segment_path(g)))
        self._ctl_words[_CTL_STATE] = CTL_LIVE
        log.info("hot publisher for %r in %s: generation %d, %d old segments to collect",
                 self._table, self._dir, self._current, len(self._retired))

    # -- files -----------------------------------------------------------------------------
    def _segment_path(self, gen: int) -> Path:
        return self._dir / segment_name(self._table, gen)

    def _open_ctl(self) -> None:
        fd = os.open(self._ctl_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StorageError(f"hot table {self._table!r} in {self._dir} already has a "
                                   f"publisher (another ngramd for this table?)") from None
            os.fchmod(fd, FILE_MODE)
            st = os.fstat(fd)
            fresh = st.st_size < CTL_SIZE
            if not fresh and os.pread(fd, 8, 0) != CTL_MAGIC:
                # we hold the lock, so no live publisher owns it: a leftover a crash or a
                # stray write damaged.  Start it over (readers see "not published yet"; the
                # segment numbers continue from the files, see __init__)
                log.warning("%s is not a valid hot-tier control file: starting it over",
                            self._ctl_path)
                os.pwrite(fd, bytes(CTL_SIZE), 0)
                fresh = True
            if fresh:
                # created now or by a publisher that died while creating it; readers treat a short
                # or magic-less control file as "not published yet"
                os.ftruncate(fd, CTL_SIZE)
            self._ctl_mm = mmap.mmap(fd, CTL_SIZE, mmap.MAP_SHARED,
                                     mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._ctl_fd = fd  # kept open: it holds the lock
        self._ctl_mv = memoryview(self._ctl_mm)
        self._ctl_words = self._ctl_mv.cast("Q")
        if fresh:
            self._ctl_words[_CTL_GEN] = 0
            self._ctl_words[_CTL_STATE] = CTL_LIVE
            struct.pack_into("<II", self._ctl_mm, 8, CTL_VERSION, 0)
            self._ctl_mm[:8] = CTL_MAGIC  # last: readers accept the file from here on
        self._ctl_words[4] = os.getpid()

    def _scan(self) -> list[int]:
        """Generations of existing segment files; removes leftover temp files (we hold the lock,
        so nobody is writing them)."""
        seg_re = re.compile(rf"^{re.escape(self._table)}\.gen(\d+)$")
        tmp_re = re.compile(rf"^\.{re.escape(self._table)}\.gen(\d+)\.tmp$")
        gens = []
        for name in os.listdir(self._dir):
            if m := seg_re.match(name):
                gens.append(int(m.group(1)))
            elif tmp_re.match(name):
                log.info("removing leftover temp segment %s", name)
                _unlink_quiet(self._dir / name)
        return sorted(gens)

    # -- API -------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        """The last published generation (0 = none yet)."""
        return self._current

    @property
    def path(self) -> Path:
        """Path of the current segment."""
        return self._segment_path(self._current)

    @property
    def identity(self) -> TableIdentity:
        """The identity every segment of this table records."""
        return self._identity

    # -- recent epochs (``RecentTable``'s files and control words) ---------------------------
    def recent_path(self, epoch: int) -> Path:
        """Path of the recent segment of ``epoch``."""
        return self._dir / recent_name(self._table, epoch)

    def recent_files(self) -> list[int]:
        """Epochs of the recent segment files in the directory (a previous daemon's too)."""
        seg_re = re.compile(rf"^{re.escape(self._table)}\.recent(\d+)$")
        return [int(m.group(1)) for n in os.listdir(self._dir) if (m := seg_re.match(n))]

    @property
    def recent_epochs(self) -> tuple[int, int]:
        """The recent epochs the control file publishes: (current, previous); 0 = none."""
        return int(self._ctl_words[_CTL_RECENT]), int(self._ctl_words[_CTL_RECENT_PREV])

    def publish_recent(self, current: int, previous: int) -> None:
        """Publish the recent epochs readers map: the previous one first, so a reader that
        reads between the two stores sees (old, old) at worst, never a gap."""
        self._ctl_words[_CTL_RECENT_PREV] = previous
        self._ctl_words[_CTL_RECENT] = current

    def publish(self, slots: np.ndarray, max_probe: int, applied_seq: int = 0,
                pruned: np.ndarray | None = None, pruned_nprobe: int = 0) -> int:
        """Write ``slots`` as generation N+1, publish it, retire N; returns N+1.

        ``slots``: C-contiguous uint32 ``(capacity, 8)`` with a power-of-two capacity (e.g. from
        ``hot.selection.build_hot``); ``max_probe``: the bound it was built with (slot reads);
        ``applied_seq``: the ingest-log watermark its counts include; ``pruned``: the blocked
        Bloom filter (uint64 words, ``pruned_nprobe`` probes) of the keys left out as
        redundant (``hot.selection.pruned_filter``).  Cost: one copy of the
        table into tmpfs plus a checksum pass, ~1 ms per MiB (32 MiB: 31-33 ms, of which the
        checksum 14 ms, on the 2-core dev box at load ~1.9).
        """
        self._check_open()
        slots = _check_slots(slots)
        entries = int(np.count_nonzero(slots[:, 0] | slots[:, 1]))
        if pruned is None or not pruned_nprobe:
            pruned, pruned_nprobe = np.zeros(0, np.uint64), 0
        pruned = np.ascontiguousarray(pruned, np.uint64)

        def fill(fd: int) -> None:
            write_all(fd, memoryview(slots).cast("B"))
            write_all(fd, memoryview(pruned).cast("B"))

        # numba's, loaded here: this module stays numpy-only (the module doc)
        from ..kernels.slots import slots_checksum

        return self.publish_stream(slots.shape[0], max_probe, applied_seq, entries,
                                   int(slots_checksum(slots)), int(pruned.shape[0]),
                                   int(pruned_nprobe), fill)

    def publish_stream(self, capacity: int, max_probe: int, applied_seq: int, entries: int,
                       checksum: int, filter_words: int, filter_nprobe: int,
                       fill: Callable[[int], None]) -> int:
        """``publish`` for a generation whose payload (the slot array, then the pruned filter)
        ``fill(fd)`` writes to the segment's file, already past its header: a hot image streamed
        from disk (``ngramd.hot.image``), one pass over it with its checksum.  ``entries`` and
        ``checksum`` are the slot array's, as ``publish`` would count them.  When ``fill``
        raises, nothing is published and the exception propagates (``OSError`` as
        ``StorageError``)."""
        self._check_open()
        if capacity < 1 or capacity & (capacity - 1):
            raise BadInput(f"slot capacity {capacity} is not a power of two")
        if not 1 <= int(max_probe) <= capacity:
            raise BadInput(f"max_probe {max_probe} must be in [1, capacity={capacity}]")
        self.collect()
        t0 = time.perf_counter()
        gen = self._last + 1
        header = pack_header(generation=gen, capacity=capacity, max_probe=int(max_probe),
                             identity=self._identity, entries=int(entries),
                             checksum=int(checksum), applied_seq=int(applied_seq),
                             filter_words=int(filter_words), filter_nprobe=int(filter_nprobe))
        final = self._segment_path(gen)
        tmp = self._dir / f".{final.name}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # the umask may have narrowed it; never widen past 0640
                write_all(fd, header)
                fill(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            want = len(header) + capacity * SLOT_BYTES + 8 * int(filter_words)
            if size != want:
                raise StorageError(f"hot generation {gen} of {self._table!r}: {size} bytes "
                                   f"written, {want} expected")
            # tmpfs: no fsync (nothing survives a reboot anyway); rename makes it whole-or-absent
            os.rename(tmp, final)
        except OSError as e:
            _unlink_quiet(tmp)
            raise StorageError(f"cannot write hot generation {gen} of {self._table!r} "
                               f"in {self._dir}: {e}") from None
        except BaseException:
            _unlink_quiet(tmp)
            raise
        # the publication: one aligned 8-byte store (memoryview 'Q' item assignment = memcpy of
        # 8 bytes to an 8-aligned address, a single store instruction)
        self._ctl_words[_CTL_GEN] = gen
        prev, self._current, self._last = self._current, gen, gen
        if prev:
            self._retired.append((self._clock(), self._segment_path(prev)))
        log.info("published %s: %d entries in %d slots (%.1f MiB), applied seq %d, %.1f ms",
                 final.name, entries, capacity, capacity * SLOT_BYTES / 2**20, applied_seq,
                 (time.perf_counter() - t0) * 1e3)
        return gen

    def _check_open(self) -> None:
        if self._closed:
            raise NgramError("publish on a closed HotPublisher")

    def collect(self, *, force: bool = False) -> int:
        """Unlink retired segments older than the grace period (all of them with ``force``);
        returns how many were unlinked."""
        now = self._clock()
        keep, done = [], 0
        for t, path in self._retired:
            if force or now - t >= self._grace_s:
                _unlink_quiet(path)
                done += 1
            else:
                keep.append((t, path))
        self._retired = keep
        return done

    def close(self, unlink: bool = True) -> None:
        """Release the table.  ``unlink=True`` removes every file of the table (readers that
        have it mapped keep working on their mapping and see the control file marked closed);
        ``unlink=False`` leaves the current generation published for a restarted publisher."""
        if self._closed:
            return
        self._closed = True
        if unlink:
            self._ctl_words[_CTL_STATE] = CTL_CLOSED
            self.collect(force=True)
            for g in self._scan():
                _unlink_quiet(self._segment_path(g))
            _unlink_quiet(self._ctl_path)
        self._ctl_words.release()
        self._ctl_mv.release()
        self._ctl_mm.close()
        os.close(self._ctl_fd)  # releases the lock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()



def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot unlink %s: %s", path, e)


def _check_slots(slots) -> np.ndarray:
    if not isinstance(slots, np.ndarray) or slots.dtype != np.uint32 or slots.ndim != 2 \
            or slots.shape[1] != SLOT_WORDS:
        raise BadInput("slots must be a uint32 array of shape (capacity, 8)")
    cap = slots.shape[0]
    if cap < 1 or cap & (cap - 1):
        raise BadInput(f"slot capacity {cap} is not a power of two")
    return np.ascontiguousarray(slots)
