"""Hot tier transport: the shared-memory segments generator processes draft from in-process.

The daemon (one ``HotPublisher`` per table) writes a slot table as a new *generation* into
``/dev/shm`` and publishes it with one atomic store; its ``RecentTable`` holds what the writer
counts since, updated in place; any number of ``HotReader`` s in other processes map both
read-only and draft from them with the kernels of ``ngramd.kernels`` (µs per context, no IPC).
This module describes the segment and control formats (below) and owns mapping, the recent
table and the reader's drafting helpers; the file names, the header and publication are
``ngramd.hot.segments``'s (numpy only: a start publishes before numba loads); *what* goes into a
generation (the selection policy) is ``ngramd.hot.selection``'s.  docs/ARCHITECTURE.md §4.

Files (all under ``shm_dir``, default ``/dev/shm/ngramd``)
---------------------------------------------------------
``<table>.gen<N>`` — one segment per generation, never modified after it is published::

    [0, 4096)                  header (little-endian, ``struct`` format ``_HEADER``)
    [4096, 4096 + 32*capacity) slot array: capacity x 8 uint32 words (layout: ngramd.kernels)
    then 8*filter_words bytes  the *pruned filter*: a blocked Bloom filter (kernels.bloom.bbloom_*)
                               of the keys the build left out as redundant
                               (hot.selection.pruned_filter), so that drafters count a hot match
                               at the order the whole table would (kernels.draft)

    header                     offset  type
      magic  b"NGRAMHOT"        0      8s
      format version            8      u32   (SEGMENT_VERSION; readers reject others)
      header size               12     u32   (4096: the slots start page-aligned)
      generation N              16     u64
      capacity (slots, 2^k)     24     u64
      max_probe (slot reads)    32     u32
      n_min, n_max              36,40  u32
      hot_k                     44     u32
      vocab_size                48     u32
      slot bytes                52     u32   (32; guards the slot layout)
      entries (occupied slots)  56     u64
      checksum                  64     u64   (kernels.slots.slots_checksum of the slot array)
      created                   72     u64   (time.time_ns() of the build)
      identity sha256           80     32s   (sha256 of TableIdentity.to_json())
      applied log watermark     112    u64   (ingest-log sequence the counts include)
      identity JSON length      120    u32
      (pad)                     124    u32
      pruned filter words       128    u64   (0 = none)
      pruned filter probes      136    u32
      (pad)                     140    u32
      identity JSON             256    bytes (TableIdentity.to_json(), for error messages/tools)

``<table>.ctl`` — the control file, 4096 bytes, created once and then only written in place::

      magic  b"NGRAMCTL" @0 (8s), version @8 (u32), pad @12, generation @16 (u64, aligned),
      state @24 (u64: 0 live, 1 closed = the publisher removed the table), publisher pid @32,
      recent epoch @40 (u64), previous recent epoch @48 (u64; 0 = none).

``<table>.recent<E>`` — a *recent* segment: the same 4096-byte header (magic ``b"NGRAMREC"``,
generation = epoch E; entries = slots in use, kept current so that readers skip an empty epoch;
checksum unused) and a slot array that the daemon updates IN PLACE with what its writer
counts (``kernels.recent.recent_add``), so what is acknowledged becomes draftable in every generator
within one writer step (ARCHITECTURE §4.5).  Readers probe the
current and the previous epoch beside the hot tier.  When an epoch's table is half full the
daemon starts a new one (zeroed), publishes it in the control file (previous first, then
current) and unlinks the epoch before the previous one ``grace_s`` later: a row stays
draftable for at least one whole epoch, and the hot tier, rebuilt from all counts, takes over.
The in-place update is the one exception to "never in-place edits": a new slot gets its data
before its key, so a reader that sees the key sees the row on x86-64; a torn read elsewhere
(a count from before and a token from after) can only cost one wrong draft token, which
verification rejects.  Old recent files are removed when a daemon starts.

``.<table>.gen<N>.tmp`` — a generation being written; never opened by readers.

Publication protocol (why no reader sees a half-built table)
------------------------------------------------------------
1. Write the complete segment N+1 (header + slots) into the temp file.
2. ``rename`` it to ``<table>.gen<N+1>`` (atomic; the name exists only once the file is whole).
3. Store N+1 into the control file's generation word: one aligned 8-byte store into a shared
   mapping, which x86-64 and AArch64 perform atomically.
4. Segment N is unlinked ``grace_s`` later.  A reader that has mapped it keeps a valid mapping
   (tmpfs frees the pages when the last mapping goes); a reader that read N from the control file
   but stalled past the grace period finds the file gone and simply re-reads the control file.

Readers check the generation word once per batch — a load from the mapped control file, no
system call — and remap only when it changed.  No file is ever unlinked by a reader; we do not
use ``multiprocessing.shared_memory`` because its resource tracker unlinks segments that an
attaching process merely opened (Python 3.11).

Security: the directory is created with mode 0750 and every file with 0640 (owner and group
only; set the group, e.g. with a setgid directory, so generator processes can read).
"""

