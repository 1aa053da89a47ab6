"""A flood of random ids against a real daemon: does backpressure hold (issue 53, item 2)?

Issue 53's black-box run: 4 clients ingested sequences of 2,000 random ids as fast as they
could for 90 s; 12,617 batches were acknowledged and no ``busy`` came back, while counting ran
at ~10 records/s (a 494k-record backlog, ~14 h of counting).  Here the same flood (``--clients``
threads, each sending batches of ``--batch`` sequences of ``--seq-tokens`` random ids, resending
a ``busy`` batch with the same key after its ``retry_ms``) runs for ``--seconds`` against a
fresh daemon (its defaults, ``--set`` overrides), then stops, and the bench waits for the
backlog to drain.

Prints: batches acknowledged, ``busy`` answers by bound, the time to the first ``busy`` (from
the flood's start, and from the first sample whose forecast passed the bound), the largest
backlog sampled (records, bytes, forecast), the drain time after the flood, the measured
counting rate, and tokens counted against tokens acknowledged (exactly once).  Writes
``bench/out/flood.json`` with the machine.  Targets (issue 53): ``busy`` within 10 s, the
backlog within its bound, drained within ``backlog_s`` after the flood.

Usage: ``OMP_NUM_THREADS=1 python bench/bench_flood.py [--seconds 60] [--set server.backlog_s=60]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ngram_client import DaemonError, DaemonUnavailable, NgramClient, Timeout
from ngramd.wire.errors import BUSY

import data
from machine import machine_info

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
VOCAB = 151_000  # ids below Qwen3's vocabulary


class Flood:
    """Client threads flooding batches of random ids until ``stop``; each thread ends once its
    last batch is acknowledged."""

    def __init__(self, endpoint: str, clients: int, batch: int, seq_tokens: int):
        self.endpoint, self.batch, self.seq_tokens = endpoint, batch, seq_tokens
        self.acked_batches = self.acked_tokens = 0
        self.busy: list[float] = []  # monotonic times of busy answers
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True)
                         for w in range(clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.1))

    def _run(self, worker: int) -> None:
        rng = np.random.default_rng(worker)
        with NgramClient(self.endpoint, timeout_ms=60_000, retries=0) as c:
            c.busy_wait_s = 0
            n = 0
            while not self.stop.is_set():
                seqs = list(rng.integers(0, VOCAB, (self.batch, self.seq_tokens), np.uint32))
                if self._send(c, seqs, f"w{worker}-{n}"):
                    with self._lock:
                        self.acked_batches += 1
                        self.acked_tokens += self.batch * self.seq_tokens
                n += 1

    def _send(self, c, seqs, key: str) -> bool:
        while True:
            try:
                c.ingest(seqs, key=key)
                return True
            except DaemonError as e:
                if e.code != BUSY:
                    self.errors.append(f"{e.code}: {e}"[:200])
                    return False
                with self._lock:
                    self.busy.append(time.monotonic())
                time.sleep((e.retry_ms or 100) / 1000)
            except (Timeout, DaemonUnavailable):
                continue  # the same key: harmless if it was written


def sample(endpoint: str, stop: threading.Event, out: list) -> None:
    """``stats`` every 0.5 s: (monotonic time, backlog, what the threads do (spill, merge),
    runs on disk)."""
    with NgramClient(endpoint, timeout_ms=30_000, retries=0) as c:
        while not stop.is_set():
            try:
                s = c.stats()
                out.append((time.monotonic(), s["server"]["backlog"], s.get("activity", {}),
                            s.get("cold", {}).get("runs", 0)))
            except (Timeout, DaemonUnavailable):
                pass
            stop.wait(0.5)


def start_daemon(root: Path, sets: list[str]) -> subprocess.Popen:
    shm = f"/dev/shm/ngramd-bench-flood-{os.getpid()}"
    args = data.daemon_args("flood", root, shm, sets)
    proc = subprocess.Popen(args, stdout=open(root / "flood.log", "ab"),
                            stderr=subprocess.STDOUT)
    with NgramClient(f"ipc://{root}/run/flood.sock", timeout_ms=500, retries=0) as c:
        deadline = time.monotonic() + 300
        while True:
            try:
                c.ping()
                return proc
            except DaemonUnavailable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((root / "flood.log").read_text()[-3000:])


def run(args, root: Path) -> dict:
    proc = start_daemon(root, args.set)
    endpoint = f"ipc://{root}/run/flood.sock"
    samples: list = []
    stop = threading.Event()
    threading.Thread(target=sample, args=(endpoint, stop, samples), daemon=True).start()
    try:
        f = Flood(endpoint, args.clients, args.batch, args.seq_tokens)
        t0 = time.monotonic()
        f.start()
        time.sleep(args.seconds)
        f.join(600)
        t_end = time.monotonic()
        with NgramClient(endpoint, timeout_ms=30_000, retries=0) as c:
            while c.stats()["server"]["backlog"]["records"] > 0:
                if time.monotonic() - t_end > args.drain_limit_s:
                    break
                time.sleep(0.5)
            t_drained = time.monotonic()
            s = c.stats()
        return summarise(args, f, samples, s, t0, t_end, t_drained)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        shutil.rmtree(f"/dev/shm/ngramd-bench-flood-{os.getpid()}", ignore_errors=True)


def summarise(args, f: Flood, samples: list, s: dict, t0, t_end, t_drained) -> dict:
    b = s["server"]["backlog"]
    passed = [t for t, x, _, _ in samples if x["forecast_s"] > x["limit_s"]]
    first_busy = min(f.busy) if f.busy else None
    during = [x for t, x, _, _ in samples if t <= t_end]
    drain = [(a, runs) for t, _, a, runs in samples if t_end < t <= t_drained]
    return {
        "seconds": args.seconds, "clients": args.clients, "batch": args.batch,
        "seq_tokens": args.seq_tokens, "sets": args.set,
        "acked_batches": f.acked_batches, "acked_tokens": f.acked_tokens,
        "errors": f.errors[:5], "busy_answers": len(f.busy), "busy_by_bound": b["busy"],
        "first_busy_s": None if first_busy is None else round(first_busy - t0, 2),
        "first_busy_after_forecast_passed_s": None if first_busy is None or not passed
        else round(first_busy - min(passed), 2),
        "limit_s": b["limit_s"], "limit_bytes": b["limit_bytes"],
        "max_backlog_records": max((x["records"] for x in during), default=0),
        "max_backlog_bytes": max((x["bytes"] for x in during), default=0),
        "max_forecast_s": max((x["forecast_s"] for x in during), default=0.0),
        "max_age_s": max((x["lag_s"] for x in during), default=0.0),
        "flood_s": round(t_end - t0, 1), "drain_s": round(t_drained - t_end, 1),
        "drained": b["records"] == 0,
        "rate_records_s": b["rate_records_s"], "rate_bytes_s": b["rate_bytes_s"],
        "flood_rate_records_s": round(float(np.median([x["rate_records_s"] for x in during]))
                                      if during else 0.0, 1),
        "counted_tokens": s["ingested_tokens"],
        # why the drain takes what it takes: the share of its samples with a merge or a spill
        # running, and the runs on disk
        "drain_merging": round(sum(bool(a.get("merge")) for a, _ in drain) / max(len(drain), 1),
                               2),
        "drain_spilling": round(sum(bool(a.get("spill")) for a, _ in drain) / max(len(drain), 1),
                                2),
        "max_runs_seen": max((runs for _, runs in drain), default=0),
    }


def report(r: dict) -> str:
    rows = [("batches acknowledged", f"{r['acked_batches']} ({r['acked_tokens']:,} tokens)"),
            ("busy answers", f"{r['busy_answers']} (by bound: {r['busy_by_bound']})"),
            ("first busy", f"{r['first_busy_s']} s into the flood; "
                           f"{r['first_busy_after_forecast_passed_s']} s after a sample showed "
                           f"the forecast past {r['limit_s']:g} s"),
            ("largest backlog", f"{r['max_backlog_records']} records, "
                                f"{r['max_backlog_bytes'] / 2**20:.0f} MiB, forecast "
                                f"{r['max_forecast_s']:.0f} s, oldest {r['max_age_s']:.0f} s"),
            ("drain after the flood", f"{r['drain_s']} s" + ("" if r["drained"] else
                                                              " (NOT drained)")),
            ("counting rate", f"{r['flood_rate_records_s']:.1f} records/s (median during "
                              f"the flood), {r['rate_records_s']:.1f} records/s "
                              f"({r['rate_bytes_s'] / 2**20:.2f} MiB/s) at the end"),
            ("during the drain", f"a merge ran in {r['drain_merging']:.0%} of the samples, a "
                                 f"spill in {r['drain_spilling']:.0%}; up to "
                                 f"{r['max_runs_seen']} runs"),
            ("counted / acknowledged", f"{r['counted_tokens']:,} / {r['acked_tokens']:,} tokens"),
            ("errors", "; ".join(r["errors"]) or "none")]
    return "\n".join(f"{k:26s} {v}" for k, v in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--batch", type=int, default=40, help="sequences a request (issue 53: "
                    "494k records in 12,617 batches)")
    ap.add_argument("--seq-tokens", type=int, default=2000)
    ap.add_argument("--drain-limit-s", type=float, default=1800.0)
    ap.add_argument("--set", action="append", default=[], help="daemon --set KEY=VALUE")
    ap.add_argument("--root", help="where the daemon's data goes (default: a temp dir)")
    args = ap.parse_args(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="bench-flood-"))
    root.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    try:
        r = run(args, root)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    print(report(r))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "flood.json").write_text(json.dumps({"machine": info, "result": r}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
