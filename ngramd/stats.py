"""Counters and latency histograms.

The hot path only increments numpy counters (no locks, no allocation); ``snapshot()`` turns
them into figures for `stats`, logs and Prometheus.  Latencies go into log-spaced buckets
(8 per octave from 0.125 µs to ~1 s), which bounds the error of a percentile to ~9%.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

_BUCKETS_PER_OCTAVE = 8
_MIN_US = 0.125
_N_BUCKETS = _BUCKETS_PER_OCTAVE * 23  # 0.125 µs .. ~1 s
_EDGES = _MIN_US * 2.0 ** (np.arange(_N_BUCKETS + 1) / _BUCKETS_PER_OCTAVE)


class LatencyHistogram:
    """Log-bucketed latency histogram in microseconds."""

    def __init__(self):
        self.counts = np.zeros(_N_BUCKETS + 1, np.int64)  # last bucket: overflow
        self.total_us = 0.0
        self._lock = threading.Lock()  # the serving thread and background readers both add

    def add(self, us: float, n: int = 1) -> None:
        """Record ``n`` events of ``us`` microseconds each."""
        if us <= _MIN_US:
            b = 0
        else:
            b = min(int(math.log2(us / _MIN_US) * _BUCKETS_PER_OCTAVE), _N_BUCKETS)
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
        return float(_EDGES[min(b + 1, _N_BUCKETS)])

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
        self.latency = {t: LatencyHistogram() for t in ("hot", "cold", "draft", "ingest")}
        self.requests = {}
        self.ingested_tokens = 0
        self.recent_skipped_tokens = 0  # counted under a backlog, not put in the recent table
        self.started = time.time()
        self._rate = (time.monotonic(), 0)  # (time, ingested tokens) of the previous snapshot
        self._lock = threading.Lock()  # only for report(): counters elsewhere have one writer

    def report(self, drafted: dict, accepted: dict) -> None:
        with self._lock:
            for k, v in drafted.items():
                n = int(k)
                if 0 <= n <= self.n_max:
                    self.reported_drafted[n] += int(v)
            for k, v in accepted.items():
                n = int(k)
                if 0 <= n <= self.n_max:
                    self.reported_accepted[n] += int(v)

    def ingest_rate(self) -> float:
        """Tokens/s ingested since the previous call (or since start)."""
        now = time.monotonic()
        t0, n0 = self._rate
        self._rate = (now, self.ingested_tokens)
        dt = now - t0
        return (self.ingested_tokens - n0) / dt if dt > 0 else 0.0

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
        }
