"""``DraftTiers``: the one door to the drafting kernel (ARCHITECTURE §3.4, §3.6).

Every drafter drafts through one: the generator's ``NgramDrafter`` and the vLLM proposer's
batch (the request-local table first), ``HotReader`` (tools, tests, benches), the daemon's
``Table`` (its warm cache first) and the hot-size curve.  It owns what the kernel's ``source``
tuple holds and how it is called:

* **The table order, defined here once.**  ``kernels.draft`` takes four slot tables, earlier
  first: a *first* table, the hot generation, the current and the previous recent epoch.  Two
  layouts differ only in the first table: ``LOCAL_FIRST`` (a request's own table: complete, so
  a draft steps on at n + 1) and ``WARM_FIRST`` (the daemon's cache of cold entries: it omits
  rows, so it restarts at n_max like the pruned hot tier).  A drafter without one of the tables
  passes an empty one; an empty table costs the kernel one branch.
* **The source, built once.**  ``SharedTiers`` is the part every drafter of a process shares
  (hot slots, its pruned-key filter, the recent epochs, the probe bound): an immutable value a
  ``HotReader`` makes anew when it maps a generation or a recent epoch changes (not per draft).
  ``DraftTiers`` joins it with its own first table into the kernel's tuple when either changes.
* **One compiled specialisation.**  Every array of the tuple is read-only and of a fixed dtype
  and every number an ``int``, whether or not a hot tier is mapped: numba types the tuple the
  same way in every case.  Before, a generator passed writable empty tables until the hot
  tier mapped and read-only maps after, so numba compiled (or loaded from its cache) a second
  version inside a vLLM step when the hot tier first appeared.
* **The fast call.**  ``draft`` calls the compiled overload directly, resolved once a process:
  it skips numba's type dispatch (0.8 against 1.5 µs a call for a kernel that does nothing),
  and only arguments of exactly the resolved types take it (``_FastCall``).
* **The batched call.**  ``draft_rows`` drafts many requests in one kernel call, each with its
  own first table (``kernels.batch.draft_rows``): an engine step's rows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numba
import numpy as np
from numba import types
from numba.typed import List

from . import kernels
from .kernels import batch as kernels_batch
from .wire.commands import Draft, DraftBatch
from .wire.constants import (MAX_DRAFT_LEN, MAX_ORDER, SLOT_WORDS, TIER_COLD, TIER_HOT,
                             TIER_LOCAL, TIER_RECENT)
from .wire.errors import BadInput
from .wire.rules import DraftRules

log = logging.getLogger(__name__)


def read_only(a: np.ndarray, dtype, ndim: int) -> np.ndarray:
    """``a`` as a read-only C-contiguous array of ``dtype`` (a view when it already is one of
    that dtype; a writable array gets a read-only view, never a copy of its data)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    if a.ndim != ndim:
        raise BadInput(f"expected a {ndim}-D {np.dtype(dtype).name} array, got shape {a.shape}")
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def read_only_slots(slots) -> np.ndarray:
    """A slot table (``(capacity, 8)`` uint32) as the kernel's source holds it: read-only."""
    slots = read_only(slots, np.uint32, 2)
    if slots.shape[1] != SLOT_WORDS:
        raise BadInput(f"slots must have {SLOT_WORDS} words a slot, got shape {slots.shape}")
    return slots


#: a slot table of no slots (an absent tier), read-only like every table of a source
EMPTY = read_only_slots(kernels.EMPTY_SLOTS)
#: a pruned-key filter of no keys, read-only
NO_FILTER = read_only(kernels.NO_FILTER, np.uint64, 1)
#: the pruned-key filter belongs to the hot tier, the second table of every layout
_HOT_TABLE = 1


class Layout:
    """The tier id and restart rule of each of the kernel's four tables: a first table, hot
    (pruned: restarts at n_max), recent and previous recent (complete: n + 1)."""

    __slots__ = ("name", "tiers", "restart")

    def __init__(self, name: str, first_tier: int, first_restarts: bool):
        self.name = name
        self.tiers = read_only(np.array([first_tier, TIER_HOT, TIER_RECENT, TIER_RECENT]),
                               np.int64, 1)
        self.restart = read_only(np.array([first_restarts, True, False, False]), np.bool_, 1)

    def __repr__(self):
        return f"Layout({self.name})"


#: a request's own table first (complete: the next step starts at n + 1): generators, readers
LOCAL_FIRST = Layout("local first", TIER_LOCAL, False)
#: the daemon's warm cache of cold entries first (it omits rows: restart at n_max)
WARM_FIRST = Layout("warm first", TIER_COLD, True)


