"""The table's write path against its ARCHITECTURE §9 targets, measured in one run (issue 7).

Corpus: the CPython standard library (7.87M Qwen3 tokens, one sequence per file; bench/data.py).

1. **Bulk warm-up, tokens already ids** (orders 1..16): ``ColdStore.bulk_load`` into an empty
   table, ``--rounds`` times (a fresh directory each), median tokens/s; both cores, 2 GiB.
2. **``ngram-client ingest --flush`` from text, end to end**: a real daemon (defaults), the
   CLI on the standard library's files (tokenizing included), wall time to the flush reply.
3. **Online ingest while serving drafts**, on the table of (2):
   * idle: a client drafts held-out 32-token contexts back to back (p50/p99);
   * loaded: an ingest process sends generator-like sequences (512 tokens of held-out code)
     at the target rate (50k tokens/s) while the client drafts; then at full speed;
   * the daemon's own stall monitor (a thread that sleeps 10 ms and records how late it
     wakes: GIL or CPU starvation) gives the longest stall of a daemon thread;
   * freshness: meanwhile a probe ingests a unique 64-token sequence every 0.25 s and polls
     an in-process ``HotReader`` (the generators' path) until it drafts it: ack -> draftable.
4. **Idle CPU**: the daemon's CPU seconds over 30 s of no requests, after it settled.
5. **Restart to first draft**: SIGTERM, start again, time until a draft is answered.
6. **RSS**: the daemon's peak RSS (VmHWM) minus the memory its config sets aside (block
   cache, hot budget, recent tables, delta x 2, filters).

SuffixDecoding's ~150k tokens/s on the same corpus (issue 7, measured on this machine by an
earlier session) is printed beside row 1.  Prints a table, writes ``bench/out/ingest.json``.
Usage: ``OMP_NUM_THREADS=1 python bench/bench_ingest.py [--quick]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
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

from ngram_client import DaemonUnavailable, NgramClient
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.hot.shm import HotReader
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules

import data
from machine import machine_info

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
SUFFIX_DECODING_TOK_S = 150_000  # issue 7: SuffixDecoding's global tree, same corpus, this VM
TARGETS = {"bulk": 500_000, "client": 250_000, "online": 50_000, "fresh_p99_s": 1.0,
           "stall_ms": 20.0, "restart_s": 2.0, "rss_beyond_mb": 350, "idle_cpu_s_per_90": 0.5}


# ---------------------------------------------------------------------------------------------
# daemon helpers
# ---------------------------------------------------------------------------------------------
class Daemon:
    def __init__(self, root: Path, name: str, sets: list[str] = ()):
        self.root, self.name, self.sets = root, name, list(sets)
        self.shm = f"/dev/shm/ngramd-bench-ingest-{os.getpid()}"
        self.endpoint = f"ipc://{root}/run/{name}.sock"
        self.proc = None
        self.phase = "start"
        self.peak_mb: dict[str, float] = {}  # phase -> peak VmRSS seen (sampled every 0.2 s)
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _sample_rss(self) -> None:
        while True:
            time.sleep(0.2)
            if self.proc is None or self.proc.poll() is not None:
                continue
            with contextlib.suppress(OSError):
                mb = self.status_kb("VmRSS") / 1024
                if mb > self.peak_mb.get(self.phase, 0.0):
                    self.peak_mb[self.phase] = mb

    def start(self, timeout_s: float = 300) -> float:
        """Start and wait until a draft is answered; returns the seconds that took."""
        args = data.daemon_args(self.name, self.root, self.shm, self.sets)
        logf = open(self.root / f"{self.name}.log", "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + timeout_s
        with NgramClient(self.endpoint, timeout_ms=200, retries=0) as c:
            while True:
                try:
                    c.draft([np.arange(8, dtype=np.uint32)], 4)
                    return time.perf_counter() - t0
                except DaemonUnavailable:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError((self.root / f"{self.name}.log").read_text()[-4000:])
                    time.sleep(0.005)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)

    def cpu_s(self) -> float:
        return data.cpu_s(self.proc.pid)

    def status_kb(self, key: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0


# ---------------------------------------------------------------------------------------------
# 1. bulk
# ---------------------------------------------------------------------------------------------
def bench_bulk(tokens, offsets, root: Path, rounds: int) -> dict:
    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=151_936)
    rates, info = [], {}
    for r in range(rounds):
        d = root / f"bulk{r}"
        shutil.rmtree(d, ignore_errors=True)
        with ColdStore(d, ident, ColdOptions(sync_log=False)) as s:
            t0 = time.perf_counter()
            run = s.bulk_load(tokens, offsets, threads=2, mem_mb=2048)
            dt = time.perf_counter() - t0
            st = s.stats()
        rates.append(tokens.size / dt)
        info = {"rows": run.rows, "run_bytes": run.bytes, "sst_bytes": st["sst_bytes"],
                "bytes_per_row_sst": st["sst_bytes"] / run.rows, "seconds": dt}
        shutil.rmtree(d, ignore_errors=True)
    return {"tokens": int(tokens.size), "tokens_per_s": rates,
            "median_tokens_per_s": float(np.median(rates)), **info}


# ---------------------------------------------------------------------------------------------
# 2. client ingest from text
# ---------------------------------------------------------------------------------------------
def bench_client_ingest(daemon: Daemon, files: list[Path], n_tokens: int) -> dict:
    state = daemon.root / "ingest-state.json"
    cmd = [sys.executable, "-m", "ngram_client.cli", "--endpoint", daemon.endpoint,
           "ingest", "--tokenizer", str(data.qwen_tokenizer_path()), "--flush", "--no-progress",
           "--state", str(state), *map(str, files)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    dt = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(out.stderr[-4000:])
    return {"tokens": n_tokens, "seconds": dt, "tokens_per_s": n_tokens / dt,
            "output": out.stdout.strip().splitlines()[-1:]}


# ---------------------------------------------------------------------------------------------
# 3. online ingest while serving
# ---------------------------------------------------------------------------------------------
_LOADER = r"""
import sys, time, json, numpy as np
from ngram_client import NgramClient
ep, rate, dur, path = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
seqs = list(np.load(path))
sent, i, inflight = 0, 0, []
with NgramClient(ep, timeout_ms=60000) as c:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < dur:
        batch = [seqs[(i + j) % len(seqs)] for j in range(16)]  # 16 x 512 = 8192 tokens
        i += 16
        inflight.append(c.ingest_async(batch))
        sent += sum(s.size for s in batch)
        while len(inflight) > 8:
            inflight.pop(0).result()
        if rate > 0:
            ahead = sent / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        elif i % 64 == 0:  # full speed, but never more than ~0.5M tokens ahead of counting
            while c.stats()["log_lag"] > 1000 and time.perf_counter() - t0 < dur:
                time.sleep(0.2)  # (a record here is one 512-token sequence)
    for f in inflight:
        f.result()
    print(json.dumps({"sent": sent, "seconds": time.perf_counter() - t0}))
