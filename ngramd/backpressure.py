"""Backpressure: when an ingest answers ``busy`` (ARCHITECTURE §5.6, §6.4).

An ingest is acknowledged once it is durable in the log; counting follows on the writer
thread.  The backlog between the two has three bounds, and an ingest that arrives while any
of them is passed answers ``busy`` with ``retry_ms``, and nothing of it is written:

* **bytes**: what the log keeps of tokens not yet counted (``[server] backlog_mb``);
* **forecast**: the time counting needs to drain the backlog at the rate measured on this
  table (``CountingRate``), at most ``backlog_s``;
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

import math
import threading
from dataclasses import dataclass

#: bounds, in the order they are checked, as ``stats`` counts the ``busy`` answers
BOUNDS = ("bytes", "forecast", "age")
#: ``retry_ms`` of a forecast ``busy``: the time the excess takes to count, within these (ms)
RETRY_MIN_MS, RETRY_MAX_MS = 100, 5000


class CountingRate:
    """Records/s and bytes/s the writer counts the ingest log at, over its recent work
    (thread-safe: the writer reports, the ingest thread and ``stats`` read).

    The writer reports each step (``counted``), the start of work (``working``) and a log
    counted through (``idle``).  Time spent idle is not work and is left out; time spent
    waiting for a spill (the delta at its bound) is work, since the backlog waits with it.

    Each step is a sample weighted by its length, capped at ``TAU_S`` (a long stall does not
    outweigh what follows it), in a mean that decays with time constant ``TAU_S`` of work.
    Before any measurement the prior holds; the first step replaces it.  A step that runs
    past twice the usual length counts meanwhile as work without progress: a counter stuck in
    one step lowers the rate while it is stuck, not only once the step ends."""

    #: time constant of the mean, in seconds of counting work
    TAU_S = 10.0
    #: the rates before the first step is measured (the first replaces them): one writer
    #: step a second, 64k tokens in records of ~1k tokens.  Real text counts several times
    #: faster (~1-2 µs a token), random ids on a big table ~3x slower (issue 53: ~20k
    #: tokens/s); a prior too high lets a flood on a fresh daemon in until the first step ends
    PRIOR_RECORDS_S = 50.0
    PRIOR_BYTES_S = float(256 << 10)
    PRIOR_STEP_S = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        self._records = self.PRIOR_RECORDS_S  # decayed sums over work (the prior: 1 s of it)
        self._bytes = self.PRIOR_BYTES_S
        self._secs = 1.0
        self._step_s = self.PRIOR_STEP_S  # the usual step's length (a moving average)
        self._since: float | None = None  # monotonic start of the step in progress
        self.steps = 0  # steps measured

    def working(self, now: float) -> None:
        """The writer is at work from ``now`` (monotonic s), unless it already was."""
        with self._lock:
            if self._since is None:
                self._since = now

    def idle(self) -> None:
        """The writer found the log counted through: it waits, and that is not work."""
        with self._lock:
            self._since = None

    def counted(self, records: int, nbytes: int, now: float) -> None:
        """A step ended at ``now``, counting ``records`` log records of ``nbytes`` bytes."""
        with self._lock:
            dt = max(now - (self._since if self._since is not None else now), 1e-6)
            w = min(dt, self.TAU_S)
            k, share = math.exp(-w / self.TAU_S) if self.steps else 0.0, w / dt
            self._records = self._records * k + records * share
            self._bytes = self._bytes * k + nbytes * share
            self._secs = self._secs * k + w
            self._step_s += (0.2 if self.steps else 1.0) * (dt - self._step_s)
            self._since = now
            self.steps += 1

    def rates(self, now: float) -> tuple[float, float]:
        """(records/s, bytes/s) at monotonic time ``now``; never 0."""
        with self._lock:
            r, b, s = self._records, self._bytes, self._secs
            stuck = now - self._since - 2 * self._step_s if self._since is not None else 0.0
        if stuck > 0:  # no news from the step in progress: work without progress so far
            k = math.exp(-stuck / self.TAU_S)
            r, b, s = r * k, b * k, s * k + stuck
        return max(r / s, 1e-6), max(b / s, 1e-6)


@dataclass(frozen=True)
class Backlog:
    """The ingest log's backlog against its bounds, at one moment."""

    records: int  # acknowledged, not yet counted
    bytes: int  # of tokens, acknowledged by this process and not yet counted
    age_s: float  # of the oldest of them
    limit_bytes: int  # [server] backlog_mb
    limit_s: float  # [server] backlog_s: the forecast's bound and the age's
    records_s: float  # the counting rate (CountingRate)
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