from __future__ import annotations

import logging
import mmap
import operator
import os
import time
from pathlib import Path

import numpy as np

from .. import kernels
from ..kernels.recent import recent_add
from ..kernels.slots import lookup_batch, probe_batch, slots_checksum
from ..wire.constants import (BB_BLOCK_WORDS, EMPTY_TOKEN, HOT_K, MAX_DRAFT_LEN, MAX_ORDER,
                              SLOT_BYTES, SLOT_WORDS)
from .segments import (CTL_LIVE, CTL_MAGIC, CTL_SIZE, FILE_MODE, HEADER_SIZE, PREFAULT,
                       HotPublisher, RECENT_MAGIC, SEGMENT_MAGIC, SEGMENT_VERSION, ctl_name,
                       identity_digest, map_read_only, pack_header, recent_name, segment_name,
                       unpack_header, _CTL_GEN, _CTL_RECENT, _CTL_RECENT_PREV, _CTL_STATE,
                       _ENTRIES_OFFSET, _check_name, _unlink_quiet)
from ..drafttiers import EMPTY, NO_SHARED, DraftTiers, SharedTiers
from ..wire.errors import (UNAVAILABLE, VERSION, BadInput, IdentityMismatch, NgramError,
                           StorageError)
from ..wire.identity import TableIdentity
from ..wire.commands import Draft, DraftBatch
from ..wire.rules import DraftRules
from ..wire.validate import as_offsets

log = logging.getLogger("ngramd.hotshm")  # the name operators know (kept)

#: a recent table starts a new epoch past this load factor (linear probes stay short)
RECENT_LOAD = 0.5

_EMPTY_SLOTS = kernels.EMPTY_SLOTS


