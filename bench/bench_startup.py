"""Start-up cost of the numba kernels: a first start (empty numba cache) and a warm start.

A child process imports the kernels and calls every kernel topic once on small data (hash,
counting, row sets, pages, Bloom filters, slots, the request-local and recent tables, the
draft, the cold refine, the hot ranking), which compiles each kernel (first start) or loads it
from ``NUMBA_CACHE_DIR`` (warm start).  Each tree (this one, and every ``--against DIR``, e.g.
a checkout from before ``ngramd/kernels/`` was split) gets its own scratch cache directory;
the trees alternate, so one run compares them under the same load.  Per tree and start, the
median of ``--rounds`` wall times of the whole child (spawn to exit) and of the part after
``import numpy`` (import of the kernels and the calls).

Usage: ``OMP_NUM_THREADS=1 flock /tmp/flashnest-heavy.lock python bench/bench_startup.py
[--against /work/main] [--rounds 3] [--python PY]``; writes ``bench/out/startup.json``.
A tree is run with ``--python`` (default: this interpreter) and ``PYTHONPATH`` set to the
tree's import path: ``DIR/.wtpath`` when it exists (a worktree), else ``DIR`` itself must be
what the interpreter imports (``PYTHONPATH`` unset, e.g. ``/work/main`` with its own venv).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: the child: one call of every kernel topic; names resolve in one module (before the split)
#: or in the package's topic modules (after it)
CHILD = r"""
import time
t0 = time.perf_counter()
import numpy as np
t1 = time.perf_counter()
import importlib, pkgutil
import ngramd.kernels as pkg
mods = [pkg] + ([importlib.import_module("ngramd.kernels." + m.name)
                 for m in pkgutil.iter_modules(pkg.__path__)] if hasattr(pkg, "__path__") else [])
def k(*names):
    for n in names:
        for m in mods:
            if hasattr(m, n):
                return getattr(m, n)
    raise AttributeError(names)
from ngramd.wire.constants import TIER_HOT, TIER_LOCAL
rng = np.random.default_rng(0)
seqs = [rng.integers(0, 300, 2000).astype(np.uint32) for _ in range(3)]
toks = np.concatenate(seqs)
offs = np.array([0, 2000, 4000, 6000], np.int64)
skips = np.zeros(3, np.int64)
rows = k("count_ngrams")(toks, offs, 1, 8, 3)
rs = k("count_rows")(toks, offs, skips, 1, 8, 3, 0, 0)
k("order_counts")(rs[2], np.zeros(17, np.int64))
cat = [np.concatenate([a, a]) for a in rs]
cat[4] = np.concatenate([rs[4], rs[4][1:] + rs[4][-1]])
merged = k("rows_gather")(np.argsort(cat[0], kind="stable"), *cat, 3)
m = rs[0].shape[0]
found = np.zeros(m, np.bool_); o_ord = np.zeros(m, np.uint8); o_tot = np.zeros(m, np.uint32)
o_tok = np.zeros((m, 3), np.uint32); o_cnt = np.zeros((m, 3), np.uint32)
k("rows_lookup")(rs[0], rs[2], rs[3], rs[4], rs[5], rs[6], rs[0], 3, found, o_ord, o_tot, o_tok,
                 o_cnt)
