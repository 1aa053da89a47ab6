"""A table's health: which part of its write path fails now, and how far counting lags the log
(ARCHITECTURE §10.3).

Each part (the ingest log, counting, spills, merges, hot rebuilds, cold reads, the fleet) marks
its failure here (``fault``) and clears it when it works again (``clear``); ``state`` turns the
marks, the counting lag and an ingest stuck on the disk into what ``Table.health`` answers
(and so ``ping``, ``info``, ``stats``, the metrics and systemd's ``STATUS=``).  Reads are served
either way.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from .wire.errors import StorageError

log = logging.getLogger("ngramd.table")


class Health:
    """The faults of one table's parts and the clock of its counting lag.

    ``cold`` gives the log positions (``counted_seq``, ``last_seq``, ``quarantined``);
    ``lag_degraded_s``: a lag longer than this is a fault of its own."""

    #: an append to the ingest log that has waited this long means the disk is stalled (s)
    STALL_S = 5.0
    #: appends closer than this share one entry of the lag clock (s): its error, at most
    LAG_STEP_S = 0.05

    def __init__(self, cold, lag_degraded_s: float):
        self.cold = cold
        self.lag_degraded_s = lag_degraded_s
        self._faults: dict[str, tuple[str, float]] = {}  # part -> (what failed, since when)
        self._lock = threading.Lock()
        self.storage_errors = 0
        #: monotonic start of the append in progress (0: none)
        self.ingest_since = 0.0
        # (last seq, monotonic time) of appends not yet counted, coalesced to LAG_STEP_S: the
        # age of the oldest record waiting to be counted (log lag in seconds)
        self._appends: collections.deque = collections.deque()
        if cold.last_seq() > cold.counted_seq():  # a log to replay: lag from now
            self._appends.append([cold.last_seq(), time.monotonic()])
        self._appends_lock = threading.Lock()

    def fault(self, part: str, e: BaseException) -> None:
        """``part`` fails now, with ``e`` (logged once, when it starts failing)."""
        with self._lock:
            if part not in self._faults:
                log.warning("degraded: %s failed: %s", part, e)
            since = self._faults.get(part, ("", time.time()))[1]
            self._faults[part] = (str(e)[:300], since)
            if isinstance(e, StorageError):
                self.storage_errors += 1

    def clear(self, part: str) -> None:
        """``part`` works again."""
        if part in self._faults:
            with self._lock:
                if self._faults.pop(part, None) is not None:
                    log.warning("recovered: %s works again", part)

    def failing(self, part: str) -> tuple[str, float] | None:
        """``(what failed, unix time since)`` while ``part`` fails, else None."""
        return self._faults.get(part)

    def appended(self, last_seq: int, now: float) -> None:
        """An append up to ``last_seq`` became durable at monotonic time ``now``."""
        with self._appends_lock:
            a = self._appends
            if a and now - a[-1][1] < self.LAG_STEP_S:
                a[-1][0] = last_seq
            else:
                a.append([last_seq, now])

    def log_lag(self) -> tuple[int, float]:
        """(records, seconds) the writer lags the log: acknowledged records not yet counted,
        and how long ago the oldest of them was appended (0 when counting keeps up)."""
        counted, last = self.cold.counted_seq(), self.cold.last_seq()
        with self._appends_lock:
            a = self._appends
            while a and a[0][0] <= counted:
                a.popleft()
            t = a[0][1] if a and last > counted else None
        return last - counted, (time.monotonic() - t if t is not None else 0.0)

    def state(self) -> dict:
        """``ok``, or ``degraded`` with the reason: a part of the write path failing now (the
        ingest log, counting, spills, merges, hot rebuilds) or an ingest stuck on the disk."""
        with self._lock:
            faults = dict(self._faults)
        lag_n, lag_s = self.log_lag()
        if lag_s > self.lag_degraded_s:
            faults["counting lag"] = (f"counting lags {lag_n} records / {lag_s:.0f} s",
                                      time.time() - lag_s)
        since = self.ingest_since
        if since and time.monotonic() - since > self.STALL_S:
            waited = time.monotonic() - since
            faults["disk"] = (f"an ingest has waited {waited:.0f} s for the disk",
                              time.time() - waited)
        state = "degraded" if faults else "ok"
        first = min(faults.items(), key=lambda kv: kv[1][1]) if faults else None
        return {"state": state, "degraded": int(bool(faults)),
                "reason": _reason(*first) if first else "",
                "since": round(first[1][1], 3) if first else 0.0,
                "faults": {k: v[0] for k, v in faults.items()},
                "storage_errors": self.storage_errors,
                "quarantined_records": self.cold.quarantined}


def _reason(part: str, fault: tuple[str, float]) -> str:
    """``part: what failed``, or the message alone when it names its part already."""
    return fault[0] if fault[0].startswith(part) else f"{part}: {fault[0]}"
