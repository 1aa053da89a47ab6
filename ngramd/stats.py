"""Counters and latency histograms, the stall monitor, and the writer's counting rate.

The hot path only increments numpy counters (no locks, no allocation); ``snapshot()`` turns
them into figures for `stats` and logs, and ``ngramd/metrics.py`` into Prometheus metrics at
scrape time.  Reading never resets anything: two readers (the CLI and a Prometheus scraper)
see the same figures.

Latencies go into log-spaced buckets, 8 per octave from 0.125 µs to 2^37 x 0.125 µs
(~4.8 hours), which bounds the error of a percentile to one bucket (2^(1/8) - 1, ~9%).  The
range reaches hours because a flush or a hot rebuild can take minutes: with the old ~1 s
ceiling a flush that took 3.5 s on average reported p99 1.05 s.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time

import numpy as np

log = logging.getLogger("ngramd.stats")

BUCKETS_PER_OCTAVE = 8
MIN_US = 0.125
OCTAVES = 37  # 0.125 µs .. ~4.8 h
N_BUCKETS = BUCKETS_PER_OCTAVE * OCTAVES
#: lower edge (µs) of bucket b is EDGES[b]; bucket N_BUCKETS holds everything above EDGES[-1]
EDGES = MIN_US * 2.0 ** (np.arange(N_BUCKETS + 1) / BUCKETS_PER_OCTAVE)
#: the ingest rate in `stats` is the mean over this many seconds (a moving window)
RATE_WINDOW_S = 10


class LatencyHistogram:
    """Log-bucketed latency histogram in microseconds."""

    def __init__(self):
        self.counts = np.zeros(N_BUCKETS + 1, np.int64)  # last bucket: overflow
        self.total_us = 0.0
        self._lock = threading.Lock()  # the serving thread and background readers both add

    def add(self, us: float, n: int = 1) -> None:
        """Record ``n`` events of ``us`` microseconds each."""
        if us <= MIN_US:
            b = 0
        else:
            b = min(int(math.log2(us / MIN_US) * BUCKETS_PER_OCTAVE), N_BUCKETS)
        with self._lock:
            self.counts[b] += n
            self.total_us += us * n

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def percentile(self, q: float) -> float:
        """Upper edge (µs) of the bucket holding the q-th percentile (0 when empty)."""
        n = self.count
        if not n:
            return 0.0
        rank = math.ceil(q / 100.0 * n)
        b = int(np.searchsorted(np.cumsum(self.counts), max(rank, 1)))
        return float(EDGES[min(b + 1, N_BUCKETS)])

    def cumulative(self, edges: np.ndarray) -> tuple[np.ndarray, int, float]:
        """``(below, count, total_us)``: ``below[i]`` events faster than ``EDGES[edges[i]]``
        (bucket indices, ascending), plus the count and the sum, read together under the lock so
        a Prometheus histogram's buckets, count and sum agree with each other."""
        with self._lock:
            counts = self.counts.copy()
            total = self.total_us
        cum = np.concatenate(([0], np.cumsum(counts)))
        return cum[edges], int(cum[-1]), total

    @staticmethod
    def merged(hists: list["LatencyHistogram"]) -> "LatencyHistogram":
        """One histogram holding the events of ``hists`` (each read under its lock)."""
        out = LatencyHistogram()
        for h in hists:
            with h._lock:
                out.counts += h.counts
                out.total_us += h.total_us
        return out

    def mean(self) -> float:
        n = self.count
        return self.total_us / n if n else 0.0

    def summary(self) -> dict:
        return {"count": self.count, "mean_us": round(self.mean(), 3),
                "p50_us": self.percentile(50), "p99_us": self.percentile(99),
                "p999_us": self.percentile(99.9)}