a, b = k("rows_range")(rs[0], np.uint64(0), np.uint64(1 << 63), True)
ids, rstart, bstart = k("pages_plan")(rs[0], rs[4], 4)
buf = np.zeros(int(bstart[-1]) // 8, np.uint64)
k("pages_fill")(*rs, rstart, bstart, buf.view(np.uint8), buf.view(np.uint32), buf)
assert k("pages_check")(bstart, buf.view(np.uint32), buf.nbytes)
qpage = np.zeros(m, np.int64)
qpage[:] = -1
k("pages_lookup")(rs[0], qpage, bstart, buf.view(np.uint8), buf.view(np.uint32), buf, 3, found,
                  o_ord, o_tot, o_tok, o_cnt)
mr, P = k("pages_dims")(bstart, buf.view(np.uint32))
out = (np.zeros(mr, np.uint64), np.zeros(mr, np.uint64), np.zeros(mr, np.uint8),
       np.zeros(mr, np.uint32), np.zeros(mr + 1, np.int64), np.zeros(P, np.uint32),
       np.zeros(P, np.uint32))
k("pages_decode_into")(bstart, buf.view(np.uint8), buf.view(np.uint32), buf, np.uint64(0),
                       np.uint64(0), False, *out, 0, 0)
k("rows_copy_into")(*rs, 0, 4, *out, 0, 0)
words = np.zeros(64, np.uint64)
k("bbloom_add")(words, rs[0][:100], 7)
k("bbloom_may_batch")(words, rs[0][:200], 7, np.zeros(200, np.bool_))
hot, placed = k("build_slots")(1 << 14, 16, rows["key"], rows["order"], rows["tok"], rows["cnt"],
                               rows["total"])
rank = k("hot_rank")(rows["key"], rows["parent"], rows["order"], rows["total"],
                     np.ascontiguousarray(rows["tok"][:, 0]), np.ascontiguousarray(rows["cnt"][:, 0]),
                     np.zeros(len(rows["key"]), np.float32), np.ones(17, np.uint32),
                     np.zeros(17, np.float32), 1.0, True)[0]
g, _ = k("gather_slots")(1 << 14, 16, rank, rows["key"], rows["order"], rows["tok"], rows["cnt"],
                         rows["total"])
k("insert_rows")(g, 16, rows["key"][:50], rows["order"][:50], rows["tok"][:50],
                 rows["cnt"][:50], rows["total"][:50])
k("checksum", "slots_checksum")(hot)
k("probe_batch")(hot, 16, rows["key"][:100], np.zeros(100, np.int64))
lt = np.zeros((1, 9, 3), np.uint32)
k("lookup_batch")(hot, 16, toks[:20], np.array([0, 20], np.int64), 1, 8, lt, lt.copy(),
                  np.zeros((1, 9), np.uint32))
k("key_hash")(toks[:5])
k("suffix_hashes")(toks, 10, 8, np.zeros(9, np.uint64))
local = np.zeros((1 << 12, 8), np.uint32)
k("local_add")(local, 16, toks, 0, 200, 1, 8)
recent = np.zeros((1 << 12, 8), np.uint32)
k("recent_add")(recent, 16, rs[0][:50], rs[2][:50], rs[3][:50], rs[4][:51], rs[5], rs[6])
from ngramd.wire.rules import DraftRules
rules = DraftRules(n_min=1, n_max=8).kernel
ctx = toks[:64].copy()
coffs = np.array([0, 32, 64], np.int64)
try:  # the source as drafters build it (read-only tables: the signature they compile)
    from ngramd.drafttiers import LOCAL_FIRST, DraftTiers, SharedTiers
    src = DraftTiers(LOCAL_FIRST, local, 16,
                     SharedTiers(hot, pruned=words, pruned_nprobe=7, max_probe=16)).source
except ImportError:  # a tree from before DraftTiers
    src = k("draft_source")((local, hot), (TIER_LOCAL, TIER_HOT), (False, True), 16, words, 7, 1)
d = k("draft_out")(2, 8)
k("draft")(src, rules, ctx, coffs, 8, d)
keys = np.zeros(16, np.uint64)
k("draft_keys")(ctx, coffs, d[0], d[1], d[4], 8, keys)
k("tally_drafts")(d[2], d[1], d[4], np.zeros((4, 17), np.int64))
warm = np.zeros((1 << 10, 8), np.uint32)
k("warm_insert")(warm, 16, np.uint64(12345), 3, toks[:3], toks[:3], 5)
c = np.zeros(64, np.int64)
k("cold_candidates")(ctx, coffs, d[0], d[1], d[4], 1, 8, warm, hot, 16, words, 7, c, c.copy(),
                     np.zeros(64, np.uint64), c.copy())
t2 = time.perf_counter()
print(t2 - t1)
"""


def tree_env(tree: Path, cache: Path) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if (tree / ".wtpath").is_dir():
        env["PYTHONPATH"] = str(tree / ".wtpath")
    return env


def one_start(python: str, tree: Path, cache: Path) -> tuple[float, float]:
    """(wall s of the child, s after ``import numpy`` inside it)."""
    t0 = time.perf_counter()
    out = subprocess.run([python, "-c", CHILD], env=tree_env(tree, cache), cwd=str(tree),
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{tree} failed:\n{out.stderr[-3000:]}")
    return wall, float(out.stdout.strip().splitlines()[-1])


def measure(python: str, trees: list[Path], rounds: int) -> dict:
    """Per tree: ``rounds`` first starts (each with a fresh cache dir), then ``rounds`` warm
    starts on the last one's cache; trees alternate within each round."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    res = {str(t): {"first": [], "warm": []} for t in trees}
    try:
        for kind in ("first", "warm"):
            for r in range(rounds):
                for i, t in enumerate(trees):
                    cache = scratch / f"{i}-{r if kind == 'first' else rounds - 1}"
                    if kind == "first":
                        shutil.rmtree(cache, ignore_errors=True)
                    res[str(t)][kind].append(one_start(python, t, cache))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO / "bench"))
    from machine import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, action="append", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    trees = [REPO] + args.against
    res = measure(args.python, trees, args.rounds)
    load = os.getloadavg()
    print(f"numba start-up, median of {args.rounds} (load {load[0]:.1f}): wall s of the child "
          f"(in-process s after import numpy)")
    for t, r in res.items():
        row = [f"{kind} {statistics.median(w for w, _ in r[kind]):.2f} "
               f"({statistics.median(x for _, x in r[kind]):.2f})" for kind in ("first", "warm")]
        print(f"  {t}: " + ", ".join(row))
    out = REPO / "bench" / "out" / "startup.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(("numpy", "numba")), "command": sys.argv,
                               "rounds": args.rounds, "load": load, "python": args.python,
                               "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
