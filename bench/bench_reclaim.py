"""How the cold tier gives back the disk space of merged-away runs (issue 19), measured in one
run; the choice it made is written down in ``ngramd/cold/store.py`` ("Reclaiming disk space").

1. **compact_range of one dead run's range**: three bulk-loaded runs of random text; the
   oldest and the newest are deleted (a range tombstone each) and compacted one at a time,
   the middle one stays live.  Per run: wall time, bytes read by this process (``rchar``:
   RocksDB's compaction reads), CPU seconds, ``du`` after; and the longest gap a Python thread
   sleeping 1 ms saw meanwhile (is the GIL held?).
2. **a column family per run, dropped whole**: ``create_column_family`` and
   ``drop_column_family`` ten times each, with the same spinning thread (their time is
   manifest and OPTIONS file syncs; the question is whether they hold the GIL).

Prints both, writes ``bench/out/reclaim.json``.  Usage:
``OMP_NUM_THREADS=1 python bench/bench_reclaim.py [--tokens N]`` (default 300k tokens a run:
~100 MiB of SST each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from rocksdict import Options, Rdict, WriteBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.machine import machine_info  # noqa: E402
from ngramd.cold.store import ColdStore  # noqa: E402
from ngramd.cold.runs import run_key  # noqa: E402
from ngramd.config import ColdOptions  # noqa: E402
from ngramd.wire.identity import table_identity  # noqa: E402


class Spinner(threading.Thread):
    """Sleeps 1 ms in a loop and records how late it wakes (the GIL held elsewhere)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.gaps: list[float] = []
        self.done = threading.Event()

    def run(self):
        last = time.perf_counter()
        while not self.done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    def max_ms(self, since: int = 0) -> float:
        return round(1e3 * max(self.gaps[since:], default=0.0), 1)


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def rchar() -> int:
    return int(Path("/proc/self/io").read_text().split("rchar:")[1].split()[0])


def compact_range(root: Path, tokens: int, spin: Spinner) -> list[dict]:
    ident = table_identity(n_min=1, n_max=16, cold_k=8, vocab_size=151_936, tokenizer="none")
    st = ColdStore(root / "t", ident, ColdOptions())
    rng = np.random.default_rng(1)
    for _ in range(3):
        st.bulk_load(rng.integers(0, 5000, tokens, dtype=np.uint32),
                     np.array([0, tokens], np.int64))
    runs, out = st.reader.run_list(), []
    for r in (runs[0], runs[2]):  # the middle one stays live
        before = du(st.path)
        wb = WriteBatch(raw_mode=True)
        wb.delete_range(run_key(r.id), run_key(r.id + 1), st.rocks.h_pg)
        st.rocks.db.write(wb, st.rocks.wo)
        g, c0, t0, cpu0 = len(spin.gaps), rchar(), time.perf_counter(), time.process_time()
        st.rocks.pg.compact_range(run_key(r.id), run_key(r.id + 1))
        out.append({"run_mib": round((before - du(st.path)) / 2**20, 1),
                    "ms": round(1e3 * (time.perf_counter() - t0)),
                    "read_mib": round((rchar() - c0) / 2**20, 1),
                    "cpu_s": round(time.process_time() - cpu0, 2),
                    "du_after_mib": round(du(st.path) / 2**20, 1),
                    "max_gil_gap_ms": spin.max_ms(g)})
    st.close()
    return out


def column_families(root: Path, spin: Spinner) -> dict:
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    db = Rdict(str(root / "cf"), o)
    res = {}
    for what in ("create", "drop"):
        g, t0 = len(spin.gaps), time.perf_counter()
        for i in range(10):
            if what == "create":
                db.create_column_family(f"run-{i}", Options(raw_mode=True))
            else:
                db.drop_column_family(f"run-{i}")
            time.sleep(0.02)
        res[what] = {"ms_each": round(1e3 * (time.perf_counter() - t0) / 10 - 20, 1),
                     "max_gil_gap_ms": spin.max_ms(g)}
    db.close()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=300_000, help="random tokens a run")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-reclaim-"))
    spin = Spinner()
    spin.start()
    try:
        cr = compact_range(root, args.tokens, spin)
        cf = column_families(root, spin)
    finally:
        spin.done.set()
        shutil.rmtree(root, ignore_errors=True)
    for r in cr:
        print(f"compact_range of one dead run: {r['run_mib']} MiB freed in {r['ms']} ms, read "
              f"{r['read_mib']} MiB, {r['cpu_s']} CPU-s, longest GIL gap {r['max_gil_gap_ms']} ms")
    for k, v in cf.items():
        print(f"{k}_column_family: {v['ms_each']} ms each, longest GIL gap {v['max_gil_gap_ms']} ms")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "reclaim.json").write_text(json.dumps(
        {"machine": machine_info(("rocksdict",)), "tokens_a_run": args.tokens,
         "compact_range": cr, "column_families": cf}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
