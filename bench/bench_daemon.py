"""Daemon round trips against their anchors, measured in one run (docs/ARCHITECTURE.md §9).

* hot-hit draft round trip over ipc and tcp versus a bare ZeroMQ ping (a Python ROUTER echo
  in its own process, a bare DEALER client): target <= 1.5x;
* draft throughput with 1 and 4 client processes (pipelined, 16 in flight each);
* cold draft round trip with the RocksDB files evicted from the page cache
  (``posix_fadvise(DONTNEED)`` before every request) versus a raw 4 KiB ``O_DIRECT`` read on
  the same filesystem: target p99 <= 3x.

Prints a table of medians and ratios and writes ``bench/out/bench_daemon.json`` with the
machine and settings.  Usage: ``python bench/bench_daemon.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from ngram_client import NgramClient
from ngramd.wire import protocol as P

import data

OUT = Path(__file__).resolve().parent / "out"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(us: list[float]) -> dict:
    a = np.asarray(us)
    return {"n": int(a.size), "p50_us": float(np.median(a)), "p99_us": float(np.percentile(a, 99)),
            "mean_us": float(a.mean())}


def _timed(fn, n: int, warmup: int = 200) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def start_daemon(root: Path, name: str, sets: list[str], endpoints: list[str]):
    args = [sys.executable, "-m", "ngramd.service", "--name", name,
            "--data-dir", str(root / "data"), "--shm-dir", f"/dev/shm/ngramd-bench-{os.getpid()}",
            "--runtime-dir", str(root / "run"), "--log-level", "WARNING"]
    for ep in endpoints:
        args += ["--endpoint", ep]
    for s in sets:
        args += ["--set", s]
    log = open(root / f"{name}.log", "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    data.wait_ready(endpoints[0], proc, root / f"{name}.log", timeout_s=180, poll_s=0)
    return proc


def stop_daemon(proc) -> None:
    proc.terminate()
    proc.wait(60)


def unique_seqs(n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.permutation(150_000)[: n * length].astype(np.uint32)
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def _echo(endpoint: str, ready) -> None:
    """The anchor: the cheapest useful ZeroMQ server in Python (ROUTER, echo every message)."""
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(endpoint)
    ready.set()
    while True:
        m = s.recv_multipart()
        if m[-1] == b"quit":
            return
        s.send_multipart(m)


class EchoServer:
    """The anchor in its own process: the cheapest useful ZeroMQ server in Python."""

    def __init__(self, endpoint: str):
        ready = mp.Event()
        self.endpoint = endpoint
        self.proc = mp.Process(target=_echo, args=(endpoint, ready), daemon=True)
        self.proc.start()
        ready.wait(10)

    def close(self) -> None:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(self.endpoint)
        s.send(b"quit")
        self.proc.join(5)
        s.close()


def _dealer(endpoint: str) -> zmq.Socket:
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


def interleaved(fns: dict, n: int, rounds: int = 10) -> dict:
    """Time every fn ``n`` times in total, in ``rounds`` alternating blocks, so that a busy
    machine slows all of them alike (ratios within a round are what we compare)."""
    out = {k: [] for k in fns}
    for fn in fns.values():
        _timed(fn, 0, warmup=200)
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k] += _timed(fn, n // rounds, warmup=0)
    return out


def round_trips(label: str, daemon_ep: str, echo_ep: str, ctx: np.ndarray, n: int) -> dict:
    echo = EchoServer(echo_ep)
    bare = _dealer(echo_ep)
    raw = _dealer(daemon_ep)
    frames = P.encode_request("draft", 1, {"max_len": 8}, P.pack_batch([ctx]))

    def bare_ping():
        bare.send(b"ping")
        bare.recv()

    def raw_draft():  # the daemon's own cost: pre-encoded request, reply not decoded
        raw.send_multipart(frames, copy=False)
        raw.recv_multipart()
    with NgramClient(daemon_ep, timeout_ms=10_000) as c:
        got = interleaved({f"bare zmq ping ({label})": bare_ping,
                           f"raw DEALER draft, no client ({label})": raw_draft,
                           f"daemon ping ({label})": c.ping,
                           f"hot draft, 8 tokens ({label})": lambda: c.draft([ctx], 8)}, n)
    bare.close()
    raw.close()
    echo.close()
    rows = {k: _summary(v) for k, v in got.items()}
    base = rows[f"bare zmq ping ({label})"]["p50_us"]
    for k in list(rows)[1:]:
        rows[k]["ratio_to_bare_p50"] = rows[k]["p50_us"] / base
    return rows


_WORKER = r"""
import sys, time, json, numpy as np
from ngram_client import NgramClient
ep, dur, ctx = sys.argv[1], float(sys.argv[2]), np.array(json.loads(sys.argv[3]), np.uint32)
with NgramClient(ep, timeout_ms=10000) as c:
    for _ in range(100): c.draft([ctx], 8)
    inflight, n = [], 0
    t_end = time.perf_counter() + dur
    while time.perf_counter() < t_end:
        inflight.append(c.draft_async([ctx], 8))
        if len(inflight) >= 16:
            inflight.pop(0).result(); n += 1
    for f in inflight: f.result(); n += 1