class TableStats:
    """Per-order, per-tier counters of one table.

    ``lookups[tier, n]``/``hits[tier, n]``: keys of order n looked up in a tier and found
    there (hot: `lookup` requests; cold: every cold read, from drafts and lookups), so
    ``hits / lookups`` is a hit rate; ``drafted[tier, n]``: tokens the daemon drafted from order
    n of a tier; ``degrades[n]``: cold reads deferred for the latency budget;
    ``reported_drafted/accepted[n]``: what generators report (they draft in-process from the
    shared-memory hot tier, so their drafts never show up in ``drafted``).
    """

    TIERS = ("local", "hot", "cold", "recent")  # indexed by kernels.TIER_*

    def __init__(self, n_max: int):
        self.n_max = n_max
        shape = (len(self.TIERS), n_max + 1)
        self.lookups = np.zeros(shape, np.int64)
        self.hits = np.zeros(shape, np.int64)
        self.drafted = np.zeros(shape, np.int64)
        self.degrades = np.zeros(n_max + 1, np.int64)
        self.reported_drafted = np.zeros(n_max + 1, np.int64)
        self.reported_accepted = np.zeros(n_max + 1, np.int64)
        self.policy: dict[str, float] = {}  # generators' draft-length policy figures, summed
        self.latency = {t: LatencyHistogram() for t in ("hot", "cold", "draft", "ingest")}
        self.requests = {}
        self.ingested_tokens = 0
        self.recent_skipped_tokens = 0  # counted under a backlog, not put in the recent table
        self.started = time.time()
        self._started_mono = time.monotonic()
        # tokens counted per monotonic second, in a ring of RATE_WINDOW_S + 1 slots (the
        # current second plus the window); written by the one writer thread, only read by
        # ``ingest_rate`` -- a read never resets it, so the CLI and a scraper agree
        self._win_tokens = np.zeros(RATE_WINDOW_S + 1, np.int64)
        self._win_second = np.full(RATE_WINDOW_S + 1, -1, np.int64)
        self._lock = threading.Lock()  # only for report(): counters elsewhere have one writer

    def report(self, drafted: dict, accepted: dict, policy: dict | None = None) -> None:
        with self._lock:
            for k, v in (policy or {}).items():
                self.policy[k] = self.policy.get(k, 0.0) + v
            for k, v in drafted.items():
                n = int(k)
                if 0 <= n <= self.n_max:
                    self.reported_drafted[n] += int(v)
            for k, v in accepted.items():
                n = int(k)
                if 0 <= n <= self.n_max:
                    self.reported_accepted[n] += int(v)

    def add_ingested(self, tokens: int, now: float | None = None) -> None:
        """Count ``tokens`` ingest-log tokens as counted (the writer thread, the only caller)."""
        sec = int(time.monotonic() if now is None else now)
        i = sec % self._win_tokens.size
        if self._win_second[i] != sec:  # a new second: clear the slot before stamping it, so a
            self._win_tokens[i] = 0     # reader in between sees an old stamp and skips it
            self._win_second[i] = sec
        self._win_tokens[i] += tokens
        self.ingested_tokens += tokens

    def ingest_rate(self, now: float | None = None) -> float:
        """Tokens/s counted over the last ``RATE_WINDOW_S`` seconds (the current one included),
        or since start when that is shorter.  Reads change nothing (a rate "since the previous
        read" would let every Prometheus scrape zero what the CLI shows).  For Prometheus,
        ``ngramd_ingested_tokens_total`` is a counter: use ``rate()``."""
        now = time.monotonic() if now is None else now
        sec = int(now)
        live = (self._win_second > sec - RATE_WINDOW_S) & (self._win_second <= sec)
        span = min(now - (sec - RATE_WINDOW_S + 1), now - self._started_mono)
        return float(self._win_tokens[live].sum()) / max(span, 1.0)

    def snapshot(self, n_min: int) -> dict:
        per_order = []
        for n in range(n_min, self.n_max + 1):
            row = {"order": n, "degrades": int(self.degrades[n]),
                   "reported_drafted": int(self.reported_drafted[n]),
                   "reported_accepted": int(self.reported_accepted[n])}
            d = row["reported_drafted"]
            row["reported_acceptance"] = round(row["reported_accepted"] / d, 4) if d else None
            for ti, t in enumerate(self.TIERS):
                row[f"{t}_lookups"] = int(self.lookups[ti, n])
                row[f"{t}_hits"] = int(self.hits[ti, n])
                row[f"{t}_drafted"] = int(self.drafted[ti, n])
                lk = self.lookups[ti, n]
                row[f"{t}_hit_rate"] = round(self.hits[ti, n] / lk, 4) if lk else None
            per_order.append(row)
        return {
            "uptime_s": round(time.time() - self.started, 1),
            "orders": per_order,
            "latency": {k: v.summary() for k, v in self.latency.items()},
            "requests": dict(self.requests),
            "ingested_tokens": self.ingested_tokens,
            "recent_skipped_tokens": self.recent_skipped_tokens,
            "ingest_tokens_per_s": round(self.ingest_rate(), 1),
            "policy": self.policy_summary(),
        }

    def policy_summary(self) -> dict:
        """The generators' draft-length policies over every step they reported: steps, the
        share of them verifying no draft, and the policy's tokens/s on those steps against
        plain decoding, full drafts and the oracle (each by the generators' cost models;
        ``ngram_generator.policy.StepTally``).  Empty before any report has them."""
        with self._lock:
            p = dict(self.policy)
        steps = p.get("steps", 0.0)
        if not steps:
            return {}
        rate = {k: p.get(f"{k}_tokens", 0.0) / p[f"{k}_seconds"]
                for k in ("policy", "plain", "full", "oracle") if p.get(f"{k}_seconds")}
        out = {"steps": int(steps), "plain_share": round(p.get("plain_steps", 0.0) / steps, 3)}
        for k in ("plain", "full", "oracle"):
            if rate.get(k) and "policy" in rate:
                out[f"vs_{k}"] = round(rate["policy"] / rate[k], 3)
        return out