class SharedTiers:
    """The tiers every drafter of a process shares, as one immutable value: the hot generation
    with its pruned-key filter ``(pruned, pruned_nprobe)`` and probe bound, and the current and
    previous recent epochs (an empty one is passed as ``EMPTY``: the kernel skips it).  Arrays
    are kept read-only (views of the given ones)."""

    __slots__ = ("hot", "recent", "recent_prev", "pruned", "pruned_nprobe", "max_probe", "_of")

    def __init__(self, hot=EMPTY, recent=EMPTY, recent_prev=EMPTY, pruned=NO_FILTER,
                 pruned_nprobe: int = 0, max_probe: int = 0):
        self._of = (hot, recent, recent_prev, pruned, int(pruned_nprobe), int(max_probe))
        self.hot = read_only_slots(hot)
        self.recent = read_only_slots(recent)
        self.recent_prev = read_only_slots(recent_prev)
        self.pruned = read_only(pruned, np.uint64, 1)
        self.pruned_nprobe = int(pruned_nprobe)
        self.max_probe = int(max_probe)

    def same(self, hot, recent, recent_prev, pruned, pruned_nprobe, max_probe) -> bool:
        """Whether this value was made of these arrays (the very objects) and numbers: a
        holder of the tables makes a new value only when one of them changed."""
        h, r0, r1, p, nprobe, probe = self._of
        return (h is hot and r0 is recent and r1 is recent_prev and p is pruned
                and nprobe == pruned_nprobe and probe == max_probe)

    @classmethod
    def of(cls, current: "SharedTiers", hot, recent, recent_prev, pruned, pruned_nprobe,
           max_probe) -> "SharedTiers":
        """``current`` when it was made of these tables, else a new value of them."""
        if current.same(hot, recent, recent_prev, pruned, pruned_nprobe, max_probe):
            return current
        return cls(hot, recent, recent_prev, pruned, pruned_nprobe, max_probe)


#: no hot tier mapped: drafting from the first table alone
NO_SHARED = SharedTiers()


