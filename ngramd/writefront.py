"""``WriteFront``: where ingests enter a daemon's table — the durable append, the wake of the
writer, and ``flush`` (ARCHITECTURE §2.3, §5.6).

One of the three roles of ``ngramd.table.Table`` (the others: its draft path, and the hot
cycle in ``ngramd.hotcycle``).  An ingest is acknowledged once its log records are durable
(``ColdStore.append_log``: one write, one fsync); counting happens later, on the writer thread
(``ngramd.maintenance``), so an ingest never waits for it.  The backlog between the two is the
log's: the writer stops at the delta's bounds and the log holds what it has not counted, and
``flush`` waits for the writer to catch up (or says why it cannot: a failing disk, a closing
table, its deadline).

Token batches arrive validated from the wire (``protocol.unpack_batch``): nothing here checks
them again.  Each append that fails marks the ``ingest`` fault in health; the next that works
clears it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from .health import Health
from .maintenance import Maintenance
from .stats import TableStats
from .wire.errors import TIMEOUT, NgramError, StorageError


class WriteFront:
    """Ingest and flush for one table (thread-safe: the log serialises appends)."""

    def __init__(self, cold, maint: Maintenance, faults: Health, stats: TableStats):
        self.cold = cold
        self.maint = maint
        self.faults = faults
        self.stats = stats
        #: called after every durable append (local or remote): the fleet's publisher waits on it
        self.on_append: Callable[[], None] | None = None

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
            self.faults.fault("ingest", e)
            raise e from None
        except StorageError as e:
            self.faults.fault("ingest", e)
            raise
        finally:
            self.faults.ingest_since = 0.0
        self.faults.clear("ingest")
        self.stats.latency["ingest"].add((time.perf_counter() - t0) * 1e6)
        now = time.monotonic()
        self.faults.appended(seqs[1], now)
        self.maint.appended(now)
        if self.on_append is not None:
            self.on_append()
        return seqs

    def records_per_sequence(self, offsets: np.ndarray) -> np.ndarray:
        """Log records each sequence of an ingest becomes (long ones are split)."""
        return self.cold.split_counts(np.diff(offsets))

    def flush(self, timeout_s: float = 600.0, abort: threading.Event | None = None) -> int:
        """Wait until everything in the log is counted, then make it durable in a run; returns
        the applied seq.  Always answers within ``timeout_s``: ``storage`` (with the reason)
        as soon as counting fails or waits behind a failing spill (a full disk: the log holds
        the backlog), ``timeout`` at the deadline, ``unavailable`` when the table closes or
        ``abort`` is set (a daemon that stops)."""
        deadline = time.monotonic() + timeout_s
        self.maint.wait_counted(self.cold.last_seq(), timeout_s, abort)
        if time.monotonic() >= deadline:
            raise NgramError(f"ingest log counted but not written within {timeout_s:g} s",
                             TIMEOUT)
        self.maint.spill()
        return self.cold.applied_seq()

    def counting_rate(self, now: float) -> tuple[float, float]:
        """(records/s, bytes/s) the writer counts the log at, measured over its recent work
        (``backpressure.CountingRate``); ``now``: monotonic s."""
        return self.maint.rate.rates(now)

    def log_lag(self) -> tuple[int, float]:
        """(records, seconds) the writer lags the log (``Health.log_lag``)."""
        return self.faults.log_lag()