print(n / dur)
"""


def throughput(endpoint: str, procs: int, ctx: np.ndarray, dur: float) -> float:
    """Drafts/s summed over ``procs`` client processes pipelining 16 requests each."""
    ps = [subprocess.Popen([sys.executable, "-c", _WORKER, endpoint, str(dur),
                            json.dumps(ctx.tolist())], stdout=subprocess.PIPE, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in range(procs)]
    return sum(float(p.communicate(timeout=dur + 120)[0]) for p in ps)


def odirect_reads(directory: Path, n: int) -> list[float]:
    """Random 4 KiB ``O_DIRECT`` reads of a 64 MiB file in ``directory`` (the disk, no cache)."""
    path = directory / "odirect.bin"
    size = 64 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rng = random.Random(0)
    try:
        us = []
        for _ in range(n):
            off = rng.randrange(size // 4096) * 4096
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            us.append((time.perf_counter() - t0) * 1e6)
        return us
    finally:
        os.close(fd)
        path.unlink()


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (smoke run)")
    ap.add_argument("--dir", help="work directory, kept afterwards (default: a temp dir under "
                                  "./var, removed afterwards)")
    args = ap.parse_args(argv)
    n = 500 if args.quick else 3000
    dur = 1.0 if args.quick else 3.0
    n_cold = 50 if args.quick else 300
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-daemon-", dir="var")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "loadavg": os.getloadavg(),
                    "python": platform.python_version(), "zmq": zmq.zmq_version(),
                    "pyzmq": zmq.__version__, "kernel": platform.release()},
        "settings": {"samples": n, "throughput_s": dur, "cold_samples": n_cold},
    }
    try:
        # ---- hot hits: ipc and tcp, against the bare echo --------------------------------
        port = _free_port()
        ipc = f"ipc://{root}/run/hot.sock"
        tcp = f"tcp://127.0.0.1:{port}"
        proc = start_daemon(root, "hot", ["table.hot_rebuild_s=0", "server.insecure=true"],
                            [ipc, tcp])  # plain tcp, as the bare echo it is compared with
        seqs = unique_seqs(200, 64, seed=1)
        with NgramClient(ipc, timeout_ms=60_000) as c:
            c.ingest(seqs)
            c.flush()
            c.rebuild_hot()
            ctx = seqs[0][:32]
            d = c.draft([ctx], 8)[0]
            res["hot_draft"] = {"length": len(d.tokens), "tiers": d.tiers.tolist()}
        rows = round_trips("ipc", ipc, f"ipc://{root}/run/echo.sock", ctx, n)
        rows.update(round_trips("tcp", tcp, f"tcp://127.0.0.1:{_free_port()}", ctx, n))
        res["round_trips"] = rows
        res["throughput"] = {f"{p} client process(es)": throughput(ipc, p, ctx, dur)
                             for p in (1, 4)}
        stop_daemon(proc)

        # ---- cold: page cache evicted before every draft ----------------------------------
        # a hot tier of one page and a recent table of 64 slots: the contexts are in RocksDB only
        cold_sets = ["table.hot_rebuild_s=0", "table.hot_budget_mb=0.05",
                     "table.recent_mb=0.002", "table.cold.block_cache_mb=1",
                     "table.warm_cache_entries=1024"]
        cep = f"ipc://{root}/run/cold.sock"
        proc = start_daemon(root, "cold", cold_sets, [cep])
        cold_seqs = unique_seqs(2000, 40, seed=2)
        with NgramClient(cep, timeout_ms=120_000) as c:
            for i in range(0, len(cold_seqs), 200):
                c.ingest(cold_seqs[i:i + 200])
            c.flush()
            c.rebuild_hot()  # publishes the one-page hot tier; the recent table has rolled on
        dbdir = root / "data" / "cold"
        cold_us, tiers = [], []
        with NgramClient(cep, timeout_ms=60_000) as c:
            for i in range(n_cold):  # a context never asked before: no warm-cache help
                data.evict_page_cache(sorted(dbdir.rglob("*.sst")))
                t0 = time.perf_counter()
                d = c.draft([cold_seqs[i + 1][:24]], 1, budget_us=1e6)[0]
                cold_us.append((time.perf_counter() - t0) * 1e6)
                tiers.append(int(d.tiers[0]) if len(d.tokens) else -1)
        stop_daemon(proc)
        raw = odirect_reads(root, n_cold)
        cold = _summary(cold_us)
        rawd = _summary(raw)
        res["cold"] = {"draft_evicted": cold, "odirect_4k": rawd,
                       "p99_ratio": cold["p99_us"] / rawd["p99_us"],
                       "p50_ratio": cold["p50_us"] / rawd["p50_us"],
                       "first_token_tiers": {str(t): tiers.count(t) for t in sorted(set(tiers))},
                       "db_bytes": sum(p.stat().st_size for p in dbdir.rglob("*.sst"))}
    finally:
        shutil.rmtree(f"/dev/shm/ngramd-bench-{os.getpid()}", ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    OUT.mkdir(exist_ok=True)
    (OUT / "bench_daemon.json").write_text(json.dumps(res, indent=2))
    print(report(res))
    return 0


def report(res: dict) -> str:
    lines = [f"machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, "
             f"load {', '.join(f'{x:.1f}' for x in res['machine']['loadavg'])}", "",
             f"{'round trip':34s} {'p50 µs':>9} {'p99 µs':>9} {'x bare p50':>10}"]
    for k, v in res["round_trips"].items():
        r = v.get("ratio_to_bare_p50")
        lines.append(f"{k:34s} {v['p50_us']:>9.1f} {v['p99_us']:>9.1f} "
                     f"{'' if r is None else f'{r:.2f}':>10}")
    lines.append(f"hot draft served by tiers {res['hot_draft']['tiers']}")
    lines.append("")
    for k, v in res["throughput"].items():
        lines.append(f"throughput, {k:24s} {v:>10.0f} drafts/s")
    c = res["cold"]
    lines += ["", f"{'cold (page cache evicted)':34s} {'p50 µs':>9} {'p99 µs':>9}",
              f"{'draft, 1 token':34s} {c['draft_evicted']['p50_us']:>9.1f} "
              f"{c['draft_evicted']['p99_us']:>9.1f}",
              f"{'raw 4 KiB O_DIRECT read':34s} {c['odirect_4k']['p50_us']:>9.1f} "
              f"{c['odirect_4k']['p99_us']:>9.1f}",
              f"ratio p50 {c['p50_ratio']:.2f}, p99 {c['p99_ratio']:.2f} (target p99 <= 3); "
              f"first-token tiers {c['first_token_tiers']} (2 = cold)"]
    return "\n".join(lines)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
