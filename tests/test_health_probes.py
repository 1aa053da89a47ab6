"""Health that heals with no client traffic (issue 52, section 1): a part that failed is probed by
the daemon itself (``health.Probes``), so a node that a load balancer drained for being
``degraded`` turns ``ok`` once the cause ends, though nothing but ``stats`` reaches it.

Real faults on a real daemon: read errors on the cold tier's SST files through a FUSE
passthrough (``faults.ReadErrors``), a loop-mounted ext4 filled to ENOSPC (``faults.disk_full``).
The schedule itself (first probe, doubling, cap, what a failed probe keeps) is checked on the
real ``Health`` with the clock as an argument."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

import faults
from conftest import wait_until
from faults import counts, keyed_seqs, settle
from ngramd.health import Health, Probes
from ngramd.wire import errors as E
from ngramd.wire.errors import StorageError

from test_reliability import _assert_health, _health, _ingest_until_error

#: the issue's bound: ok within this long of the cause ending, with only ``stats`` calls (s)
RECOVER_WITHIN_S = 10.0


def _ok_with_stats_only(c, within_s: float) -> float | None:
    """Seconds until ``stats`` says ``ok`` (``stats`` is the only call made), or None."""
    t0 = time.monotonic()
    if wait_until(lambda: _health(c)["state"] == "ok", within_s, step_s=0.2):
        return time.monotonic() - t0
    return None


def test_cold_read_errors_that_end_turn_health_ok_with_only_stats_calls(start_daemon, tmp_path):
    """SST reads fail with EIO (FUSE) while drafts read the cold tier: health turns degraded
    naming cold reads, and the daemon's own probes of cold reads fail meanwhile (the fault and
    its message stay).  Then the reads work again and only ``stats`` is called.  Proves: health
    is ``ok`` within 10 s and stats name the probe's last result.  (Issue 52: degraded for
    37.6 s and more, until drafts happened to read the cold tier.)"""
    with faults.ReadErrors(tmp_path) as fs:
        # tiny hot and recent tiers: most contexts are only in the cold tier
        d = start_daemon(table={"data_dir": str(fs.mnt), "hot_budget_mb": 0.05,
                                "recent_mb": 0.01})
        try:
            with d.client(timeout_ms=15_000, retries=0) as c:
                rng = np.random.default_rng(52)
                seqs = keyed_seqs(0, 2000, 32)
                for s in seqs:  # long contexts only: a draft needs the cold tier
                    s[3:] = rng.integers(100, 116, s.size - 3)
                c.ingest(seqs, key="k0")
                settle(c)
                fresh = iter(range(200, 2000))
                with fs.failing():
                    def cold_reads_failed() -> bool:
                        c.draft([seqs[next(fresh)][:16]], 8, budget_us=1e6)
                        return "cold reads" in _health(c)["faults"]
                    assert wait_until(cold_reads_failed, 60, step_s=0.01), \
                        "no cold read failed: the test did not test reads"
                    # no more drafts: the daemon's own probe fails while the fault lasts
                    assert wait_until(lambda: _health(c)["probes"].get("cold reads", {})
                                      .get("ok") is False, 30), _health(c)
                    h = _health(c)
                    assert h["state"] == "degraded" and "cold reads" in h["reason"], h
                    assert "cold reads" in h["faults"], h
                took = _ok_with_stats_only(c, RECOVER_WITHIN_S)
                h = _health(c)
                assert took is not None, (f"health still {h['state']!r} {RECOVER_WITHIN_S} s "
                                          f"after reads work again, with no drafts: {h}")
                probe = h["probes"]["cold reads"]
                assert probe["ok"] is True and probe["outcome"] == "ok", probe
                assert probe["at"] > 0, probe
        finally:
            d.kill()


def test_a_disk_that_was_full_turns_health_ok_with_only_stats_calls(start_daemon, tmp_path):
    """The data dir's filesystem (a loop-mounted ext4) is filled until an ingest answers
    ``storage``; health is degraded.  The space is freed and only ``stats`` is called.
    Proves: health is ``ok`` within 10 s, the probe of the ingest log says so, and every
    acknowledged sequence is counted exactly once.  (Before: the ``ingest`` fault cleared only
    at the next ingest that worked, so a drained node stayed degraded for good.)"""
    with faults.loop_fs(tmp_path) as mnt:
        d = start_daemon(table={"data_dir": str(mnt)})
        try:
            with d.client(timeout_ms=15_000, retries=0) as c:
                c.ingest(keyed_seqs(0, 64, 32), key="k0")
                acked = list(range(64))
                settle(c)
                with faults.disk_full(mnt):
                    err, _, _ = _ingest_until_error(c, 64, acked)
                    assert err.code == E.STORAGE, err
                    _assert_health(c, "degraded", 5, "after the storage error")
                    assert "ingest" in _health(c)["faults"], _health(c)
                    assert wait_until(lambda: _health(c)["probes"].get("ingest", {})
                                      .get("ok") is False, 30), _health(c)
                    assert _health(c)["state"] == "degraded"
                took = _ok_with_stats_only(c, RECOVER_WITHIN_S)
                h = _health(c)
                assert took is not None, (f"health still {h['state']!r} {RECOVER_WITHIN_S} s "
                                          f"after the space was freed, with no ingest: {h}")
                assert h["probes"]["ingest"]["ok"] is True, h["probes"]
                settle(c)
                n = counts(c, acked)
                assert (n == 1).all(), f"{int((n != 1).sum())} acked sequences not counted once"
        finally:
            d.kill()


# ---------------------------------------------------------------------------------------------
# the schedule, on the real Health with the clock as an argument
# ---------------------------------------------------------------------------------------------
def _health_of_a_quiet_table() -> Health:
    cold = SimpleNamespace(last_seq=lambda: 0, counted_seq=lambda: 0,
                           log=SimpleNamespace(quarantined=0))
    return Health(cold, lag_degraded_s=10.0, recover_s=3.0)


def test_probes_back_off_while_failing_keep_the_message_and_clear_when_the_part_works():
    h = _health_of_a_quiet_table()
    broken = {"yes": True}
    calls = []

    def check():
        calls.append(now)
        if broken["yes"]:
            raise StorageError("probe: still EIO")

    probes = Probes(h, {"cold reads": check}, first_s=0.25, max_s=2.0)
    now = 100.0
    assert probes.step(now) == 2.0 and not calls  # nothing fails: nothing probed
    h.fault("cold reads", StorageError("cold reads: EIO on page 7"))
    wait = probes.step(now)  # seen now, first probe 0.25 s later
    assert not calls and wait == 0.25
    for expect_wait in (0.5, 1.0, 2.0, 2.0):  # doubling to the cap while it fails
        now += wait
        wait = probes.step(now)
        assert calls[-1] == now and wait == expect_wait
    st = h.state()
    assert st["state"] == "degraded" and st["reason"] == "cold reads: EIO on page 7", st
    assert st["probes"]["cold reads"]["ok"] is False
    assert "still EIO" in st["probes"]["cold reads"]["outcome"]
    broken["yes"] = False
    now += wait
    probes.step(now)
    st = h.state()
    assert "cold reads" not in st["faults"] and st["probes"]["cold reads"]["ok"] is True
    assert probes.step(now + 0.1) == 2.0  # nothing fails any more: nothing due


def test_a_probe_that_only_starts_a_retry_does_not_clear_the_fault():
    h = _health_of_a_quiet_table()
    asked = []
    probes = Probes(h, {"hot rebuild": lambda: asked.append(1) or "a rebuild was asked"},
                    first_s=0.25, max_s=2.0)
    h.fault("hot rebuild", RuntimeError("rank failed"))
    probes.step(0.0)
    probes.step(0.25)
    st = h.state()
    assert asked and "hot rebuild" in st["faults"], st
    assert st["probes"]["hot rebuild"] == {"at": st["probes"]["hot rebuild"]["at"], "ok": True,
                                           "outcome": "a rebuild was asked"}
