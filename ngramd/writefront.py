"""``WriteFront``: where ingests enter a daemon's table — the durable append, the wake of the
writer, and ``flush`` (ARCHITECTURE §2.3, §5.6); ``IngestFront``: the daemon's ingest queue
and the one thread that group-commits it through the ``WriteFront``.

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
ingest that arrives while any of them is passed answers ``busy`` with ``retry_ms`` (``IngestFront``
asks ``Backlog.busy`` before each group commit), and nothing of it is written:

* **bytes**: what the log keeps of tokens not yet counted (``[server] backlog_mb``);
* **forecast**: the time counting needs to drain the backlog at the rate measured on this
  table (``stats.CountingRate``, reported by the writer), at most ``backlog_s``;
* **age**: the oldest record not yet counted, at most ``backlog_s`` old: the backstop for a
  rate that was wrong.

Why a forecast: the age is a lagging signal; a flood of random ids on a slow-counting table
built hours of counting before the oldest record was ``backlog_s`` old (ARCHITECTURE §5.6).
The decision is taken on the backlog as it stands, before the ingest is written: a table with
no backlog forecasts 0 s and never refuses, whatever its rate and the ingest's size.  The
overshoot is one group commit of the ingest thread (at most ``[server] max_tokens``).
"""

from __future__ import annotations

import collections
import shutil
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from .health import Health
from .maintenance import Maintenance
from .stats import TableStats
from .wire import protocol as P
from .wire.errors import BUSY, TIMEOUT, NgramError, StorageError

if TYPE_CHECKING:
    from .config import ServerConfig

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


# ---------------------------------------------------------------------------------------------
class IngestJob(NamedTuple):
    """One ``ingest`` request between the server's main loop and the ingest thread."""

    envelope: list  # the reply's route (the server's: socket, routing id)
    req_id: object
    key: str | None  # the dedup key: a resend with the same key is acknowledged, not written
    tokens: np.ndarray  # uint32, validated from the wire
    offsets: np.ndarray  # int64, len = sequences + 1
    t0: float  # perf_counter at arrival: the op's latency counts from it


