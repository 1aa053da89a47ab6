"""What hot rebuilds cost a daemon under a steady stream of ingest (issue 18).

A rebuild ranks the whole table, so its cost follows the table's size; before issue 18 a
daemon rebuilt every 30 s whenever the counts had changed, and under a steady ingest on a
47M-entry table its rebuild thread was never idle (~100% of a core).  Now a rebuild's CPU time
is paid off at ``hot_rebuild_cpu`` (5% of a core) before the next scheduled one
(``ngramd.hot.selection.RebuildBudget``).  This measures that on a table of ~50M entries:

1. the table: ``--train-tokens`` (10M) of the warm workload's project (bench_replay.py:
   transformers, split by file at random) bulk-counted (``ngramd warm``'s path);
2. a daemon at its defaults on it; it ranks the table at start (free), and the bench waits
   for that generation;
3. ``--seconds`` (600) of steady ingest at ``--rate`` (50k tokens/s) through the ingest op,
   as generators feed back: 512-token sequences of the held-out files, cycled (feedback
   repeats itself; the first pass adds new rows);
4. figures, from the daemon's own accounting (``stats`` -> ``hot.rebuilds``: the rebuilding
   thread's CPU time, ``time.thread_time``) and ``/proc`` (the whole process): rebuilds in the
   window, their CPU, the share of a core they took in the window, and the process's CPU.

``--set table.hot_rebuild_cpu=1`` gives the schedule before issue 18 (rebuild whenever the
period passes and something changed) for comparison.  Prints a table, writes
``bench/out/rebuild.json``.
Usage: ``OMP_NUM_THREADS=1 python bench/bench_rebuild.py [--quick] [--set K=V ...]`` (under the
heavy lock: ~20 min of about one core; --quick: 1M tokens, 120 s).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


from ngram_client import NgramClient
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.wire.identity import tokenizer_fingerprint
from ngramd.table import table_identity_of
from ngramd.config import TableConfig

import data
from bench_replay import Daemon, N_MAX, N_MIN
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"
SEQ_TOKENS = 512


def build_table(root: Path, seqs, fp_path: Path) -> dict:
    """Bulk-count ``seqs`` into the table the daemon ``t`` will open under ``root``."""
    ident = table_identity_of(TableConfig(n_min=N_MIN, n_max=N_MAX, tokenizer=str(fp_path)))
    tokens, offsets = data.pack(seqs)
    t0 = time.perf_counter()
    with ColdStore(root / "data" / "t", ident, ColdOptions(sync_log=False)) as s:
        run = s.bulk_load(tokens, offsets, threads=2, mem_mb=2048)
        st = s.stats()
    return {"tokens": int(tokens.size), "entries": int(run.rows if run else 0),
            "sst_bytes": int(st["sst_bytes"]), "bulk_s": round(time.perf_counter() - t0, 1)}


def steady_ingest(d: Daemon, seqs, rate: float, seconds: float, fp: str) -> dict:
    """``rate`` tokens/s of ``seqs`` (cycled) for ``seconds``; the daemon's rebuild figures and
    the process's CPU over the window."""
    st0, cpu0, t0 = d.stats(), data.cpu_s(d.proc.pid), time.perf_counter()
    samples, sent, i, inflight = [], 0, 0, []
    with NgramClient(d.endpoint, timeout_ms=120_000, tokenizer_fingerprint=fp) as c:
        next_sample = t0
        while (now := time.perf_counter()) - t0 < seconds:
            batch = [seqs[(i + j) % len(seqs)] for j in range(16)]  # 8192 tokens
            i += 16
            inflight.append(c.ingest_async(batch))
            sent += sum(s.size for s in batch)
            while len(inflight) > 8:
                inflight.pop(0).result()
            ahead = sent / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
            if now >= next_sample:
                rb = c.stats()["hot"]["rebuilds"]
                samples.append((round(now - t0, 1), rb["rebuilds"], rb["spent_cpu_s"]))
                next_sample += 10.0
        for f in inflight:
            f.result()
    window = time.perf_counter() - t0
    st1, cpu1 = d.stats(), data.cpu_s(d.proc.pid)
    r0, r1 = st0["hot"]["rebuilds"], st1["hot"]["rebuilds"]
    spent = r1["spent_cpu_s"] - r0["spent_cpu_s"]
    return {"rate": rate, "sent_tokens": sent, "window_s": round(window, 1),
            "counted_tokens": st1["ingested_tokens"] - st0["ingested_tokens"],
            "rebuilds": r1["rebuilds"] - r0["rebuilds"], "rebuild_cpu_s": round(spent, 2),
            "rebuild_cpu_share": spent / window,
            "process_cpu_share": (cpu1 - cpu0) / window,
            "entries_after": st1["cold"].get("entries_total"),
            "next_scheduled_in_s": r1["next_scheduled_in_s"], "rebuilds_end": r1,
            "samples": samples}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", default="transformers")
    ap.add_argument("--train-tokens", type=int, default=10_000_000)
    ap.add_argument("--rate", type=float, default=50_000.0, help="ingest tokens/s")
    ap.add_argument("--seconds", type=float, default=600.0, help="the steady window")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="daemon override (--set table.hot_rebuild_cpu=1)")
    ap.add_argument("--quick", action="store_true", help="1M tokens, a 120 s window")
    ap.add_argument("--dir", help="work directory (default: a temp dir under ./var)")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_tokens, args.seconds = 1_000_000, 120.0
    tok_path = data.qwen_tokenizer_path()
    fp = tokenizer_fingerprint(tok_path)
    names = args.project.split(",")
    seqs = data.file_tokens(data.qwen_tokenizer(), data.package_files(names), "-".join(names))
    warm_idx, hold_idx = data.split_by_file(seqs, 0.15, 0)
    warm, n = [], 0
    for i in warm_idx:
        if n >= args.train_tokens:
            break
        warm.append(seqs[i][:args.train_tokens - n])
        n += warm[-1].size
    stream = [s[a:a + SEQ_TOKENS] for s in (seqs[i] for i in hold_idx)
              for a in range(0, s.size - SEQ_TOKENS + 1, SEQ_TOKENS)]
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-rebuild-", dir="var")).resolve()
    res = {"machine": machine_info(("numpy", "numba", "rocksdict")),
           "settings": {k: v for k, v in vars(args).items() if k != "dir"}}
    try:
        res["table"] = build_table(root, warm, tok_path)
        print(f"table: {json.dumps(res['table'])}", file=sys.stderr)
        d = Daemon(root, "t", args.sets)
        t0 = time.perf_counter()
        d.start()
        try:
            while not d.stats()["hot"].get("placed"):  # the start's rebuild (free)
                time.sleep(1.0)
            st = d.stats()
            res["start"] = {"ready_s": round(time.perf_counter() - t0, 1),
                            "hot": {k: st["hot"].get(k) for k in ("placed", "bytes", "build_s",
                                                                  "rebuilds", "sizing")}}
            print(f"start: {json.dumps(res['start'])}", file=sys.stderr)
            res["steady"] = steady_ingest(d, stream, args.rate, args.seconds, fp)
        finally:
            d.stop()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    res["command"] = " ".join(["python", "bench/bench_rebuild.py", *(argv or sys.argv[1:])])
    OUT.mkdir(exist_ok=True)
    (OUT / "rebuild.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


def report(r: dict) -> str:
    t, s, st = r["table"], r["steady"], r["start"]
    first = st["hot"]["rebuilds"]
    return "\n".join([
        f"machine: {r['machine']['cpu']}, {r['machine']['nproc']} cores; daemon overrides: "
        f"{r['settings']['sets'] or 'none'}",
        f"table: {t['tokens'] / 1e6:.1f}M tokens -> {t['entries'] / 1e6:.1f}M entries "
        f"({t['sst_bytes'] / 2**30:.2f} GiB); the start's rebuild: {first['last_cpu_s']:.1f} "
        f"CPU-s, {st['hot']['build_s']} s wall, {st['hot']['placed']:,} rows hot",
        f"steady ingest: {s['rate']:,.0f} tokens/s for {s['window_s']:.0f} s "
        f"({s['counted_tokens']:,} counted; {s['entries_after'] / 1e6:.1f}M entries after)",
        f"  rebuilds in the window: {s['rebuilds']}, {s['rebuild_cpu_s']:.1f} CPU-s: "
        f"{s['rebuild_cpu_share']:.1%} of a core (target <= 10%); the whole daemon "
        f"{s['process_cpu_share']:.0%} of a core; next scheduled rebuild in "
        f"{s['next_scheduled_in_s']:.0f} s"])


if __name__ == "__main__":
    sys.exit(main())
