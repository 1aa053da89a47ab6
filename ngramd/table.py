"""``Table``: drafting and lookups over every tier, ingest, hot rebuilds and statistics.

Tiers, fastest first (docs/ARCHITECTURE.md §2-§7):

* **hot** — the slot table this daemon last published to shared memory (``ngramd.hotshm``):
  what the data says is worth a draft, chosen over the whole table (``ngramd.hotset``);
* **recent** — the shared-memory table the writer updates in place with every counted batch
  (``hotshm.RecentTable``): what generators taught the table in the last seconds, draftable by
  every generator's in-process path within one writer step;
* **warm** — a small in-daemon cache of entries read from the cold tier;
* **cold** — RocksDB (``ngramd.cold``): runs of pages plus the in-memory delta.

Fast path: the hot, recent and warm tables, drafted by one kernel (``kernels.draft``).
Slow path: keys longer than what the fast path matched are read from the cold tier when the
estimated cost fits the caller's latency budget; otherwise the request is answered from the fast
path at a lower order (a *degrade*, counted per order) and the cold read runs in the background
so the next request finds the entry in the warm cache (ARCHITECTURE §7).  The warm cache is emptied
whenever the recent table starts a new epoch or a hot generation is published: every absent
answer it holds is younger than the recent epochs readers see, so no stale "absent" survives
an ingest.

Threads: ``ingest`` only appends to the durable log (the caller's thread); the *writer* counts
the log into the cold tier's delta and the recent table; the *spiller* merges the delta's
parts in RAM and writes the delta as runs (on size, age and idle ingest, and never while the
merger lags: the log holds that backlog); the *merger* merges runs and gives back the disk
space of the runs it replaced; the *rebuilder* publishes hot generations when the table
changed (never when idle) and the CPU its last rebuild took is paid off (``hot_rebuild_cpu``
of a core in the long run: ``hotset.RebuildBudget``).  All four run at a lower CPU priority
than the serving thread; they live in ``ngramd.maintenance`` (``Maintenance``), and what fails
now in ``ngramd.health`` (``Health``).  A restarted table serves at once: it keeps the hot
generation it finds in shared memory and rebuilds in the background.

Faults (ARCHITECTURE §10.3, issue 9): reads are served whatever the disk does.  The ingest log is
written with calls that release the GIL (``ngramd.ingestlog``), spills and merges first probe
the disk the same way, and a cold read that fails degrades the draft to the in-memory tiers.
Each part of the write path that fails (ingest log, counting, spill, merge, hot rebuild, cold
reads) marks the table ``degraded`` in ``health()`` (and so in ``ping``, ``info``, ``stats``,
the metrics and systemd's ``STATUS=``) and retries on its own: spills and merges reopen
RocksDB first, since it stays read-only after a failed write.  The mark clears when the part
works again; an ingest stuck on the disk for ``Health.STALL_S`` shows too.  A log record that
cannot be counted is quarantined (``coldlog.ColdLog.quarantine``), never retried forever.

Resources (the shm publisher, the cold tier, the recent table, the background-read pool, the
threads) are opened onto one ``contextlib.ExitStack``: a start-up that fails half-way closes
exactly what it opened, in reverse order, and ``close`` closes the same stack.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import math
import threading
import time
from pathlib import Path

import numpy as np

from . import kernels as K
from .cold import ColdStore
from .rows import slice_rows
from .config import TableConfig
from .wire.commands import DraftBatch
from .wire.errors import TIMEOUT, UNAVAILABLE, BadInput, NgramError, StorageError
from .hotset import (HitCounts, HotBuilder, HotSelector, HotSizing, RebuildBudget,
                     choose_capacity, pruned_filter)
from .health import Health
from .maintenance import Maintenance
from .hotshm import HotPublisher, HotReader, RecentTable
from .drafttiers import WARM_FIRST, DraftTiers
from .hotimage import ImageRefused, image_path, read_image, remove_leftover, write_image
from .wire.identity import TableIdentity, table_identity
from .stats import TableStats

log = logging.getLogger("ngramd.table")

_EMPTY_SLOTS = K.EMPTY_SLOTS
_NO_TIER = 255
#: the most a draft call may spend on cold reads (a caller's budget_us is capped to it)
MAX_BUDGET_US = 100_000.0
#: cold keys one ``lookup`` call may read (past it: BadInput; lookups are for tools and tests)
MAX_LOOKUP_COLD_KEYS = 65_536


class Table:
    """One n-gram table: cold tier in RocksDB, hot and recent tiers in shared memory."""

    def __init__(self, config: TableConfig):
        self.config = config
        # every table records its tokenizer: the packaged Qwen3 one unless configured ("none":
        # explicitly none, logged)
        self.identity = table_identity_of(config)
        #: what the table drafts with (and sends in info()); its orders are the table's
        self.rules = config.rules
        self.n_min, self.n_max = self.rules.n_min, self.rules.n_max
        self.max_probe = config.hot_max_probe
        self.stats = TableStats(self.n_max)
        #: called after every durable append (local or remote): the fleet's publisher waits on it
        self.on_append = None
        self._closed = False
        self._busy_at_close: list[str] = []  # threads ``close`` left running (a stalled disk)
        # each resource is closed by this stack, in the reverse order of opening: a start-up
        # that fails half-way closes exactly what it opened (close() closes the rest)
        with contextlib.ExitStack() as stack:
            self._open_tiers(stack)
            self._init_state()
            # a table that cannot serve releases RocksDB's lock and the shm
            # what shm or the image on disk holds is served first: generators draft from it
            # in-process while the daemon compiles its request path
            self._adopt_published()
            self._warm_kernels()
            self._start_threads(stack)
            self._resources = stack.pop_all()

    def _open_tiers(self, stack: contextlib.ExitStack) -> None:
        """Open the shm publisher, the cold tier, the recent table and the background-read
        pool, each registered on ``stack`` to be closed."""
        config = self.config
        # the shm control file's lock first: a second daemon for this table is refused before
        # it creates anything on disk
        self.publisher = HotPublisher(config.shm_dir, config.name, self.identity,
                                      grace_s=config.hot_grace_s)
        stack.callback(self.publisher.close, unlink=False)
        path = Path(config.data_dir) / config.name
        self._image_path = image_path(path)
        # shared memory empty (a reboot, a restore, a new host): the image is published before
        # RocksDB opens (seconds on a loaded host); its sequence is checked once it is open
        self._early_image = None if self.publisher.generation else \
            self._publish_image(1 << 63)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.cold = ColdStore(str(path), self.identity, config.cold)
        stack.callback(self._close_cold)
        self.cold.auto_spill = False  # the merger thread spills: counting never waits for it
        recent_slots = 1 << max(6, int(math.log2(max(config.recent_mb, 0.01) * 2**20
                                                 / K.SLOT_BYTES)))
        self.recent = RecentTable(self.publisher, recent_slots, self.max_probe,
                                  grace_s=config.hot_grace_s)
        stack.callback(self.recent.close, unlink=True)
        self._bg = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ngramd-coldbg")
        stack.callback(self._shutdown_bg)

    def _init_state(self) -> None:
        """The hot tier's, the warm cache's and the background threads' state."""
        config = self.config
        self.builder = HotBuilder()
        self.sizing = HotSizing.from_config(config.hot_budget_mb)
        self.rebuild_budget = RebuildBudget(config.hot_rebuild_cpu, time.monotonic())
        self._hot_rows_at_build = 0  # _stored_rows() when the current generation was built
        self._backlog_seen = False  # counting lagged the log since (a bulk ingest)
        self.hits = HitCounts(config.hit_keys)
        # blocked Bloom filter of the keys the hot build pruned as redundant (published with it)
        self._pruned, self._pruned_nprobe = np.zeros(0, np.uint64), 0
        self._hot = _EMPTY_SLOTS  # the generation this process last published (read-only map)
        self._hot_reader: HotReader | None = None
        self._hot_info: dict = {}
        self._hot_applied = -1  # counted seq the current generation was built from
        #: where the served hot tier came from: "shm" (a restart found it), "image" (the
        #: table's image on disk, hotimage), "rebuild" (ranked by this daemon), "empty"
        self._hot_source = "empty"
        self._image: dict = {}  # the image on disk: last written, loaded or refused
        warm_cap = 1 << max(10, int(np.ceil(np.log2(max(config.warm_cache_entries, 1) * 2))))
        self._warm = np.zeros((warm_cap, K.SLOT_WORDS), np.uint32)
        # the daemon drafts warm cache, hot, recent, previous recent (drafttiers: WARM_FIRST)
        self._tiers = DraftTiers(WARM_FIRST, self._warm, self.max_probe)
        self._warm_used = 0
        self._warm_lock = threading.Lock()
        self._recent_epoch = self.recent.epoch
        self._cold_us = 50.0  # running estimate of one cold key read (µs), refined as we go
        self._hot_us = 1.0  # running estimate of one context's fast-path draft (µs)
        self._bg_pending = 0  # background cold reads queued or running (<= 4)
        self._bg_lock = threading.Lock()
        self._generation = self.publisher.generation
        #: what fails now and the counting lag's clock (``health()``)
        self.faults = Health(self.cold, config.lag_degraded_s, config.health_recover_s)
        #: the writer, spill, merge and rebuild threads (started by ``_start_threads``)
        self.maint = Maintenance(config, self.cold, self.recent, self.stats, self.faults,
                                 rebuild_budget=self.rebuild_budget,
                                 rebuild=lambda: self._rebuild(),
                                 rebuild_pays=lambda: self._rebuild_pays(),
                                 generation=lambda: self._generation,
                                 urgent=lambda: self.hot_starved())

    def _start_threads(self, stack: contextlib.ExitStack) -> None:
        """Start the writer, spill, merge and rebuild threads; ``stack`` stops and joins the
        ones started if a later one fails to start."""
        # the write path's and the hot build's kernels compile (or load from numba's cache) in
        # the background now: a first compile holds the GIL for 0.1-1 s, which must not land
        # in the middle of serving (measured: 100-500 ms stalls at a daemon's first rebuild)
        threading.Thread(target=_warm_background, args=(self.identity,),
                         name="ngramd-warmup", daemon=True).start()
        stack.callback(self._stop_threads)
        self.maint.start()

    # ------------------------------------------------------------------ reads (never block)
    def draft(self, tokens: np.ndarray, offsets: np.ndarray, max_len: int,
              budget_us: float | None = None) -> DraftBatch:
        """Draft up to ``max_len`` tokens for each context ``tokens[offsets[i]:offsets[i+1]]``.

        Returns a ``DraftBatch`` of (B, max_len) arrays (the ``draft`` op's reply: ``arrays()``).
        ``budget_us`` bounds the time spent on cold reads for this call (default: the
        configured budget, or 1.5 x the mean fast-path draft time of one context x
        ``max_draft_len``; at most ``MAX_BUDGET_US``).
        """
        t0 = time.perf_counter()
        max_len = int(max_len)
        if not 1 <= max_len <= self.rules.max_draft_len:
            raise BadInput(f"max_len {max_len} outside 1..{self.rules.max_draft_len}")
        self._check_recent_epoch()
        out = self._fast_draft(tokens, offsets, max_len)
        t_fast = (time.perf_counter() - t0) * 1e6
        nb = offsets.shape[0] - 1
        self._hot_us = 0.95 * self._hot_us + 0.05 * (t_fast / max(nb, 1))
        budget = budget_us if budget_us is not None else self._budget_us()
        budget = min(budget, MAX_BUDGET_US)
        try:
            redo = self._cold_refine(tokens, offsets, out, max(budget - t_fast, 0.0))
            self._clear("cold reads")
        except StorageError as e:  # answer from memory; the disk's trouble shows as health
            self._fault("cold reads", e)
            redo = np.zeros(0, np.int64)
        if redo.size:
            sub_tok, sub_off = _select(tokens, offsets, redo)
            again = self._fast_draft(sub_tok, sub_off, max_len)
            for mine, theirs in zip(out.arrays().values(), again.arrays().values()):
                mine[redo] = theirs
        self._count_draft(tokens, offsets, out)
        self.stats.latency["draft"].add((time.perf_counter() - t0) * 1e6)
        return out

    def lookup(self, tokens: np.ndarray, offsets: np.ndarray) -> dict:
        """Top-3 candidates per order for each context, hot first then cold for the orders the
        hot tier lacks.  ``tier`` is 1 (hot), 2 (cold) or 255 (absent)."""
        nb = offsets.shape[0] - 1
        w = self.n_max + 1
        tok = np.full((nb, w, K.HOT_K), K.EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((nb, w, K.HOT_K), np.uint32)
        total = np.zeros((nb, w), np.uint32)
        t0 = time.perf_counter()
        K.lookup_batch(self._hot, self.max_probe, tokens, offsets, self.n_min, self.n_max,
                       tok, cnt, total)
        self.stats.latency["hot"].add((time.perf_counter() - t0) * 1e6)
        tier = np.where(total > 0, K.TIER_HOT, _NO_TIER).astype(np.uint8)
        lens = np.diff(offsets)
        miss_b, miss_n = np.nonzero((total == 0) & (np.arange(w)[None, :] >= self.n_min)
                                    & (np.arange(w)[None, :] <= lens[:, None]))
        for n in range(self.n_min, w):  # keys looked up: contexts at least n tokens long
            self.stats.lookups[K.TIER_HOT, n] += int((lens >= n).sum())
            self.stats.hits[K.TIER_HOT, n] += int((tier[:, n] == K.TIER_HOT).sum())
        if miss_b.size > MAX_LOOKUP_COLD_KEYS:
            raise BadInput(f"lookup would read {miss_b.size} keys from the cold tier (at most "
                           f"{MAX_LOOKUP_COLD_KEYS} a call): send fewer or shorter contexts")
        if miss_b.size:
            keys = np.empty(miss_b.size, np.uint64)
            for i, (b, n) in enumerate(zip(miss_b.tolist(), miss_n.tolist())):
                e = int(offsets[b + 1])
                keys[i] = K.key_hash(tokens[e - n:e])
            res = self._cold_lookup(miss_n, keys)
            for i in np.flatnonzero(res.found).tolist():
                b, n = miss_b[i], miss_n[i]
                tok[b, n] = res.tok[i, :K.HOT_K]
                cnt[b, n] = res.cnt[i, :K.HOT_K]
                total[b, n] = res.total[i]
                tier[b, n] = K.TIER_COLD
        return {"tok": tok, "cnt": cnt, "total": total, "tier": tier}

    # ------------------------------------------------------------------ writes
    def ingest(self, tokens: np.ndarray, offsets: np.ndarray) -> tuple[int, int]:
        """Append sequences to the durable ingest log; returns (first_seq, last_seq) of the
        log records once they are durable.  Counting happens on the writer thread."""
        return self._append(self.cold.append_log, tokens, offsets)

    def ingest_remote(self, records: list) -> tuple[int, int]:
        """Other hosts' log records ``(origin id, origin seq, record)`` (the fleet's consumer):
        appended to the same durable log in one write and counted like a local ingest."""
        return self._append(self.cold.append_remote, records)

    def _append(self, append, *args) -> tuple[int, int]:
        t0 = time.perf_counter()
        self.faults.ingest_since = time.monotonic()
        try:
            seqs = append(*args)
        except OSError as e:  # any other call on the log path that meets the disk's refusal
            e = StorageError(f"ingest log: append failed: {e.strerror or e}")
            self._fault("ingest", e)
            raise e from None
        except StorageError as e:
            self._fault("ingest", e)
            raise
        finally:
            self.faults.ingest_since = 0.0
        self._clear("ingest")
        self.stats.latency["ingest"].add((time.perf_counter() - t0) * 1e6)
        self.maint.last_ingest = now = time.monotonic()
        self.faults.appended(seqs[1], now)
        with self.maint.wake:
            self.maint.wake.notify()
        if self.on_append is not None:
            self.on_append()
        return seqs

    def records_per_sequence(self, offsets: np.ndarray) -> np.ndarray:
        """Log records each sequence of an ingest becomes (long ones are split)."""
        return self.cold.split_counts(np.diff(offsets))

    def report(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None) -> None:
        """Generators' per-order figures, and the keys of the hot entries they drafted from
        (they rank the next hot generation)."""
        self.stats.report(drafted, accepted)
        if keys is not None and keys.size:
            self.hits.add(keys)

    def flush(self, timeout_s: float = 600.0, abort: threading.Event | None = None) -> int:
        """Wait until everything in the log is counted, then make it durable in a run; returns
        the applied seq.  Always answers within ``timeout_s``: ``storage`` (with the reason)
        as soon as counting fails or waits behind a failing spill (a full disk: the log holds
        the backlog), ``timeout`` at the deadline, ``unavailable`` when the table closes or
        ``abort`` is set (a daemon that stops)."""
        target = self.cold.last_seq()
        deadline = time.monotonic() + timeout_s
        with self.maint.wake:
            self.maint.wake.notify()
        with self.maint.applied_cv:
            while self.cold.counted_seq() < target:
                if self.maint.writer_error is not None:
                    raise self.maint.writer_error
                spill = self.faults.failing("spill")
                if spill is not None and self.maint.writer_waits:
                    raise StorageError(f"counting waits for a spill that fails ({spill[0]}); "
                                       f"the ingest log keeps the backlog")
                if self._closed or (abort is not None and abort.is_set()):
                    raise NgramError("table is closing", UNAVAILABLE)
                left = deadline - time.monotonic()
                if left <= 0:
                    n, lag_s = self.log_lag()
                    raise NgramError(f"ingest log not counted within {timeout_s:g} s (log lag "
                                     f"{n} records / {lag_s:.1f} s)", TIMEOUT)
                self.maint.applied_cv.wait(min(left, 0.1))
        if time.monotonic() >= deadline:
            raise NgramError(f"ingest log counted but not written within {timeout_s:g} s",
                             TIMEOUT)
        self.maint.spill()
        return self.cold.applied_seq()

    def rebuild_hot(self, full: bool = False, timeout_s: float = 600.0,
                    abort: threading.Event | None = None) -> int:
        """Build and publish a new hot generation now; returns its number.  Every rebuild
        ranks the whole table, so ``full`` (kept for the protocol) changes nothing.  Raises
        at once when the rebuild fails (with its cause), ``unavailable`` when the table
        closes or ``abort`` is set, ``timeout`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self.maint.rebuild_done:
            before = self._generation
            failures = self.maint.rebuild_failures
            self.maint.rebuild_req.set()
            while True:
                if self._generation > before:
                    return self._generation
                if self.maint.rebuild_failures != failures:
                    failed = self.maint.rebuild_failed
                    raise NgramError(f"hot rebuild failed: {failed}") from failed
                if self._closed or (abort is not None and abort.is_set()):
                    raise NgramError("table is closing", UNAVAILABLE)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NgramError(f"hot rebuild did not finish within {timeout_s} s",
                                     TIMEOUT)
                self.maint.rebuild_done.wait(min(left, 0.5))

    # ------------------------------------------------------------------ info
    def info(self) -> dict:
        return {
            "identity": self.identity.to_dict(),
            "table_id": self.cold.table_id,  # random per created table (ngramd/cold.py)
            "hot": {"shm_dir": str(self.config.shm_dir), "table": self.config.name,
                    "generation": self._generation, "max_probe": self.max_probe,
                    "recent_epoch": self.recent.epoch},
            **self.rules.to_info(),  # orders, limits, confidence
            # what generators feed back: their outputs, and their prompts too when set
            "feedback": {"learn_prompts": bool(self.config.learn_prompts)},
        }

    def stats_dict(self) -> dict:
        s = self.stats.snapshot(self.n_min)
        cold = self.cold.stats()
        s["cold"] = cold
        s["hot"] = dict(self._hot_info, generation=self._generation,
                        counted_seq=self._hot_applied,
                        bytes=int(self._hot.nbytes), slots=int(self._hot.shape[0]),
                        pruned_filter_bytes=int(self._pruned.nbytes),
                        # how big, and why (the limit and what the data needed)
                        sizing=self._hot_info.get("sizing") or self.sizing.explain(),
                        # what rebuilds cost, and when the next scheduled one may run
                        rebuilds=self.rebuild_budget.stats(time.monotonic()),
                        # unix time of the generation's build (its segment header), so its age
                        # survives a restart that adopts it
                        created_s=self._hot_created_s(), **self.hot_state())
        s["recent"] = self.recent.stats()
        s["warm_cache"] = {"entries": self._warm_used, "capacity": int(self._warm.shape[0])}
        s["hits"] = {"keys": int(self.hits.keys.size), "pending": self.hits.pending,
                     "recorded": self.hits.added}
        s["budget_us"] = round(self._budget_us(), 2)
        s["log_lag"], lag_s = self.log_lag()
        s["log_lag_s"] = round(lag_s, 3)
        m = self.maint
        s["writer_error"] = str(m.writer_error) if m.writer_error else None
        s["rebuild_error"] = str(m.rebuild_failed) if m.rebuild_failed else None
        s["rebuild_failures"] = m.rebuild_failures
        s["activity"] = dict(m.busy)
        s["health"] = self.health()
        s["memory"] = self.memory()
        return s

    def _hot_created_s(self) -> float:
        """Unix time the hot generation served now was built (0.0 before one is mapped)."""
        reader = self._hot_reader
        return reader.header.get("created_ns", 0) / 1e9 if reader is not None else 0.0

    # ------------------------------------------------------------------ health
    def log_lag(self) -> tuple[int, float]:
        """(records, seconds) the writer lags the log (``Health.log_lag``)."""
        return self.faults.log_lag()

    def hot_curve(self, tokens: np.ndarray, offsets: np.ndarray, *, max_mb: float | None,
                  points: int, prompt_tokens: int, max_len: int,
                  abort: threading.Event | None = None) -> dict:
        """The hot-size curve of this table on held-out sequences (``ngramd.hotcurve``; the
        ``hot_curve`` op): budgets halving from ``max_mb`` (default 4x, at most 8x the
        configured hot budget: the ranking holds every row the largest one places)."""
        from .hotcurve import ReplaySettings, hot_curve

        # relative to the operator's limit, or (sized from data) to the size last chosen
        base, what = self.config.hot_budget_mb, "hot_budget_mb"
        if not base:
            base, what = max(self._hot.nbytes / 2**20, 1.0), "the hot tier's size"
        limit = 8 * base
        max_mb = 4 * base if max_mb is None else float(max_mb)
        if max_mb > limit:
            raise BadInput(f"max_mb {max_mb:g} is above 8x {what} ({limit:g} MiB): the "
                           f"ranking would hold too many rows in the daemon")
        cap = choose_capacity(1 << 62, int(max_mb * 2**20), self.builder.load_factor)
        max_rows = int(cap * self.builder.load_factor)
        entries = max(1, int(self.cold.stats().get("entries_total") or 0))
        fractions = [min(1.0, max_rows / 2**i / entries) for i in range(points)]
        reqs = [(tokens[a:min(b, a + prompt_tokens)], tokens[min(b, a + prompt_tokens):b])
                for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
                if b - a > prompt_tokens]
        if not reqs:
            raise BadInput(f"no sequence is longer than prompt_tokens ({prompt_tokens})")
        cfg = ReplaySettings(rules=self.rules, max_len=max_len, max_probe=self.max_probe)
        out = hot_curve(self.cold, reqs, sorted(set(fractions)), settings=cfg,
                        load_factor=self.builder.load_factor, hits=self.hits.lookup,
                        count_weight=self.builder.count_weight, max_rows=max_rows, stop=abort)
        out["configured_hot_budget_mb"] = self.config.hot_budget_mb
        out["hot_mb"] = round(self._hot.nbytes / 2**20, 3)
        return out

    def checksum(self, abort: threading.Event | None = None) -> dict:
        """Digests of what is counted (``ColdStore.checksum``)."""
        return self.cold.checksum(abort)

    def fault(self, part: str, e: BaseException) -> None:
        """Report a failing part that lives outside the table (the fleet) in ``health``."""
        self.faults.fault(part, e)

    def _fault(self, part: str, e: BaseException) -> None:
        self.faults.fault(part, e)

    def _clear(self, part: str) -> None:
        self.faults.clear(part)

    def health(self) -> dict:
        """``ok``, or ``degraded`` with the reason: a part of the write path failing now (the
        ingest log, counting, spills, merges, hot rebuilds) or an ingest stuck on the disk.
        Reads keep being served either way; each part clears itself when it works again
        (``ngramd.health``).  Also ``degraded`` while a table of over ``HOT_EMPTY_ROWS`` rows
        serves drafts from an empty hot tier (a rebuild after a start without an image)."""
        return _hot_health(self.faults.state(), self)

    def busy(self) -> bool:
        """True while a spill, merge or rebuild runs or the writer has log records to apply."""
        return any(self.maint.busy.values()) or self.cold.last_seq() != self.cold.counted_seq()

    def memory(self) -> dict:
        """Where the daemon's memory goes, by design (bytes)."""
        m = self.cold.memory()
        m.update(hot_bytes=int(self._hot.nbytes), recent_bytes=self.recent.stats()["bytes"],
                 warm_bytes=int(self._warm.nbytes),
                 hits_bytes=int(self.hits.keys.nbytes + self.hits.hits.nbytes),
                 count_buffers_bytes=self.cold.count_buffers_bytes())
        return m

    def top(self, order: int, n: int):
        if not self.n_min <= order <= self.n_max:
            raise BadInput(f"order {order} outside {self.n_min}..{self.n_max}")
        return self.cold.top(order, n)

    #: the most ``close`` waits for the background threads to stop (s); one still busy (a
    #: spill or merge on a stalled disk) is left to the process exit
    CLOSE_JOIN_S = 4.0

    def close(self) -> None:
        """Stop the threads, make the delta durable, keep the hot generation published (a
        restarted daemon and running generators keep drafting from it) and close RocksDB.
        Never raises for the disk's sake and waits for the threads ``CLOSE_JOIN_S`` at most:
        what cannot be made durable stays in the ingest log (logged with its count) and is
        counted again at the next start."""
        if self._closed:
            return
        busy = self._stop_threads()
        if not busy:
            self.cold.interrupted = False
            try:
                self.cold.spill()
            except NgramError as e:  # the log keeps what could not be spilled
                log.warning("spill at close failed (%s)", e)
        held = self.cold.last_seq() - self.cold.applied_seq()
        if held:
            log.warning("%d acknowledged log records (seqs %d..%d) are not in runs: they stay "
                        "in the ingest log and are counted at the next start", held,
                        self.cold.applied_seq() + 1, self.cold.last_seq())
        self._resources.close()  # the background reads, recent, cold, the shm publisher

    def _stop_threads(self) -> list[str]:
        """Mark the table closed, wake and join the background threads (``CLOSE_JOIN_S`` at
        most) and stop the background reads; returns the names of the threads still busy (a
        spill or merge on a stalled disk), which are left to the process exit.  Once only:
        ``close`` calls it first, then its resources' stack again."""
        if self.maint.stop.is_set():
            return self._busy_at_close
        self._closed = True
        self.maint.signal_stop()
        self.cold.interrupted = True  # a merge in progress stops at its next slice
        busy = self._busy_at_close = self.maint.join(self.CLOSE_JOIN_S)
        self._shutdown_bg()
        with self.maint.rebuild_done:
            self.maint.rebuild_done.notify_all()
        if busy:
            log.warning("closing: %s still busy after %.0f s (a stalled disk?); RocksDB is "
                        "left to the process exit", ", ".join(busy), self.CLOSE_JOIN_S)
        return busy

    def _shutdown_bg(self) -> None:
        """Stop the background cold reads (waiting for them unless a thread was left busy)."""
        self._bg.shutdown(wait=not self._busy_at_close, cancel_futures=True)

    def _close_cold(self) -> None:
        """Close the cold tier, unless ``close`` left a thread busy in it (a stalled disk:
        RocksDB is then left to the process exit)."""
        if self._busy_at_close:
            return
        try:
            self.cold.close()
        except NgramError as e:  # after a storage error: RocksDB recovers from its WAL
            log.warning("closing the cold tier failed (%s)", e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ internals
    def _warm_kernels(self) -> None:
        """Compile (or load from numba's cache) every kernel of the request path now: a first
        compile inside a request would blow its latency budget by seconds."""
        toks = np.arange(self.n_max + 2, dtype=np.uint32)
        offs = np.array([0, toks.size], np.int64)
        out = self._fast_draft(toks, offs, 2)
        self._candidates(toks, offs, out)
        keys = np.empty(4, np.uint64)
        K.draft_keys(toks, offs, out.tokens, out.orders, out.lengths, self.n_max, keys)
        K.bbloom_may(pruned_filter(keys)[0], keys[0], pruned_filter(keys)[1])
        K.warm_insert(np.zeros((16, K.SLOT_WORDS), np.uint32), 4, np.uint64(1), 1,
                      toks[:1], toks[:1], 1)
        w = self.n_max + 1
        K.lookup_batch(self._hot, self.max_probe, toks, offs, self.n_min, self.n_max,
                       np.zeros((1, w, K.HOT_K), np.uint32), np.zeros((1, w, K.HOT_K), np.uint32),
                       np.zeros((1, w), np.uint32))
        self.cold.lookup(keys)
        self.stats.latency["hot"] = type(self.stats.latency["hot"])()  # not a real request

    def _adopt_published(self) -> None:
        """Serve at once: map the generation already in shared memory (a restart), else the
        table's image on disk (a reboot, a restore, ``ngramd warm``), else publish an empty one
        (a new table), so readers can attach before any rebuild."""
        durable = max(self.cold.last_seq(), self.cold.applied_seq())
        image = self._early_image
        if image is None:
            if self.publisher.generation:
                try:
                    self._map_hot()
                    if self._hot_reader.header["applied_seq"] > durable:
                        raise NgramError(f"built at log seq "
                                         f"{self._hot_reader.header['applied_seq']}, ahead of "
                                         f"what the table holds ({durable})")
                    if self._hot_reader.header["entries"] or not self._image_path.exists():
                        self._adopt_shm()
                        return
                    log.info("hot generation %d in shared memory is empty: trying the image "
                             "on disk", self._generation)
                except NgramError as e:
                    log.info("existing hot generation not usable (%s)", e)
            image = self._publish_image(durable)
        elif image["state"] == "loaded" and image["applied_seq"] > durable:
            reason = (f"built at log seq {image['applied_seq']}, ahead of what the table holds "
                      f"({durable}): not this table's past")
            log.warning("hot image %s refused: %s; rebuilding the hot tier", self._image_path,
                        reason)
            image = {"state": "refused", "reason": reason}
        if image is not None and image["state"] == "loaded":
            self._take_image(image, durable)
            if self._hot_applied != self.cold.last_seq():
                self.maint.rebuild_req.set()  # what was counted since: recent tier, then this
            return
        if image is not None:
            self._image = image
        self._publish(np.zeros((64, K.SLOT_WORDS), np.uint32), {}, np.zeros(0, np.uint64), 0)
        if self.cold.last_seq() > 0 or self.cold.runs():  # runs: `ngramd warm`, a restore
            self.maint.rebuild_req.set()

    def _adopt_shm(self) -> None:
        """Serve the generation a previous daemon left in shared memory."""
        self._hot_applied = int(self._hot_reader.header["applied_seq"])
        self._pruned, self._pruned_nprobe = self._hot_reader.pruned
        self._hot_source = "shm"
        self._hot_rows_at_build = self._stored_rows()  # unknown: taken as the table's
        log.info("serving hot generation %d from shared memory (built at applied seq %d); "
                 "rebuilding in the background", self._generation, self._hot_applied)
        if self._hot_applied != self.cold.last_seq():
            self.maint.rebuild_req.set()

    def _map_hot(self) -> None:
        if self._hot_reader is None:
            self._hot_reader = HotReader(self.config.shm_dir, self.config.name,
                                         identity=self.identity, warm=False)
        else:
            self._hot_reader.refresh()
        self._hot = self._hot_reader.slots
        self._generation = self._hot_reader.generation

    def _budget_us(self) -> float:
        if self.config.budget_us > 0:
            return self.config.budget_us
        # ARCHITECTURE §7: the seed's rule, 1.5 x the mean in-memory draft time, per draft step
        # (_hot_us times a whole draft of one context: the rule is applied to max_draft_len steps)
        return 1.5 * self._hot_us * self.rules.max_draft_len

    def _check_recent_epoch(self) -> None:
        """A new recent epoch drops the rows of the one before the previous: absent answers
        cached before them could now be stale, so the warm cache starts over."""
        if self.recent.epoch != self._recent_epoch:
            with self._warm_lock:
                self._recent_epoch = self.recent.epoch
                self._warm[:] = 0
                self._warm_used = 0

    def _fast_draft(self, tokens, offsets, max_len) -> DraftBatch:
        out = K.draft_out(offsets.shape[0] - 1, max_len)
        t0 = time.perf_counter()
        r0, r1 = self.recent.tables()
        with self._warm_lock:  # background reads insert, rebuilds and new epochs empty it
            self._tiers.share_tables(self._hot, r0, r1, self._pruned, self._pruned_nprobe,
                                     self.max_probe)
            self._tiers.draft_batch(tokens, offsets, max_len, self.rules, out)
        self.stats.latency["hot"].add((time.perf_counter() - t0) * 1e6)
        return DraftBatch(*out)

    def _cold_refine(self, tokens, offsets, out, budget_us) -> np.ndarray:
        """Read from the cold tier the keys longer than what the fast path matched, step by
        step along the drafts, while the estimated cost fits ``budget_us``; past the budget,
        degrade (answer from the fast path) and read them in the background.  Returns the
        indices of contexts whose draft should be recomputed (their keys are now warm)."""
        t_end = time.perf_counter() + budget_us / 1e6
        redo_all = np.zeros(0, np.int64)
        cur_tok, cur_off, cur_idx = tokens, offsets, np.arange(offsets.shape[0] - 1)
        cur = out
        for _ in range(out.tokens.shape[1] + 1):  # each round fixes at least one more step
            rows = self._candidates(cur_tok, cur_off, cur)
            if rows is None:
                break
            c_ctx, c_ord, c_key, c_pos = rows
            if not self._fetch_longest_first(c_ctx, c_pos, c_ord, c_key, t_end):
                break
            touched = np.unique(c_ctx)
            cur_idx = cur_idx[touched]
            redo_all = np.union1d(redo_all, cur_idx)
            cur_tok, cur_off = _select(cur_tok, cur_off, touched)
            cur = self._fast_draft(cur_tok, cur_off, out.tokens.shape[1])
        return redo_all

    def _fetch_longest_first(self, c_ctx, c_pos, c_ord, c_key, t_end) -> bool:
        """Read candidate keys into the warm cache, longest order first within each draft step,
        stopping a step at its first key present in the cold tier: only the longest match
        matters, and absent keys are cheap (filters in RAM) while present ones cost a page
        read.  Rounds that do not fit before ``t_end`` degrade to the background.  Returns
        False when it degraded."""
        # keys the filters rule out need no read: cache them as absent right away
        maybe = self.cold.may_exist(c_key)
        if not maybe.all():
            self._warm_negative(c_ord[~maybe], c_key[~maybe])
            keep = np.flatnonzero(maybe)
            if not keep.size:
                return True
            c_ctx, c_pos, c_ord, c_key = c_ctx[keep], c_pos[keep], c_ord[keep], c_key[keep]
        group = c_ctx * (self.rules.max_draft_len + 2) + c_pos
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])  # rows come grouped
        rank = np.arange(group.size) - np.repeat(starts, np.diff(np.r_[starts, group.size]))
        done = np.zeros(group.size, bool)  # per row: its step already has its longest match
        for r in range(int(rank.max()) + 1):
            sel = np.flatnonzero((rank == r) & ~done)
            if not sel.size:
                break
            if sel.size * self._cold_us > (t_end - time.perf_counter()) * 1e6:
                rest = np.flatnonzero((rank >= r) & ~done)
                self._degrade(c_ord[rest], c_key[rest])
                return False
            found = self._fetch_into_warm(c_ord[sel], c_key[sel])
            done |= np.isin(group, group[sel[found]])
        return True

    def _candidates(self, tokens, offsets, d):
        nb = offsets.shape[0] - 1
        cap = nb * self.n_max * (d.tokens.shape[1] + 1)
        c_ctx = np.empty(cap, np.int64)
        c_ord = np.empty(cap, np.int64)
        c_key = np.empty(cap, np.uint64)
        c_pos = np.empty(cap, np.int64)
        with self._warm_lock:
            m = K.cold_candidates(tokens, offsets, d.tokens, d.orders, d.lengths, self.n_min,
                                  self.n_max, self._warm, self._hot, self.max_probe,
                                  self._pruned, self._pruned_nprobe, c_ctx, c_ord, c_key, c_pos)
        if not m:
            return None
        return c_ctx[:m], c_ord[:m], c_key[:m], c_pos[:m]

    def _degrade(self, orders, keys) -> None:
        """Answer from the fast path now; warm the cache in the background (bounded queue)."""
        np.add.at(self.stats.degrades, orders, 1)
        with self._bg_lock:
            if self._bg_pending >= 4:  # bounded: a burst of misses must not queue without end
                return
            self._bg_pending += 1
        fut = self._bg.submit(self._fetch_into_warm, orders, keys)
        fut.add_done_callback(self._bg_done)

    def _bg_done(self, fut):
        with self._bg_lock:
            self._bg_pending -= 1
        if fut.exception() is not None and not self._closed:
            log.warning("background cold read failed: %s", fut.exception())

    def _cold_lookup(self, orders, keys):
        """Cold reads of ``keys`` (timed, counted per order)."""
        t0 = time.perf_counter()
        res = self.cold.lookup(keys)
        us = (time.perf_counter() - t0) * 1e6
        orders = np.asarray(orders, np.int64)
        np.add.at(self.stats.lookups[K.TIER_COLD], orders, 1)
        np.add.at(self.stats.hits[K.TIER_COLD], orders[res.found], 1)
        n = max(keys.size, 1)
        self.stats.latency["cold"].add(us / n, n)
        self._cold_us = 0.9 * self._cold_us + 0.1 * (us / n)
        return res

    def _warm_negative(self, orders, keys) -> None:
        """Record keys known to be absent from the cold tier in the warm cache."""
        np.add.at(self.stats.lookups[K.TIER_COLD], np.asarray(orders, np.int64), 1)
        with self._warm_lock:
            self._warm_insert(orders, keys, np.zeros(keys.size, bool), None)

    def _fetch_into_warm(self, orders, keys) -> np.ndarray:
        """Cold reads of ``keys`` into the warm cache, absent ones as negative entries;
        returns which were found."""
        epoch = self.recent.epoch
        res = self._cold_lookup(orders, keys)
        with self._warm_lock:
            if epoch == self._recent_epoch:  # else the cache was just emptied: drop the answer
                self._warm_insert(orders, keys, res.found, res)
        return res.found

    def _warm_insert(self, orders, keys, found, res) -> None:
        """Insert cold answers into the bounded warm cache (lock held)."""
        empty = np.zeros(0, np.uint32)
        if self._warm_used + keys.size > self._warm.shape[0] // 2:
            self._warm[:] = 0  # bounded cache: start over rather than grow probe chains
            self._warm_used = 0
        for i in range(keys.size):
            if found[i]:
                kk = int((res.tok[i] != K.EMPTY_TOKEN).sum())
                ok = K.warm_insert(self._warm, self.max_probe, np.uint64(keys[i]),
                                   int(orders[i]), res.tok[i, :kk], res.cnt[i, :kk],
                                   int(res.total[i]))
            else:
                ok = K.warm_insert(self._warm, self.max_probe, np.uint64(keys[i]),
                                   int(orders[i]), empty, empty, 0)
            self._warm_used += 1
            if not ok:
                self._warm[:] = 0
                self._warm_used = 0

    def _count_draft(self, tokens, offsets, out) -> None:
        L = out.lengths
        if not L.any():
            return
        K.tally_drafts(out.tiers, out.orders, L, self.stats.drafted)
        keys = np.empty(int(L.sum()), np.uint64)
        m = K.draft_keys(tokens, offsets, out.tokens, out.orders, L, self.n_max, keys)
        self.hits.add(keys[:m])

    # ------------------------------------------------------------------ hot rebuilds
    #: a scheduled rebuild waits while counting lags the log by more than this (s): a bulk
    #: ingest is counted first, then ranked once
    REBUILD_LAG_S = 5.0

    def _rebuild_pays(self) -> str | None:
        """Why a scheduled rebuild runs now, or None: something changed (counts, or enough new
        hits: a full rebuild for a handful of hits cost ~60 CPU-s on an 89M-row table, idle
        is free), counting keeps up, and the CPU budget allows it (``RebuildBudget``: paid
        off, or a catch-up of a tier built from less than half of the table)."""
        if self._hot_applied == self.cold.counted_seq() \
                and self.hits.pending < self.config.hot_rebuild_hits:
            return None
        if self.log_lag()[1] > self.REBUILD_LAG_S:
            self._backlog_seen = True
            return None
        if self.hot_starved():
            return "starved"  # the tier is empty or far behind: no CPU-share throttle
        catch_up = self._backlog_seen and self._stored_rows() >= 2 * self._hot_rows_at_build
        return self.rebuild_budget.allows(time.monotonic(), catch_up)

    def _stored_rows(self) -> int:
        """Rows in runs and the delta (a key in several runs counts once per run): cheap, and
        what tells a rebuild that the table has grown since the last one."""
        return sum(r.rows for r in self.cold.runs()) + self.cold.delta_rows()

    def _rebuild(self) -> None:
        """Rank the whole table (a streaming scan in bounded memory) and publish what is hot."""
        t0 = time.perf_counter()
        counted = self.cold.counted_seq()
        rows_now = self._stored_rows()
        self.hits.merge(self.config.hit_decay)
        ranked = rank_table(self.cold, self.config, self.builder, self.sizing,
                            self.hits.lookup, self.maint.stop)
        if ranked is None:
            return
        slots, info, redundant = ranked
        words, nprobe = pruned_filter(redundant)
        del redundant
        self._serve(slots, words, nprobe, info, counted, t0, source="rebuild")
        self._hot_rows_at_build = rows_now
        self._backlog_seen = False
        if self._hot_reader.header["entries"]:  # an empty tier is not worth a restart's read
            self._write_image(counted, rows_now)

    def _publish(self, slots, info, redundant, counted, t0=None) -> None:
        words, nprobe = pruned_filter(redundant)
        self._serve(slots, words, nprobe, info, counted, t0)

    def _serve(self, slots, words, nprobe, info, counted, t0=None, source="empty",
               known=None) -> None:
        """Publish ``slots`` (and its pruned filter) as the next generation and draft from it
        (``known``: its entries and checksum, ``HotPublisher.publish``)."""
        gen = self.publisher.publish(slots, self.max_probe, counted, words, nprobe, known=known)
        del slots, words  # the daemon drafts from the shared mapping, not a second copy
        self._map_hot()
        self._pruned, self._pruned_nprobe = self._hot_reader.pruned
        self._hot_applied = counted
        self._hot_source = source
        self._hot_info = dict(info, build_s=round(time.perf_counter() - t0, 3) if t0 else 0.0)
        with self._warm_lock:
            self._warm[:] = 0  # entries may now be hot (or stale): start the warm cache over
            self._warm_used = 0
        with self.maint.rebuild_done:
            self._generation = gen
            self.maint.rebuild_failed = None  # stats show the current state; the count stays
            self.maint.rebuild_done.notify_all()
        self._clear("hot rebuild")
        if info:
            log.info("hot generation %d: %s", gen, self._hot_info)

    # ------------------------------------------------------------------ the image on disk
    def _write_image(self, counted: int, rows: int) -> None:
        """Write the generation just published as the table's image (``ngramd.hotimage``), from
        the shared mapping, on the rebuilder's thread and outside every lock a draft takes.
        A failure costs only the next restart's head start: it is logged, never raised."""
        try:
            w = write_image(self._image_path, self.identity, self._hot, self.max_probe,
                            counted, self._pruned, self._pruned_nprobe, rows,
                            slot_checksum=self._hot_reader.header["checksum"])
        except OSError as e:
            log.warning("hot image not written to %s (%s): a start with empty shared memory "
                        "will rebuild", self._image_path, e.strerror or e)
            self._image = dict(self._image, write_error=str(e))
            return
        self._image = dict(w, state="written", at=round(time.time(), 3))
        log.info("hot image written: %d entries, %.1f MiB, applied seq %d, %.2f s",
                 w["entries"], w["bytes"] / 2**20, counted, w["seconds"])

    def _publish_image(self, max_seq: int) -> dict | None:
        """Validate the table's image on disk (``hotimage.read_image``: at most ``max_seq``)
        and publish it as the next generation; returns what ``stats`` shows of it (``state``
        loaded or refused), None when there is none.  A damaged or mismatched image is
        refused with one log line (the daemon rebuilds).  Touches the publisher only: the
        table's state follows in ``_take_image``."""
        remove_leftover(self._image_path)
        t0 = time.perf_counter()
        try:
            img = read_image(self._image_path, self.identity, max_seq)
            if img is not None and img.max_probe > self.max_probe:
                img.close()
                raise ImageRefused(f"built with max_probe {img.max_probe}, above this table's "
                                   f"hot_max_probe {self.max_probe}")
        except (ImageRefused, OSError) as e:
            log.warning("hot image %s refused: %s; rebuilding the hot tier", self._image_path, e)
            return {"state": "refused", "reason": str(e)}
        if img is None:
            return None
        try:
            self.publisher.publish(img.slots, self.max_probe, img.applied_seq, img.pruned,
                                   img.pruned_nprobe, known=(img.entries, img.slot_checksum))
        finally:
            img.close()
        return {"state": "loaded", "bytes": img.bytes, "applied_seq": img.applied_seq,
                "entries": img.entries, "table_rows": img.table_rows,
                "seconds": round(time.perf_counter() - t0, 3),
                "built_at": round(img.created_ns / 1e9, 3)}

    def _take_image(self, image: dict, durable: int) -> None:
        """Draft from the generation ``_publish_image`` published."""
        self._map_hot()
        self._pruned, self._pruned_nprobe = self._hot_reader.pruned
        self._hot_applied = image["applied_seq"]
        self._hot_source = "image"
        self._hot_rows_at_build = image["table_rows"]
        self._image = image
        log.info("serving hot generation %d from the image on disk (%d entries, %.1f MiB, "
                 "applied seq %d of %d) in %.2f s", self._generation, image["entries"],
                 image["bytes"] / 2**20, image["applied_seq"], durable, image["seconds"])

    def hot_starved(self) -> bool:
        """True while the served hot tier is empty though the table is not, or reflects less
        than half of the table's rows: then its rebuild is the most urgent background work (no
        CPU-share throttle, merges wait: ``Maintenance``)."""
        rows = self._stored_rows()
        if not rows or self._hot_reader is None:
            return False
        if self._hot_source == "rebuild" and self._hot_applied == self.cold.counted_seq():
            return False  # ranked from everything counted: a rebuild would find the same
        return not self._hot_reader.header["entries"] or rows >= 2 * self._hot_rows_at_build

    def hot_state(self) -> dict:
        """Where the served hot tier came from and how far behind the table it is (stats)."""
        counted = self.cold.counted_seq()
        return {"source": self._hot_source, "applied_seq": self._hot_applied,
                "behind_records": max(counted - self._hot_applied, 0),
                "entries": int(self._hot_reader.header["entries"]) if self._hot_reader else 0,
                "starved": self.hot_starved(), "image": dict(self._image)}