class DraftTiers:
    """The one drafting front end: a layout, a first table (or none), the shared tiers, and
    result buffers for one context (module doc).

    ``set_first(slots, max_probe)`` and ``share(shared)`` change the tables: the kernel's source
    is rebuilt only when one of them is a different object.  ``draft`` drafts one context (the
    fast call), ``draft_batch`` a batch of contexts over the same tables, ``draft_rows`` a batch
    whose every context has its own first table.  Not thread-safe: one per drafting thread (the
    daemon's ``Table`` serialises its drafts under its warm-cache lock)."""

    def __init__(self, layout: Layout = LOCAL_FIRST, first=None, first_max_probe: int = 0,
                 shared: SharedTiers = NO_SHARED):
        self.layout = layout
        self._first_of: np.ndarray | None = None  # the array ``first`` was made of
        self._first = EMPTY
        self._first_probe = int(first_max_probe)
        self._shared = shared
        self.source: tuple = ()
        self._offs = np.zeros(2, np.int64)  # a single draft is a batch of one: [0, len(ctx)]
        self._width = 0
        self._grow(16)
        self._rows: _RowTables | None = None
        self.set_first(first, first_max_probe)

    # -- the tables ------------------------------------------------------------------------
    @property
    def first(self) -> np.ndarray:
        """The first table as the kernel reads it (read-only; ``EMPTY`` when none)."""
        return self._first

    @property
    def shared(self) -> SharedTiers:
        return self._shared

    def set_first(self, slots: np.ndarray | None, max_probe: int | None = None) -> None:
        """Draft from ``slots`` (the request-local table or the warm cache, which its owner
        keeps writing: the kernel reads a read-only view of it) first, built with at most
        ``max_probe`` (default: unchanged); None: no first table."""
        if (slots is self._first_of and self.source
                and (max_probe is None or max_probe == self._first_probe)):
            return
        probe = self._first_probe if max_probe is None else int(max_probe)
        self._first_of = slots
        self._first = EMPTY if slots is None else read_only_slots(slots)
        self._first_probe = probe
        self._build()

    def share(self, shared: SharedTiers) -> None:
        """Draft from these shared tiers (``HotReader.tiers``; ``NO_SHARED``: none)."""
        if shared is not self._shared:
            self._shared = shared
            self._build()

    def share_tables(self, hot, recent, recent_prev, pruned, pruned_nprobe: int,
                     max_probe: int) -> None:
        """``share`` the tiers made of these tables (``SharedTiers``'s fields), rebuilt only
        when one of them is another object than last time: for a holder of the tables
        themselves, such as the daemon, whose recent table is its own."""
        self.share(SharedTiers.of(self._shared, hot, recent, recent_prev, pruned,
                                  pruned_nprobe, max_probe))

    def _build(self) -> None:
        s, lay = self._shared, self.layout
        # one probe bound serves every table in the kernel: the larger is correct for all (a
        # probe stops at the first empty slot anyway)
        self.source = (self._first, s.hot, s.recent, s.recent_prev, lay.tiers, lay.restart,
                       max(self._first_probe, s.max_probe), s.pruned, s.pruned_nprobe,
                       _HOT_TABLE)

    # -- drafting --------------------------------------------------------------------------
    def _grow(self, max_len: int) -> None:
        if not 1 <= max_len <= MAX_DRAFT_LEN:
            raise BadInput(f"max_len {max_len} must be in [1, {MAX_DRAFT_LEN}]")
        n = max(max_len, 2 * self._width)
        self._out = kernels.draft_out(1, n)
        self._width = n
        # result views for every length, made once: four slices per call cost ~0.8 µs
        tok, order, tier, conf, _ = (a[0] for a in self._out)
        self._views = [(tok[:i], order[:i], tier[:i], conf[:i]) for i in range(n + 1)]

    def draft(self, ctx: np.ndarray, n: int | None, max_len: int, rules: DraftRules) -> Draft:
        """Draft up to ``max_len`` tokens after ``ctx[:n]`` (token ids, all of them for
        ``n=None``; only the last n_max matter) with ``rules`` (orders and stop rules; its
        ``max_draft_len`` is not applied here).  Returns views of this object's buffers, valid
        until its next draft."""
        max_len = int(max_len)
        if not 0 < max_len <= self._width:
            self._grow(max_len)
        kernel_rules = rules.kernel  # built once per rules object
        offs, out = self._offs, self._out
        fast = _FAST.entry
        if (fast is not None and type(ctx) is np.ndarray and ctx.dtype is _U32
                and ctx.ndim == 1 and ctx.flags.num & _C_WRITEABLE == _C_WRITEABLE):
            offs[1] = ctx.shape[0] if n is None else n
            probes = fast(self.source, kernel_rules, ctx, offs, max_len, out)
            return Draft(*self._views[out[4][0]], probes)
        ctx = np.asarray(ctx)
        if ctx.ndim != 1:
            raise BadInput(f"context must be 1-D token ids, got shape {ctx.shape}")
        n = ctx.shape[0] if n is None else int(n)
        # the kernel reads the last n_max tokens: a writable copy of them is the one type
        ctx = np.array(ctx[max(n - kernel_rules[1], 0):n], dtype=np.uint32)
        offs[1] = ctx.shape[0]
        probes = kernels.draft(self.source, kernel_rules, ctx, offs, max_len, out)
        if fast is None:
            _FAST.resolve((self.source, kernel_rules, ctx, offs, max_len, out))
        return Draft(*self._views[out[4][0]], int(probes))

    def draft_batch(self, tokens: np.ndarray, offsets: np.ndarray, max_len: int,
                    rules: DraftRules, out: tuple) -> int:
        """Draft after each context ``tokens[offsets[b]:offsets[b+1]]`` into ``out``
        (``kernels.draft_out``: row slices of one are fine); returns the probes spent.  The
        caller checks ``tokens`` and ``offsets`` (the kernel does not bounds-check)."""
        return int(kernels.draft(self.source, rules.kernel, tokens, offsets, int(max_len), out))

    def draft_rows(self, firsts: Sequence[np.ndarray], contexts: Sequence[np.ndarray],
                   lengths: Sequence[int], max_lens: Sequence[int],
                   rules: DraftRules) -> DraftBatch:
        """Draft for many requests in one kernel call: row ``b`` drafts up to ``max_lens[b]``
        tokens after ``contexts[b][:lengths[b]]`` (uint32 token ids) from ``firsts[b]`` (its
        own first table, built with this object's first probe bound; kept writable by its
        owner) and the shared tiers: what ``draft`` gives each row alone.  Returns views of
        this object's buffers, valid until its next ``draft_rows``.

        Every argument of the kernel is this object's own (the last n_max tokens of each
        context gathered into one buffer), so each call has the types of the first: after it,
        the compiled overload is called directly, as ``draft`` does."""
        rows, n_max = len(firsts), rules.n_max
        width = max(max(max_lens, default=1), 1)
        if width > MAX_DRAFT_LEN:
            raise BadInput(f"max_len {width} must be in [1, {MAX_DRAFT_LEN}]")
        if self._rows is None:
            self._rows = _RowTables()
        bufs = self._rows.buffers(rows, n_max, width)
        tok, offs, lim, out = bufs
        pos = 0
        for i in range(rows):
            n = int(lengths[i])
            start = n - n_max if n > n_max else 0
            tok[pos:pos + n - start] = contexts[i][start:n]
            pos += n - start
            offs[i + 1] = pos
            lim[i] = max_lens[i]
        args = (self.source, self._rows.update(firsts), rules.kernel, tok, offs[:rows + 1],
                lim, out)
        fast = _FAST_ROWS.entry
        probes = fast(*args) if fast is not None else kernels_batch.draft_rows(*args)
        if fast is None:
            _FAST_ROWS.resolve(args)
        return DraftBatch(*(a[:rows] for a in out), int(probes))


