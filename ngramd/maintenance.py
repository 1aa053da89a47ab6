"""A table's maintenance threads: the writer, the spiller, the merger and the rebuilder
(ARCHITECTURE §2.4).

* the *writer* counts the ingest log into the cold tier's delta and the recent table;
* the *spiller* merges the delta's parts in RAM and writes the delta as runs (on size, age and
  idle ingest, and never while the merger lags: the log holds that backlog);
* the *merger* merges runs and gives back the disk space of the runs it replaced;
* the *rebuilder* runs the table's hot rebuilds when asked (``rebuild_req``) or when the
  table's ``rebuild_pays`` says a scheduled one is due (every ``hot_rebuild_s``).

All four run at the serving thread's CPU priority, not niced: a niced thread that holds the
GIL (a numpy call, an SST ``finish``) and is preempted keeps it until the scheduler runs it
again, which on a busy host is a small share of a core, so every thread of the daemon waits on
it (ARCHITECTURE §2.4).  What keeps background work from crowding the serving thread is its own
bounds: the rebuild's CPU-share budget, the writer's step size.  A rebuild of a *starved* hot
tier (empty, or built from less than half of the table: a start without shared memory or an
image) is free of the CPU-share budget, and merges wait for it: under the budget a big table's
first rebuild beside busy processes took minutes (ARCHITECTURE §4.3).  A part that fails marks its
fault in the table's ``Health`` and retries on its own; spills and merges reopen RocksDB
first, since it stays read-only after a failed write.

The hot tier a rebuild builds is the table's hot cycle (``ngramd.hot.cycle.HotCycle``); the
rebuilder reaches it through one narrow interface, ``HotWork``, and nothing else of the
table.  The table's parts reach these threads through the public methods below: ``appended``
and ``wait_counted`` (the write front), ``request_rebuild``, ``spill``, ``state`` (stats) and
``rate``, the writer's counting rate (``stats.CountingRate``: the ``busy`` forecast).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from .config import TableConfig
from .health import Health
from .stats import CountingRate
from .wire.errors import TIMEOUT, UNAVAILABLE, NgramError, StorageError

log = logging.getLogger("ngramd.table")

#: delta parts (one per writer step) past which the spill thread merges them in RAM
#: (``ColdStore.compact_delta``); a read searches each part (~0.2 µs a key)
DELTA_PARTS = 16
#: parts at which the writer waits for the spill thread (which merges or spills them)
MAX_DELTA_PARTS = 256
#: how often the spill thread looks at the delta when nothing wakes it (s)
SPILL_CHECK_S = 0.25


class HotWork(Protocol):
    """What the rebuilder asks of the hot tier (``hot.cycle.HotCycle``)."""

    #: the hot generation served now
    generation: int

    def rebuild(self, stop: threading.Event, why: str | None) -> None:
        """Rank and publish on the calling thread (raises on failure; ``stop``: give up)."""

    def rebuild_pays(self) -> str | None:
        """Why a scheduled rebuild runs now, or None."""

    def starved(self) -> bool:
        """True while the tier is empty or far behind the table: its rebuild goes first."""


class Maintenance:
    """The four background threads of one table and what they share: the events that wake
    them, what runs now (``busy``), the writer's last error and the clocks the spiller
    decides by.  ``start`` starts them; ``signal_stop`` and ``join`` stop them."""

    def __init__(self, config: TableConfig, cold, recent, stats, faults: Health,
                 hot: HotWork):
        self.config = config
        self.cold = cold
        self.recent = recent
        self.stats = stats
        self.faults = faults
        self.hot = hot
        #: set while a starved tier's rebuild runs: the merger starts no merge meanwhile
        self.urgent = threading.Event()
        self._wake = threading.Condition()  # the writer: an append arrived
        self._applied_cv = threading.Condition()  # a writer step ended (flush waits on it)
        # the log seq through which counting is done *and* its figures are in (``_counted``):
        # flush waits for this, not for the cold tier's counted seq, which a step advances
        # before the stats see its tokens (a flush answered, then ``stats`` lagged it)
        self._done_seq = cold.counted_seq()
        self._spill_wake = threading.Event()  # the spill thread
        self._runs_wake = threading.Event()  # the merge thread
        self._rebuild_req = threading.Event()
        self.stop = threading.Event()
        self.writer_error: BaseException | None = None
        self.busy = {"spill": False, "merge": False, "rebuild": False}  # what runs now
        self.last_ingest = time.monotonic()
        self.delta_since = 0.0  # monotonic time rows last entered an empty delta (0: empty)
        self.writer_waits = False  # the writer waits for the spill thread (bounded RAM)
        self.changed = time.monotonic()  # last time the counts changed (rebuild trigger)
        self.threads: list[threading.Thread] = []
        #: what the writer counts per second (the ``busy`` forecast's rate)
        self.rate = CountingRate()

    def start(self, also: list | None = None) -> None:
        """Start the threads, and ``also`` ((target, name) pairs: the table's health probes),
        which end when ``stop`` is set (``self.threads`` holds those started, should one
        fail; ``join`` joins them all)."""
        for target, name in ((self._writer_loop, "ngramd-writer"),
                             (self._spill_loop, "ngramd-spill"),
                             (self._merger_loop, "ngramd-merger"),
                             (self._rebuild_loop, "ngramd-hot"), *(also or ())):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self.threads.append(t)

    def signal_stop(self) -> None:
        """Ask every thread to stop, and wake whoever waits on them."""
        self.stop.set()
        with self._wake:
            self._wake.notify_all()
        with self._applied_cv:
            self._applied_cv.notify_all()
        self._spill_wake.set()
        self._runs_wake.set()
        self._rebuild_req.set()

    def join(self, timeout_s: float) -> list[str]:
        """Join the threads, ``timeout_s`` in all; returns the names of those still alive."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.01))
        return [t.name for t in self.threads if t.is_alive()]

    # ------------------------------------------------------------------ for the table's parts
    def request_rebuild(self) -> None:
        """Ask the rebuilder for a hot rebuild now (whatever ``rebuild_pays`` says)."""
        self._rebuild_req.set()

    def appended(self, now: float) -> None:
        """An ingest is durable in the log (at monotonic time ``now``): wake the writer; the
        spiller's idle clock starts over."""
        self.last_ingest = now
        with self._wake:
            self._wake.notify()

    def wait_counted(self, target: int, timeout_s: float,
                     abort: threading.Event | None = None) -> None:
        """Wake the writer and wait until the log is counted up to ``target`` (``flush``).
        Raises ``storage`` (with the reason) as soon as counting fails or waits behind a
        failing spill (a full disk: the log holds the backlog), ``unavailable`` when the
        threads stop or ``abort`` is set, ``timeout`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            self._wake.notify()
        with self._applied_cv:
            while self._done_seq < target:
                if self.writer_error is not None:
                    raise self.writer_error
                spill = self.faults.failing("spill")
                if spill is not None and self.writer_waits:
                    raise StorageError(f"counting waits for a spill that fails ({spill[0]}); "
                                       f"the ingest log keeps the backlog")
                if self.stop.is_set() or (abort is not None and abort.is_set()):
                    raise NgramError("table is closing", UNAVAILABLE)
                left = deadline - time.monotonic()
                if left <= 0:
                    n, lag_s = self.faults.log_lag()
                    raise NgramError(f"ingest log not counted within {timeout_s:g} s (log lag "
                                     f"{n} records / {lag_s:.1f} s)", TIMEOUT)
                self._applied_cv.wait(min(left, 0.1))

    def state(self) -> dict:
        """What the threads show in ``stats``: the writer's error, what runs now."""
        return {"writer_error": str(self.writer_error) if self.writer_error else None,
                "activity": dict(self.busy)}

    def spill(self):
        """``cold.spill()`` for the spill thread and ``flush``.  After a failed spill, RocksDB is
        made writable again first (it stays read-only after a failed write); a failure marks
        the ``spill`` fault and wakes the spill thread to retry, a success clears it."""
        started = time.monotonic()
        try:
            if self.faults.failing("spill"):
                self.cold.reopen()
            run = self.cold.spill()
        except BaseException as e:
            self.faults.fault("spill", e)
            self._spill_wake.set()
            raise
        # rows counted while it ran stay in the delta: their age counts from its start
        self.delta_since = started if self.cold.delta_rows() else 0.0
        self.faults.clear("spill")
        return run

    def _writer_loop(self) -> None:
        """The single writer: counts the ingest log into the delta and the recent table.
        It waits only while the delta is over its bounds (twice ``delta_mb``, or
        ``MAX_DELTA_PARTS`` parts), and then it has woken the spill thread, whose checks
        (``_spill_due``) hold for exactly these bounds: a wait always has a spill or a merge
        of parts scheduled to end it, or a failing spill shown in health."""
        cfg = self.config
        limit = 2 * (cfg.cold.delta_mb << 20)
        while not self.stop.is_set():
            self.rate.working(time.monotonic())
            if self.cold.delta_bytes() > limit or self.cold.delta_parts() > MAX_DELTA_PARTS:
                # spills lag: let the durable log hold the backlog (bounded RAM)
                self.writer_waits = True
                self._spill_wake.set()
                self.stop.wait(0.05)
                continue
            self.writer_waits = False
            try:
                res = self.cold.apply(cfg.apply_batch_tokens)
            except BaseException as e:  # keep serving reads; report through flush()/stats
                if self.stop.is_set():
                    break
                if self.writer_error is None or str(e) != str(self.writer_error):
                    log.error("counting the ingest log failed: %s", e)
                self.writer_error = e
                self.faults.fault("counting", e)
                self.stop.wait(1.0)
                continue
            self.writer_error = None
            self.faults.clear("counting")
            if res is not None:
                self.rate.counted(res.last_seq - res.first_seq + 1, 4 * res.tokens,
                                  time.monotonic())
                self._counted(res)
                continue
            self.rate.idle()
            with self._applied_cv:
                self._done_seq = max(self._done_seq, self.cold.counted_seq())
                self._applied_cv.notify_all()
            with self._wake:
                if self.cold.counted_seq() >= self.cold.last_seq():
                    self._wake.wait(0.2)

    def _counted(self, res) -> None:
        """After a writer step: the recent table, the figures, the spill thread's clocks."""
        cfg = self.config
        r = res.rows
        # freshness matters when the log is keeping up; under a bulk backlog (a full batch
        # with more waiting) the recent table would only churn epochs: the rows reach readers
        # through the next hot generation and the daemon's cold reads
        backlog = (res.tokens >= cfg.apply_batch_tokens
                   and self.cold.last_seq() > res.last_seq)
        if backlog:
            self.stats.recent_skipped_tokens += res.tokens
        else:
            self.recent.add(r.key, r.order, r.total, r.poff, r.tok, r.cnt)
        self.stats.add_ingested(res.tokens)
        self.changed = time.monotonic()
        if not self.delta_since and len(r):
            self.delta_since = self.changed
        if self.cold.delta_bytes() >= cfg.cold.delta_mb << 20 \
                or self.cold.delta_parts() > DELTA_PARTS:
            self._spill_wake.set()
        with self._applied_cv:
            self._done_seq = max(self._done_seq, res.last_seq)
            self._applied_cv.notify_all()

    def _spill_due(self) -> str | None:
        """Why the delta should be written as a run now (None: not yet): it is full
        (``delta_mb``), it has held rows for ``spill_age_s``, ingest has been idle for
        ``spill_idle_s``, or a failed spill waits for its retry."""
        cfg = self.config
        if self.faults.failing("spill"):
            return "retry"  # even with nothing left to spill: RocksDB is made writable again
        if not self.cold.delta_rows() or self._merge_debt():
            return None
        now = time.monotonic()
        if self.cold.delta_bytes() >= cfg.cold.delta_mb << 20:
            return "full"
        if self.delta_since and now - self.delta_since >= cfg.spill_age_s:
            return "age"
        if now - self.last_ingest >= cfg.spill_idle_s:
            return "idle"
        return None

    def _merge_debt(self) -> bool:
        """True while the merger lags the spills by more than ``max_runs`` runs: then no
        spill is due, so the writer stops at its bound and the ingest log holds the backlog
        (4 bytes a token, far less than unmerged runs of repeated text hold: spills that outran
        merges filled the disk, ARCHITECTURE §5.6).  ``flush`` and ``close`` still spill."""
        return len(self.cold.reader.run_list()) >= 2 * self.config.cold.max_runs

    def _spill_loop(self) -> None:
        """Writes the delta as a run when ``_spill_due`` says so, and merges its parts in RAM
        when there are more than ``DELTA_PARTS`` (or writes them, when merging would need more
        than an eighth of ``delta_mb`` of RAM beside them).  Its own thread: a spill never
        waits behind a long merge (when it did, the delta filled, the writer paused and
        freshness stalled for the length of the merge)."""
        while not self.stop.is_set():
            self._spill_wake.wait(SPILL_CHECK_S)
            self._spill_wake.clear()
            if self.stop.is_set():
                break
            try:
                if self._spill_due() is not None:
                    self.busy["spill"] = True
                    if self.spill() is not None:
                        self._runs_wake.set()
                elif self.cold.delta_parts() > DELTA_PARTS:
                    self.busy["spill"] = True
                    # merged in RAM while that costs at most an eighth of delta_mb more;
                    # bigger parts go to disk (a spill needs no copy of the delta)
                    if not self.cold.compact_delta(DELTA_PARTS,
                                                   (self.config.cold.delta_mb << 20) // 8) \
                            and not self._merge_debt():
                        if self.spill() is not None:
                            self._runs_wake.set()
            except BaseException:
                if self.stop.is_set():
                    break
                self.stop.wait(2.0)  # _spill marked the fault and asked for a retry
            finally:
                self.busy["spill"] = False

    def _merger_loop(self) -> None:
        """Merges runs by the cold tier's size-tier policy (and deletes retired ones)."""
        while not self.stop.is_set():
            self._runs_wake.wait(5.0)
            self._runs_wake.clear()
            if self.stop.is_set():
                break
            while self.urgent.is_set() and not self.stop.is_set():
                self.stop.wait(0.2)  # a starved hot tier's rebuild goes first
            try:
                # after a failed merge, RocksDB first (a probe write when it is fine): a reopen
                # that failed while the disk still did leaves no handle, and only a reopen ends
                # that -- the merge fault stayed set for minutes when nothing was to merge
                if self.faults.failing("merge"):
                    self.cold.reopen()
                self.busy["merge"] = self.cold.runs.pick() is not None
                while not self.stop.is_set() and not self.urgent.is_set() \
                        and self.cold.maybe_merge() is not None:
                    # a merge worked: its fault is over now, not when merging stops (under a
                    # steady ingest on a busy host that was minutes: health stayed degraded)
                    self.faults.clear("merge")
                    self.busy["merge"] = self.cold.runs.pick() is not None
                self.faults.clear("merge")
            except BaseException as e:
                if self.stop.is_set():
                    break
                self.faults.fault("merge", e)
                self._runs_wake.set()  # retry after a pause
                self.stop.wait(5.0)
            finally:
                self.busy["merge"] = False

    def _rebuild_loop(self) -> None:
        """Waits for a rebuild request or a scheduled one that pays (``rebuild_pays``) and runs
        it (``_run_rebuild``)."""
        period = self.config.hot_rebuild_s
        while not self.stop.is_set():
            fired = self._rebuild_req.wait(period if period > 0 else None)
            if self.stop.is_set():
                break
            self._rebuild_req.clear()
            why = None if fired else self.hot.rebuild_pays()
            if not fired and why is None:
                continue
            self._run_rebuild(why)

    def _run_rebuild(self, why: str | None) -> None:
        """One rebuild; a starved hot tier's goes first (the merger waits for ``urgent``) and
        skips the CPU-share budget.  The hot cycle keeps its failure for ``rebuild_hot`` and
        charges its CPU time to its budget; health shows it."""
        urgent = bool(self.hot.starved())
        if urgent:
            self.urgent.set()
            log.info("hot tier starved: rebuilding ahead of merges, free of the CPU budget")
        self.busy["rebuild"] = True
        try:
            self.hot.rebuild(self.stop, "starved" if urgent else why)
        except Exception as e:
            log.exception("hot rebuild failed; keeping generation %d", self.hot.generation)
            self.faults.fault("hot rebuild", e)
        finally:
            self.urgent.clear()
            self.busy["rebuild"] = False
