"""Does writing the hot image stall drafts?  (issue 28's "image write" target row)

A real ``ngramd`` at its defaults is warmed with ``--tokens`` of standard-library code through
the ingest op.  A client thread then asks it for drafts without pause (``draft`` of ``--rows``
contexts of held-out code, ``max_len`` 8: the cold reads a generator's asks make), timing each
call.  Each round forces a hot rebuild (``rebuild_hot``), which ranks the table, publishes the
new generation and writes it as the table's image (``ngramd.hot.image.write_image``, on the
rebuilder's thread).  The daemon's stats give the write's end and length, so every draft call is
put in one of three windows: **baseline** (no rebuild running), **rank** (the rebuild before
its image write) and **image write**.  Reported per window: calls, p50, p99 and max latency
(client-side, ZeroMQ round trip included); and the image's bytes and seconds.

    OMP_NUM_THREADS=1 python bench/bench_image_write.py [--contend 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import data
from bench_replay import Daemon, warm_through_daemon
from machine import machine_info
from ngram_client import NgramClient
from ngramd.wire.identity import tokenizer_fingerprint


def drafter_loop(endpoint: str, fp: str, contexts: list[np.ndarray], rows: int,
                 stop: threading.Event, out: list) -> None:
    """Draft ``rows`` contexts a call until ``stop``; ``(start, seconds)`` of each call."""
    with NgramClient(endpoint, timeout_ms=60_000, tokenizer_fingerprint=fp) as c:
        i = 0
        while not stop.is_set():
            batch = [contexts[(i + j) % len(contexts)] for j in range(rows)]
            i += rows
            t0 = time.time()
            c.draft(batch, 8)
            out.append((t0, time.time() - t0))


def percentiles(calls: list[tuple[float, float]]) -> dict:
    if not calls:
        return {"calls": 0}
    ms = np.array([s for _, s in calls]) * 1e3
    return {"calls": int(ms.size), "p50_ms": round(float(np.median(ms)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "max_ms": round(float(ms.max()), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3_000_000, help="warm-up tokens")
    p.add_argument("--rounds", type=int, default=3, help="forced rebuilds (image writes)")
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--rows", type=int, default=8, help="contexts a draft call")
    p.add_argument("--contend", type=int, default=0, help="busy processes beside the daemon")
    p.add_argument("--quick", action="store_true", help="300k tokens, 1 round, 4 s baseline")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" /
                                        "image_write.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds, args.baseline_s = 300_000, 1, 4.0
    fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
    tokens, offsets = data.stdlib_corpus()
    seqs = [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    warm, held, n = [], [], 0
    for i, s in enumerate(seqs):  # every 10th file held out: the drafts' contexts
        if i % 10 == 9:
            held.append(s)
        elif n < args.tokens:
            warm.append(s)
            n += s.size
    rng = np.random.default_rng(0)
    contexts = []
    for s in held:
        if s.size > 64:
            for at in rng.integers(32, s.size, 16):
                contexts.append(np.ascontiguousarray(s[max(at - 32, 0):at], np.uint32))
    root = Path(tempfile.mkdtemp(prefix="bench-image-write-"))
    d = Daemon(root, "img")
    res: dict = {"rounds": []}
    try:
        d.start()
        res["warm"] = warm_through_daemon(d, warm, fp)
        with data.contention(args.contend):
            calls: list = []
            stop = threading.Event()
            t = threading.Thread(target=drafter_loop,
                                 args=(d.endpoint, fp, contexts, args.rows, stop, calls))
            t.start()
            try:
                t_base = time.time()
                time.sleep(args.baseline_s)
                windows = [("baseline", t_base, time.time())]
                with NgramClient(d.endpoint, timeout_ms=1_200_000,
                                 tokenizer_fingerprint=fp) as c:
                    for r in range(args.rounds):
                        t0 = time.time()
                        c.rebuild_hot(timeout_ms=1_200_000)
                        image = {}
                        for _ in range(600):  # the image is written after the publication
                            image = c.stats()["hot"].get("image") or {}
                            if image.get("state") == "written" and image.get("at", 0) >= t0:
                                break
                            time.sleep(0.1)
                        w_end = image["at"]
                        w_start = w_end - image["seconds"]
                        windows += [("rank", t0, w_start), ("image write", w_start, w_end)]
                        res["rounds"].append({"image_bytes": image["bytes"],
                                              "image_s": image["seconds"],
                                              "rebuild_s": round(w_end - t0, 2)})
                        time.sleep(2.0)
                        windows.append(("baseline", w_end + 0.5, time.time()))
            finally:
                stop.set()
                t.join()
        by: dict = {}
        for name, a, b in windows:
            by.setdefault(name, []).extend(
                (s, x) for s, x in calls if s + x > a and s < b)  # overlaps the window
        res["windows"] = {k: percentiles(v) for k, v in by.items()}
        res["daemon_draft_latency_us"] = (d.stats().get("latency") or {}).get("draft")
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    res["settings"] = vars(args) | {"command": " ".join(sys.argv)}
    res["machine"] = machine_info()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({"rounds": res["rounds"], "windows": res["windows"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
