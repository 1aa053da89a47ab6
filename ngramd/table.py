"""``Table``: one daemon's n-gram table — the draft path over every tier, and the coordinator of
its other two roles, the hot cycle and the write front.

Roles (ARCHITECTURE §2.2-§2.5):

* **the draft path** (this module): ``draft`` (fast draft, then cold refine within a budget)
  and ``lookup``, over the tiers below, with the warm cache and the background cold reads;
* **the hot cycle** (``ngramd.hot.cycle.HotCycle``, ``Table.hotcycle``): rebuilds, publication,
  the image on disk, starvation; it hands each generation it maps to the draft path;
* **the write front** (``ngramd.writefront.WriteFront``, ``Table.writes``): ingest, flush, the
  log's backlog.

``Table`` owns them, the tiers they share and the background threads (``Maintenance``), and
answers what spans them: ``rebuild_hot``, ``stats_dict``, ``health``, ``memory``, ``close``.
Callers use the part they need: ``table.writes.ingest``, ``table.hotcycle.state()``, and the
cold tier's reads through ``table.cold_reader``.

Tiers, fastest first (docs/ARCHITECTURE.md §2-§7):

* **hot** — the slot table this daemon last published to shared memory (``ngramd.hot.shm``):
  what the data says is worth a draft, chosen over the whole table (``ngramd.hot.selection``);
* **recent** — the shared-memory table the writer updates in place with every counted batch
  (``hot.shm.RecentTable``): what generators taught the table in the last seconds, draftable by
  every generator's in-process path within one writer step;
* **warm** — a small in-daemon cache of entries read from the cold tier;
* **cold** — RocksDB (``ngramd.cold.store``): runs of pages plus the in-memory delta.

Fast path: the hot, recent and warm tables, drafted by one kernel (``kernels.draft``).
Slow path: keys longer than what the fast path matched are read from the cold tier when the
estimated cost fits the caller's latency budget; otherwise the request is answered from the fast
path at a lower order (a *degrade*, counted per order) and the cold read runs in the background
so the next request finds the entry in the warm cache (ARCHITECTURE §7).  The warm cache is emptied
whenever the recent table starts a new epoch or a hot generation is published: every absent
answer it holds is younger than the recent epochs readers see, so no stale "absent" survives
an ingest.

Threads: ``WriteFront.ingest`` only appends to the durable log (the caller's thread); the
*writer* counts the log into the cold tier's delta and the recent table; the *spiller* merges
the delta's parts in RAM and writes the delta as runs (on size, age and idle ingest, and never
while the merger lags: the log holds that backlog); the *merger* merges runs and gives back
the disk space of the runs it replaced; the *rebuilder* publishes hot generations
(``ngramd.hot.cycle``) when the table changed (never when idle) and the CPU its last rebuild
took is paid off (``hot_rebuild_cpu`` of a core in the long run: ``hot.selection.RebuildBudget``).
All four run at a lower CPU priority
than the serving thread; they live in ``ngramd.maintenance`` (``Maintenance``), and what fails
now in ``ngramd.health`` (``Health``).  A restarted table serves at once: it keeps the hot
generation it finds in shared memory and rebuilds in the background.

Faults (ARCHITECTURE §10.3): reads are served whatever the disk does.  The ingest log is
written with calls that release the GIL (``ngramd.cold.ingestlog``), spills and merges first probe
the disk the same way, and a cold read that fails degrades the draft to the in-memory tiers.
Each part of the write path that fails (ingest log, counting, spill, merge, hot rebuild, cold
reads) marks the table ``degraded`` in ``health()`` (and so in ``ping``, ``info``, ``stats``,
the metrics and systemd's ``STATUS=``) and retries on its own: spills and merges reopen
RocksDB first, since it stays read-only after a failed write.  The mark clears when the part
works again; an ingest stuck on the disk for ``Health.STALL_S`` shows too.  A log record that
cannot be counted is quarantined (``cold.log.ColdLog.quarantine``), never retried forever.

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
from .kernels.bloom import bbloom_add, bbloom_may
from .kernels.drafting import draft_keys, tally_drafts
from .kernels.hashing import key_hash
from .kernels.pages import pages_decode_into
from .kernels.recent import recent_add
from .kernels.refine import cold_candidates, warm_insert
from .kernels.rowset import rows_copy_into
from .kernels.slots import lookup_batch
from .wire.constants import EMPTY_TOKEN, HOT_K, SLOT_BYTES, SLOT_WORDS
from .cold.store import ColdStore
from .config import TableConfig, table_identity_of
from .wire.commands import DraftBatch
from .wire.errors import BadInput, NgramError, StorageError
from .hot.cycle import HotCycle, rank_table, stored_rows
from .hot.selection import HitCounts, HotBuilder, HotSizing, pruned_filter
from .health import Health, Probes
from .maintenance import Maintenance
from .hot.segments import HotPublisher
from .hot.shm import HotReader, RecentTable
from .drafttiers import WARM_FIRST, DraftTiers
from .hot.image import image_path, start_publisher, write_image
from .wire.identity import TableIdentity
from .writefront import WriteFront
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

    def __init__(self, config: TableConfig, *,
                 started: tuple[HotPublisher, dict | None] | None = None):
        # ``started``: what ``hot.image.start_publisher`` returned for this config (``ngramd``
        # calls it before this module loads); None: done here
        self.config = config
        # every table records its tokenizer: the packaged Qwen3 one unless configured ("none":
        # explicitly none, logged)
        self.identity = table_identity_of(config)
        #: what the table drafts with (and sends in info()); its orders are the table's
        self.rules = config.rules
        self.n_min, self.n_max = self.rules.n_min, self.rules.n_max
        self.max_probe = config.hot_max_probe
        self.stats = TableStats(self.n_max)
        self._closed = False
        self._busy_at_close: list[str] = []  # threads ``close`` left running (a stalled disk)
        # each resource is closed by this stack, in the reverse order of opening: a start-up
        # that fails half-way closes exactly what it opened (close() closes the rest)
        with contextlib.ExitStack() as stack:
            self._open_tiers(stack, started)
            self._init_state()
            # a table that cannot serve releases RocksDB's lock and the shm
            # what shm or the image on disk holds is served first: generators draft from it
            # in-process while the daemon compiles its request path
            self._adopt_published()
            self._warm_kernels()
            self._start_threads(stack)
            self._resources = stack.pop_all()

    def _open_tiers(self, stack: contextlib.ExitStack,
                    started: tuple[HotPublisher, dict | None] | None) -> None:
        """Open the shm publisher (``started``'s when given), the cold tier, the recent table
        and the background-read pool, each registered on ``stack`` to be closed."""
        config = self.config
        # the shm control file's lock first: a second daemon for this table is refused before
        # it creates anything on disk.  Shared memory empty (a reboot, a restore, a new host):
        # the image is published before RocksDB opens (seconds on a loaded host); its sequence
        # is checked once it is open
        if started is not None and started[0].identity != self.identity:
            started[0].close(unlink=False)
            raise BadInput("the hot publisher handed to Table is of another table identity")
        self.publisher, self._early_image = started or start_publisher(config, self.identity)
        stack.callback(self.publisher.close, unlink=False)
        path = Path(config.data_dir) / config.name
        path.parent.mkdir(parents=True, exist_ok=True)
        self.cold = ColdStore(str(path), self.identity, config.cold)
        stack.callback(self._close_cold)
        #: every read of the cold tier (``cold.reader.ColdReader``)
        self.cold_reader = self.cold.reader
        #: generators' draft-length-policy states, kept in the cold tier's meta (durable: they
        #: survive a restart and ride checkpoints and snapshots; ``cold.policies``)
        self.policies = self.cold.policies
        self.cold.auto_spill = False  # the merger thread spills: counting never waits for it
        recent_slots = 1 << max(6, int(math.log2(max(config.recent_mb, 0.01) * 2**20
                                                 / SLOT_BYTES)))
        self.recent = RecentTable(self.publisher, recent_slots, self.max_probe,
                                  grace_s=config.hot_grace_s)
        stack.callback(self.recent.close, unlink=True)
        self._bg = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ngramd-coldbg")
        stack.callback(self._shutdown_bg)

    def _init_state(self) -> None:
        """The draft path's state (the hot generation it drafts from, the warm cache), then the
        parts: the hot cycle, the background threads and the write front."""
        config = self.config
        self.hits = HitCounts(config.hit_keys)
        # blocked Bloom filter of the keys the hot build pruned as redundant (published with it)
        self._pruned, self._pruned_nprobe = np.zeros(0, np.uint64), 0
        self._hot = _EMPTY_SLOTS  # the generation served now (read-only map: ``_hot_served``)
        warm_cap = 1 << max(10, int(np.ceil(np.log2(max(config.warm_cache_entries, 1) * 2))))
        self._warm = np.zeros((warm_cap, SLOT_WORDS), np.uint32)
        # the daemon drafts warm cache, hot, recent, previous recent (drafttiers: WARM_FIRST)
        self._tiers = DraftTiers(WARM_FIRST, self._warm, self.max_probe)
        self._warm_used = 0
        self._warm_lock = threading.Lock()
        self._recent_epoch = self.recent.epoch
        self._cold_us = 50.0  # running estimate of one cold key read (µs), refined as we go
        self._hot_us = 1.0  # running estimate of one context's fast-path draft (µs)
        self._bg_pending = 0  # background cold reads queued or running (<= 4)
        self._bg_lock = threading.Lock()
        #: what fails now and the counting lag's clock (``health()``)
        self.faults = Health(self.cold, config.lag_degraded_s, config.health_recover_s)
        #: rebuilds, publication and the image on disk (``ngramd.hot.cycle``)
        self.hotcycle = HotCycle(config, self.identity, self.publisher, self.cold, self.hits,
                                 self.faults, served=self._hot_served)
        #: the writer, spill, merge and rebuild threads (started by ``_start_threads``)
        self.maint = Maintenance(config, self.cold, self.recent, self.stats, self.faults,
                                 self.hotcycle)
        #: ingest and flush (``ngramd.writefront``)
        self.writes = WriteFront(self.cold, self.maint, self.faults, self.stats)
        #: failing parts re-checked on their own schedule, traffic or not (``health.Probes``)
        self.probes = Probes(self.faults, {
            "cold reads": self.cold.reader.probe, "ingest": self.cold.log.probe,
            "spill": self._probe_writes, "merge": self._probe_writes,
            "hot rebuild": self._probe_rebuild}, max_s=config.health_probe_s)

    def _start_threads(self, stack: contextlib.ExitStack) -> None:
        """Start the writer, spill, merge and rebuild threads; ``stack`` stops and joins the
        ones started if a later one fails to start."""
        # the write path's and the hot build's kernels compile (or load from numba's cache) in
        # the background now: a first compile holds the GIL for 0.1-1 s, which must not land
        # in the middle of serving (measured: 100-500 ms stalls at a daemon's first rebuild)
        threading.Thread(target=_warm_background, args=(self.identity,),
                         name="ngramd-warmup", daemon=True).start()
        stack.callback(self._stop_threads)
        self.maint.start(also=[(lambda: self.probes.run(self.maint.stop), "ngramd-probe")])

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
            self.faults.clear("cold reads")
        except StorageError as e:  # answer from memory; the disk's trouble shows as health
            self.faults.fault("cold reads", e)
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
        tok = np.full((nb, w, HOT_K), EMPTY_TOKEN, np.uint32)
        cnt = np.zeros((nb, w, HOT_K), np.uint32)
        total = np.zeros((nb, w), np.uint32)
        t0 = time.perf_counter()
        lookup_batch(self._hot, self.max_probe, tokens, offsets, self.n_min, self.n_max,
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
                keys[i] = key_hash(tokens[e - n:e])
            res = self._cold_lookup(miss_n, keys)
            for i in np.flatnonzero(res.found).tolist():
                b, n = miss_b[i], miss_n[i]
                tok[b, n] = res.tok[i, :HOT_K]
                cnt[b, n] = res.cnt[i, :HOT_K]
                total[b, n] = res.total[i]
                tier[b, n] = K.TIER_COLD
        return {"tok": tok, "cnt": cnt, "total": total, "tier": tier}

    # ------------------------------------------------------------------ feedback, rebuilds
    def report(self, drafted: dict, accepted: dict, keys: np.ndarray | None = None,
               policy: dict | None = None) -> None:
        """Generators' per-order figures and draft-length policy figures, and the keys of the
        hot entries they drafted from (they rank the next hot generation)."""
        self.stats.report(drafted, accepted, policy)
        if keys is not None and keys.size:
            self.hits.add(keys)

    def rebuild_hot(self, full: bool = False, timeout_s: float = 600.0,
                    abort: threading.Event | None = None) -> int:
        """Build and publish a new hot generation now; returns its number.  Every rebuild
        ranks the whole table, so ``full`` (kept for the protocol) changes nothing.  Raises
        at once when the rebuild fails (with its cause), ``unavailable`` when the table
        closes or ``abort`` is set, ``timeout`` after ``timeout_s``."""
        mark = self.hotcycle.mark()
        self.maint.request_rebuild()
        return self.hotcycle.wait_newer(mark, timeout_s, abort)

    # ------------------------------------------------------------------ info
    def info(self) -> dict:
        return {
            "identity": self.identity.to_dict(),
            "table_id": self.cold.table_id,  # random per created table (ngramd/cold/store.py)
            "hot": {"shm_dir": str(self.config.shm_dir), "table": self.config.name,
                    "generation": self.hotcycle.generation, "max_probe": self.max_probe,
                    "recent_epoch": self.recent.epoch},
            **self.rules.to_info(),  # orders, limits, confidence
            # what generators feed back: their outputs, and their prompts too when set
            "feedback": {"learn_prompts": bool(self.config.learn_prompts)},
        }

    def stats_dict(self) -> dict:
        s = self.stats.snapshot(self.n_min)
        cold = self.cold.stats()
        s["cold"] = cold
        s["hot"] = self.hotcycle.stats()
        s["recent"] = self.recent.stats()
        s["warm_cache"] = {"entries": self._warm_used, "capacity": int(self._warm.shape[0])}
        s["policy_states"] = self.policies.stats()  # generators' kept states: keys, bytes
        s["hits"] = {"keys": int(self.hits.keys.size), "pending": self.hits.pending,
                     "recorded": self.hits.added}
        s["budget_us"] = round(self._budget_us(), 2)
        s["log_lag"], lag_s = self.faults.log_lag()
        s["log_lag_s"] = round(lag_s, 3)
        s.update(self.maint.state())  # writer_error, activity
        hot = self.hotcycle
        s["rebuild_error"] = str(hot.failed) if hot.failed else None
        s["rebuild_failures"] = hot.failures
        s["health"] = self.health()
        s["memory"] = self.memory()
        return s

    # ------------------------------------------------------------------ health
    def _probe_writes(self) -> str:
        """The probe of a failing spill or merge (``health.Probes``): the disk takes a write
        and has room for runs (``ColdStore.probe_writes``).  Those parts retry on their own
        (RocksDB reopened first) and clear themselves."""
        self.cold.probe_writes()
        return "the disk takes writes and has room: the part's own retry clears it"

    def _probe_rebuild(self) -> str:
        """The probe of a failed hot rebuild: the cold tier reads and the data directory takes
        a write (what a rebuild needs); then a rebuild is asked, whose success clears it --
        when the CPU budget of rebuilds allows one (a failed rebuild is charged too: a big
        table's must not run back to back) or the tier is starved."""
        self.cold.reader.probe()
        self.cold.probe_disk()
        if self.maint.busy["rebuild"]:
            return "a rebuild runs"
        wait = self.hotcycle.rebuild_budget.due_in(time.monotonic())
        if wait > 0 and not self.hotcycle.starved():
            return f"the disk works; a rebuild waits {wait:.0f} s for its CPU budget"
        self.maint.request_rebuild()
        return "the cold tier reads and the disk takes writes: a rebuild was asked"

    def health(self) -> dict:
        """``ok``, or ``degraded`` with the reason: a part of the write path failing now (the
        ingest log, counting, spills, merges, hot rebuilds) or an ingest stuck on the disk.
        Reads keep being served either way; each part clears itself when it works again
        (``ngramd.health``).  Also ``degraded`` while a table of over
        ``hot.cycle.HOT_EMPTY_ROWS`` rows serves drafts from an empty hot tier (a rebuild after
        a start without an image)."""
        return self.hotcycle.health(self.faults.state())

    def busy(self) -> bool:
        """True while a spill, merge or rebuild runs or the writer has log records to apply."""
        return bool(self.activity())

    def activity(self) -> list[str]:
        """The background work running now: ``spill``, ``merge``, ``rebuild`` (the maintenance
        threads') and ``count`` (log records not yet applied)."""
        act = [k for k, v in self.maint.state()["activity"].items() if v]
        if self.cold.last_seq() != self.cold.counted_seq():
            act.append("count")
        return act

    def memory(self) -> dict:
        """Where the daemon's memory goes, by design (bytes)."""
        m = self.cold_reader.memory()
        m.update(hot_bytes=int(self._hot.nbytes), recent_bytes=self.recent.stats()["bytes"],
                 warm_bytes=int(self._warm.nbytes),
                 hits_bytes=int(self.hits.keys.nbytes + self.hits.hits.nbytes),
                 count_buffers_bytes=self.cold.count_buffers_bytes())
        return m

    def top(self, order: int, n: int):
        if not self.n_min <= order <= self.n_max:
            raise BadInput(f"order {order} outside {self.n_min}..{self.n_max}")
        return self.cold_reader.top(order, n)

    #: the most ``close`` waits for the background threads to stop (s); one still busy (a
    #: spill or merge on a stalled disk) is left to the process exit
    CLOSE_JOIN_S = 4.0
    #: the most ``close`` spends writing the counted delta as a run (s): past it the spill
    #: stops at its next slice, and the log keeps those records (the next start counts them)
    CLOSE_SPILL_S = 2.0

    def close(self) -> None:
        """Stop the threads, make the delta durable, keep the hot generation published (a
        restarted daemon and running generators keep drafting from it) and close RocksDB.
        Never raises for the disk's sake and never counts the log's backlog: it waits for the
        threads ``CLOSE_JOIN_S`` at most and spills what is counted for ``CLOSE_SPILL_S`` at
        most; what is not made durable stays in the ingest log (logged with its count) and
        is counted at the next start."""
        if self._closed:
            return
        busy = self._stop_threads()
        if not busy:
            self._spill_at_close()
        held = self.cold.last_seq() - self.cold.applied_seq()
        if held:
            log.warning("%d acknowledged log records (seqs %d..%d) are not in runs: they stay "
                        "in the ingest log and are counted at the next start", held,
                        self.cold.applied_seq() + 1, self.cold.last_seq())
        self._resources.close()  # the background reads, recent, cold, the shm publisher

    def _spill_at_close(self) -> None:
        """Write the counted delta as a run, stopped after ``CLOSE_SPILL_S`` (a large delta on
        a slow disk); a spill that fails or stops leaves its records to the log."""
        self.cold.runs.interrupted = False
        timer = threading.Timer(self.CLOSE_SPILL_S, setattr, (self.cold.runs, "interrupted", True))
        timer.daemon = True
        timer.start()
        try:
            self.cold.spill()
        except NgramError as e:  # the log keeps what could not be spilled
            log.warning("spill at close failed (%s)", e)
        finally:
            timer.cancel()

    def _stop_threads(self) -> list[str]:
        """Mark the table closed, wake and join the background threads (``CLOSE_JOIN_S`` at
        most) and stop the background reads; returns the names of the threads still busy (a
        spill or merge on a stalled disk), which are left to the process exit.  Once only:
        ``close`` calls it first, then its resources' stack again."""
        if self._closed:
            return self._busy_at_close
        self._closed = True
        self.maint.signal_stop()
        self.cold.runs.interrupted = True  # a merge in progress stops at its next slice
        busy = self._busy_at_close = self.maint.join(self.CLOSE_JOIN_S)
        self._shutdown_bg()
        self.hotcycle.close()  # who waits for a rebuild hears that the table closes
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
        draft_keys(toks, offs, out.tokens, out.orders, out.lengths, self.n_max, keys)
        bbloom_may(pruned_filter(keys)[0], keys[0], pruned_filter(keys)[1])
        warm_insert(np.zeros((16, SLOT_WORDS), np.uint32), 4, np.uint64(1), 1,
                    toks[:1], toks[:1], 1)
        w = self.n_max + 1
        lookup_batch(self._hot, self.max_probe, toks, offs, self.n_min, self.n_max,
                     np.zeros((1, w, HOT_K), np.uint32), np.zeros((1, w, HOT_K), np.uint32),
                     np.zeros((1, w), np.uint32))
        self.cold_reader.lookup(keys)
        self.stats.latency["hot"] = type(self.stats.latency["hot"])()  # not a real request

    def _adopt_published(self) -> None:
        """Serve at once, before any rebuild (``HotCycle.adopt``: the generation in shared
        memory, else the image on disk, else an empty one); a rebuild follows when what is
        served is behind the table."""
        if self.hotcycle.adopt(self._early_image):
            self.maint.request_rebuild()

    def _hot_served(self, reader: HotReader) -> None:
        """The hot cycle mapped a generation: draft from it.  The warm cache starts over, since
        its entries may now be hot (or stale)."""
        self._hot = reader.slots
        self._pruned, self._pruned_nprobe = reader.pruned
        with self._warm_lock:
            self._warm[:] = 0
            self._warm_used = 0

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
        maybe = self.cold_reader.may_exist(c_key)
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
            m = cold_candidates(tokens, offsets, d.tokens, d.orders, d.lengths, self.n_min,
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
        if fut.cancelled():  # close() drops queued warm-ups (shutdown(cancel_futures=True))
            return
        if fut.exception() is not None and not self._closed:
            log.warning("background cold read failed: %s", fut.exception())

    def _cold_lookup(self, orders, keys):
        """Cold reads of ``keys`` (timed, counted per order)."""
        t0 = time.perf_counter()
        res = self.cold_reader.lookup(keys)
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
                kk = int((res.tok[i] != EMPTY_TOKEN).sum())
                ok = warm_insert(self._warm, self.max_probe, np.uint64(keys[i]),
                                 int(orders[i]), res.tok[i, :kk], res.cnt[i, :kk],
                                 int(res.total[i]))
            else:
                ok = warm_insert(self._warm, self.max_probe, np.uint64(keys[i]),
                                 int(orders[i]), empty, empty, 0)
            self._warm_used += 1
            if not ok:
                self._warm[:] = 0
                self._warm_used = 0

    def _count_draft(self, tokens, offsets, out) -> None:
        L = out.lengths
        if not L.any():
            return
        tally_drafts(out.tiers, out.orders, L, self.stats.drafted)
        keys = np.empty(int(L.sum()), np.uint64)
        m = draft_keys(tokens, offsets, out.tokens, out.orders, L, self.n_max, keys)
        self.hits.add(keys[:m])


def write_table_image(cold, config: TableConfig) -> dict | None:
    """Rank a stopped table and write its hot image (``ngramd warm``): the first start then
    serves a full hot tier at once.  None when the table has nothing hot."""
    sel = rank_table(cold, config, HotBuilder(), HotSizing.from_config(config.hot_budget_mb),
                     lambda keys: np.zeros(keys.shape[0], np.float64))
    slots, _, redundant = sel
    if not np.count_nonzero(slots[:, 0] | slots[:, 1]):
        return None
    words, nprobe = pruned_filter(redundant)
    return write_image(image_path(cold.path), table_identity_of(config), slots,
                       config.hot_max_probe, cold.applied_seq(), words, nprobe, stored_rows(cold))


def _warm_background(ident: TableIdentity) -> None:
    """Run every kernel of counting, spills, merges, scans and hot builds once on toy data."""
    try:
        from .cold.rows import Counter as RowCounter, RowSet, merge_rowsets
        from .cold.runs import encode_pages, page_buffer
        from .hot.selection import HotSelector, build_hot

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
        pages_decode_into(pstart, buf.view(np.uint8), buf.view(np.uint32), buf,
                          np.uint64(0), np.uint64(0), False, *out, 0, 0)
        rows_copy_into(*m, 0, len(m), *out, 0, 0)
        tok3, cnt3 = m.padded(HOT_K)
        sel = HotSelector(4, 1, 0.0, ident.n_max, grow=1.1)
        sel.add(m.key, m.parent, m.order, m.total, tok3, cnt3, np.zeros(len(m)))
        build_hot(sel.rows(), 1 << 12, 1, 0.0)
        recent_add(np.zeros((64, SLOT_WORDS), np.uint32), 8, m.key, m.order, m.total,
                   m.poff, m.tok, m.cnt)
        bbloom_add(np.zeros(8, np.uint64), m.key, 3)
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