class StallLog:
    """Log lines about stalls of ``threshold_ms`` or more, at most one per ``interval_s``.

    Under CPU contention a daemon's threads are kept from running several times a second, and a
    line per stall buries everything else in the journal.
    The first stall after a quiet ``interval_s`` is logged at once (an operator sees it when it
    happens); the ones that follow within the interval are summed into one line (how many, the
    longest, their total) written once the interval has passed.  ``add`` takes the time
    (``time.monotonic`` seconds) as an argument."""

    def __init__(self, threshold_ms: float = 50.0, interval_s: float = 60.0):
        self.threshold_ms = threshold_ms
        self.interval_s = interval_s
        self._last_line = -math.inf  # when the last line was written
        self._count = 0  # stalls since it, not yet logged
        self._longest_ms = self._total_ms = 0.0
        self.lines = 0  # counter: lines written

    def add(self, ms: float, now: float) -> None:
        """One wake-up that came ``ms`` late at ``now``."""
        due = now - self._last_line >= self.interval_s
        if ms >= self.threshold_ms:
            if due and not self._count:
                self._write(now, "a daemon thread was kept from running for %.0f ms", ms)
                return
            self._count += 1
            self._longest_ms = max(self._longest_ms, ms)
            self._total_ms += ms
        if due and self._count:
            self._write(now, "daemon threads were kept from running %d times for >= %.0f ms in "
                        "the last %.0f s (longest %.0f ms, %.1f s in all)", self._count,
                        self.threshold_ms, now - self._last_line, self._longest_ms,
                        self._total_ms / 1e3)
            self._count, self._longest_ms, self._total_ms = 0, 0.0, 0.0

    def _write(self, now: float, msg: str, *args) -> None:
        log.info(msg, *args)
        self._last_line = now
        self.lines += 1


