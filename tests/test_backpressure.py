"""Backpressure by forecast (issue 53, item 2): an ingest answers ``busy`` once the backlog
would take longer than ``[server] backlog_s`` to count at the rate measured on the table.

The rate and the decision are tested directly with the clock as an argument; the daemon tests
flood a real ngramd (RocksDB, ZeroMQ) whose counting is slowed (tests/slow_counting.py), and
wait on states they can observe, so a busy host makes them slower, not red."""

from __future__ import annotations

import threading
import time

import pytest

import slow_counting
from conftest import wait_until
from faults import counts, keyed_seqs, settle
from ngram_client import DaemonError, DaemonUnavailable, Timeout
from ngramd.stats import CountingRate
from ngramd.writefront import RETRY_MAX_MS, RETRY_MIN_MS, Backlog
from ngramd.wire import errors as E


# ------------------------------------------------------------------ the rate, clock given
def _steps(rate: CountingRate, t: float, n: int, step_s: float, records: int) -> float:
    """``n`` writer steps of ``step_s`` each counting ``records`` records of 8 KiB, from
    ``t``; returns the time the last ended."""
    rate.working(t)
    for _ in range(n):
        t += step_s
        rate.counted(records, records * 8192, t)
    return t


def test_the_prior_holds_until_the_first_step_which_replaces_it():
    r = CountingRate()
    assert r.rates(0.0) == (CountingRate.PRIOR_RECORDS_S, CountingRate.PRIOR_BYTES_S)
    t = _steps(r, 0.0, 1, 3.0, 30)  # issue 53's flood: ~10 records/s
    assert r.rates(t) == pytest.approx((10.0, 81920.0))


def test_the_rate_follows_recent_work_and_idle_time_is_not_work():
    r = CountingRate()
    t = _steps(r, 0.0, 20, 0.1, 100)  # 1,000 records/s
    assert r.rates(t)[0] == pytest.approx(1000.0)
    r.idle()  # an hour without ingests: the rate is what it was
    assert r.rates(t + 3600)[0] == pytest.approx(1000.0)
    t = _steps(r, t + 3600, 10, 3.0, 30)  # then 30 s of slow steps: 10 records/s
    assert 10.0 <= r.rates(t)[0] < 20.0  # within 2x of it after 30 s of work


def test_a_stuck_step_lowers_the_rate_while_it_runs_and_a_long_stall_is_forgotten():
    r = CountingRate()
    t = _steps(r, 0.0, 10, 1.0, 10)  # 10 records/s, steps of 1 s
    assert r.rates(t + 1.5)[0] == pytest.approx(10.0)  # within twice the usual step
    assert r.rates(t + 15.0)[0] < 2.0  # 13 s past it without news
    r.counted(10, 81920, t + 600.0)  # the step ends after a 600 s stall
    stalled = r.rates(t + 600.0)[0]
    assert stalled < 1.0
    t = _steps(r, t + 600.0, 20, 1.0, 10)  # 20 s of steps at 10 records/s again
    assert r.rates(t)[0] > 5 * stalled
    t = _steps(r, t, 160, 1.0, 10)  # 3 minutes of them
    assert r.rates(t)[0] > 7.0


def test_bursts_between_waits_are_not_taken_for_the_rate():
    """A table under a flood: the writer counts fast until the delta is full (5 s at 100
    records/s), then waits 30 s for a spill behind a merge (10 records): 14.6 records/s in
    all.  Right after a burst the rate stays near that, not near the burst's."""
    r = CountingRate()
    t = 0.0
    r.working(t)
    for _ in range(6):
        for _ in range(5):
            t += 1.0
            r.counted(100, 0, t)
        after_burst = r.rates(t)[0]
        t += 30.0
        r.counted(10, 0, t)
    assert 510 / 35 <= after_burst < 1.2 * 510 / 35


# ------------------------------------------------------------------ the decision
def _backlog(**kw) -> Backlog:
    base = dict(records=0, bytes=0, age_s=0.0, limit_bytes=1 << 30, limit_s=120.0,
                records_s=10.0, bytes_s=80_000.0)
    return Backlog(**{**base, **kw})


def test_no_backlog_never_refuses_whatever_the_rate():
    b = _backlog(records_s=1e-6, bytes_s=1e-6, limit_s=0.001)
    assert b.forecast_s == 0.0 and b.busy() is None