class RecentTable:
    """The daemon's recent table: what its writer counts, in shared memory at once.

    One slot table of ``capacity`` slots per epoch (``<table>.recent<E>``), mapped read-write
    here and read-only by every ``HotReader``; ``add`` merges counted rows into it in place
    (``kernels.recent.recent_add``, µs per thousand rows).  Past ``RECENT_LOAD`` (or when a row
    finds no slot within ``max_probe``) the next ``add`` starts a new epoch: the previous one stays
    readable, the one before it is unlinked after ``grace_s``.  See the module docstring.
    """

    def __init__(self, publisher: HotPublisher, capacity: int, max_probe: int, *,
                 grace_s: float = 10.0):
        if capacity < 64 or capacity & (capacity - 1):
            raise BadInput(f"recent capacity {capacity} must be a power of two >= 64")
        self._pub = publisher
        self.capacity = int(capacity)
        self.max_probe = int(max_probe)
        self._grace_s = float(grace_s)
        self._retired: list[tuple[float, Path]] = []
        self._maps: dict[int, tuple] = {}  # epoch -> (mmap, slots)
        self.used = 0  # slots occupied in the current epoch
        self.rows = 0  # rows merged in (counter)
        self.dropped = 0  # rows that found no slot (counter)
        self.rolls = 0  # epochs started (counter)
        # a previous daemon's recent epochs are stale (their rows are in the counts now)
        old = publisher.recent_files()
        self._epoch = max(old + list(publisher.recent_epochs))
        publisher.publish_recent(0, 0)
        for e in old:
            _unlink_quiet(self._path(e))
        self.slots = self.prev = _EMPTY_SLOTS
        self._roll()

    def _path(self, epoch: int) -> Path:
        return self._pub.recent_path(epoch)

    def _roll(self) -> None:
        pub = self._pub
        epoch = self._epoch + 1
        path = self._path(epoch)
        size = HEADER_SIZE + self.capacity * SLOT_BYTES
        header = pack_header(generation=epoch, capacity=self.capacity, max_probe=self.max_probe,
                             identity=pub.identity, entries=0, checksum=0, magic=RECENT_MAGIC)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)
                os.ftruncate(fd, size)  # tmpfs: zero-filled pages, allocated on first write
                os.pwrite(fd, header, 0)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            _unlink_quiet(path)
            raise StorageError(f"cannot create recent segment {path}: {e}") from None
        slots = np.frombuffer(mm, np.uint32, count=self.capacity * SLOT_WORDS,
                              offset=HEADER_SIZE).reshape(self.capacity, SLOT_WORDS)
        # the header's entries word: slots in use, kept current so readers skip an empty epoch
        # (probing an empty 64 MiB table still costs a cache miss an order: 33 µs a draft on
        # a fresh daemon, against ~5 µs without the two recent tables, measured at 61a5513)
        self._entries = np.frombuffer(mm, np.uint64, count=1, offset=_ENTRIES_OFFSET)
        self._maps[epoch] = (mm, slots)
        prev, gone = pub.recent_epochs
        pub.publish_recent(epoch, prev)
        self.prev = self.slots
        self._prev_used = getattr(self, "used", 0)
        self.slots = slots
        self._epoch = epoch
        self.used = 0
        self.rolls += 1
        if gone:
            self._retired.append((time.monotonic(), self._path(gone)))
            self._maps.pop(gone, None)  # our own mapping goes once no array refers to it
        self._collect()

    def _collect(self, force: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for t, path in self._retired:
            if force or now - t >= self._grace_s:
                _unlink_quiet(path)
            else:
                keep.append((t, path))
        self._retired = keep

    @property
    def epoch(self) -> int:
        return self._epoch

    def add(self, key, order, total, poff, tok, cnt) -> int:
        """Merge a row set's counts into the current epoch; returns the rows placed.  Starts a
        new epoch first when this one is past ``RECENT_LOAD``."""
        m = int(key.shape[0])
        if not m:
            return 0
        if self.used + m > RECENT_LOAD * self.capacity:
            self._roll()
        if m > RECENT_LOAD * self.capacity:  # a batch larger than an epoch: keep a prefix
            m = int(RECENT_LOAD * self.capacity)
            key, order, total, poff = key[:m], order[:m], total[:m], poff[:m + 1]
        dropped, inserted = recent_add(self.slots, self.max_probe, key, order, total,
                                       poff, tok, cnt)
        self.used += int(inserted)
        self._entries[0] = self.used  # after the slots: a reader that sees it sees them
        self.rows += m - int(dropped)
        self.dropped += int(dropped)
        if dropped:
            self.used = self.capacity  # probe chains are long: start over at the next add
        return m - int(dropped)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The current and previous epochs' slot arrays, an empty array for an empty one."""
        return (self.slots if self.used else _EMPTY_SLOTS,
                self.prev if self._prev_used else _EMPTY_SLOTS)

    def stats(self) -> dict:
        return {"epoch": self._epoch, "capacity": self.capacity, "used": self.used,
                "bytes": 2 * self.capacity * SLOT_BYTES, "rows": self.rows,
                "dropped": self.dropped, "rolls": self.rolls}

    def close(self, unlink: bool = True) -> None:
        if unlink:
            self._pub.publish_recent(0, 0)
            self._collect(force=True)
            for e in list(self._maps):
                _unlink_quiet(self._path(e))
        self._maps.clear()
        self.slots = self.prev = _EMPTY_SLOTS



def _read_only(attr: str, doc: str) -> property:
    """A read-only property that returns ``self.<attr>``."""
    return property(operator.attrgetter(attr), doc=doc)


# ---------------------------------------------------------------------------------------------
# reader (generator side)
# ---------------------------------------------------------------------------------------------
class HotReader:
    """Read-only view of the current hot generation of a table and of its recent epochs, plus
    thin drafting helpers.

    Attaching maps the control file and the segment it names (``O_RDONLY``, ``PROT_READ``);
    nothing is ever unlinked or written.  Every helper calls ``refresh()`` once (a load from the
    mapped control file) and remaps when the daemon published a new generation.  Not thread-safe:
    use one reader per thread (they share nothing but the page cache).

    Token ids are not range-checked here (this is the in-process hot path; ids come from the
    model): an out-of-vocabulary id only makes its contexts miss.

    Raises ``NgramError`` (code ``unavailable``) when the table is not published,
    ``IdentityMismatch`` when ``identity`` is given and the table was built for another one.
    """

    #: seconds between attempts to re-attach after the publisher removed the table
    reattach_interval_s = 1.0

    def __init__(self, shm_dir: str | os.PathLike, table_name: str, *,
                 identity: TableIdentity | None = None, warm: bool = True):
        self._dir = Path(shm_dir)
        self._table = _check_name(table_name)
        self._identity = identity
        self._digest = identity_digest(identity) if identity is not None else None
        self._ctl_path = self._dir / ctl_name(self._table)
        self._gen = 0
        self._slots = _EMPTY_SLOTS
        self._rc = self._rp = 0  # recent epochs mapped (current, previous)
        self._pruned, self._pruned_nprobe = np.zeros(0, np.uint64), 0
        self._recent = self._recent_all = (_EMPTY_SLOTS, _EMPTY_SLOTS)
        self._recent_n = (None, None)
        self._recent_maps: dict[int, tuple] = {}
        self._header: dict = {}
        self._next_reattach = 0.0
        self._shared = NO_SHARED
        self._shared_at = None  # the recent epochs' emptiness _shared was made for
        self._open_ctl()
        self._attach()
        self._bbuf_shape = (0, 0)
        # every draft goes through the drafting front end, fed the tiers mapped now
        self._tiers = DraftTiers()
        self._lk_tok = None
        self._pr_cap = 0
        if warm:  # compile (or load from numba's cache) the drafting kernel now
            rules = DraftRules(n_min=self._n_min, n_max=self._n_max, c_min=1, s_min=0.0)
            self.draft(np.zeros(1, np.uint32), 1, rules)
            self.draft(np.zeros(1, np.uint32), 1, rules)  # the second call takes the fast path

    @classmethod
    def from_info(cls, info: dict, **kw) -> "HotReader":
        """Map the hot generation a daemon's ``info()`` names (``hot: {shm_dir, table}``,
        checked against its ``identity``), to draft in-process (µs) and ask the daemon only
        on a miss.  Needs the same host and read access to the shm dir.  (It was
        ``NgramClient.attach_hot``: the client library loads no numba.)"""
        hot = info["hot"]
        return cls(hot["shm_dir"], hot["table"], identity=TableIdentity(**info["identity"]),
                   **kw)

    # -- attach / refresh ------------------------------------------------------------------
    def _open_ctl(self) -> None:
        try:
            fd = os.open(self._ctl_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NgramError(f"hot table {self._table!r} not found in {self._dir} (no "
                             f"{self._ctl_path.name}: is ngramd running for this table?)",
                             UNAVAILABLE) from None
        except PermissionError:
            raise NgramError(f"hot table {self._table!r} in {self._dir}: permission denied (the "
                             f"segments are readable by the daemon's user and group only)",
                             UNAVAILABLE) from None
        try:
            st = os.fstat(fd)
            if st.st_size < CTL_SIZE:  # mapping past EOF would SIGBUS on access
                raise NgramError(f"hot table {self._table!r}: control file not initialised yet",
                                 UNAVAILABLE)
            mm = mmap.mmap(fd, CTL_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        if mm[:8] != CTL_MAGIC:
            raise NgramError(f"hot table {self._table!r}: control file not initialised yet",
                             UNAVAILABLE)
        self._ctl_mm = mm
        self._ctl_ino = st.st_ino
        self._ctl_words = memoryview(mm).cast("Q")  # read-only view; [_CTL_GEN] is a plain load

    def _attach(self) -> None:
        """Map the generation the control file names.  The segment can vanish between reading
        the control word and opening it only if we stalled longer than the grace period: then
        the control file names a newer one, so re-read it and retry."""
        for attempt in range(5):
            gen = int(self._ctl_words[_CTL_GEN])
            if gen == 0:
                raise NgramError(f"hot table {self._table!r} in {self._dir}: no generation "
                                 f"published yet", UNAVAILABLE)
            try:
                mm, slots, header = self._open_segment(gen)
            except FileNotFoundError:
                log.debug("hot segment %s.gen%d vanished before mapping; retrying", self._table,
                          gen)
                time.sleep(0.001 * attempt)
                continue
            if self._digest is not None and header["identity_sha256"] != self._digest:
                raise _identity_error(header, self._identity)
            # the previous mapping stays valid for whoever still holds its arrays
            self._mm, self._slots, self._header, self._gen = mm, slots, header, gen
            self._max_probe = header["max_probe"]
            self._n_min = header["n_min"]
            self._n_max = header["n_max"]
            self._pruned = header.pop("pruned")
            self._pruned_nprobe = int(header["filter_nprobe"])
            self._map_recent()  # (the shared tiers are made anew at the next draft)
            return
        raise NgramError(f"hot table {self._table!r}: segment generation {gen} is missing from "
                         f"{self._dir}", UNAVAILABLE)

    def _map_recent(self) -> None:
        """Map the recent epochs the control file names (read-only); a missing or foreign
        segment is skipped (empty) until the next change of the words."""
        rc, rp = int(self._ctl_words[_CTL_RECENT]), int(self._ctl_words[_CTL_RECENT_PREV])
        maps = {}
        for e in (rc, rp):
            if not e or e in maps:
                continue
            got = self._recent_maps.get(e)
            if got is None:
                try:
                    got = self._open_segment(e, recent=True)[:2]
                except (OSError, NgramError) as err:
                    log.debug("recent segment %s.recent%d not mapped: %s", self._table, e, err)
                    continue
            maps[e] = got
        self._recent_maps = maps
        self._recent_all = (maps[rc][1] if rc in maps else _EMPTY_SLOTS,
                            maps[rp][1] if rp in maps else _EMPTY_SLOTS)
        self._recent_n = tuple(np.frombuffer(maps[e][0], np.uint64, count=1,
                                             offset=_ENTRIES_OFFSET) if e in maps else None
                               for e in (rc, rp))
        self._recent = self._recent_all
        self._rc, self._rp = rc, rp
        self._shared_at = None

    def _open_segment(self, gen: int, recent: bool = False):
        path = self._dir / (recent_name(self._table, gen) if recent
                            else segment_name(self._table, gen))
        mm, size = map_read_only(os.open(path, os.O_RDONLY | os.O_CLOEXEC), HEADER_SIZE)
        if mm is None:
            raise StorageError(f"{path}: truncated hot segment ({size} bytes)")
        h = unpack_header(mm)
        if h["magic"] != (RECENT_MAGIC if recent else SEGMENT_MAGIC):
            raise StorageError(f"{path}: not a {'recent' if recent else 'hot'} segment")
        if recent and self._digest is not None and h["identity_sha256"] != self._digest:
            raise _identity_error(h, self._identity)
        if h["version"] != SEGMENT_VERSION:
            raise NgramError(f"{path}: hot segment format {h['version']}, this reader speaks "
                             f"{SEGMENT_VERSION}", VERSION)
        cap = h["capacity"]
        fw = h["filter_words"]
        if (h["header_size"] != HEADER_SIZE or h["slot_bytes"] != SLOT_BYTES
                or cap < 1 or cap & (cap - 1) or fw % BB_BLOCK_WORDS
                or size != HEADER_SIZE + cap * SLOT_BYTES + 8 * fw
                or h["generation"] != gen
                or not 1 <= h["n_min"] <= h["n_max"] <= MAX_ORDER):
            raise StorageError(f"{path}: inconsistent hot segment header")
        slots = np.frombuffer(mm, np.uint32, count=cap * SLOT_WORDS, offset=HEADER_SIZE)
        h["segment"] = path.name
        h["pruned"] = np.frombuffer(mm, np.uint64, count=fw,
                                    offset=HEADER_SIZE + cap * SLOT_BYTES)
        PREFAULT.add(mm)  # its pages mapped in the background, not one fault a probe
        return mm, slots.reshape(cap, SLOT_WORDS), h

    def refresh(self) -> bool:
        """Remap if the daemon published a new generation or recent epoch; returns True when
        it did.  Fast path: four loads from the mapped control file (no system call)."""
        w = self._ctl_words
        if (w[_CTL_GEN] == self._gen and w[_CTL_STATE] == CTL_LIVE
                and w[_CTL_RECENT] == self._rc and w[_CTL_RECENT_PREV] == self._rp):
            return False
        return self._refresh_slow()

    def _refresh_slow(self) -> bool:
        w = self._ctl_words
        if w[_CTL_STATE] == CTL_LIVE and (w[_CTL_RECENT] != self._rc
                                          or w[_CTL_RECENT_PREV] != self._rp):
            self._map_recent()
            if w[_CTL_GEN] == self._gen:
                return True
        return self._refresh_gen()

    def _refresh_gen(self) -> bool:
        if self._ctl_words[_CTL_STATE] != CTL_LIVE:
            # the publisher removed the table: keep drafting from the mapping we have and look
            # for a new control file now and then
            now = time.monotonic()
            if now < self._next_reattach:
                return False
            self._next_reattach = now + self.reattach_interval_s
            try:
                if os.stat(self._ctl_path).st_ino == self._ctl_ino:
                    return False
                old = (self._ctl_mm, self._ctl_ino, self._ctl_words)
                self._open_ctl()
            except (OSError, NgramError):
                return False
            if self._ctl_words[_CTL_GEN] == 0:
                self._ctl_mm, self._ctl_ino, self._ctl_words = old
                return False
            log.info("hot table %r re-attached to a new control file", self._table)
            # a new publisher may restart the numbering: remap even if the number is ours
            self._attach()
            return True
        if self._ctl_words[_CTL_GEN] == self._gen:
            return False
        self._attach()
        return True

    # -- properties ------------------------------------------------------------------------
    @property
    def slots(self) -> np.ndarray:
        """The current slot array: read-only uint32 ``(capacity, 8)``."""
        return self._slots

    @property
    def pruned(self) -> tuple[np.ndarray, int]:
        """The pruned filter of the current generation: ``(words, probes)`` (empty: none)."""
        return self._pruned, self._pruned_nprobe

    @property
    def recent(self) -> tuple[np.ndarray, np.ndarray]:
        """The recent tables (current epoch, previous epoch): read-only slot arrays, empty
        ``(0, 8)`` when the daemon publishes none or the epoch holds nothing yet."""
        return self._recent_tables()

    def _recent_tables(self) -> tuple[np.ndarray, np.ndarray]:
        a, b = self._recent_all
        na, nb = self._recent_n
        # an epoch that holds nothing is skipped (its probes would find nothing)
        return (a if na is not None and na[0] else EMPTY,
                b if nb is not None and nb[0] else EMPTY)

    @property
    def tiers(self) -> SharedTiers:
        """The tiers mapped now as drafters share them (``DraftTiers.share``): the hot
        generation with its pruned filter and probe bound, the recent epochs.  The same value
        until the generation, an epoch or an epoch's emptiness changes."""
        na, nb = self._recent_n
        filled = (na is not None and na[0] != 0, nb is not None and nb[0] != 0)
        if filled != self._shared_at:  # a mapping changed (None), or an epoch's emptiness
            r0, r1 = self._recent_tables()
            self._shared = SharedTiers.of(self._shared, self._slots, r0, r1, self._pruned,
                                          self._pruned_nprobe, self._max_probe)
            self._shared_at = filled
        return self._shared

    generation = _read_only("_gen", "The hot generation mapped now (int).")
    max_probe = _read_only("_max_probe", "The mapped generation's probe bound (int).")
    n_min = _read_only("_n_min", "The table's lowest order (int).")
    n_max = _read_only("_n_max", "The table's highest order (int).")

    @property
    def header(self) -> dict:
        """The current segment's header fields (see the module docstring), plus ``segment``."""
        return dict(self._header)

    def verify(self) -> bool:
        """Recompute the slot checksum and compare with the header (O(capacity); tests/tools)."""
        return int(slots_checksum(self._slots)) == self._header["checksum"]

    def close(self) -> None:
        """Drop the mappings (they go away once no returned array refers to them)."""
        self._slots = _EMPTY_SLOTS
        self._recent = self._recent_all = (_EMPTY_SLOTS, _EMPTY_SLOTS)
        self._recent_n = (None, None)
        self._recent_maps = {}
        self._shared, self._shared_at = NO_SHARED, None
        self._tiers.share(NO_SHARED)
        self._mm = None
        self._ctl_words = None
        self._ctl_mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- drafting ------------------------------------------------------------------------
    def draft(self, ctx, max_len: int, rules: DraftRules,
              local_slots: np.ndarray | None = None, *, local_max_probe: int = 0) -> Draft:
        """Draft up to ``max_len`` tokens after ``ctx`` (token ids; only the last n_max matter)
        from the hot tier and the recent tables, with ``rules`` (orders and stop rules: the
        table's, ``DraftRules.from_info(info)``; its ``max_draft_len`` is not applied here).

        ``local_slots``: a request-local slot table (``kernels.local.local_add``) tried before the hot
        one, built with at most ``local_max_probe``.  Returns views valid until the next call.
        Drafts through ``drafttiers.DraftTiers`` (its fast call for a uint32 context).
        """
        self.refresh()
        t = self._tiers
        t.share(self.tiers)
        t.set_first(local_slots, local_max_probe)
        return t.draft(ctx, None, max_len, rules)

    def draft_batch(self, tokens, offsets, max_len: int, rules: DraftRules,
                    local_slots: np.ndarray | None = None, *,
                    local_max_probe: int = 0) -> DraftBatch:
        """``draft`` for contexts ``tokens[offsets[i]:offsets[i+1]]`` (one refresh per batch).

        ``local_slots``, if given, is one table shared by the whole batch (e.g. several drafts
        of one request).  Returns ``(B, max_len)`` views of the reader's buffers, valid until
        the next call."""
        self.refresh()
        tokens, offsets = _as_batch(tokens, offsets)
        bsz, max_len = offsets.shape[0] - 1, int(max_len)
        if not 1 <= max_len <= MAX_DRAFT_LEN:
            raise BadInput(f"max_len {max_len} must be in [1, {MAX_DRAFT_LEN}]")
        if bsz > self._bbuf_shape[0] or max_len > self._bbuf_shape[1]:
            shape = (max(bsz, self._bbuf_shape[0]), max(max_len, self._bbuf_shape[1]))
            self._b_out = kernels.draft_out(*shape)
            self._bbuf_shape = shape
        # row slices [:bsz] of C arrays stay C-contiguous: one compiled specialisation
        t, o, r, c, ln = (a[:bsz] for a in self._b_out)
        tiers = self._tiers
        tiers.share(self.tiers)
        tiers.set_first(local_slots, local_max_probe)
        probes = tiers.draft_batch(tokens, offsets, max_len, rules, (t, o, r, c, ln))
        return DraftBatch(t[:, :max_len], o[:, :max_len], r[:, :max_len], c[:, :max_len], ln,
                          int(probes))

    def lookup_batch(self, tokens, offsets):
        """Top-3 candidates of every order of every context (no chaining).

        Returns ``(tok (B, n_max+1, 3) uint32, cnt (B, n_max+1, 3) uint32,
        total (B, n_max+1) int64, hits)``; orders that miss have total 0.  Views of the
        reader's buffers, valid until the next call."""
        self.refresh()
        tokens, offsets = _as_batch(tokens, offsets)
        bsz, width = offsets.shape[0] - 1, self._n_max + 1
        if self._lk_tok is None or bsz > self._lk_tok.shape[0] or self._lk_tok.shape[1] != width:
            cap = max(bsz, 0 if self._lk_tok is None else self._lk_tok.shape[0])
            self._lk_tok = np.empty((cap, width, HOT_K), np.uint32)
            self._lk_cnt = np.empty((cap, width, HOT_K), np.uint32)
            self._lk_total = np.empty((cap, width), np.int64)
            # the kernel only writes orders n_min..n_max: the rest stays "miss" for good
            self._lk_tok[:] = EMPTY_TOKEN
            self._lk_cnt[:] = 0
            self._lk_total[:] = 0
        t, c, tot = self._lk_tok[:bsz], self._lk_cnt[:bsz], self._lk_total[:bsz]
        hits = lookup_batch(self._slots, self._max_probe, tokens, offsets, self._n_min,
                            self._n_max, t, c, tot)
        return t, c, tot, int(hits)

    def probe_batch(self, keys) -> np.ndarray:
        """Slot index of each key hash in the current generation, -1 on a miss (view, valid until
        the next call).  Decode with ``kernels.slots.slot_decode(reader.slots, idx, ...)``."""
        self.refresh()
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        if keys.ndim != 1:
            raise BadInput("keys must be 1-D")
        if keys.shape[0] > self._pr_cap:
            self._pr_cap = max(keys.shape[0], 2 * self._pr_cap)
            self._pr_out = np.empty(self._pr_cap, np.int64)
        out = self._pr_out[:keys.shape[0]]
        probe_batch(self._slots, self._max_probe, keys, out)
        return out

    def __repr__(self):
        return (f"HotReader({str(self._dir)!r}, {self._table!r}, generation={self._gen}, "
                f"capacity={self._slots.shape[0]})")


def _as_batch(tokens, offsets):
    """Token ids and offsets of a batch of contexts, checked by ``validate.as_offsets`` (empty
    contexts allowed: they draft nothing); ids are not range-checked (see ``HotReader``)."""
    tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
    if tokens.ndim != 1:
        raise BadInput(f"batch: tokens must be 1-D, got shape {tokens.shape}")
    # the kernels do not bounds-check: a bad offset would read foreign memory
    return tokens, as_offsets(offsets, tokens.shape[0], what="batch offsets")


def _identity_error(header: dict, wanted: TableIdentity) -> IdentityMismatch:
    try:
        have = TableIdentity(**header["identity"])
        have.check_compatible(wanted)
    except IdentityMismatch as e:
        return IdentityMismatch(f"hot segment {header.get('segment')}: {e}")
    except Exception:  # unparsable identity JSON: fall back to the digest
        pass
    return IdentityMismatch(f"hot segment {header.get('segment')}: table identity differs "
                            f"(sha256 {header['identity_sha256'].hex()[:16]}…)")
