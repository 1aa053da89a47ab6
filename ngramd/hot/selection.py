"""Hot tier policy: which rows of the table are hot, and the slot array that holds them.

The daemon scores every row from data (long-run counts and recent lookup hits), keeps the best
that pass the drafters' confidence rule and fit the byte budget, and builds their slot array:
``build_hot`` for rows in memory, ``HotSelector`` streaming over the whole table in bounded
memory, ``HitCounts`` for the demand half of the score, ``pruned_filter`` for the keys left
out as redundant.  ``ngramd.hot.shm`` publishes what this module builds; this module knows
nothing of files or shared memory.

What is hot (``build_hot``; ARCHITECTURE §4.2)
----------------------------------------------
Input: candidate rows (one per context: ``key, parent, order, total, tok[m,K], cnt[m,K], hits``).

1. **Confidence.**  A row whose best candidate fails ``cnt[0] >= c_min[order]`` and
   ``cnt[0] >= s_min[order] * total`` is dropped: the drafter would skip it anyway.
2. **Redundancy.**  An order-n row is dropped when its parent row (the order-(n-1) suffix of
   the same context, ``parent``) is among the candidates, passes the confidence rule, has the
   same best token and *at least the same share* (``cnt[0] / total``, compared exactly).  The
   longest-match drafter then falls through to the parent (or, if the parent was itself
   dropped as redundant, further down the chain of equal best tokens) and drafts exactly the
   token the dropped row would have drafted, with a confidence no lower than the dropped row's
   own: with the drafter using the same thresholds and nothing dropped for space, *every
   draft of the whole table is a prefix of the pruned tier's draft* (tested; the ``p_cum``
   stop multiplies confidences, so it never ends a chain sooner; ``f_cap`` > 0 caps by the
   reported order, which may be the parent's).  The reported confidence
   is the shorter context's; the reported order too, unless the pruned filter (below) lifts
   it.
   Why the share: without it, a pruned row seen once (share 1.0) drafted with its parent's
   lower share, and the chain's product fell below ``p_cum`` sooner (the replay that showed
   it: ARCHITECTURE §4.2).
   The hits of a dropped row are credited to its parent (from the longest order down), because
   the lookups that used to stop at the child now land on the parent.

   A table with such rows pruned is not suffix-closed, which the drafter must know:
   ``kernels.draft`` restarts every step at n_max in the hot tier (its ``restart_at_max`` flag;
   the n + 1 restart of a complete table loses accepted tokens over a pruned one: ARCHITECTURE
   §13), and the keys left out are published with the generation as the *pruned filter*
   (``pruned_filter``) so that a hot match counts at the order the whole table would report.
   ``prune_redundant=False`` keeps those rows for a daemon that prefers to spend memory
   instead.
3. **Score** of a surviving row (expected accepted first tokens per unit of time)::

       score = share * (hits_eff + count_weight * total),     share = cnt[0] / total

   ``hits_eff`` = decayed lookup hits plus those credited by pruned children (recent demand);
   ``total`` = observations of the context in the ingested data (long-run demand);
   ``share`` ≈ the probability the drafted token is accepted.  Ties: lower order, then key.
4. **Capacity**: the smallest power of two that holds the ranked rows at load factor
   <= ``load_factor`` (0.7), capped by the byte budget (32 B a slot); rows ranked beyond
   ``capacity * load_factor`` are dropped for space.
5. Rows are inserted in score order (``kernels.slots.gather_slots``): a row that cannot be placed
   within ``max_probe`` slots of its home is dropped (so a miss costs at most ``max_probe`` reads).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass

import numpy as np

from ..kernels.bloom import BB_BLOCK_WORDS, bbloom_add
from ..kernels.rank import hot_keep, hot_rank, rank_positions
from ..kernels.slots import gather_slots
from ..wire.constants import EMPTY_TOKEN, HOT_K, MAX_ORDER, SHARE_SLACK, SLOT_BYTES
from ..config import TableConfig
from ..wire.errors import BadInput
from ..wire.validate import per_order

log = logging.getLogger("ngramd.hotset")  # the name operators know (kept)

#: default weight of an observation (count) against a decayed lookup hit in the hot score
COUNT_WEIGHT = 0.5
#: default load factor of the hot table (linear probing degrades quickly above ~0.7)
LOAD_FACTOR = 0.7
#: default bound on probe length, in slot reads (a miss reads at most this many 32 B slots):
#: the daemon's setting, ``TableConfig.hot_max_probe``, so that one number is the default
MAX_PROBE = TableConfig.hot_max_probe
#: bits a key of the pruned filter: with the chain rule of kernels.draft, false positives at
#: several consecutive orders are needed to mislead a draft
PRUNED_FILTER_BITS = 12


def hot_score(hits, total, best_cnt, count_weight: float = COUNT_WEIGHT) -> np.ndarray:
    """``share * (hits + count_weight * total)`` with ``share = best_cnt / total`` (float64):
    expected accepted first tokens, from recent demand (decayed lookup hits) and long-run
    demand (observations), weighted by the chance the drafted token is accepted."""
    total = np.asarray(total, np.float64)
    share = np.asarray(best_cnt, np.float64) / np.maximum(total, 1.0)
    return share * (np.asarray(hits, np.float64) + count_weight * total)


_ROW_FIELDS = ("key", "parent", "order", "total", "tok", "cnt", "hits")
_ROW_DTYPES = dict(key=np.uint64, parent=np.uint64, order=np.uint8, total=np.uint32,
                   tok=np.uint32, cnt=np.uint32, hits=np.float32)


def _as_rows(rows: dict, k: int | None = None) -> dict:
    """Validate candidate rows; returns contiguous arrays with the canonical dtypes (``hits``
    defaults to 0; ``tok``/``cnt`` cut or padded to ``k`` columns when ``k`` is given)."""
    missing = [f for f in _ROW_FIELDS[:-1] if f not in rows]
    if missing:
        raise BadInput(f"candidate rows lack {', '.join(missing)}")
    key = np.asarray(rows["key"])
    m = key.shape[0] if key.ndim == 1 else -1
    out = {}
    for f in _ROW_FIELDS:
        v = rows.get(f)
        if v is None:  # only hits may be absent
            v = np.zeros(max(m, 0), np.float32)
        a = np.asarray(v)
        want_nd = 2 if f in ("tok", "cnt") else 1
        if a.ndim != want_nd or a.shape[0] != m:
            raise BadInput(f"candidate rows: {f} has shape {a.shape}, expected {m} rows")
        out[f] = np.ascontiguousarray(a, dtype=_ROW_DTYPES[f])
    if out["tok"].shape != out["cnt"].shape or out["tok"].shape[1] < 1:
        raise BadInput("candidate rows: tok and cnt must have the same (m, K) shape, K >= 1")
    if m and (out["order"].min() < 1 or out["order"].max() > MAX_ORDER):
        raise BadInput(f"candidate rows: orders must be in [1, {MAX_ORDER}]")
    if k is not None and out["tok"].shape[1] != k:
        kk = out["tok"].shape[1]
        if kk > k:  # columns are best first
            out["tok"], out["cnt"] = (np.ascontiguousarray(out["tok"][:, :k]),
                                      np.ascontiguousarray(out["cnt"][:, :k]))
        else:
            pad = ((0, 0), (0, k - kk))
            out["tok"] = np.pad(out["tok"], pad, constant_values=EMPTY_TOKEN)
            out["cnt"] = np.pad(out["cnt"], pad)
    return out


def _dedupe_last(r: dict, *, sum_hits: bool) -> tuple[dict, int]:
    """Rows sorted by key with one row per key (the last given wins; with ``sum_hits`` the
    group's hits are added up).  Returns (rows, number of duplicates removed)."""
    m = r["key"].shape[0]
    if m < 2 or bool(np.all(r["key"][1:] > r["key"][:-1])):
        return r, 0  # already sorted and unique (count_ngrams and the pool give this): no copy
    sk = np.sort(r["key"])  # np.unique holds the GIL for seconds on millions of keys; sort not
    if not sum_hits and bool(np.all(sk[1:] != sk[:-1])):
        return r, 0  # unique in any order (HotSelector gives this): build_hot sorts itself
    perm = np.argsort(r["key"], kind="stable")
    sk = r["key"][perm]
    last = np.ones(m, bool)
    last[:-1] = sk[1:] != sk[:-1]
    sel = perm[last]
    out = {f: r[f][sel] for f in _ROW_FIELDS}
    if sum_hits and sel.shape[0] != m:
        first = np.ones(m, bool)
        first[1:] = sk[1:] != sk[:-1]
        out["hits"] = np.add.reduceat(r["hits"][perm].astype(np.float64),
                                      np.flatnonzero(first)).astype(np.float32)
    return out, m - sel.shape[0]


def pruned_filter(keys: np.ndarray, bits: int = PRUNED_FILTER_BITS) -> tuple[np.ndarray, int]:
    """The blocked Bloom filter of the keys a hot build pruned as redundant: ``(words,
    probes)`` for ``hot.shm.HotPublisher.publish`` and ``kernels.draft``."""
    keys = np.ascontiguousarray(keys, np.uint64)
    if not keys.size:
        return np.zeros(0, np.uint64), 0
    nprobe = max(1, min(8, round(bits * 0.69)))
    words = np.zeros(max(1, -(-keys.size * bits // 512)) * BB_BLOCK_WORDS, np.uint64)
    bbloom_add(words, keys, nprobe)
    return words, nprobe


#: share of the host's memory the hot tier may take when ``hot_budget_mb`` is 0 (the default)
HOT_MEMORY_SHARE = 1 / 16


def host_memory_bytes() -> int:
    """Memory this process may use, bytes: the host's physical memory, or less when its cgroup
    says so (systemd's ``MemoryMax=``; cgroup v2 and v1); 8 GiB where the system does not
    say.  Shared memory counts against the cgroup of the process that writes it."""
    try:
        mem = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 8 << 30
    limit = _cgroup_memory_limit()
    return min(mem, limit) if limit else mem


def _cgroup_memory_limit() -> int | None:
    """The smallest memory limit of this process's cgroup and its parents, or None."""
    from pathlib import Path

    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hier, _, rest = line.partition(":")
        ctrl, _, path = rest.partition(":")
        if hier == "0" and ctrl == "":  # v2
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in ctrl.split(","):  # v1
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            try:
                v = (d / name).read_text().strip()
                if v != "max" and int(v) < 1 << 60:  # v1 says "no limit" with ~2^63
                    found.append(int(v))
            except (OSError, ValueError):
                pass
            if d == base or d == d.parent:
                break
            d = d.parent
    return min(found) if found else None


def _mib(n: float) -> str:
    """Bytes for people: GiB, MiB or KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class HotSizing:
    """The most bytes of slots a hot build may fill, and where that limit comes from.

    A build sizes the tier from the data below it (``choose_capacity``: the smallest power of
    two of slots that holds every row that can change a draft, at load <= ``load_factor``).
    The limit binds only on a table whose useful rows do not fit; then the score ranking
    decides which rows stay (``build_hot``, rules 3-4).  Why a share of the host's memory and
    not a fixed size: the 64 MiB default of the first builds held 1.42M of a 47.5M-entry
    table's 40.5M candidates (issue 18), while on a small table any size is plenty."""

    limit_bytes: int
    source: str  # where the limit comes from, for people

    @classmethod
    def from_config(cls, hot_budget_mb: float, memory_bytes: int | None = None
                    ) -> "HotSizing":
        """``hot_budget_mb`` > 0 is the operator's limit; 0 means ``HOT_MEMORY_SHARE`` of
        ``memory_bytes`` (default: this host's physical memory)."""
        if hot_budget_mb > 0:
            return cls(int(hot_budget_mb * 2**20), f"hot_budget_mb = {hot_budget_mb:g}")
        mem = host_memory_bytes() if memory_bytes is None else int(memory_bytes)
        share = round(1 / HOT_MEMORY_SHARE)
        return cls(max(int(mem * HOT_MEMORY_SHARE), 1 << 20),
                   f"1/{share} of the {_mib(mem)} of memory this process may use "
                   f"(hot_budget_mb = 0)")

    def explain(self, info: dict | None = None, complete: bool = True) -> dict:
        """What a build chose and why, from its ``info`` (``build_hot``, ``HotSelector.build``;
        None before the first build).  ``complete``: the build saw every row that can change a
        draft (its selection never cut one for space)."""
        out = {"limit_bytes": self.limit_bytes, "limit": self.source}
        if not info:
            out["why"] = f"limit {_mib(self.limit_bytes)} ({self.source}); no build yet"
            return out
        placed = int(info["placed"])
        binds = bool(info["dropped_budget"] or not complete)
        # how many rows can change a draft is known only when none was cut for space (a cut
        # may keep a redundant row whose parent it dropped: HotSelector)
        useful = None if binds else placed + int(info["dropped_probe"])
        out.update(chosen_bytes=int(info["bytes"]), useful_rows=useful, limit_binds=binds)
        where = f"{placed:,} rows in {_mib(info['bytes'])} (load {info['load']:.2f})"
        if binds:
            out["why"] = (f"{where}: the limit, {_mib(self.limit_bytes)} ({self.source}), "
                          f"binds: the table has more rows that can change a draft, the "
                          f"best-scored are hot")
        else:
            out["why"] = (f"{where}: every row that can change a draft ({useful:,}), "
                          f"within the limit of {_mib(self.limit_bytes)} ({self.source})")
        return out


class RebuildBudget:
    """When a scheduled hot rebuild may run: ``cpu_share`` of one core in the long run, plus
    one catch-up an hour.

    A rebuild ranks the whole table (``HotSelector`` over a scan), so it costs what the table's
    size costs whatever changed: 122-126 s of wall time on a 47M-entry table on a loaded host,
    and with a rebuild every 30 s the rebuilding thread was never idle (issue 18).  So the CPU
    time a rebuild takes (the rebuilding thread's own, measured) becomes a debt, paid off at
    ``cpu_share`` CPU-seconds per second, and a scheduled rebuild waits until it is paid: a
    table whose rebuild takes 60 CPU-s rebuilds at most every 20 minutes at 5%, a small one
    whenever it changes.  What is learned meanwhile reaches generators through the recent
    tier (what the writer counted in the last seconds, in shared memory) and the daemon's
    answers (cold reads).

    One exception, where the gain is plain: when a bulk ingest has just been counted (the
    writer lagged the log, and caught up) and the tier was built from less than half of the
    table, it is rebuilt at once, debt or not, at most once per ``CATCH_UP_S``; so a warm-up
    that went by a rebuild of its first part is ranked whole minutes later, not when the first
    part's debt is paid.  Over any hour rebuilds take at most ``cpu_share`` of a core plus one
    rebuild, and under a steady ingest that counting keeps up with, ``cpu_share``.  The first rebuild of a daemon is free;
    requested ones (``rebuild_hot``) run at once and are charged.  Times are arguments
    (``time.monotonic`` seconds)."""

    CATCH_UP_S = 3600.0

    def __init__(self, cpu_share: float, now: float):
        if not 0.0 < cpu_share <= 1.0:
            raise BadInput(f"hot_rebuild_cpu must be in (0, 1], got {cpu_share!r}")
        self.cpu_share = float(cpu_share)
        self.start = now
        self._debt, self._at = 0.0, now  # CPU-s owed at time _at
        self._caught_up = -math.inf  # when the last catch-up ran
        self.spent_cpu_s = 0.0  # counter: CPU-s of every rebuild
        self.rebuilds = self.catch_ups = 0  # counters
        self.last_cpu_s = 0.0

    def debt(self, now: float) -> float:
        """CPU-s still owed at ``now``."""
        return max(0.0, self._debt - self.cpu_share * (now - self._at))

    def due_in(self, now: float) -> float:
        """Seconds until the debt is paid (0: a scheduled rebuild may run now)."""
        return self.debt(now) / self.cpu_share

    def allows(self, now: float, catch_up: bool = False) -> str | None:
        """Why a scheduled rebuild may run now ("paid" or "catch-up"), or None.  ``catch_up``:
        a bulk ingest was just counted into a table twice the size the tier was built from."""
        if self.debt(now) <= 0.0:
            return "paid"
        if catch_up and now - self._caught_up >= self.CATCH_UP_S:
            return "catch-up"
        return None

    def charge(self, cpu_s: float, now: float, why: str | None = "paid") -> None:
        """A rebuild that took ``cpu_s`` CPU-seconds ended at ``now`` (``why``: what
        ``allows`` said, None for a requested one)."""
        cpu_s = max(cpu_s, 0.0)
        self._debt, self._at = self.debt(now) + cpu_s, now
        if why == "catch-up":
            self._caught_up = now
            self.catch_ups += 1
        self.spent_cpu_s += cpu_s
        self.last_cpu_s = cpu_s
        self.rebuilds += 1

    def stats(self, now: float) -> dict:
        up = max(now - self.start, 1e-9)
        return {"cpu_share_limit": self.cpu_share, "rebuilds": self.rebuilds,
                "catch_ups": self.catch_ups, "last_cpu_s": round(self.last_cpu_s, 3),
                "spent_cpu_s": round(self.spent_cpu_s, 3),
                "cpu_share_since_start": round(self.spent_cpu_s / up, 4),
                "next_scheduled_in_s": round(self.due_in(now), 1)}


def choose_capacity(n_rows: int, budget_bytes: int, load_factor: float = LOAD_FACTOR,
                    min_capacity: int = 64) -> int:
    """Smallest power of two holding ``n_rows`` at ``load_factor`` (at least ``min_capacity``),
    capped by the largest power of two whose slots fit ``budget_bytes`` (32 B each)."""
    max_cap = int(budget_bytes) // SLOT_BYTES
    if max_cap < 1:
        raise BadInput(f"hot budget of {budget_bytes} bytes holds no slot")
    max_cap = 1 << (max_cap.bit_length() - 1)
    need = max(int(math.ceil(n_rows / load_factor)), min_capacity, 1)
    return min(1 << (need - 1).bit_length(), max_cap)


def build_hot(rows: dict, budget_bytes: int, c_min, s_min, max_probe: int = MAX_PROBE, *,
              load_factor: float = LOAD_FACTOR, count_weight: float = COUNT_WEIGHT,
              min_capacity: int = 64, prune_redundant: bool = True,
              return_pruned: bool = False):
    """Decide what is hot and build its slot array (rules in the module docstring).

    ``rows``: candidate rows (``key, parent, order, total, tok (m, K), cnt (m, K)``, optional
    ``hits``; duplicate keys: the last wins).  ``budget_bytes``: bytes for slots (32 B each; the
    segment adds a 4 KiB header).  ``c_min``/``s_min``: per-order thresholds (scalar or indexed
    by order) — use the ones the drafters use.  ``max_probe``: slot reads a lookup may take.
    ``prune_redundant=False`` keeps rows that repeat their parent's best token (what pruning
    asks of the drafter: the module docstring, rule 2).

    Returns ``(slots, info)`` (with ``return_pruned``: ``(slots, info, redundant_keys)``, the
    uint64 keys dropped as redundant); ``info`` counts candidates, duplicates, invalid (key 0),
    pruned_confidence, pruned_redundant, dropped_budget, dropped_probe, placed, and gives
    capacity, bytes (of slots), load and min_score (the lowest score placed).
    """
    if not 0.0 < load_factor <= 1.0:
        raise BadInput(f"load_factor {load_factor} must be in (0, 1]")
    if int(max_probe) < 1:
        raise BadInput(f"max_probe {max_probe} must be >= 1")
    r = _as_rows(rows)
    m_in = r["key"].shape[0]
    r, dups = _dedupe_last(r, sum_hits=False)
    valid = r["key"] != 0
    invalid = int(np.count_nonzero(~valid))
    if invalid:
        r = {f: a[valid] for f, a in r.items()}
    m = r["key"].shape[0]
    top_order = int(r["order"].max()) if m else 1
    cmin = per_order(c_min, top_order, np.int64, "c_min")
    smin = per_order(s_min, top_order, np.float64, "s_min")
    # 1-3. confidence, redundancy and rank, in one nogil kernel (kernels.rank.hot_rank)
    rank, score, n_conf, redundant, _ = hot_rank(
        r["key"], r["parent"], r["order"], r["total"], np.ascontiguousarray(r["tok"][:, 0]),
        np.ascontiguousarray(r["cnt"][:, 0]), r["hits"].astype(np.float64), cmin, smin,
        float(count_weight), bool(prune_redundant))
    # 4. capacity and 5. bounded-probe insertion in score order
    cap = choose_capacity(rank.shape[0], budget_bytes, load_factor, min_capacity)
    n_fit = min(rank.shape[0], int(cap * load_factor))
    slots, placed = gather_slots(cap, int(max_probe), rank[:n_fit], r["key"], r["order"],
                                 r["tok"], r["cnt"], r["total"])
    n_placed = int(np.count_nonzero(placed))
    info = dict(
        candidates=m_in, duplicates=dups, invalid=invalid,
        pruned_confidence=int(m - n_conf),
        pruned_redundant=int(np.count_nonzero(redundant)),
        dropped_budget=int(rank.shape[0] - n_fit), dropped_probe=int(n_fit - n_placed),
        placed=n_placed, capacity=cap, bytes=cap * SLOT_BYTES, load=n_placed / cap,
        min_score=float(score[:n_fit][placed].min()) if n_placed else 0.0,
    )
    log.debug("hot build: %s", info)
    if return_pruned:  # the keys left out as redundant (a cold read of them adds nothing)
        return slots, info, r["key"][redundant]
    return slots, info


@dataclass(frozen=True)
class HotBuilder:
    """Settings of the hot selection (see ``build_hot``); ``build`` applies them."""

    load_factor: float = LOAD_FACTOR
    count_weight: float = COUNT_WEIGHT
    min_capacity: int = 64
    prune_redundant: bool = True

    def build(self, rows: dict, budget_bytes: int, c_min, s_min,
              max_probe: int = MAX_PROBE, return_pruned: bool = False):
        return build_hot(rows, budget_bytes, c_min, s_min, max_probe, return_pruned=return_pruned,
                         load_factor=self.load_factor, count_weight=self.count_weight,
                         min_capacity=self.min_capacity, prune_redundant=self.prune_redundant)


class HitCounts:
    """Decayed lookup hits per key: what generators (``report``) and the daemon's own drafts
    used, the demand half of the hot score.  Sorted unique keys with float32 hits; new hits are
    staged and merged at ``merge``; at most ``max_keys`` are kept (the fewest hits go first).
    Thread-safe."""

    def __init__(self, max_keys: int = 1 << 20):
        self.max_keys = int(max_keys)
        self._lock = threading.Lock()
        self.keys = np.zeros(0, np.uint64)
        self.hits = np.zeros(0, np.float32)
        self._staged: list[np.ndarray] = []
        self._n_staged = 0
        self.added = 0  # counter: hits recorded

    def add(self, keys) -> None:
        """One hit for each key (repeats add up); bounded: past 4 x ``max_keys`` staged keys
        the oldest stage is dropped."""
        keys = np.ascontiguousarray(keys, np.uint64).reshape(-1)
        if not keys.size:
            return
        with self._lock:
            self._staged.append(keys)
            self._n_staged += keys.size
            self.added += keys.size
            while self._n_staged > 4 * self.max_keys and len(self._staged) > 1:
                self._n_staged -= self._staged.pop(0).size

    @property
    def pending(self) -> int:
        return self._n_staged

    def merge(self, decay: float = 1.0) -> None:
        """Decay what is stored by ``decay`` and add the staged hits."""
        with self._lock:
            staged, self._staged, self._n_staged = self._staged, [], 0
            keys, hits = self.keys, self.hits * np.float32(decay)
        if staged:
            # sort-based grouping: np.unique holds the GIL (seconds on millions of keys), a
            # sort releases it
            allk = np.concatenate([keys] + staged)
            allh = np.concatenate([hits, np.ones(allk.size - keys.size, np.float32)])
            perm = np.argsort(allk, kind="stable")
            sk = allk[perm]
            first = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
            keys = sk[first]
            hits = np.add.reduceat(allh[perm], first).astype(np.float32) if first.size \
                else np.zeros(0, np.float32)
        keep = hits >= 0.05  # one hit is forgotten after 5 halvings (1/32 < 0.05)
        keys, hits = keys[keep], hits[keep]
        if keys.size > self.max_keys:
            top = np.sort(np.argpartition(-hits, self.max_keys - 1)[:self.max_keys])
            keys, hits = keys[top], hits[top]
        with self._lock:
            self.keys, self.hits = keys, hits

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Hits of each key (0 for unknown keys), float64."""
        sk, sh = self.keys, self.hits
        if not sk.size:
            return np.zeros(keys.shape[0], np.float64)
        idx = np.minimum(np.searchsorted(sk, keys), sk.size - 1)
        return np.where(sk[idx] == keys, sh[idx], 0.0).astype(np.float64)


class HotSelector:
    """Streaming choice of hot candidates over the whole table in bounded memory, and the build
    of the slot table from them (``build``).

    Rows arrive slice by slice (e.g. ``ColdReader.scan_rows``).  A row that fails the drafter's
    confidence rule is dropped at once; the others are scored (``hot_score``, with ``hits``)
    and copied into a preallocated buffer of ``grow`` x ``keep`` rows.  When it is full it is
    cut back to ``keep`` rows: redundant rows (a buffered parent with the same best token:
    ``kernels.rank.hot_rank``, which also moves their hits to the parent) go first, then the lowest
    scores; the score at the cut becomes a bar that later rows must pass before they are even
    copied.  Pruning while selecting is what lets ``keep`` stay near the rows the budget can
    place: on code, 72% of the best-scored rows were redundant, so ranking first and pruning
    after left the hot tier 44% empty with twice the candidates (measured at commit 7081493).

    A scan gives rows in key order, and the cuts keep that order (``kernels.rank.hot_keep``):
    a cut then needs no sort by key, and only the last one (``rows()``) and those that cut rows
    for space sort by score.  Rows offered out of key order are sorted at each cut instead
    (the same rows come out).  Measured on a 17.8M-row table: 0.78x the CPU of ranking at every
    cut, the same slots (bench/RESULTS.md, "Where a hot rebuild's CPU goes").

    Memory, from the field sizes: the buffer, 53 bytes a row, grows as rows arrive (from
    ``MIN_ROWS``, doubling, up to ``grow`` x ``keep``; the daemon keeps 1.1 x the rows its limit
    can place, ``hot_keep_factor``).  Before it doubles, the rows that became redundant since
    the last cut are pruned, so it holds about twice the rows that can change a draft plus the
    redundant ones whose parent has not been scanned yet, whatever the limit.  Plus
    ``hot_rank``'s ~100 bytes a buffered row during a cut, plus the slots.  The measured rise
    of the daemon's RSS during a build is in bench/RESULTS.md."""

    MIN_ROWS = 1 << 16  # the buffer's first size, rows
    _FIELDS = (("key", np.uint64, ()), ("parent", np.uint64, ()), ("order", np.uint8, ()),
               ("total", np.uint32, ()), ("tok", np.uint32, (HOT_K,)),
               ("cnt", np.uint32, (HOT_K,)), ("hits", np.float32, ()),
               ("score", np.float32, ()))

    def __init__(self, keep: int, c_min, s_min, n_max: int, *,
                 count_weight: float = COUNT_WEIGHT, prune_redundant: bool = True,
                 grow: float = 1.25):
        self.keep = max(int(keep), 1)
        self.grow = max(float(grow), 1.1)
        self.cmin = per_order(c_min, n_max, np.int64, "c_min")
        self.smin = per_order(s_min, n_max, np.float64, "s_min")
        self.count_weight = count_weight
        self.prune = prune_redundant
        self._zeros_i = np.zeros(n_max + 1, np.int64)  # the cuts' rules: rows are confident
        self._zeros_f = np.zeros(n_max + 1, np.float64)
        self._cap = 0
        self._buf: dict = {}
        self._n = 0
        self._kept = self.MIN_ROWS // 2  # rows left by the last cut
        self._ranked = False  # buffer[:n] is in rank order (after the last cut, ``rows()``)
        self._key_sorted = True  # buffer[:n] is in ascending key order (a scan's rows)
        self._cut = -1.0  # score of the keep-th best row at the last cut: below it, no entry
        self.seen = 0  # rows offered
        self.confident = 0  # rows passing the confidence rule
        self.pruned_redundant = 0  # rows dropped as redundant while selecting
        self._redundant: list[np.ndarray] = []

    def _ensure(self, need: int) -> None:
        if need <= self._cap:
            return
        cap = max(need, min(2 * self._cap, int(self.grow * self.keep) + 1), self.MIN_ROWS)
        new = {f: np.empty((cap,) + shp, dt) for f, dt, shp in self._FIELDS}
        for f in self._buf:
            new[f][:self._n] = self._buf[f][:self._n]
        self._buf, self._cap = new, cap

    def add(self, key, parent, order, total, tok3, cnt3, hits) -> None:
        """Offer rows: ``tok3``/``cnt3`` their best ``HOT_K`` candidates ``(m, 3)``, ``hits``
        their decayed hits (float)."""
        self.seen += key.shape[0]
        o = order.astype(np.int64)
        best = cnt3[:, 0]
        conf = ((tok3[:, 0] != EMPTY_TOKEN) & (best >= self.cmin[o])
                & (best >= self.smin[o] * total.astype(np.float64) * SHARE_SLACK))
        idx = np.flatnonzero(conf)
        if not idx.size:
            return
        self.confident += idx.size
        score = hot_score(hits[idx], total[idx], best[idx], self.count_weight).astype(np.float32)
        if self._cut >= 0:  # most rows of a big table cannot enter: drop them before copying
            better = score > self._cut
            idx, score = idx[better], score[better]
            if not idx.size:
                return
        if self._key_sorted:  # a scan gives rows in key order: a cut needs no sort by key
            k = key[idx]
            self._key_sorted = bool((self._n == 0 or k[0] > self._buf["key"][self._n - 1])
                                    and np.all(k[1:] > k[:-1]))
        need = self._n + idx.size
        # cut when full; and before the buffer doubles, prune what became redundant since the
        # last cut (rows whose parent arrived since): memory follows the useful rows, not the
        # limit (a limit of a sixteenth of the host's memory would be gigabytes of buffer)
        if self._n and (need > int(self.grow * self.keep)
                        or (need > self._cap and self._n >= 2 * self._kept)):
            self._shrink()
        self._ensure(self._n + idx.size)
        a, b, buf = self._n, self._n + idx.size, self._buf
        buf["key"][a:b] = key[idx]
        buf["parent"][a:b] = parent[idx]
        buf["order"][a:b] = order[idx]
        buf["total"][a:b] = total[idx]
        buf["tok"][a:b] = tok3[idx]
        buf["cnt"][a:b] = cnt3[idx]
        buf["hits"][a:b] = hits[idx]
        buf["score"][a:b] = score
        self._n = b
        self._ranked = False

    def _shrink(self, ranked: bool = False) -> None:
        """Cut the buffer back to the best ``keep`` rows: in rank order when ``ranked`` (the
        last cut, for the build), else in the order they were in (key order for a scan's rows,
        so that the next cut needs no sort by key, and no ranking while nothing is cut for
        space: the cuts before the last one only prune)."""
        n, buf = self._n, self._buf
        r = {f: buf[f][:n] for f in buf}
        if self.prune:
            args = (r["key"], r["parent"], r["order"], r["total"],
                    np.ascontiguousarray(r["tok"][:, 0]), np.ascontiguousarray(r["cnt"][:, 0]),
                    r["hits"].astype(np.float64), self._zeros_i, self._zeros_f,
                    float(self.count_weight), True, self._key_sorted)
            if ranked:
                top, score, _, redundant, eff = hot_rank(*args)
            else:
                keep, score, _, redundant, eff = hot_keep(*args)
                top = keep
                if keep.shape[0] > self.keep:  # the best keep rows, still in key order
                    chosen = np.sort(rank_positions(score, r["order"], keep)[:self.keep])
                    top, score = keep[chosen], score[chosen]
            self.pruned_redundant += int(np.count_nonzero(redundant))
            self._redundant.append(r["key"][redundant])
            top, score = top[:self.keep], score[:self.keep].astype(np.float32)
            hits_top = eff[top].astype(np.float32)  # pruned children's hits stay counted
        else:
            top = np.argsort(-r["score"], kind="stable")[:self.keep]
            if not ranked:
                top = np.sort(top)
            hits_top, score = r["hits"][top], r["score"][top]
        m = top.shape[0]
        for f in r:  # one field at a time: one field's temporary, not a copy of every row
            if f not in ("hits", "score"):
                buf[f][:m] = r[f][top]
        buf["hits"][:m] = hits_top
        buf["score"][:m] = score
        self._n = self._kept = m
        self._ranked = ranked
        self._key_sorted = self._key_sorted and not ranked
        if m >= self.keep:
            self._cut = float(score.min())

    @property
    def complete(self) -> bool:
        """True while no row that can change a draft was cut for space (every one offered so
        far is in the buffer or was pruned as redundant)."""
        return self._cut < 0

    def redundant_keys(self) -> np.ndarray:
        """Keys pruned as redundant while selecting (a cold read of them adds nothing)."""
        return np.concatenate(self._redundant) if self._redundant else np.zeros(0, np.uint64)

    def rows(self) -> dict:
        """The best ``keep`` rows seen (best first), as candidate rows for ``build_hot``."""
        if self._n and not self._ranked:
            self._shrink(ranked=True)
        if not self._n:
            return {f: np.zeros((0, HOT_K) if f in ("tok", "cnt") else 0,
                                _ROW_DTYPES[f]) for f in _ROW_FIELDS}
        return {f: self._buf[f][:self._n] for f in _ROW_FIELDS}

    def build(self, budget_bytes: int, max_probe: int = MAX_PROBE,
              load_factor: float = LOAD_FACTOR, min_capacity: int = 64):
        """The slot table of the best rows (already ranked and pruned: no second pass), as
        ``(slots, info, redundant_keys)`` like ``build_hot(..., return_pruned=True)``."""
        r = self.rows()
        m = r["key"].shape[0]
        cap = choose_capacity(m, budget_bytes, load_factor, min_capacity)
        n_fit = min(m, int(cap * load_factor))
        slots, placed = gather_slots(cap, int(max_probe), np.arange(n_fit),
                                     r["key"], r["order"], r["tok"], r["cnt"],
                                     r["total"])
        n_placed = int(np.count_nonzero(placed))
        info = dict(candidates=self.confident, duplicates=0, invalid=0,
                    pruned_confidence=self.seen - self.confident,
                    pruned_redundant=self.pruned_redundant, dropped_budget=m - n_fit,
                    dropped_probe=n_fit - n_placed, placed=n_placed, capacity=cap,
                    bytes=cap * SLOT_BYTES, load=n_placed / cap,
                    min_score=float(self._buf["score"][:n_fit][placed].min()) if n_placed
                    else 0.0)
        return slots, info, self.redundant_keys()