class IngestFront:
    """The daemon's ingest front: the queue of ``ingest`` requests and the one thread that
    group-commits them to the durable log through ``writes`` (``WriteFront.ingest``).

    In arrival order, the thread takes every queued job (up to ``max_tokens``), acknowledges
    repeated keys with their first ranges (the last ``dedup_keys`` keys are remembered),
    answers the rest ``busy`` while the backlog is past a bound (``Backlog.busy``), else
    appends them in ONE write (one WAL sync for many clients) and acknowledges each with its
    own range of log seqs.  ``answer(job, reply frames, error code or None)`` hands each
    reply back to the server, which owns the socket.  ``settings()`` is read at each use
    (a SIGHUP may replace it); ``error_parts(op, exc)`` turns a failed write into the
    ``(code, message)`` of its error reply."""

    def __init__(self, writes: WriteFront, settings: Callable[[], ServerConfig],
                 answer: Callable[[IngestJob, list, str | None], None],
                 error_parts: Callable[[str, Exception], tuple[str, str]]):
        self.writes = writes
        self._settings = settings
        self._answer = answer
        self._error_parts = error_parts
        self._q: collections.deque = collections.deque()  # IngestJob, or None: stop
        self._cv = threading.Condition()
        self.submitted = 0  # the submitting thread's only (the server's main loop)
        self._finished = 0  # guarded by _cv
        self._dedup: collections.OrderedDict = collections.OrderedDict()  # ingest thread only
        self._thread = threading.Thread(target=self._loop, name="ngramd-ingest", daemon=True)
        self._backlog_limit = 0  # bytes; derived at the first ingest (backlog)
        # the backlog in bytes: (last seq, bytes appended up to it) per append not yet counted
        self._appended: collections.deque = collections.deque()
        self._appended_bytes = self._counted_bytes = 0
        #: ``busy`` answers to ingests, by the bound passed (``BOUNDS``)
        self.busy_answers = collections.Counter({b: 0 for b in BOUNDS})

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: IngestJob) -> None:
        """Queue ``job`` for the ingest thread (from one thread: the server's main loop)."""
        self.submitted += 1
        with self._cv:
            self._q.append(job)
            self._cv.notify()

    def wait_finished(self, count: int, stop: threading.Event, timeout: float | None) -> None:
        """Wait until the first ``count`` jobs submitted are answered, ``stop`` is set (seen
        at the next wake: ``close`` wakes every waiter) or ``timeout`` (s) passes."""
        with self._cv:
            self._cv.wait_for(lambda: self._finished >= count or stop.is_set(), timeout)

    def close(self, timeout: float) -> None:
        """Answer what is queued, then stop the thread (waiting at most ``timeout`` s)."""
        with self._cv:
            self._q.append(None)
            self._cv.notify_all()
        self._thread.join(timeout=timeout)

    def backlog(self) -> Backlog:
        """The ingest log's backlog against its bounds (``[server] backlog_mb``, ``backlog_s``):
        records and bytes of tokens acknowledged and not yet counted, the age of the oldest of
        them (s), the rate counting drains them at."""
        cold = self.writes.cold
        cfg = self._settings()
        counted = cold.counted_seq()
        with self._cv:  # (last seq, bytes appended up to it), oldest first
            a = self._appended
            while a and a[0][0] <= counted:
                self._counted_bytes = a.popleft()[1]
            pending = self._appended_bytes - self._counted_bytes if a else 0
        if not self._backlog_limit:  # derived once: a tenth of the free disk, 1 MiB..4 GiB
            free = shutil.disk_usage(cold.path).free
            self._backlog_limit = int(cfg.backlog_mb * 2**20) or min(max(
                free // 10, 1 << 20), 4 << 30)
        records, age_s = self.writes.log_lag()
        records_s, bytes_s = self.writes.counting_rate(time.monotonic())
        return Backlog(records=int(records), bytes=int(pending), age_s=age_s,
                       limit_bytes=self._backlog_limit, limit_s=cfg.backlog_s,
                       records_s=records_s, bytes_s=bytes_s)

    def _busy(self, jobs: int) -> tuple | None:
        """``(code, message, retry_ms)`` of a ``busy`` answer to ``jobs`` ingests while the
        backlog is past a bound (``Backlog.busy``), else None; counted per bound."""
        refused = self.backlog().busy()
        if refused is None:
            return None
        bound, msg, retry_ms = refused
        self.busy_answers[bound] += jobs
        return BUSY, msg, retry_ms

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                max_tokens = self._settings().max_tokens
                jobs, n_tok = [], 0
                while self._q and self._q[0] is not None and (
                        not jobs or n_tok + self._q[0].tokens.size <= max_tokens):
                    jobs.append(self._q.popleft())
                    n_tok += jobs[-1].tokens.size
                stop = not jobs
            if stop:
                return
            self._commit(jobs)
            with self._cv:
                self._finished += len(jobs)
                self._cv.notify_all()

    def _commit(self, jobs: list[IngestJob]) -> None:
        """One group commit: dedup, the backlog's bounds, one append, one answer per job."""
        acks: dict[int, tuple[int, int]] = {}  # job index -> (first_seq, last_seq)
        dup_of: dict[int, int] = {}  # job index -> index of the job with the same key
        fresh, by_key = [], {}
        for i, job in enumerate(jobs):
            if job.key is not None and job.key in self._dedup:
                acks[i] = self._dedup[job.key]
            elif job.key is not None and job.key in by_key:
                dup_of[i] = by_key[job.key]
            else:
                fresh.append(i)
                if job.key is not None:
                    by_key[job.key] = i
        error = self._busy(len(fresh)) if fresh else None
        by_index = set(fresh)
        if fresh and error is None:
            try:
                if len(fresh) == 1:
                    tokens, offsets = jobs[fresh[0]].tokens, jobs[fresh[0]].offsets
                else:  # concatenate; each job's offsets shift by the tokens before it
                    sizes = [jobs[i].tokens.size for i in fresh]
                    tokens = np.concatenate([jobs[i].tokens for i in fresh])
                    offsets = np.concatenate([np.zeros(1, np.int64)] + [
                        jobs[i].offsets[1:] + base
                        for i, base in zip(fresh, np.cumsum([0] + sizes))])
                first, last = (int(x) for x in self.writes.ingest(tokens, offsets))
                with self._cv:
                    self._appended_bytes += 4 * int(tokens.size)
                    self._appended.append((last, self._appended_bytes))
                for i in fresh:  # the log numbers records contiguously within one write
                    n_rec = int(self.writes.records_per_sequence(jobs[i].offsets).sum())
                    acks[i] = (first, first + n_rec - 1)
                    first += n_rec
                    if jobs[i].key is not None:
                        self._dedup[jobs[i].key] = acks[i]
                while len(self._dedup) > self._settings().dedup_keys:
                    self._dedup.popitem(last=False)
            except Exception as e:  # one write: none of the group is durable
                error = self._error_parts("ingest", e)
        for i, job in enumerate(jobs):
            src = dup_of.get(i, i)
            if error is not None and src in by_index:
                reply, code = P.encode_error(job.req_id, *error), error[0]  # (code, msg[, retry])
            else:
                a, b = acks[src]
                dup = i in dup_of or i not in by_index
                reply, code = P.encode_reply(job.req_id, {"first_seq": a, "last_seq": b,
                                                          "duplicate": dup}), None
            self._answer(job, reply, code)