def rank_table(cold, config: TableConfig, builder: HotBuilder, sizing: HotSizing, hits,
               stop: threading.Event | None = None):
    """Rank every row of ``cold`` for the hot tier (a streaming scan in bounded memory):
    ``(slots, info, redundant keys)``, or None when ``stop`` was set.  ``hits``: decayed hits
    of keys (``HitCounts.lookup``).  The daemon's rebuilds and ``ngramd warm`` call it."""
    rules = config.rules
    budget = sizing.limit_bytes
    cap = choose_capacity(1 << 62, budget, builder.load_factor)
    keep = int(cap * builder.load_factor * config.hot_keep_factor)
    sel = HotSelector(keep, rules.by_order("c_min"), rules.by_order("s_min"), rules.n_max,
                      count_weight=builder.count_weight, prune_redundant=builder.prune_redundant)
    for rows in cold.scan_rows(stop):
        # 64k rows at a time: each numpy call on them holds the GIL for ~10 ms at most
        for a in range(0, len(rows), 1 << 16):
            part = slice_rows(rows, a, min(a + (1 << 16), len(rows)))
            tok, cnt = part.padded(K.HOT_K)
            sel.add(part.key, part.parent, part.order, part.total, tok, cnt,
                    hits(part.key))
    if stop is not None and stop.is_set():
        return None
    slots, info, redundant = sel.build(budget, config.hot_max_probe, builder.load_factor,
                                       builder.min_capacity)
    info.update(scanned=sel.seen, sizing=sizing.explain(info, sel.complete))
    return slots, info, redundant