"""


def drafter(endpoint: str, ctxs: np.ndarray, stop: threading.Event, out: list) -> None:
    with NgramClient(endpoint, timeout_ms=60_000) as c:
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            c.draft([ctxs[i % len(ctxs)]], 8)
            out.append((time.perf_counter() - t0) * 1e6)
            i += 1


def freshness_probe(daemon: Daemon, stop: threading.Event, out: list, seed: int) -> None:
    """Ingest a unique sequence, poll the in-process hot + recent path until it drafts it."""
    rng = np.random.default_rng(seed)
    with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
        info = c.info()
        reader = HotReader(info["hot"]["shm_dir"], info["hot"]["table"],
                           identity=TableIdentity(**info["identity"]))
        rules = DraftRules(n_min=reader.n_min, n_max=reader.n_max, c_min=1, s_min=0.0, p_cum=0.0)
        while not stop.is_set():
            seq = rng.integers(100_000, 150_000, 64).astype(np.uint32)  # unseen 8-grams
            c.ingest([seq])  # returns once durable: the clock starts at the ack
            t0 = time.perf_counter()
            while True:
                d = reader.draft(seq[:40], 4, rules)
                if d.tokens.tolist() == seq[40:44].tolist():
                    out.append(time.perf_counter() - t0)
                    break
                if time.perf_counter() - t0 > 10:
                    out.append(float("inf"))
                    break
                time.sleep(0.0005)
            stop.wait(0.25)
        reader.close()


def stall_in(stats: dict, t0: float, t1: float) -> float:
    """Longest daemon thread stall (ms) between unix times t0 and t1 (per-second maxima)."""
    ms = [m for t, m in stats["server"]["stall"]["recent_ms"] if t0 - 1 <= t <= t1 + 1]
    return max(ms, default=0.0)


def settle(daemon: Daemon, quiet_s: float = 20.0, limit_s: float = 900.0) -> float:
    """Wait until the daemon is quiet: no new run, no new hot generation and the log counted,
    for ``quiet_s`` in a row; returns the seconds waited."""
    t0 = time.monotonic()
    last, since = None, time.monotonic()
    with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
        while time.monotonic() - t0 < limit_s:
            st = c.stats()
            busy = any(st["activity"].values()) or \
                st["hot"]["counted_seq"] != st["cold"]["counted_seq"]  # a rebuild is due
            now = (st["cold"]["runs"], st["cold"]["run_rows"], st["hot"]["generation"],
                   st["log_lag"], st["cold"]["delta_rows"], busy)
            if now != last or busy:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
            time.sleep(1.0)
    return time.monotonic() - t0


def load_phase(daemon: Daemon, ctxs, seq_path: Path, rate: float, dur: float) -> dict:
    stop = threading.Event()
    lat, fresh = [], []
    with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
        before = c.stats()
    threads = [threading.Thread(target=drafter, args=(daemon.endpoint, ctxs, stop, lat)),
               threading.Thread(target=freshness_probe, args=(daemon, stop, fresh, int(rate)))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    u0 = time.time()
    loader = subprocess.run([sys.executable, "-c", _LOADER, daemon.endpoint, str(rate),
                             str(dur), str(seq_path)], capture_output=True, text=True,
                            timeout=dur + 600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if loader.returncode:
        stop.set()
        raise RuntimeError(loader.stderr[-3000:])
    sent = json.loads(loader.stdout)
    # wait until the daemon has counted what was sent: the sustained rate includes catching up
    with NgramClient(daemon.endpoint, timeout_ms=600_000) as c:
        while c.stats()["log_lag"] > 0:
            time.sleep(0.05)
        counted_s = time.perf_counter() - t0
        after = c.stats()
    stop.set()
    for t in threads:
        t.join()
    counted = after["ingested_tokens"] - before["ingested_tokens"]
    fr = np.asarray(fresh)
    ok = fr[np.isfinite(fr)]
    return {"target_rate": rate, "sent_tokens": sent["sent"], "send_s": sent["seconds"],
            "counted_tokens": counted, "counted_tokens_per_s": counted / counted_s,
            "catch_up_s": counted_s - sent["seconds"],
            "draft": data.summary(lat),
            "stall_ms": stall_in(after, u0, time.time()),
            "freshness_s": {"n": int(fr.size), "timed_out": int(fr.size - ok.size),
                            "p50": float(np.median(fr)) if fr.size else None,
                            "p99": float(np.percentile(ok, 99)) if ok.size == fr.size and ok.size
                            else float("inf"),
                            "max": float(fr.max()) if fr.size else None}}


def idle_phase(daemon: Daemon, ctxs, dur: float) -> dict:
    stop = threading.Event()
    lat = []
    t = threading.Thread(target=drafter, args=(daemon.endpoint, ctxs, stop, lat))
    u0 = time.time()
    t.start()
    time.sleep(dur)
    stop.set()
    t.join()
    with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
        st = c.stats()
    return {"draft": data.summary(lat), "stall_ms": stall_in(st, u0, time.time())}


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M tokens, short phases (smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="work directory (default: a temp dir under ./var)")
    args = ap.parse_args(argv)
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ingest-", dir="var")).resolve()
    (root / "run").mkdir(parents=True, exist_ok=True)
    tok = data.qwen_tokenizer()
    files = data.stdlib_files()
    tokens, offsets = data.stdlib_corpus(tok)
    n_files = len(files)
    if args.quick:
        cut = int(np.searchsorted(offsets, 1_000_000))
        tokens, offsets, files = tokens[:offsets[cut]], offsets[:cut + 1], files[:cut]
    phase_s = 6.0 if args.quick else 20.0
    res: dict = {"machine": machine_info(("numpy", "numba", "rocksdict", "pyzmq")),
                 "settings": {"corpus": "CPython stdlib .py files", "files": len(files),
                              "tokens": int(tokens.size), "rounds": args.rounds,
                              "phase_s": phase_s, "daemon": "defaults (TableConfig)"},
                 "targets": TARGETS}
    daemon = Daemon(root, "t")
    try:
        print(f"1. bulk load of {tokens.size} tokens x {args.rounds} ...", file=sys.stderr)
        res["bulk"] = bench_bulk(tokens, offsets, root, 1 if args.quick else args.rounds)

        print("2. ngram-client ingest --flush from text ...", file=sys.stderr)
        daemon.start()
        daemon.phase = "client ingest"
        res["client_ingest"] = bench_client_ingest(daemon, files, int(tokens.size))

        # held-out contexts and generator-like sequences: the last 10% of the files' tokens
        rng = np.random.default_rng(0)
        held = tokens[int(offsets[int(n_files * 0.9)]) if not args.quick else 0:]
        starts = rng.integers(0, held.size - 600, 4000)
        ctxs = np.stack([held[s:s + 32] for s in starts[:2000]])
        seqs = np.stack([held[s:s + 512] for s in starts])
        seq_path = root / "seqs.npy"
        np.save(seq_path, seqs)
        print("3. drafts idle, then under 50k tokens/s of ingest, then at full speed ...",
              file=sys.stderr)
        daemon.phase = "settle after ingest"
        res["settle_before_idle_s"] = settle(daemon)  # merges and the hot rebuild done
        daemon.phase = "idle drafts"
        res["idle"] = idle_phase(daemon, ctxs, phase_s / 2)
        daemon.phase = "online at target"
        res["online_target"] = load_phase(daemon, ctxs, seq_path, TARGETS["online"], phase_s)
        daemon.phase = "online at full speed"
        res["online_full"] = load_phase(daemon, ctxs, seq_path, 0.0, phase_s)
        daemon.phase = "flush and settle"

        print("4. idle CPU ...", file=sys.stderr)
        with NgramClient(daemon.endpoint, timeout_ms=600_000) as c:
            c.flush()
        res["settle_before_idle_cpu_s"] = settle(daemon)
        c0, t0 = daemon.cpu_s(), time.perf_counter()
        time.sleep(10 if args.quick else 30)
        res["idle_cpu_s_per_90"] = (daemon.cpu_s() - c0) / (time.perf_counter() - t0) * 90
        res["rss"] = {"vm_hwm_mb": daemon.status_kb("VmHWM") / 1024,
                      "vm_rss_mb": daemon.status_kb("VmRSS") / 1024}
        with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
            st = c.stats()
        mem = st["memory"]
        configured = (mem["block_cache_bytes"] + mem["hot_bytes"] + mem["recent_bytes"]
                      + 2 * (128 << 20) + mem["filter_bytes"] + mem["warm_bytes"]
                      + mem["count_buffers_bytes"])
        res["rss"].update(configured_mb=configured / 2**20, memory=mem,
                          peak_by_phase_mb={k: round(v) for k, v in daemon.peak_mb.items()},
                          beyond_configured_mb=res["rss"]["vm_hwm_mb"] - configured / 2**20,
                          table_rows=st["cold"]["entries_total"], runs=st["cold"]["runs"])

        print("5. restart ...", file=sys.stderr)
        daemon.stop()
        res["restart_s"] = daemon.start()
        res["restart_rows"] = res["rss"]["table_rows"]
    finally:
        daemon.stop()
        shutil.rmtree(daemon.shm, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    OUT.mkdir(exist_ok=True)
    res["command"] = " ".join(["python", "bench/bench_ingest.py", *(argv or sys.argv[1:])])
    (OUT / "ingest.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


def _k(x) -> str:
    return f"{x / 1e3:.0f}k"


def report(r: dict) -> str:
    m = r["machine"]
    on, full, idle = r["online_target"], r["online_full"], r["idle"]
    rows = [
        ("bulk warm-up, orders 1..16, ids (median of "
         f"{len(r['bulk']['tokens_per_s'])})", f"{_k(r['bulk']['median_tokens_per_s'])} tok/s",
         f">= {_k(TARGETS['bulk'])}", f"SuffixDecoding ~{_k(SUFFIX_DECODING_TOK_S)}"),
        ("ngram-client ingest --flush, from text",
         f"{_k(r['client_ingest']['tokens_per_s'])} tok/s", f">= {_k(TARGETS['client'])}",
         f"{r['client_ingest']['seconds']:.1f} s"),
        ("online ingest at the target rate, counted",
         f"{_k(on['counted_tokens_per_s'])} tok/s", f">= {_k(TARGETS['online'])}",
         f"draft p99 {on['draft']['p99_us']:.0f} µs vs idle {idle['draft']['p99_us']:.0f} µs "
         f"({on['draft']['p99_us'] / idle['draft']['p99_us']:.2f}x, target <= 2x)"),
        ("online ingest at full speed, counted", f"{_k(full['counted_tokens_per_s'])} tok/s",
         "", f"draft p99 {full['draft']['p99_us']:.0f} µs "
             f"({full['draft']['p99_us'] / idle['draft']['p99_us']:.2f}x idle); sender kept "
             f"<= 0.5M tokens ahead of counting"),
        ("longest daemon thread stall (target rate / full)",
         f"{on['stall_ms']:.1f} / {full['stall_ms']:.1f} ms",
         f"<= {TARGETS['stall_ms']:.0f} ms", f"idle {idle['stall_ms']:.1f} ms"),
        ("ack -> draftable in-process, p50 / p99",
         f"{on['freshness_s']['p50'] * 1e3:.0f} / {on['freshness_s']['p99'] * 1e3:.0f} ms",
         f"<= {TARGETS['fresh_p99_s'] * 1e3:.0f} ms p99",
         f"{on['freshness_s']['n']} probes at the target rate; at full speed p50 "
         f"{full['freshness_s']['p50'] * 1e3:.0f} ms"),
        ("idle CPU", f"{r['idle_cpu_s_per_90']:.2f} CPU-s / 90 s", "~0", ""),
        ("restart to first draft", f"{r['restart_s']:.2f} s", f"<= {TARGETS['restart_s']:.0f} s",
         f"{r['restart_rows'] / 1e6:.1f}M rows"),
        ("daemon peak RSS beyond configured memory",
         f"{r['rss']['beyond_configured_mb']:.0f} MB", f"<= {TARGETS['rss_beyond_mb']} MB",
         f"VmHWM {r['rss']['vm_hwm_mb']:.0f} MB, configured {r['rss']['configured_mb']:.0f} MB, "
         f"{r['rss']['table_rows'] / 1e6:.1f}M rows"),
    ]
    w = max(len(a) for a, *_ in rows)
    out = [f"machine: {m['cpu']}, {m['nproc']} cores, commit {m['git_commit']}",
           f"corpus: {r['settings']['tokens']} tokens ({r['settings']['files']} files)", "",
           f"{'figure':{w}s}  {'measured':>22s}  {'target':>14s}  notes"]
    for a, b, c, d in rows:
        out.append(f"{a:{w}s}  {b:>22s}  {c:>14s}  {d}")
    peaks = r["rss"].get("peak_by_phase_mb", {})
    if peaks:
        out += ["", "daemon peak RSS by phase (MB, sampled every 0.2 s): "
                + ", ".join(f"{k} {v}" for k, v in peaks.items())]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
