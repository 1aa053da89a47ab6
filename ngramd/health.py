"""A table's health: which part of its write path fails now, and how far counting lags the log
(ARCHITECTURE §10.3).

Each part (the ingest log, counting, spills, merges, hot rebuilds, cold reads, the fleet) marks
its failure here (``fault``) and clears it when it works again (``clear``); ``state`` turns the
marks, the counting lag and an ingest stuck on the disk into what ``Table.health`` answers
(and so ``ping``, ``info``, ``stats``, the metrics and systemd's ``STATUS=``).  Reads are served
either way.

The state has hysteresis: it turns ``degraded`` at the first fault and back to ``ok`` only once
no part has failed for ``recover_s`` (3 s by default), and each change is logged once, with its
cause.  A part's own failures and recoveries are logged at debug level only: a fault that comes
and goes with every request (a flapping disk) made 117 ``degraded`` and 116 ``recovered``
lines in 2 s, and a ``health: ok`` in the middle of the fault.

Probes (``Probes``): some parts only work again when something uses them -- cold reads clear at
the next draft that reads the cold tier, the ingest log at the next ingest, the hot rebuild at
the next rebuild.  Behind a load balancer or a readiness probe that drains degraded nodes, that
traffic never comes, and a node would stay ``degraded`` for good.  So each part that fails is
probed by the daemon, first ``first_s`` after it is seen failing, then at intervals doubling to
at most ``max_s`` (``[table] health_probe_s``) while the probe fails: a probe that shows the
part works clears its fault, and health turns ``ok`` ``recover_s`` later with no client traffic;
one that fails keeps the fault and its message; one may instead start the part's own retry (a
hot rebuild) and leave the clearing to it.  Each probe's last result (when, ok, outcome) is in
``state()["probes"]``.
Probes run on a thread of their own, each a few small reads or writes through calls that
release the GIL, never on the serving thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

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

    def __init__(self, cold, lag_degraded_s: float, recover_s: float = 3.0):
        self.cold = cold
        self.lag_degraded_s = lag_degraded_s
        self.recover_s = recover_s
        self._faults: dict[str, tuple[str, float]] = {}  # part -> (what failed, since when)
        #: part -> the last probe's result: {"at": unix s, "ok": bool, "outcome": str}
        self._probes: dict[str, dict] = {}
        self._lock = threading.Lock()
        # the published state: (degraded?, the cause it changed on, unix time of the change),
        # and the monotonic time the last fault was seen (recovery counts from it)
        self._published = (False, "", 0.0)
        self._last_fault = -1e18
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
                log.debug("%s failed: %s", part, e)
            self._last_fault = time.monotonic()
            since = self._faults.get(part, ("", time.time()))[1]
            self._faults[part] = (str(e)[:300], since)
            if isinstance(e, StorageError):
                self.storage_errors += 1

    def clear(self, part: str) -> None:
        """``part`` works again."""
        if part in self._faults:
            with self._lock:
                if self._faults.pop(part, None) is not None:
                    self._last_fault = time.monotonic()
                    log.debug("%s works again", part)

    def failing(self, part: str) -> tuple[str, float] | None:
        """``(what failed, unix time since)`` while ``part`` fails, else None."""
        return self._faults.get(part)

    def failing_parts(self) -> list[str]:
        """The parts that fail now."""
        with self._lock:
            return list(self._faults)

    def probed(self, part: str, ok: bool, outcome: str, clears: bool = True) -> None:
        """A probe of ``part`` (``Probes``) ended; ``outcome`` is what stats show.  A
        probe that worked clears the fault, as the part working again would (unless
        ``clears`` is False: it only started the part's own retry, whose success clears it).
        A failed probe keeps the fault and its first message (the cause an operator reads),
        and recovery counts from now."""
        with self._lock:
            self._probes[part] = {"at": round(time.time(), 3), "ok": ok,
                                  "outcome": outcome[:300]}
            if not ok and part in self._faults:
                self._last_fault = time.monotonic()
        if ok and clears:
            self.clear(part)

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

    def state(self, now: float | None = None) -> dict:
        """``ok``, or ``degraded`` with the reason: a part of the write path failing now (the
        ingest log, counting, spills, merges, hot rebuilds) or an ingest stuck on the disk, or
        one that failed less than ``recover_s`` ago.  ``now``: monotonic time (tests)."""
        with self._lock:
            faults = dict(self._faults)
            probes = {k: dict(v) for k, v in self._probes.items()}
        lag_n, lag_s = self.log_lag()
        if lag_s > self.lag_degraded_s:
            faults["counting lag"] = (f"counting lags {lag_n} records / {lag_s:.0f} s",
                                      time.time() - lag_s)
        since = self.ingest_since
        if since and time.monotonic() - since > self.STALL_S:
            waited = time.monotonic() - since
            faults["disk"] = (f"an ingest has waited {waited:.0f} s for the disk",
                              time.time() - waited)
        first = min(faults.items(), key=lambda kv: kv[1][1]) if faults else None
        degraded, cause, since = self._publish(_reason(*first) if first else "",
                                               time.monotonic() if now is None else now)
        return {"state": "degraded" if degraded else "ok", "degraded": int(degraded),
                "reason": _reason(*first) if first else (cause if degraded else ""),
                "since": round(first[1][1], 3) if first else (since if degraded else 0.0),
                "faults": {k: v[0] for k, v in faults.items()},
                "storage_errors": self.storage_errors,
                "quarantined_records": self.cold.log.quarantined,
                "probes": probes}

    def _publish(self, reason: str, now: float) -> tuple[bool, str, float]:
        """The published state given the faults of this moment (``reason``: the first, or
        ""): degraded at once, ok only after ``recover_s`` without a fault; each change
        logged once with its cause."""
        with self._lock:
            degraded, cause, since = self._published
            if reason:
                self._last_fault = max(self._last_fault, now)
                if not degraded:
                    self._published = (True, reason, round(time.time(), 3))
                    log.warning("health: degraded: %s", reason)
            elif degraded and now - self._last_fault >= self.recover_s:
                self._published = (False, "", round(time.time(), 3))
                log.warning("health: ok again after %.1f s degraded (it began with: %s)",
                            time.time() - since, cause)
            return self._published


def _reason(part: str, fault: tuple[str, float]) -> str:
    """``part: what failed``, or the message alone when it names its part already."""
    return fault[0] if fault[0].startswith(part) else f"{part}: {fault[0]}"


#: a probe: returns None when the part works (its fault clears), or a note when it only
#: started the part's own retry; raises when the part still fails
Check = Callable[[], "str | None"]


class Probes:
    """The probe schedule of one table: ``checks`` maps a part's name (as it marks its fault)
    to its probe.  ``step(now)`` runs the probes due; ``run(stop)`` calls it on a thread."""

    def __init__(self, faults: Health, checks: dict[str, Check], first_s: float = 0.25,
                 max_s: float = 2.0):
        self.faults = faults
        self.checks = dict(checks)
        self.first_s = min(first_s, max_s)
        self.max_s = max_s
        self._due: dict[str, tuple[float, float]] = {}  # part -> (monotonic due, interval)

    def step(self, now: float) -> float:
        """Probe the failing parts whose time has come (``now``: monotonic seconds); returns
        the seconds until the next probe is due (``max_s`` when nothing fails)."""
        failing = [p for p in self.faults.failing_parts() if p in self.checks]
        for part in list(self._due):
            if part not in failing:  # it works again: the next fault starts a new schedule
                del self._due[part]
        wait = self.max_s
        for part in failing:
            due, every = self._due.setdefault(part, (now + self.first_s, self.first_s))
            if now >= due:
                worked = self.probe(part)
                every = self.first_s if worked else min(2 * every, self.max_s)
                due = now + every
                self._due[part] = (due, every)
            wait = min(wait, due - now)
        return max(wait, 0.01)

    def probe(self, part: str) -> bool:
        """Run ``part``'s probe now and record its result; True when it cleared the fault."""
        try:
            note = self.checks[part]()
        except Exception as e:
            log.debug("probe of %s failed: %s", part, e)
            self.faults.probed(part, False, f"failed: {e}")
            return False
        self.faults.probed(part, True, note or "ok", clears=note is None)
        return note is None

    def run(self, stop: threading.Event) -> None:
        """Probe until ``stop`` is set (the table's probe thread)."""
        while not stop.is_set():
            try:
                wait = self.step(time.monotonic())
            except Exception:  # a bug here must not end the thread: health would stick
                log.exception("health probes failed; trying again")
                wait = self.max_s
            stop.wait(wait)
