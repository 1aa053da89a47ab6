"""Run every benchmark in bench/ one after the other (``make bench``), each in its own process
so that none inherits another's memory or JIT state; stop at the first failure.

``--quick`` passes ``--quick`` to those that have it (a smoke run of the whole set).  Results go
to bench/out/*.json; bench/RESULTS.md records the figures of full runs with their commands.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (script, takes --quick, what it measures)
BENCHES = [
    ("bench_table.py", True, "table engine: hot draft, probes, cold reads, sizes"),
    ("bench_ingest.py", True, "write path: bulk, client ingest, online, freshness, restart"),
    ("bench_daemon.py", True, "daemon round trips and cold drafts against their anchors"),
    ("bench_replay.py", True, "drafting reach on a warmed table: AL of every drafter"),
    ("bench_generate.py", True, "generation: plain vs prompt lookup vs ngramd"),
    ("placement.py", True, "placement study: all-hot vs two-tier vs cold-only, hot-size curve"),
    ("bench_fleet.py", True, "many hosts over NATS: propagation, replicated ingest, bootstrap, AL"),
    ("bench_scale.py", False, "the >= 50M-token scale run (long; --with-scale)"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke runs")
    ap.add_argument("--with-scale", action="store_true", help="also the scale run (~15 min)")
    ap.add_argument("--only", nargs="*", help="run only these scripts")
    args = ap.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for script, has_quick, what in BENCHES:
        if args.only and script not in args.only:
            continue
        if script == "bench_scale.py" and not (args.with_scale or args.only):
            continue
        cmd = [sys.executable, str(HERE / script)] + (["--quick"] if args.quick and has_quick
                                                      else [])
        print(f"== {script}: {what}\n$ {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, env=env)
        print(f"== {script}: exit {rc} after {time.perf_counter() - t0:.0f} s\n", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