class StallMonitor:
    """How long a Python thread of the daemon can be kept from running (ARCHITECTURE §9: <= 20 ms).

    A daemon thread sleeps in a loop and records by how much each wake-up came late: the time
    it waited for the GIL (a long write or fsync that holds it) or for a CPU.  That is the
    stall every other thread of the process (the serving loop included) sees.

    The lateness of one wake-up does not depend on how long the sleep was, but a stall that
    starts and ends inside one sleep goes unseen: ``period_s`` (10 ms) catches every stall of
    10 ms or more, and is used while ``busy()`` says the daemon works (requests in the last
    seconds, a write, spill, merge or rebuild).  An idle daemon sleeps ``idle_period_s``
    (250 ms): 100 timer wake-ups a second were most of an idle daemon's CPU (ARCHITECTURE §5.9).

    ``clock`` (monotonic seconds) and ``sleep`` are the real ones unless a test passes its own
    and calls ``step`` instead of ``start``."""

    WINDOW_S = 120  # per-second maxima kept for ``recent_ms``

    def __init__(self, period_s: float = 0.01, idle_period_s: float = 0.25,
                 busy=lambda: True, *, doing=lambda: [], clock=time.perf_counter,
                 sleep=time.sleep):
        self.period_s = period_s
        self.idle_period_s = idle_period_s
        self.busy = busy
        # what background work ran right after the longest stall (``doing()``, a list of
        # names): a hint at who held the process, for ``stats`` and the tests' messages
        self.doing = doing
        self.max_during: list[str] = []
        self._clock, self._sleep = clock, sleep
        self.hist = LatencyHistogram()
        self.max_ms = 0.0
        self._seconds = collections.deque(maxlen=self.WINDOW_S)  # (unix second, max ms)
        self.log = StallLog()  # stalls of >= 50 ms: one line a minute at most
        self._thread = threading.Thread(target=self._run, name="ngramd-stall", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.step()

    def step(self) -> None:
        """One sleep of the monitor's loop, and the lateness of its wake-up."""
        try:
            period = self.period_s if self.busy() else self.idle_period_s
        except Exception:  # a closing table: measure at the fine period
            period = self.period_s
        t0 = self._clock()
        self._sleep(period)
        now = self._clock()
        late = (now - t0 - period) * 1e6
        self.hist.add(max(late, 0.0))
        ms = late / 1e3
        if ms > self.max_ms:
            self.max_ms = ms
            try:
                self.max_during = list(self.doing())
            except Exception:  # a closing table
                self.max_during = []
        sec = int(time.time())
        if self._seconds and self._seconds[-1][0] == sec:
            if ms > self._seconds[-1][1]:
                self._seconds[-1] = (sec, ms)
        else:
            self._seconds.append((sec, ms))
        self.log.add(ms, now)

    def summary(self) -> dict:
        s = self.hist.summary()
        return {"count": s["count"], "p50_us": s["p50_us"], "p99_us": s["p99_us"],
                "p999_us": s["p999_us"], "max_ms": round(self.max_ms, 3),
                "max_during": self.max_during,
                # the longest stall of each of the last WINDOW_S seconds, oldest first
                "recent_ms": [[t, round(m, 2)] for t, m in list(self._seconds)]}


class CountingRate:
    """Records/s and bytes/s the writer counts the ingest log at, over its recent work
    (thread-safe: the writer reports, the ingest thread and ``stats`` read).

    The writer reports each step (``counted``), the start of work (``working``) and a log
    counted through (``idle``).  Time spent idle is not work and is left out; time spent
    waiting for a spill (the delta at its bound, the spill behind merges) is work, since the
    backlog waits with it.

    Each step is a sample weighted by its length in two means that decay over ``TAUS_S`` of
    work (a step weighs at most one time constant: a long stall does not outweigh all that
    follows it); the rate is the lower of the two.  The short one follows a slowdown within
    seconds; the long one spans the cycles of a table under a flood, where the writer counts
    fast until the delta is full and then waits for spills behind merges, so a burst between
    two waits does not admit a backlog the next wait will hold (bench/bench_flood.py: a flood's
    rate falls by far more than 10x between the burst and the drain).  Before any measurement the
    prior holds; the first step replaces it.  A step that runs past twice the usual length
    counts meanwhile as work without progress: a counter stuck in one step lowers the rate
    while it is stuck, not only once the step ends."""

    #: time constants of the two means, in seconds of counting work
    TAUS_S = (10.0, 120.0)
    #: the rates before the first step is measured (the first replaces them): one writer
    #: step a second, 64k tokens in records of ~1k tokens.  Real text counts several times
    #: faster, random ids on a big table a few times slower; a prior too high lets a flood on
    #: a fresh daemon in until the first step ends
    PRIOR_RECORDS_S = 50.0
    PRIOR_BYTES_S = float(256 << 10)
    PRIOR_STEP_S = 1.0

    def __init__(self):
        self._lock = threading.Lock()
        # per mean: decayed sums of records, bytes and seconds of work (the prior: 1 s of it)
        self._sums = [[self.PRIOR_RECORDS_S, self.PRIOR_BYTES_S, 1.0] for _ in self.TAUS_S]
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
            for tau, sums in zip(self.TAUS_S, self._sums):
                w = min(dt, tau)
                k = math.exp(-w / tau) if self.steps else 0.0
                sums[:] = (sums[0] * k + records * w / dt, sums[1] * k + nbytes * w / dt,
                           sums[2] * k + w)
            self._step_s += (0.2 if self.steps else 1.0) * (dt - self._step_s)
            self._since = now
            self.steps += 1

    def rates(self, now: float) -> tuple[float, float]:
        """(records/s, bytes/s) at monotonic time ``now``: the lower of the two means; never
        0."""
        with self._lock:
            sums = [tuple(x) for x in self._sums]
            stuck = now - self._since - 2 * self._step_s if self._since is not None else 0.0
        out = []
        for tau, (r, b, s) in zip(self.TAUS_S, sums):
            if stuck > 0:  # no news from the step in progress: work without progress so far
                k = math.exp(-stuck / tau)
                r, b, s = r * k, b * k, s * k + stuck
            out.append((r / s, b / s))
        return (max(min(x[0] for x in out), 1e-6), max(min(x[1] for x in out), 1e-6))
