"""The scale run (issue 7): a table built from >= 50M tokens of real text that ships in packages.

Corpus (bench/data.py): the Python sources of every installed package (site-packages) and of
the standard library, plus the dialogue corpora; Qwen3 tokenizer; one sequence per file or
conversation.  Steps, each timed:

1. tokenize (``encode_batch``, all cores);
2. ``ColdStore.bulk_load`` (orders 1..16; the path of ``ngramd warm``) into an empty table:
   tokens/s, rows, bytes on disk, bytes per entry, bytes the process wrote per ingested token
   (``/proc/self/io`` write_bytes: SST files, WAL, RocksDB compactions: the write
   amplification as the disk sees it), peak RSS;
3. open the table as the daemon does (``Table``): seconds to serve, then a full hot rebuild
   (seconds, peak RSS of the rebuild);
4. hot draft latency (``HotReader.draft``, 8 tokens, held-out contexts) and cold lookups
   (``ColdReader.lookup`` of one key, with the page cache warm and evicted).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_scale.py [--tokens N] [--mem-mb M]``; the
default (all of it, ~58M tokens here) takes ~10 minutes and ~15 GB of disk.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import dataclasses
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ngramd.kernels.hashing import key_hash
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.config import TableConfig
from ngramd.hot.shm import HotReader
from ngramd.wire.identity import TableIdentity, tokenizer_fingerprint
from ngramd.service import tune_malloc
from ngramd.table import Table

import data
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak RSS over a block (sampled every 50 ms)."""

    def __enter__(self):
        self.peak, self._stop = rss_mb(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=0, help="cap the corpus (0 = all)")
    ap.add_argument("--mem-mb", type=int, default=8192, help="bulk_load memory budget")
    ap.add_argument("--dir", help="work directory (default: a temp dir under ./var)")
    args = ap.parse_args(argv)
    tune_malloc()
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-scale-", dir="var")).resolve()
    res: dict = {"machine": machine_info(("numpy", "numba", "rocksdict", "tokenizers")),
                 "settings": {"mem_mb": args.mem_mb, "orders": "1..16", "cold_k": 8}}
    try:
        tok = data.qwen_tokenizer()
        t0 = time.perf_counter()
        files = data.site_packages_files() + data.stdlib_files()
        seqs, _ = data.tokenize(tok, files, args.tokens or 1 << 62)
        n = sum(s.size for s in seqs)
        if not args.tokens or n < args.tokens:
            seqs += data.tokenize_texts(tok, data.dialogue_texts())
        tokens, offsets = data.pack(seqs)
        if args.tokens:
            cut = int(np.searchsorted(offsets, args.tokens, "right")) - 1
            tokens, offsets = tokens[:offsets[cut]], offsets[:cut + 1]
        del seqs
        res["corpus"] = {"files": len(files), "sequences": int(offsets.size - 1),
                         "tokens": int(tokens.size),
                         "tokenize_s": time.perf_counter() - t0}
        print(f"corpus: {tokens.size / 1e6:.1f}M tokens in {offsets.size - 1} sequences "
              f"({res['corpus']['tokenize_s']:.0f} s to read and tokenize)", file=sys.stderr)

        fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
        ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=151_936, tokenizer=fp)
        path = root / "data" / "scale"
        w0 = written_bytes()
        with PeakRss() as pk, ColdStore(path, ident, ColdOptions()) as s:
            t0 = time.perf_counter()
            run = s.bulk_load(tokens, offsets, threads=2, mem_mb=args.mem_mb,
                              progress=lambda d, n: print(f"  partition {d}/{n}",
                                                          file=sys.stderr))
            dt = time.perf_counter() - t0
            st = s.stats()
        wrote = written_bytes() - w0
        res["build"] = {"seconds": dt, "tokens_per_s": tokens.size / dt, "rows": run.rows,
                        "rows_per_token": run.rows / tokens.size, "sst_bytes": st["sst_bytes"],
                        "total_bytes": st["total_bytes"],
                        "bytes_per_entry": st["sst_bytes"] / run.rows,
                        "written_bytes": wrote, "written_per_token": wrote / tokens.size,
                        "peak_rss_mb": pk.peak, "filter_mb": st["memory"]["filter_bytes"] / 2**20}
        print(f"build: {json.dumps(res['build'])}", file=sys.stderr)

        # the daemon's view of it: open, rebuild hot, draft
        heldout = tokens[int(offsets[-200]):]  # the last sequences: dialogue, counted too
        rng = np.random.default_rng(0)
        cfg = TableConfig(name="scale", data_dir=str(root / "data"), tokenizer="",
                          shm_dir=f"/dev/shm/ngramd-bench-scale-{os.getpid()}", hot_rebuild_s=0)
        cfg = dataclasses.replace(cfg, tokenizer=str(data.qwen_tokenizer_path()))
        t0 = time.perf_counter()
        table = Table(cfg)
        res["open_s"] = time.perf_counter() - t0
        try:
            with PeakRss() as pk:
                t0 = time.perf_counter()
                table.rebuild_hot()
                res["hot_rebuild"] = {"seconds": time.perf_counter() - t0,
                                      "peak_rss_mb": pk.peak, **table.stats_dict()["hot"]}
            reader = HotReader(cfg.shm_dir, cfg.name, identity=table.identity)
            ctxs = [heldout[p:p + 32].copy() for p in rng.integers(0, heldout.size - 40, 2000)]
            lat = []
            for c in ctxs:
                t0 = time.perf_counter()
                reader.draft(c, 8, table.rules)
                lat.append((time.perf_counter() - t0) * 1e6)
            res["hot_draft"] = data.summary(lat)
            reader.close()
            keys = np.array([key_hash(tokens[int(p) - o:int(p)]) for p, o in
                             zip(rng.integers(16, tokens.size, 300), rng.integers(1, 17, 300))],
                            np.uint64)
            cold = table.cold
            warm, evicted = [], []
            for k in keys:
                t0 = time.perf_counter()
                cold.reader.lookup(k[None])
                warm.append((time.perf_counter() - t0) * 1e6)
            for k in keys[:100]:
                data.evict_page_cache(path.rglob("*.sst"))
                t0 = time.perf_counter()
                cold.reader.lookup(k[None])
                evicted.append((time.perf_counter() - t0) * 1e6)
            res["cold_lookup"] = {"warm": data.summary(warm), "evicted": data.summary(evicted)}
        finally:
            table.close()
            shutil.rmtree(cfg.shm_dir, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    res["peak_rss_process_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["command"] = " ".join(["python", "bench/bench_scale.py", *(argv or sys.argv[1:])])
    OUT.mkdir(exist_ok=True)
    (OUT / "scale.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


def report(r: dict) -> str:
    b, c, h = r["build"], r["corpus"], r["hot_rebuild"]
    return "\n".join([
        f"machine: {r['machine']['cpu']}, {r['machine']['nproc']} cores",
        f"corpus: {c['tokens'] / 1e6:.1f}M tokens, {c['sequences']} sequences "
        f"(read + tokenize {c['tokenize_s']:.0f} s)",
        f"bulk build: {b['seconds']:.0f} s = {b['tokens_per_s'] / 1e3:.0f}k tokens/s; "
        f"{b['rows'] / 1e6:.0f}M entries ({b['rows_per_token']:.1f} a token)",
        f"on disk: {b['sst_bytes'] / 2**30:.2f} GiB = {b['bytes_per_entry']:.1f} B an entry; "
        f"written {b['written_per_token']:.0f} B per ingested token; peak RSS "
        f"{b['peak_rss_mb']:.0f} MB (budget {r['settings']['mem_mb']} MB)",
        f"daemon open: {r['open_s']:.2f} s; hot rebuild {h['seconds']:.0f} s, peak RSS "
        f"{h['peak_rss_mb']:.0f} MB, {h['placed']} rows in {h['bytes'] / 2**20:.0f} MiB",
        f"hot draft (8 tokens, in-process): p50 {r['hot_draft']['p50_us']:.1f} µs, "
        f"p99 {r['hot_draft']['p99_us']:.1f} µs",
        f"cold lookup, one key: warm p50 {r['cold_lookup']['warm']['p50_us']:.0f} µs / p99 "
        f"{r['cold_lookup']['warm']['p99_us']:.0f} µs; page cache evicted p50 "
        f"{r['cold_lookup']['evicted']['p50_us']:.0f} µs / p99 "
        f"{r['cold_lookup']['evicted']['p99_us']:.0f} µs",
    ])


if __name__ == "__main__":
    sys.exit(main())