def write_table_image(cold, config: TableConfig) -> dict | None:
    """Rank a stopped table and write its hot image (``ngramd warm``): the first start then
    serves a full hot tier at once.  None when the table has nothing hot."""
    sel = rank_table(cold, config, HotBuilder(), HotSizing.from_config(config.hot_budget_mb),
                     lambda keys: np.zeros(keys.shape[0], np.float64))
    slots, _, redundant = sel
    if not np.count_nonzero(slots[:, 0] | slots[:, 1]):
        return None
    words, nprobe = pruned_filter(redundant)
    rows = sum(r.rows for r in cold.runs()) + cold.delta_rows()
    return write_image(image_path(cold.path), table_identity_of(config), slots,
                       config.hot_max_probe,
                       cold.applied_seq(), words, nprobe, rows)


def table_identity_of(config: TableConfig) -> TableIdentity:
    """The identity a ``[table]`` config asks for (the packaged Qwen3 tokenizer by default)."""
    return table_identity(n_min=config.n_min, n_max=config.n_max, cold_k=config.cold_k,
                          vocab_size=config.vocab_size, tokenizer=config.tokenizer)


#: rows past which a table serving from an empty hot tier is ``degraded`` (``Table.health``)
HOT_EMPTY_ROWS = 1_000_000