def test_the_forecast_refuses_before_the_age_and_hints_the_time_the_excess_takes():
    b = _backlog(records=1500, bytes=1500 * 8000, age_s=3.0)  # 150 s to count, 3 s old
    bound, msg, retry_ms = b.busy()
    assert bound == "forecast" and "150 s" in msg and retry_ms == RETRY_MAX_MS
    assert _backlog(records=1201, bytes=1201 * 8000).busy()[2] == RETRY_MIN_MS
    assert _backlog(records=1202, bytes=1202 * 8000).busy()[2] == 200
    assert _backlog(records=1200, bytes=1200 * 8000).busy() is None  # at the bound: taken
    # the longer of the two forecasts: many short records cost more than their bytes say
    assert _backlog(records=2000, bytes=8000).busy()[0] == "forecast"
    assert _backlog(records=10, bytes=10 << 20).busy()[0] == "forecast"
    assert _backlog(records=10, bytes=80_000, age_s=121.0).busy()[0] == "age"
    assert _backlog(records=10, bytes=2 << 30).busy()[0] == "bytes"


def test_stats_line_and_metrics_show_the_forecast_rate_and_busy_answers():
    from ngram_client.cli import format_stats
    from ngramd.metrics import _health_families

    b = {**_backlog(records=300, bytes=300 * 8000).as_dict(),
         "busy": {"bytes": 0, "forecast": 7, "age": 0}}
    line = [x for x in format_stats({"server": {"backlog": b}}).splitlines()
            if x.startswith("ingest:")][0]
    assert "drains in 30.0 s at 10.0 records/s (bound 120 s); busy answers: forecast 7" in line
    fams = {f.name: f for f in _health_families({"server": {"backlog": b}})}
    assert fams["ngramd_ingest_backlog_forecast_seconds"].samples[0].value == 30.0
    assert fams["ngramd_counting_rate_records_per_second"].samples[0].value == 10.0
    busy = {s.labels["bound"]: s.value for s in fams["ngramd_ingest_busy"].samples}
    assert busy == {"bytes": 0, "forecast": 7, "age": 0}


# ------------------------------------------------------------------ a real daemon
SEQ_TOKENS = 512
BATCH = 8  # sequences a request, one log record each


class Flood:
    """``clients`` threads, each ingesting batches of ``BATCH`` keyed sequences (its own
    numbers) as fast as answers come, until ``stop``.  A ``busy`` answer is recorded and the
    batch resent with the same key after ``retry_ms``; a lost answer is resent too (the key
    makes it harmless).  Each thread ends once its last batch is acknowledged."""

    def __init__(self, daemon, clients: int = 4, seq_tokens: int = SEQ_TOKENS,
                 pace_s: float = 0.0):
        self.daemon, self.seq_tokens, self.pace_s = daemon, seq_tokens, pace_s
        self.acked: list[int] = []  # sequence numbers acknowledged
        self.busy: list[tuple[float, str, int]] = []  # (monotonic time, message, retry_ms)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True)
                         for w in range(clients)]

    def __enter__(self) -> "Flood":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(180)

    def _run(self, worker: int) -> None:
        with self.daemon.client(timeout_ms=30_000, retries=0) as c:
            c.busy_wait_s = 0  # every busy answer comes back here
            q = (worker + 1) * 100_000
            while not self.stop.is_set():
                self._send(c, q)
                with self._lock:
                    self.acked.extend(range(q, q + BATCH))
                q += BATCH
                self.stop.wait(self.pace_s)

    def _send(self, c, q: int) -> None:
        seqs = keyed_seqs(q, BATCH, self.seq_tokens)
        while True:
            try:
                c.ingest(seqs, key=f"f{q}")
                return
            except DaemonError as e:
                if e.code != E.BUSY:
                    self.errors.append(f"{e.code}: {e}")
                    raise
                with self._lock:
                    self.busy.append((time.monotonic(), str(e), e.retry_ms))
                time.sleep(e.retry_ms / 1000)
            except (Timeout, DaemonUnavailable):
                continue


