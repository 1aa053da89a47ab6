"""Runs' SST files are written by a helper process (``ngramd.cold.sstwriter``), so a write that
waits in the kernel (RocksDB's writer drops its file's pages each MiB, a call that waited 1-30 s
beside busy processes, all with the GIL held) never stops the daemon's serving thread
(issue 31).  Proves, on a real daemon: while the helper is stopped mid-spill, the daemon
answers pings and drafts at once; a helper that dies fails one spill, which the next one redoes
without a restart or a lost count; and the helper's contract (errors come back as the text
RocksDB gave; it outlives no parent; Ctrl-C and a service stop are the daemon's to act on)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import faults
from conftest import wait_until
from faults import counts, keyed_seqs, settle
from ngram_client import DaemonError
from ngramd.cold import sstwriter
from ngramd.wire import errors as E


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's ``children`` list)."""
    out = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


def _helper_of(pid: int, within_s: float = 60.0) -> int:
    """The daemon's helper process, as soon as it exists (polled every 2 ms)."""
    kids = wait_until(lambda: _children(pid), within_s, 0.002)
    if not kids:
        pytest.fail(f"no helper process under pid {pid} within {within_s:g} s")
    return kids[0]


def _flush_in_thread(d, out: dict) -> threading.Thread:
    def run():
        with d.client(timeout_ms=120_000, retries=0) as c:
            try:
                c.flush(timeout_ms=120_000)
                out["flush"] = "ok"
            except DaemonError as e:
                out["flush"] = e.code
                out["msg"] = str(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_stopped_helper_costs_the_serving_thread_nothing(start_daemon):
    """The helper is SIGSTOPped as soon as a flush's spill starts it (a writer stuck in the
    kernel, the worst case): for 2 s the flush waits, and meanwhile pings and drafts are
    answered as fast as a host that woke a bystander process on time allows.  Once it runs
    again the flush completes and every sequence is counted once."""
    d = start_daemon(table={"spill_idle_s": 600.0})
    known = keyed_seqs(0, 64, 32)
    with d.client(timeout_ms=30_000) as c:
        c.ingest(known)
        out: dict = {}
        flusher = _flush_in_thread(d, out)
        helper = _helper_of(d.proc.pid)
        os.kill(helper, signal.SIGSTOP)
        try:
            lat = []
            with faults.bystander() as host:
                t_end = time.monotonic() + 2.0
                while time.monotonic() < t_end:
                    t0 = time.monotonic()
                    c.ping()
                    got = c.draft([known[1][:8]], 8)[0]
                    lat.append(time.monotonic() - t0)
                    assert got.tokens.tolist() == known[1][8:8 + len(got.tokens)].tolist()
            assert flusher.is_alive() and "flush" not in out, \
                f"the flush did not wait for the stopped helper: {out}"
        finally:
            os.kill(helper, signal.SIGCONT)
        flusher.join(120)
        assert out.get("flush") == "ok", out
        assert len(lat) >= 10 and max(lat) < 0.5 + host["late_s"], \
            f"{len(lat)} answers, slowest {max(lat):.3f} s (bystander late {host['late_s']:.3f} s)"
        settle(c)
        assert (counts(c, range(64)) == 1).all()
    d.kill()


def test_a_helper_that_dies_fails_one_spill_and_the_next_one_writes_everything(start_daemon):
    """The helper is SIGKILLed as soon as a flush's spill starts it: that flush fails with a
    storage error naming the helper, no file of the run is left behind, and the next flush
    (a new helper) writes the run: every sequence counted once, the daemon never restarted."""
    d = start_daemon(table={"spill_idle_s": 600.0})
    pid = d.proc.pid
    with d.client(timeout_ms=60_000, retries=0) as c:
        c.ingest(keyed_seqs(0, 64, 32))
        out: dict = {}
        flusher = _flush_in_thread(d, out)
        helper = _helper_of(pid)
        os.kill(helper, signal.SIGKILL)
        flusher.join(120)
        assert out.get("flush") == E.STORAGE, out
        assert "SST writer process" in out["msg"], out["msg"]
        faults.flush_until_ok(c, 60, timeout_ms=60_000)  # the spill thread may write the run
        settle(c)
        assert (counts(c, range(64)) == 1).all()
        ingest_dir = d.root / "data" / "t" / "ingest"  # where runs' files are written
        assert ingest_dir.is_dir()
        left = sorted(p.name for p in ingest_dir.iterdir())
        assert left == [], left
    assert d.proc.poll() is None and d.proc.pid == pid
    d.kill()


# ---------------------------------------------------------------------------------------------
# the helper's contract
# ---------------------------------------------------------------------------------------------
def _begin(h: sstwriter.SstHelper, stem: Path) -> None:
    h.call({"op": "begin", "stem": str(stem), "file_bytes": 1 << 20, "sync_bytes": 1 << 16,
            "compression": "lz4", "block_size_kb": 4})


def _pages(n: int, size: int, seed: int = 0):
    blob = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    return (np.arange(n, dtype=np.uint64), np.arange(n + 1, dtype=np.int64) * size, blob)


def test_the_helper_writes_files_rocksdb_reads_back(tmp_path):
    """Pages put through the helper are split into files of ``file_bytes``; RocksDB ingests
    the files and returns every value."""
    from rocksdict import Options, Rdict
    h = sstwriter.helpers.acquire()
    try:
        _begin(h, tmp_path / "run7")
        ids, bstart, blob = _pages(600, 4096)  # 2.4 MiB: three files of 1 MiB
        assert h.call({"op": "put", "prefix": b"P"}, ids, bstart, blob)["bytes"] == blob.size
        files = h.call({"op": "finish"})["files"]
    finally:
        sstwriter.helpers.release(h)
    assert [Path(f).name for f in files] == ["run7-0.sst", "run7-1.sst", "run7-2.sst"]
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    try:
        db.ingest_external_file(files)
        for i in (0, 299, 599):
            assert db[b"P" + i.to_bytes(8, "big")] == blob[i * 4096:(i + 1) * 4096].tobytes()
    finally:
        db.close()


def test_an_error_in_the_helper_comes_back_with_rocksdbs_text(tmp_path):
    """A file that cannot be created (its directory is missing): the put raises what RocksDB
    said, and the helper stays usable for the next run."""
    h = sstwriter.helpers.acquire()
    try:
        _begin(h, tmp_path / "missing" / "run1")
        with pytest.raises(Exception) as e:
            h.call({"op": "put", "prefix": b"P"}, *_pages(4, 64))
        assert "IO error" in str(e.value) and "missing" in str(e.value), e.value
        _begin(h, tmp_path / "run2")
        h.call({"op": "put", "prefix": b"P"}, *_pages(4, 64))
        assert len(h.call({"op": "finish"})["files"]) == 1
    finally:
        sstwriter.helpers.release(h)


def test_the_helper_leaves_signals_to_the_daemon_and_exits_with_it(tmp_path):
    """SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C, a service manager's stop and reload
    reach the whole group) leave the helper serving; when the daemon is gone (its stdin
    closes) the helper exits at once."""
    h = sstwriter.SstHelper()
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            _begin(h, tmp_path / "run1")  # a round trip: it is up and has its handlers
            os.kill(h.pid, sig)
        _begin(h, tmp_path / "run1")
        assert h.proc.poll() is None
        h.proc.stdin.close()
        assert h.proc.wait(10) == 0
    finally:
        h.close()
    # a daemon killed outright: its helper sees EOF and exits too
    code = ("import sys, time; from ngramd.cold import sstwriter; h = sstwriter.helpers.acquire(); "
            "print(h.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and \
                Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the helper outlived its daemon by 10 s"
            time.sleep(0.05)
    finally:
        parent.kill()
