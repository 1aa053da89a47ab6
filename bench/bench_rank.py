"""What ranking a table for its hot tier costs, and where the CPU goes (issue 28: "cut the
ranking's cost where it is wasted").

A hot rebuild (and ``ngramd warm``) scans the whole table and streams it through
``ngramd.hot.selection.HotSelector``, whose buffer is cut back to the rows the budget can place
whenever it fills (``kernels.rank.hot_rank`` at each cut).  This measures that on a table of
real code, in-process, without a daemon:

1. the table: the first ``--tokens`` (2M) tokens of the standard library, bulk-counted at the
   daemon's default orders (``ngramd warm``'s path), in a temp dir;
2. ``ngramd.hot.cycle.rank_table`` on it (what every rebuild runs; the budget of a daemon at its
   defaults on this host, no hits) ``--runs`` times after one warm-up, with the CPU time of
   each ranking (``time.process_time``: the scan's reads, the selection, the slots), its wall
   time, and the selector's cuts (rows in the buffer, rows kept, CPU seconds each);
3. ``--profile``: one more ranking under cProfile, its 15 costliest functions by own time;
   ``--one-shot``: the whole table ranked at once in memory, and how many rows that keeps
   against the streaming selector (which prunes a row only against a parent still buffered);
4. the slots of every run must be identical: a difference is printed, exit status 1.

Usage: ``OMP_NUM_THREADS=1 python bench/bench_rank.py [--tokens N] [--runs R] [--profile]
[--hot-mb MB] [--one-shot]`` (``--hot-mb 64``: a limit below the table's useful rows, so cuts rank)
(2M tokens: a ~18M-row table, ~5 s to count, ~10 CPU-s a ranking here).  JSON to
``bench/out/rank.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import data  # noqa: E402
from machine import machine_info  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def build(root: Path, n_tokens: int):
    """The first ``n_tokens`` of the standard library bulk-counted into a table under
    ``root``; ``(cold store, config, figures)``."""
    from ngramd.cold.store import ColdOptions, ColdStore
    from ngramd.config import TableConfig
    from ngramd.table import table_identity_of

    tokens, offsets = data.stdlib_corpus()
    last = int(np.searchsorted(offsets, n_tokens, side="right"))
    offsets = offsets[:max(last, 2)]
    tokens = tokens[:offsets[-1]]
    config = TableConfig(tokenizer=str(data.qwen_tokenizer_path()))
    t0 = time.perf_counter()
    cold = ColdStore(root / "t", table_identity_of(config), ColdOptions(sync_log=False))
    run = cold.bulk_load(tokens, offsets, threads=2, mem_mb=2048)
    return cold, config, {"tokens": int(tokens.size), "rows": int(run.rows if run else 0),
                          "count_s": round(time.perf_counter() - t0, 1)}


def rank_once(cold, config, hot_mb: float = 0) -> dict:
    """One ranking the daemon's way: its CPU and wall seconds, the selector's cuts and a
    digest of its slots."""
    from ngramd.hot.cycle import rank_table
    from ngramd.hot.selection import HotBuilder, HotSelector, HotSizing

    cuts, shrink = [], HotSelector._shrink

    def timed_shrink(sel, *args, **kwargs):
        n, c0 = sel._n, time.process_time()
        shrink(sel, *args, **kwargs)
        cuts.append((n, sel._n, round(time.process_time() - c0, 3)))

    HotSelector._shrink = timed_shrink
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        slots, info, redundant = rank_table(cold, config, HotBuilder(),
                                            HotSizing.from_config(hot_mb),
                                            lambda keys: np.zeros(keys.shape[0], np.float64))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        HotSelector._shrink = shrink
    digest = hashlib.sha256(slots.tobytes() + np.sort(redundant).tobytes()).hexdigest()[:16]
    return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "placed": int(info["placed"]),
            "kept": _kept(info),
            "scanned": int(info["scanned"]), "cuts": cuts, "slots": digest}


def profile(cold, config, hot_mb: float, top: int = 15) -> list[dict]:
    """One ranking under cProfile: its ``top`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(rank_once, cold, config, hot_mb)
    st = pstats.Stats(prof).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": v[1],
             "own_s": round(v[2], 3), "cumulative_s": round(v[3], 3)}
            for (f, line, name), v in rows]


def _kept(info: dict) -> int:
    """The rows a ranking kept (placed, or left out only for space or probes) from its info."""
    return int(info["placed"] + info["dropped_budget"] + info["dropped_probe"])


def one_shot(cold, config) -> dict:
    """The whole table ranked at once in memory (``hot.selection.build_hot`` over every row, with a
    budget that does not bind): the rows it keeps, against the streaming selector, which prunes
    a row only against a parent still buffered at a cut.  Holds every row at once (+0.2 GB of
    peak memory for a 3.5M-row table here)."""
    from ngramd.hot.selection import build_hot
    from ngramd.wire.constants import HOT_K

    parts: dict[str, list] = {f: [] for f in ("key", "parent", "order", "total", "tok", "cnt")}
    for rs in cold.reader.scan_rows():
        tok, cnt = rs.padded(HOT_K)
        for f, v in (("key", rs.key), ("parent", rs.parent), ("order", rs.order),
                     ("total", rs.total), ("tok", tok), ("cnt", cnt)):
            parts[f].append(np.array(v))
    rows = {f: np.concatenate(v) for f, v in parts.items()}
    m, rules = rows["key"].shape[0], config.rules
    cpu0 = time.process_time()
    _, info = build_hot(rows, 1 << 40, rules.by_order("c_min"), rules.by_order("s_min"))
    confident = m - info["duplicates"] - info["invalid"] - info["pruned_confidence"]
    return {"rows": m, "confident": confident, "redundant": info["pruned_redundant"],
            "kept": _kept(info),
            "build_cpu_s": round(time.process_time() - cpu0, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--runs", type=int, default=3, help="rankings timed")
    ap.add_argument("--profile", action="store_true", help="and one under cProfile")
    ap.add_argument("--hot-mb", type=float, default=0,
                    help="the hot tier's limit (MiB; 0: the daemon's default, 1/16 of memory); "
                         "a small one makes the selector cut rows for space")
    ap.add_argument("--one-shot", action="store_true",
                    help="and the rows that ranking the whole table at once keeps (in memory)")
    ap.add_argument("--out", default=str(OUT / "rank.json"))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-rank-"))
    try:
        cold, config, table = build(root, args.tokens)
        print(f"table: {table['tokens']:,} tokens -> {table['rows']:,} rows "
              f"({table['count_s']} s)", file=sys.stderr)
        rank_once(cold, config, args.hot_mb)  # numba compiled or loaded, the pages cached
        runs = []
        for _ in range(args.runs):
            runs.append(rank_once(cold, config, args.hot_mb))
            print(f"  {runs[-1]}", file=sys.stderr)
        prof = profile(cold, config, args.hot_mb) if args.profile else None
        whole = one_shot(cold, config) if args.one_shot else None
        cold.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {"table": table, "runs": runs, "profile": prof, "one_shot": whole,
           "machine": machine_info(),
           "settings": vars(args) | {"command": " ".join(sys.argv)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    cpu = [r["cpu_s"] for r in runs]
    print(f"ranking {table['rows']:,} rows ({runs[0]['placed']:,} placed): CPU "
          f"{statistics.median(cpu):.2f} s median ({min(cpu):.2f}-{max(cpu):.2f}), wall "
          f"{statistics.median(r['wall_s'] for r in runs):.2f} s; {len(runs[0]['cuts'])} cuts "
          f"(rows in, kept, CPU s): {runs[0]['cuts']}")
    if prof:
        print("| function | calls | own s | cumulative s |\n|---|---|---|---|")
        for p in prof:
            print(f"| {p['function']} | {p['calls']} | {p['own_s']} | {p['cumulative_s']} |")
    if whole:
        print(f"the whole table ranked at once keeps {whole['kept']:,} rows "
              f"({whole['redundant']:,} of {whole['confident']:,} confident rows redundant; "
              f"{whole['build_cpu_s']} CPU-s to build); the streaming selector kept "
              f"{runs[0]['kept']:,}")
    same = len({r["slots"] for r in runs}) == 1
    print("slots identical in every run" if same else "SLOTS DIFFER between runs")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