class Sampler:
    """``stats``' backlog every ~0.2 s while in use: ``samples`` of (monotonic time, dict)."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.samples: list[tuple[float, dict]] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with self.daemon.client(timeout_ms=10_000, retries=0) as c:
            while not self.stop.is_set():
                try:
                    self.samples.append((time.monotonic(), c.stats()["server"]["backlog"]))
                except (Timeout, DaemonUnavailable):
                    pass
                self.stop.wait(0.2)


def _backlog_now(c) -> dict:
    return c.stats()["server"]["backlog"]


STEP_S = 0.5  # each counting step sleeps this long (tests/slow_counting.py)
BOUND_S = 10.0  # [server] backlog_s


def test_a_flood_on_slow_counting_answers_busy_by_forecast_stays_bounded_and_drains(
        start_daemon):
    """4 clients flood a daemon whose counting steps (8 records each) take >= 0.5 s, so it
    counts at most 16 records/s; ``backlog_s`` 10 s.  Proves: ``busy`` comes from the
    forecast within 10 s of the forecast passing the bound (long before the oldest record is
    10 s old); the backlog never holds more than the bound admits at 16 records/s plus one
    group commit; once the flood stops it drains and an ingest is taken at once; every
    acknowledged sequence is counted exactly once.  (Issue 53: 12,617 batches acked, no
    ``busy``, a backlog of ~14 h of counting.)"""
    d = start_daemon(launcher=slow_counting.launcher(STEP_S),
                     table={"apply_batch_tokens": BATCH * SEQ_TOKENS, "spill_idle_s": 0.5},
                     server={"backlog_s": BOUND_S})
    try:
        with d.client(timeout_ms=60_000, retries=0) as c:
            c.ingest(keyed_seqs(0, BATCH, SEQ_TOKENS), key="warm")  # one step measured
            c.flush()
            assert _backlog_now(c)["rate_records_s"] <= BATCH / STEP_S
            with Sampler(d) as s, Flood(d) as f:
                assert wait_until(lambda: f.busy or f.errors, 120), "no busy answer at all"
                busy_at = f.busy[0][0]
                time.sleep(5)  # the flood goes on against the bound
            flood_end = time.monotonic()
            assert not f.errors, f.errors[:3]
            drained = wait_until(lambda: _backlog_now(c)["records"] == 0, 3 * BOUND_S + 30)
            drain_s = time.monotonic() - flood_end
            assert drained, _backlog_now(c)
            c.busy_wait_s = 0
            c.ingest(keyed_seqs(BATCH, BATCH, SEQ_TOKENS), key="after")  # taken: no busy
            b = _backlog_now(c)
            settle(c, timeout_ms=120_000)
            acked = [*range(2 * BATCH), *f.acked]  # "warm", "after", the flood
            n = counts(c, sorted(set(acked)))
        passed = [t for t, x in s.samples if x["forecast_s"] > x["limit_s"]]
        worst = max(x["records"] for _, x in s.samples)
        admitted = BOUND_S * BATCH / STEP_S + 4 * BATCH  # the bound, then one group of 4 jobs
        assert "to count at" in f.busy[0][1], f.busy[0]  # the forecast's answer, not the age's
        assert busy_at - min(passed + [busy_at]) <= 10.0, (passed[:1], busy_at)
        assert b["busy"]["forecast"] > 0 and b["forecast_s"] < BOUND_S, b
        assert worst <= admitted, (worst, admitted)
        assert drain_s <= 3 * BOUND_S + 30, drain_s
        print(f"flood: {len(f.acked)} sequences acked, {len(f.busy)} busy answers, the first "
              f"{busy_at - min(passed + [busy_at]):.1f} s after the forecast passed; backlog "
              f"at most {worst} records (admitted {admitted:.0f}); drained in {drain_s:.1f} s")
        assert len(acked) == len(set(acked)) and (n == 1).all(), \
            f"{int((n != 1).sum())} of {n.size} acked sequences not counted once"
    finally:
        d.kill()


def test_an_idle_table_never_answers_busy_even_with_a_tiny_bound(start_daemon):
    """``backlog_s`` 0.05 s and the real counter: each ingest lands on a counted-through log
    (the test waits for it), 64k tokens at a time, the first before any rate is measured.
    Proves: no ``busy`` (a table with no backlog forecasts 0 s, whatever its rate)."""
    d = start_daemon(server={"backlog_s": 0.05})
    try:
        with d.client(timeout_ms=30_000, retries=0) as c:
            c.busy_wait_s = 0  # a busy answer raises
            for q in range(0, 8 * 64, 64):
                c.ingest(keyed_seqs(q, 64, 1024), key=f"i{q}")
                assert wait_until(lambda: c.stats()["log_lag"] == 0, 60)
            b = _backlog_now(c)
            assert b["forecast_s"] == 0.0 and sum(b["busy"].values()) == 0, b
            settle(c)
            assert (counts(c, range(8 * 64)) == 1).all()
    finally:
        d.kill()


def test_a_table_counting_as_fast_as_it_is_fed_never_answers_busy(start_daemon):
    """Two clients each ingest 8 sequences of 128 tokens every 0.1 s for 8 s (~20k tokens/s,
    a few percent of a core to count) with ``backlog_s`` 5 s.  Proves: no ``busy``, and every
    sequence is counted once."""
    d = start_daemon(server={"backlog_s": 5.0})
    try:
        with Flood(d, clients=2, seq_tokens=128, pace_s=0.1) as f:
            f.stop.wait(8.0)
        assert not f.errors and not f.busy, (f.errors[:3], f.busy[:3])
        with d.client(timeout_ms=60_000, retries=0) as c:
            b = _backlog_now(c)
            assert sum(b["busy"].values()) == 0 and b["rate_records_s"] > 0, b
            settle(c)
            assert len(f.acked) >= 2 * BATCH and (counts(c, f.acked) == 1).all()
    finally:
        d.kill()
