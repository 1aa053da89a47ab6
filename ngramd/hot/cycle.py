"""``HotCycle``: the hot tier's life in the daemon — rank the table, publish a generation, keep
its image on disk, and say how urgent the next rebuild is (ARCHITECTURE §4.3, §4.8).

One of the three roles of ``ngramd.table.Table`` (the others: its draft path, and the write
front in ``ngramd.writefront``).  What it owns:

* the generation served now: where it came from (``source``: ``shm`` a restart found it,
  ``image`` the table's image on disk, ``rebuild`` ranked by this daemon, ``empty``), the log
  seq it was built from (``applied``) and the rows the table held then;
* rebuilds: ``rebuild`` ranks the whole table (a streaming scan in bounded memory,
  ``rank_table``) and publishes; ``rebuild_pays`` says when a scheduled one is worth its CPU
  (``selection.RebuildBudget``); ``starved`` when the tier is empty or built from less than half
  of the table, which makes its rebuild the most urgent background work;
* the image on disk (``ngramd.hot.image``): written after each rebuild on the rebuilder's
  thread, read at a start with empty shared memory (``hot.image.publish_image``, before
  numba and RocksDB load);
* the waiters of ``rebuild_hot``: a generation newer than the one they saw, or the failure.

The rebuilder thread (``ngramd.maintenance``) calls ``rebuild``, ``rebuild_pays``, ``starved``
and ``generation`` — the ``maintenance.HotWork`` protocol — and nothing else.  The draft path
learns of each generation it should draft from through ``served`` (its slots and pruned
filter), once, when it is mapped.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..kernels import EMPTY_SLOTS
from ..wire.constants import HOT_K, SLOT_WORDS
from ..config import TableConfig
from ..health import Health
from .image import image_path, publish_image, write_image
from .selection import (HitCounts, HotBuilder, HotSelector, HotSizing, RebuildBudget,
                        choose_capacity, pruned_filter)
from .segments import HotPublisher
from .shm import HotReader
from ..cold.rows import slice_rows
from ..wire.errors import TIMEOUT, UNAVAILABLE, BadInput, NgramError
from ..wire.identity import TableIdentity

log = logging.getLogger("ngramd.table")

#: rows past which a table serving from an empty hot tier is ``degraded`` (``HotCycle.health``)
HOT_EMPTY_ROWS = 1_000_000


class HotCycle:
    """The hot tier of one daemon's table: rebuilds, publication, the image on disk."""

    #: a scheduled rebuild waits while counting lags the log by more than this (s): a bulk
    #: ingest is counted first, then ranked once
    REBUILD_LAG_S = 5.0

    def __init__(self, config: TableConfig, identity: TableIdentity, publisher: HotPublisher,
                 cold, hits: HitCounts, faults: Health,
                 served: Callable[[HotReader], None]):
        self.config = config
        self.identity = identity
        self.publisher = publisher
        self.cold = cold
        self.hits = hits  # decayed hits of keys drafted from: they rank the next generation
        self.faults = faults
        self._served = served  # the draft path: draft from this reader's slots from now on
        self.max_probe = config.hot_max_probe
        self.image_path = image_path(Path(config.data_dir) / config.name)
        self.builder = HotBuilder()
        self.sizing = HotSizing.from_config(config.hot_budget_mb)
        self.rebuild_budget = RebuildBudget(config.hot_rebuild_cpu, time.monotonic())
        self.reader: HotReader | None = None  # the generation served now (read-only map)
        self.generation = publisher.generation
        self.applied = -1  # counted seq the current generation was built from
        self.source = "empty"
        self.info: dict = {}  # what its build said (sizes, sizing, build_s)
        self.image: dict = {}  # the image on disk: last written, loaded or refused
        self._rows_at_build = 0  # stored_rows() when the current generation was built
        self._backlog_seen = False  # counting lagged the log since (a bulk ingest)
        self._done = threading.Condition()  # a generation published, or a rebuild failed
        self.failed: BaseException | None = None  # the last failure, and how many
        self.failures = 0
        self._closed = False

    # ------------------------------------------------------------------ what the rebuilder asks
    def rebuild(self, stop: threading.Event, why: str | None) -> None:
        """Rank the whole table and publish what is hot, on the calling (build) thread; its
        CPU time is charged to the budget as ``why``.  A failure is kept for ``rebuild_hot``
        (and raised: the rebuilder logs it and marks the fault)."""
        cpu0 = time.thread_time()
        try:
            self._rebuild(stop)
        except Exception as e:
            with self._done:
                self.failed = e
                self.failures += 1
                self._done.notify_all()
            raise
        finally:
            self.rebuild_budget.charge(time.thread_time() - cpu0, time.monotonic(), why)

    def rebuild_pays(self) -> str | None:
        """Why a scheduled rebuild runs now, or None: something changed (counts, or enough new
        hits: a full rebuild for a handful of hits cost ~60 CPU-s on an 89M-row table, idle
        is free), counting keeps up, and the CPU budget allows it (``RebuildBudget``: paid
        off, or a catch-up of a tier built from less than half of the table)."""
        if self.applied == self.cold.counted_seq() \
                and self.hits.pending < self.config.hot_rebuild_hits:
            return None
        if self.faults.log_lag()[1] > self.REBUILD_LAG_S:
            self._backlog_seen = True
            return None
        if self.starved():
            return "starved"  # the tier is empty or far behind: no CPU-share throttle
        catch_up = self._backlog_seen and self.stored_rows() >= 2 * self._rows_at_build
        return self.rebuild_budget.allows(time.monotonic(), catch_up)

    def starved(self) -> bool:
        """True while the served hot tier is empty though the table is not, or reflects less
        than half of the table's rows: then its rebuild is the most urgent background work (no
        CPU-share throttle, merges wait: ``Maintenance``)."""
        rows = self.stored_rows()
        if not rows or self.reader is None:
            return False
        if self.source == "rebuild" and self.applied == self.cold.counted_seq():
            return False  # ranked from everything counted: a rebuild would find the same
        return not self.reader.header["entries"] or rows >= 2 * self._rows_at_build

    def stored_rows(self) -> int:
        """Rows in runs and the delta (a key in several runs counts once per run): cheap, and
        what tells a rebuild that the table has grown since the last one."""
        return stored_rows(self.cold)

    def _rebuild(self, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        counted = self.cold.counted_seq()
        rows_now = self.stored_rows()
        self.hits.merge(self.config.hit_decay)
        ranked = rank_table(self.cold, self.config, self.builder, self.sizing,
                            self.hits.lookup, stop)
        if ranked is None:
            return
        slots, info, redundant = ranked
        words, nprobe = pruned_filter(redundant)
        del redundant
        self._serve(slots, words, nprobe, info, counted, t0, source="rebuild")
        self._rows_at_build = rows_now
        self._backlog_seen = False
        if self.reader.header["entries"]:  # an empty tier is not worth a restart's read
            self._write_image(counted, rows_now)

    # ------------------------------------------------------------------ publication
    def _serve(self, slots, words, nprobe, info, counted, t0=None, source="empty") -> None:
        """Publish ``slots`` (and its pruned filter) as the next generation and draft from it."""
        gen = self.publisher.publish(slots, self.max_probe, counted, words, nprobe)
        del slots, words  # the daemon drafts from the shared mapping, not a second copy
        self._map()
        self.applied = counted
        self.source = source
        self.info = dict(info, build_s=round(time.perf_counter() - t0, 3) if t0 else 0.0)
        with self._done:
            self.generation = gen
            self.failed = None  # stats show the current state; the count stays
            self._done.notify_all()
        self.faults.clear("hot rebuild")
        if info:
            log.info("hot generation %d: %s", gen, self.info)

    def _map(self) -> None:
        """Map the generation published now and hand it to the draft path."""
        if self.reader is None:
            self.reader = HotReader(self.config.shm_dir, self.config.name,
                                    identity=self.identity, warm=False)
        else:
            self.reader.refresh()
        self.generation = self.reader.generation
        self._served(self.reader)

    def adopt(self, early_image: dict | None) -> bool:
        """Serve at once: map the generation already in shared memory (a restart), else the
        table's image on disk (a reboot, a restore, ``ngramd warm``: ``early_image`` when it
        was published before RocksDB opened), else publish an empty one (a new table), so
        readers can attach before any rebuild.  Returns True when a rebuild should follow."""
        durable = max(self.cold.last_seq(), self.cold.applied_seq())
        image = early_image
        if image is None:
            if self.publisher.generation:
                try:
                    self._map()
                    if self.reader.header["applied_seq"] > durable:
                        raise NgramError(f"built at log seq {self.reader.header['applied_seq']}"
                                         f", ahead of what the table holds ({durable})")
                    if self.reader.header["entries"] or not self.image_path.exists():
                        return self._adopt_shm()
                    log.info("hot generation %d in shared memory is empty: trying the image "
                             "on disk", self.generation)
                except NgramError as e:
                    log.info("existing hot generation not usable (%s)", e)
            image = publish_image(self.publisher, self.image_path, self.identity,
                                  self.max_probe, durable)
        elif image["state"] == "loaded" and image["applied_seq"] > durable:
            reason = (f"built at log seq {image['applied_seq']}, ahead of what the table holds "
                      f"({durable}): not this table's past")
            log.warning("hot image %s refused: %s; rebuilding the hot tier", self.image_path,
                        reason)
            image = {"state": "refused", "reason": reason}
        if image is not None and image["state"] == "loaded":
            self._take_image(image, durable)
            return self.applied != self.cold.last_seq()  # counted since: recent tier, then this
        if image is not None:
            self.image = image
        words, nprobe = pruned_filter(np.zeros(0, np.uint64))
        self._serve(np.zeros((64, SLOT_WORDS), np.uint32), words, nprobe, {}, 0)
        # runs: `ngramd warm`, a restore
        return bool(self.cold.last_seq() > 0 or self.cold.reader.run_list())

    def _adopt_shm(self) -> bool:
        """Serve the generation a previous daemon left in shared memory."""
        self.applied = int(self.reader.header["applied_seq"])
        self.source = "shm"
        self._rows_at_build = self.stored_rows()  # unknown: taken as the table's
        log.info("serving hot generation %d from shared memory (built at applied seq %d); "
                 "rebuilding in the background", self.generation, self.applied)
        return self.applied != self.cold.last_seq()

    def _take_image(self, image: dict, durable: int) -> None:
        """Draft from the generation ``publish_image`` published."""
        self._map()
        self.applied = image["applied_seq"]
        self.source = "image"
        self._rows_at_build = image["table_rows"]
        self.image = image
        log.info("serving hot generation %d from the image on disk (%d entries, %.1f MiB, "
                 "applied seq %d of %d) in %.2f s", self.generation, image["entries"],
                 image["bytes"] / 2**20, image["applied_seq"], durable, image["seconds"])

    def _write_image(self, counted: int, rows: int) -> None:
        """Write the generation just published as the table's image (``ngramd.hot.image``), from
        the shared mapping, on the rebuilder's thread and outside every lock a draft takes.
        A failure costs only the next restart's head start: it is logged, never raised."""
        pruned, nprobe = self.reader.pruned
        try:
            w = write_image(self.image_path, self.identity, self.reader.slots, self.max_probe,
                            counted, pruned, nprobe, rows,
                            slot_checksum=self.reader.header["checksum"])
        except OSError as e:
            log.warning("hot image not written to %s (%s): a start with empty shared memory "
                        "will rebuild", self.image_path, e.strerror or e)
            self.image = dict(self.image, write_error=str(e))
            return
        self.image = dict(w, state="written", at=round(time.time(), 3))
        log.info("hot image written: %d entries, %.1f MiB, applied seq %d, %.2f s",
                 w["entries"], w["bytes"] / 2**20, counted, w["seconds"])

    # ------------------------------------------------------------------ waiting for a rebuild
    def mark(self) -> tuple[int, int]:
        """(generation, failures) now: what ``wait_newer`` compares against."""
        with self._done:
            return self.generation, self.failures

    def wait_newer(self, mark: tuple[int, int], timeout_s: float,
                   abort: threading.Event | None = None) -> int:
        """Wait for a generation newer than ``mark``'s and return its number.  Raises at once
        when a rebuild fails after ``mark`` (with its cause), ``unavailable`` when the table
        closes or ``abort`` is set, ``timeout`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        before, failures = mark
        with self._done:
            while True:
                if self.generation > before:
                    return self.generation
                if self.failures != failures:
                    raise NgramError(f"hot rebuild failed: {self.failed}") from self.failed
                if self._closed or (abort is not None and abort.is_set()):
                    raise NgramError("table is closing", UNAVAILABLE)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NgramError(f"hot rebuild did not finish within {timeout_s} s",
                                     TIMEOUT)
                self._done.wait(min(left, 0.5))

    def close(self) -> None:
        """The table closes: waiters of ``wait_newer`` answer ``unavailable``."""
        with self._done:
            self._closed = True
            self._done.notify_all()

    # ------------------------------------------------------------------ figures
    def state(self) -> dict:
        """Where the served hot tier came from and how far behind the table it is (stats)."""
        counted = self.cold.counted_seq()
        return {"source": self.source, "applied_seq": self.applied,
                "behind_records": max(counted - self.applied, 0),
                "entries": int(self.reader.header["entries"]) if self.reader else 0,
                "starved": self.starved(), "image": dict(self.image)}

    def stats(self) -> dict:
        """The ``hot`` section of ``stats``: the build's figures, its size and why, what
        rebuilds cost, the generation's age, and ``state``."""
        slots = self.reader.slots if self.reader is not None else EMPTY_SLOTS
        pruned = self.reader.pruned[0] if self.reader is not None else np.zeros(0, np.uint64)
        # unix time of the generation's build (its segment header), so its age survives a
        # restart that adopts it
        created = self.reader.header.get("created_ns", 0) / 1e9 if self.reader else 0.0
        return dict(self.info, generation=self.generation, counted_seq=self.applied,
                    bytes=int(slots.nbytes), slots=int(slots.shape[0]),
                    pruned_filter_bytes=int(pruned.nbytes),
                    sizing=self.info.get("sizing") or self.sizing.explain(),
                    rebuilds=self.rebuild_budget.stats(time.monotonic()),
                    created_s=created, **self.state())

    def hot_bytes(self) -> int:
        """Bytes of the generation served now (0 before one is mapped)."""
        return int(self.reader.slots.nbytes) if self.reader is not None else 0

    def health(self, state: dict) -> dict:
        """``state`` (``Health.state``) with the hot tier's condition added: empty while the
        table holds over ``HOT_EMPTY_ROWS`` rows (drafts then need the daemon's cold reads)."""
        if self.reader is not None and self.reader.header["entries"]:
            return state
        rows = self.stored_rows()
        if rows <= HOT_EMPTY_ROWS:
            return state
        msg = f"the hot tier is empty while the table holds {rows} rows (rebuilding)"
        state = dict(state, state="degraded", degraded=1,
                     faults=dict(state.get("faults", {}), **{"hot tier": msg}))
        if not state.get("reason"):
            state.update(reason=f"hot tier: {msg}", since=round(time.time(), 3))
        return state

    def hot_curve(self, tokens: np.ndarray, offsets: np.ndarray, *, max_mb: float | None,
                  points: int, prompt_tokens: int, max_len: int,
                  abort: threading.Event | None = None) -> dict:
        """The hot-size curve of this table on held-out sequences (``ngramd.hot.curve``; the
        ``hot_curve`` op): budgets halving from ``max_mb`` (default 4x, at most 8x the
        configured hot budget: the ranking holds every row the largest one places)."""
        from .curve import ReplaySettings, hot_curve

        # relative to the operator's limit, or (sized from data) to the size last chosen
        base, what = self.config.hot_budget_mb, "hot_budget_mb"
        if not base:
            base, what = max(self.hot_bytes() / 2**20, 1.0), "the hot tier's size"
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
        cfg = ReplaySettings(rules=self.config.rules, max_len=max_len, max_probe=self.max_probe)
        out = hot_curve(self.cold, reqs, sorted(set(fractions)), settings=cfg,
                        load_factor=self.builder.load_factor, hits=self.hits.lookup,
                        count_weight=self.builder.count_weight, max_rows=max_rows, stop=abort)
        out["configured_hot_budget_mb"] = self.config.hot_budget_mb
        out["hot_mb"] = round(self.hot_bytes() / 2**20, 3)
        return out


def stored_rows(cold) -> int:
    """Rows in ``cold``'s runs and delta (a key in several runs counts once per run)."""
    return sum(r.rows for r in cold.reader.run_list()) + cold.delta_rows()


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
    for rows in cold.reader.scan_rows(stop):
        # 64k rows at a time: each numpy call on them holds the GIL for ~10 ms at most
        for a in range(0, len(rows), 1 << 16):
            part = slice_rows(rows, a, min(a + (1 << 16), len(rows)))
            tok, cnt = part.padded(HOT_K)
            sel.add(part.key, part.parent, part.order, part.total, tok, cnt,
                    hits(part.key))
    if stop is not None and stop.is_set():
        return None
    slots, info, redundant = sel.build(budget, config.hot_max_probe, builder.load_factor,
                                       builder.min_capacity)
    info.update(scanned=sel.seen, sizing=sizing.explain(info, sel.complete))
    return slots, info, redundant