class _RowTables:
    """The first table of each row of ``draft_rows``, as the numba typed list the kernel takes
    (a Python list would be unboxed item by item at every call), updated in place: a row's
    entry is replaced only when its table is another object (a new request in the row, a
    table that grew), so a batch that holds its requests costs an identity check a row."""

    def __init__(self):
        self._list = List.empty_list(_RO_SLOTS)
        self._of: list = []  # the array each entry was made of
        self._bufs: tuple = ()
        _compile_list_methods(self._list)

    def update(self, firsts: Sequence[np.ndarray]) -> List:
        lst, of = self._list, self._of
        for i, t in enumerate(firsts):
            if i < len(of):
                if of[i] is not t:
                    lst[i] = read_only_slots(t)
                    of[i] = t
            else:
                lst.append(read_only_slots(t))
                of.append(t)
        while len(of) > len(firsts):
            lst.pop()
            of.pop()
        return lst

    def buffers(self, rows: int, n_max: int, width: int) -> tuple:
        """The kernel's other row buffers, grown to ``rows`` rows of ``n_max`` context tokens
        and ``width`` draft tokens: (tokens, offsets, limits, ``draft_out``)."""
        have = self._bufs[3][0].shape if self._bufs else (0, 0)
        if rows > have[0] or width > have[1] or rows * n_max > self._bufs[0].shape[0]:
            r, w = max(rows, have[0], 8), max(width, have[1])
            self._bufs = (np.zeros(r * MAX_ORDER, np.uint32),
                          np.zeros(r + 1, np.int64), np.zeros(r, np.int64),
                          kernels.draft_out(r, w))
        return self._bufs


def _compile_list_methods(lst: List) -> None:
    """Run every method of the typed list that ``_RowTables.update`` uses once.  numba compiles
    a typed list's methods at their first call in a process and caches none of them on disk
    (0.2-0.5 s each here): uncompiled, they ran in a vLLM engine's first steps that replaced a
    row's table or shrank the batch (ARCHITECTURE §13)."""
    lst.append(EMPTY)
    lst[0] = EMPTY
    lst.pop()


_RO_SLOTS = types.Array(types.uint32, 2, "C", readonly=True)
_U32 = np.dtype(np.uint32)
_C_WRITEABLE = 0x1 | 0x400  # NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE (ndarray.flags.num)


class _FastCall:
    """The compiled overload of a kernel (``kernels.draft``, ``kernels.batch.draft_rows``) for
    the argument types ``DraftTiers`` passes it, found once a process after the first call
    through numba's dispatcher.  Every source a ``DraftTiers`` builds has the same numba type
    (read-only arrays of fixed dtypes, ints), its rules come from ``DraftRules.kernel`` (fixed
    dtypes), its offsets and buffers are its own, and ``draft`` checks that the context is a
    writable C-contiguous uint32 array: so the overload's types are those of every call that
    takes it.  Any doubt (numba's internals changed) leaves it None: the dispatcher is used."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.entry = None

    def resolve(self, args: tuple) -> None:
        try:
            cres = self.kernel.overloads.get(tuple(numba.typeof(a) for a in args))
            if cres is not None:
                self.entry = cres.entry_point
        except Exception:  # numba internals changed: keep using the dispatcher
            log.debug("no direct entry point for %s", self.kernel, exc_info=True)
            self.entry = None


_FAST = _FastCall(kernels.draft)
_FAST_ROWS = _FastCall(kernels_batch.draft_rows)