def _hot_health(state: dict, table: "Table") -> dict:
    """``state`` (``Health.state``) with the hot tier's condition added: empty while the
    table holds over ``HOT_EMPTY_ROWS`` rows (drafts then need the daemon's cold reads)."""
    reader = table._hot_reader
    if reader is not None and reader.header["entries"]:
        return state
    rows = table._stored_rows()
    if rows <= HOT_EMPTY_ROWS:
        return state
    msg = f"the hot tier is empty while the table holds {rows} rows (rebuilding)"
    state = dict(state, state="degraded", degraded=1,
                 faults=dict(state.get("faults", {}), **{"hot tier": msg}))
    if not state.get("reason"):
        state.update(reason=f"hot tier: {msg}", since=round(time.time(), 3))
    return state


def _warm_background(ident: TableIdentity) -> None:
    """Run every kernel of counting, spills, merges, scans and hot builds once on toy data."""
    try:
        from .rows import Counter as RowCounter, RowSet, merge_rowsets
        from .runs import encode_pages, page_buffer
        from .hotset import HotSelector, build_hot

        toks = (np.arange(4 * ident.n_max + 8, dtype=np.uint32) * 7) % ident.vocab_size
        offs = np.array([0, toks.size], np.int64)
        a = RowCounter(ident).count(toks, offs, np.zeros(1, np.int64))
        b = RowCounter(ident).count(toks[::-1].copy(), offs, np.zeros(1, np.int64), 0, 1, False)
        m = merge_rowsets([a, RowSet(*(x.copy() for x in b))], ident.cold_k)
        ids, bstart, blob = encode_pages(m, 2)
        vals = [blob[bstart[i]:bstart[i + 1]].tobytes() for i in range(ids.shape[0])]
        buf, pstart, _ = page_buffer(vals + [None])
        out = RowSet(*(np.empty(len(m) + 1, d) for d in (np.uint64, np.uint64, np.uint8,
                                                         np.uint32)),
                     np.zeros(len(m) + 2, np.int64), np.empty(m.tok.size + 1, np.uint32),
                     np.empty(m.tok.size + 1, np.uint32))
        K.pages_decode_into(pstart, buf.view(np.uint8), buf.view(np.uint32), buf,
                            np.uint64(0), np.uint64(0), False, *out, 0, 0)
        K.rows_copy_into(*m, 0, len(m), *out, 0, 0)
        tok3, cnt3 = m.padded(K.HOT_K)
        sel = HotSelector(4, 1, 0.0, ident.n_max, grow=1.1)
        sel.add(m.key, m.parent, m.order, m.total, tok3, cnt3, np.zeros(len(m)))
        build_hot(sel.rows(), 1 << 12, 1, 0.0)
        K.recent_add(np.zeros((64, K.SLOT_WORDS), np.uint32), 8, m.key, m.order, m.total,
                     m.poff, m.tok, m.cnt)
        K.bbloom_add(np.zeros(8, np.uint64), m.key, 3)
    except Exception:  # a warm-up only: the real call compiles on its own
        log.debug("kernel warm-up failed", exc_info=True)


def _select(tokens: np.ndarray, offsets: np.ndarray, idx: np.ndarray):
    """Sub-batch (tokens, offsets) of the contexts ``idx`` (repeats allowed)."""
    idx = np.asarray(idx, np.int64)
    starts, ends = offsets[idx], offsets[idx + 1]
    lens = ends - starts
    new_off = np.zeros(idx.size + 1, np.int64)
    np.cumsum(lens, out=new_off[1:])
    if idx.size == 0:
        return np.zeros(0, np.uint32), new_off
    gather = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
    return tokens[gather], new_off

