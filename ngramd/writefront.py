"""``WriteFront``: where ingests enter a daemon's table — the durable append, the wake of the
writer, and ``flush`` (ARCHITECTURE §2.3, §5.6).

One of the three roles of ``ngramd.table.Table`` (the others: its draft path, and the hot
cycle in ``ngramd.hot.cycle``).  An ingest is acknowledged once its log records are durable
(``ColdStore.append_log``: one write, one fsync); counting happens later, on the writer thread
(``ngramd.maintenance``), so an ingest never waits for it.  The backlog between the two is the
log's: the writer stops at the delta's bounds and the log holds what it has not counted, and
``flush`` waits for the writer to catch up (or says why it cannot: a failing disk, a closing
table, its deadline).

Token batches arrive validated from the wire (``protocol.unpack_batch``): nothing here checks
them again.  Each append that fails marks the ``ingest`` fault in health; the next that works
clears it.

Backpressure (``Backlog``): the backlog between the ack and the count has three bounds, and an
ingest that arrives while any of them is passed answers ``busy`` with ``retry_ms`` (the server
asks ``Backlog.busy`` before each group commit), and nothing of it is written:

* **bytes**: what the log keeps of tokens not yet counted (``[server] backlog_mb``);
* **forecast**: the time counting needs to drain the backlog at the rate measured on this
  table (``stats.CountingRate``, reported by the writer), at most ``backlog_s``;
* **age**: the oldest record not yet counted, at most ``backlog_s`` old: the backstop for a
  rate that was wrong.

Why a forecast: the age is a lagging signal.  Issue 53: 4 clients flooding sequences of
2,000 random ids for 90 s had 12,617 batches acknowledged and no ``busy`` (bounds 4 GiB and
120 s of age), while counting ran at ~10 records/s: a 494k-record backlog, ~14 h of counting.
The decision is taken on the backlog as it stands, before the ingest is written: a table with
no backlog forecasts 0 s and never refuses, whatever its rate and the ingest's size.  The
overshoot is one group commit of the ingest thread (at most ``[server] max_tokens``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .health import Health
from .maintenance import Maintenance
from .stats import TableStats
from .wire.errors import TIMEOUT, NgramError, StorageError

#: the backlog's bounds, in the order they are checked, as ``stats`` counts the ``busy`` answers
BOUNDS = ("bytes", "forecast", "age")
#: ``retry_ms`` of a forecast ``busy``: the time the excess takes to count, within these (ms)
RETRY_MIN_MS, RETRY_MAX_MS = 100, 5000


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
        (``stats.CountingRate``); ``now``: monotonic s."""
        return self.maint.rate.rates(now)

    def log_lag(self) -> tuple[int, float]:
        """(records, seconds) the writer lags the log (``Health.log_lag``)."""
        return self.faults.log_lag()


@dataclass(frozen=True)
class Backlog:
    """The ingest log's backlog against its bounds, at one moment."""

    records: int  # acknowledged, not yet counted
    bytes: int  # of tokens, acknowledged by this process and not yet counted
    age_s: float  # of the oldest of them
    limit_bytes: int  # [server] backlog_mb
    limit_s: float  # [server] backlog_s: the forecast's bound and the age's
    records_s: float  # the counting rate (stats.CountingRate)
    bytes_s: float

    @property
    def forecast_s(self) -> float:
        """Seconds counting needs to drain the backlog at the measured rate: the longer of the
        records' and the bytes' forecasts (a backlog of many short records costs more per
        token than the steps measured, one of long records more per record); 0 without a
        backlog."""
        if self.records <= 0 and self.bytes <= 0:
            return 0.0
        return max(self.records / self.records_s, self.bytes / self.bytes_s)

    def busy(self) -> tuple[str, str, int] | None:
        """``(bound, message, retry_ms)`` while a bound is passed, else None.  The hint: the
        bytes bound waits for a spill (a second or so); the forecast for the excess to count
        (100 ms to 5 s); the age a tenth of ``limit_s`` (at most 5 s)."""
        if self.bytes > self.limit_bytes:
            return ("bytes", f"ingest log backlog {self.bytes >> 20} MiB over its bound "
                             f"{self.limit_bytes >> 20} MiB; resend with the same key", 1000)
        forecast = self.forecast_s
        if forecast > self.limit_s:
            retry = (forecast - self.limit_s) * 1000
            return ("forecast", f"ingest log backlog of {self.records} records takes "
                                f"{forecast:.0f} s to count at {self.records_s:.1f} records/s, "
                                f"over its bound {self.limit_s:g} s; resend with the same key",
                    int(min(max(retry, RETRY_MIN_MS), RETRY_MAX_MS)))
        if self.age_s > self.limit_s:
            return ("age", f"ingest log backlog {self.age_s:.0f} s of counting over its bound "
                           f"{self.limit_s:g} s; resend with the same key",
                    int(min(self.limit_s / 10, 5.0) * 1000))
        return None

    def as_dict(self) -> dict:
        """``stats``' ``server.backlog`` (``lag_s`` is the age, as before the forecast)."""
        return {"records": self.records, "bytes": self.bytes, "limit_bytes": self.limit_bytes,
                "lag_s": round(self.age_s, 3), "limit_s": self.limit_s,
                "forecast_s": round(self.forecast_s, 3),
                "rate_records_s": round(self.records_s, 3),
                "rate_bytes_s": round(self.bytes_s, 1)}
