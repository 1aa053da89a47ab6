"""Replay of held-out code through every drafter, on a warmed table (issue 8).

Data (bench/data.py): the CPython standard library, files sorted by path.  The table is warmed
(``ColdStore.bulk_load``, the path of ``ngramd warm``) with the first files, up to
``--train-tokens``; the requests come from the last 10% of the files (disjoint): prompt = the
first ``--prompt`` tokens of a file, output = the next ``--output`` tokens.  Greedy, so the
"model" is the file itself: a drafted token is accepted when it equals the next token of the
file, and every step emits the accepted tokens plus one (the bonus token).

Drafters, side by side on the same requests:

* **generator path**: ``NgramDrafter`` + ``DaemonLink`` against a real ``ngramd`` (defaults:
  64 MiB hot tier), exactly as ``ngram-generate`` drafts: request-local table, the hot and
  recent tiers in shared memory, asynchronous daemon asks; each verify step sleeps
  ``--forward-ms`` (default 15, a GPU forward) so the daemon's answers get the time they would
  have in generation;
* **daemon full answer**: the daemon's ``draft`` with a generous budget (global table only,
  cold tier included), per step;
* **all-in-RAM bound**: request-local table + every row of the table in one unpruned in-memory
  slot table (``draft_multi``): what drafting from the whole table without tiers would give;
* **HF prompt lookup**: transformers' prompt-lookup decoding (n-gram match in the request,
  ``max_ngram_size`` 3), reimplemented.

Reports AL (tokens per verify step, bonus included), acceptance (accepted / drafted), the share
of accepted tokens per tier and order, the daemon asks (answered in time, used), and the
daemon's RSS while it builds the hot tier.  SuffixDecoding is not built here (C++ from a repo
this machine cannot fetch at benchmark time): the all-in-RAM bound stands in for it.
Usage: ``OMP_NUM_THREADS=1 python bench/bench_replay.py [--requests N] [--quick]``.
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
from collections import Counter
from pathlib import Path

import numpy as np

from ngram_client import DaemonUnavailable, NgramClient
from ngram_generator.drafting import DraftConfig, NgramDrafter
from ngram_generator.remote import DaemonLink
from ngramd import kernels as K
from ngramd.cold import ColdOptions, ColdStore
from ngramd.identity import TableIdentity, tokenizer_fingerprint

import data
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"
K_DRAFT = 8
SUFFIX_DECODING_AL = 3.92  # issue 8: SuffixDecoding on the replay (another corpus)


# ---------------------------------------------------------------------------------------------
def hf_prompt_lookup(ctx: np.ndarray, k: int, max_ngram: int = 3) -> np.ndarray:
    """transformers' PromptLookupCandidateGenerator: the first earlier occurrence of the
    context's last n-gram (n = max_ngram..1), and the tokens that followed it."""
    n_ctx = ctx.shape[0]
    for n in range(max_ngram, 0, -1):
        if n_ctx <= n:
            continue
        pat = ctx[n_ctx - n:]
        win = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)
        hits = np.flatnonzero((win == pat).all(1))
        for h in hits:
            start = h + n
            end = min(start + k, n_ctx)
            if start < end:
                return ctx[start:end]
    return ctx[:0]


class Tally:
    def __init__(self):
        self.steps = self.emitted = self.drafted = self.accepted = 0
        self.by_tier, self.by_order = Counter(), Counter()

    def step(self, n_drafted: int, n_acc: int, tiers=None, orders=None):
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_acc
        self.emitted += n_acc + 1
        if tiers is not None:
            for t, o in zip(list(tiers)[:n_acc], list(orders)[:n_acc]):
                self.by_tier[K.TIER_NAMES[int(t)] if int(t) < 4 else str(int(t))] += 1
                self.by_order[int(o)] += 1

    def result(self) -> dict:
        acc = self.accepted
        return {"al": self.emitted / max(self.steps, 1),
                "acceptance": acc / max(self.drafted, 1),
                "drafted_per_step": self.drafted / max(self.steps, 1),
                "steps": self.steps, "accepted": acc,
                "accepted_share_by_tier": {k: v / max(acc, 1) for k, v in self.by_tier.items()},
                "accepted_share_by_order": {str(k): v / max(acc, 1)
                                            for k, v in sorted(self.by_order.items())}}


def matched(draft: np.ndarray, truth: np.ndarray) -> int:
    n = 0
    for a, b in zip(draft.tolist(), truth.tolist()):
        if a != b:
            break
        n += 1
    return n


def replay(requests, draft_fn, on_step=None) -> Tally:
    """``draft_fn(context, request index, step) -> (tokens, tiers, orders)``."""
    t = Tally()
    for ri, (prompt, out) in enumerate(requests):
        ctx = list(prompt)
        pos = 0
        while pos < out.size:
            toks, tiers, orders = draft_fn(np.asarray(ctx, np.uint32), ri, pos)
            toks = np.asarray(toks)[:min(K_DRAFT, out.size - pos - 1)]
            n = matched(toks, out[pos:])
            t.step(len(toks), n, tiers, orders)
            emitted = out[pos:pos + n + 1]
            if on_step is not None:
                on_step(n, emitted)
            ctx.extend(emitted.tolist())
            pos += n + 1
    return t


# ---------------------------------------------------------------------------------------------
class Daemon:
    def __init__(self, root: Path, name: str, sets=()):
        self.root, self.name, self.sets = root, name, list(sets)
        self.shm = f"/dev/shm/ngramd-bench-replay-{os.getpid()}"
        self.endpoint = f"ipc://{root}/run/{name}.sock"

    def start(self):
        args = data.daemon_args(self.name, self.root, self.shm, self.sets)
        self.proc = subprocess.Popen(args, stdout=open(self.root / "daemon.log", "ab"),
                                     stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 300
        with NgramClient(self.endpoint, timeout_ms=300, retries=0) as c:
            while True:
                try:
                    c.ping()
                    return
                except DaemonUnavailable:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError((self.root / "daemon.log").read_text()[-3000:])
                    time.sleep(0.05)

    def rss_kb(self, key="VmRSS") -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(300)


def rebuild_with_peak_rss(d: Daemon) -> dict:
    """``rebuild_hot`` while sampling the daemon's RSS every 20 ms."""
    before, peak, stop = d.rss_kb(), [0], threading.Event()

    def watch():
        while not stop.wait(0.02):
            peak[0] = max(peak[0], d.rss_kb())
    th = threading.Thread(target=watch)
    th.start()
    t0 = time.perf_counter()
    with NgramClient(d.endpoint, timeout_ms=1_800_000) as c:
        gen = c.rebuild_hot()
        hot = c.stats()["hot"]
    stop.set()
    th.join()
    return {"generation": gen, "seconds": time.perf_counter() - t0,
            "rss_before_mb": before / 1024, "rss_peak_mb": max(peak[0], before) / 1024,
            "rise_mb": (max(peak[0], before) - before) / 1024, "hot_bytes": hot["bytes"],
            "placed": hot.get("placed"), "pruned_filter_bytes": hot.get("pruned_filter_bytes")}


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-tokens", type=int, default=4_000_000)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=800)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--forward-ms", type=float, default=15.0)
    ap.add_argument("--hot-mb", type=float, default=64.0, help="the daemon's hot budget")
    ap.add_argument("--quick", action="store_true", help="500k train tokens, 20 requests")
    ap.add_argument("--dir", help="work directory (default: a temp dir under ./var)")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_tokens, args.requests = 500_000, 20
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-replay-", dir="var")).resolve()
    (root / "run").mkdir(parents=True, exist_ok=True)
    tok = data.qwen_tokenizer()
    files = data.stdlib_files()
    n_hold = len(files) // 10
    train, _ = data.tokenize(tok, files[:-n_hold], args.train_tokens)
    hold, _ = data.tokenize(tok, files[-n_hold:])
    need = args.prompt + args.output
    requests = [(h[:args.prompt], h[args.prompt:need]) for h in hold if h.size >= need]
    requests = requests[:args.requests]
    res: dict = {"machine": machine_info(("numpy", "numba", "rocksdict")),
                 "settings": {k: v for k, v in vars(args).items() if k != "dir"} | {
                     "k": K_DRAFT, "requests_used": len(requests),
                     "train_files": len(files) - n_hold, "heldout_files": n_hold}}
    print(f"{len(requests)} requests; warming the table with "
          f"{sum(s.size for s in train)} tokens ...", file=sys.stderr)
    fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=151_936, tokenizer=fp)
    tokens, offsets = data.pack(train)
    with ColdStore(root / "data" / "t", ident, ColdOptions(sync_log=False)) as s:
        run = s.bulk_load(tokens, offsets, threads=2, mem_mb=2048)
        res["table"] = {"tokens": int(tokens.size), "entries": run.rows,
                        "sst_bytes": s.stats()["sst_bytes"]}
        # the all-in-RAM bound: every row, unpruned, one slot table (K = 3 candidates)
        cap = 1 << int(np.ceil(np.log2(run.rows / 0.6)))
        full = np.zeros((cap, K.SLOT_WORDS), np.uint32)
        for rows in s.scan_rows():
            tk, ct = rows.padded(K.HOT_K)
            assert K.insert_rows(full, cap, rows.key, rows.order, tk, ct, rows.total) == 0
    del tokens, offsets, train

    daemon = Daemon(root, "t", [f"table.hot_budget_mb={args.hot_mb}", "table.hot_rebuild_s=0"])
    try:
        daemon.start()
        res["hot_build"] = rebuild_with_peak_rss(daemon)
        print(f"hot tier: {json.dumps(res['hot_build'])}", file=sys.stderr)

        cmin, smin = np.ones(17, np.int64), np.full(17, 0.3)
        empty = np.zeros((0, K.SLOT_WORDS), np.uint32)
        tiers_rl = np.array([K.TIER_LOCAL, K.TIER_HOT, 0, 0])
        full_rl = np.array([False, False, True, True])
        buf = [np.zeros(K_DRAFT, np.uint32), np.zeros(K_DRAFT, np.uint8),
               np.zeros(K_DRAFT, np.uint8), np.zeros(K_DRAFT, np.float32)]
        local = np.zeros((1 << 16, K.SLOT_WORDS), np.uint32)
        state = {"ri": -1, "n": 0}

        def ram_bound(ctx, ri, pos):
            if ri != state["ri"]:
                local[:] = 0
                state["ri"], state["n"] = ri, 0
            K.local_add(local, 16, ctx, state["n"], ctx.size, 1, 16)
            state["n"] = ctx.size
            n, _ = K.draft_multi(local, full, empty, empty, tiers_rl, full_rl, 16, ctx, 1, 16,
                                 K_DRAFT, cmin, smin, 0.1, 0.0, *buf, np.zeros(0, np.uint64),
                                 0, -1)
            return buf[0][:n].copy(), buf[2][:n].copy(), buf[1][:n].copy()

        print("all-in-RAM bound ...", file=sys.stderr)
        res["ram_bound"] = replay(requests, ram_bound).result()
        del full
        print("HF prompt lookup ...", file=sys.stderr)
        res["hf_prompt_lookup"] = replay(
            requests, lambda ctx, ri, pos: (hf_prompt_lookup(ctx, K_DRAFT), None, None)).result()

        print("daemon full answer ...", file=sys.stderr)
        with NgramClient(daemon.endpoint, timeout_ms=60_000) as c:
            def daemon_full(ctx, ri, pos):
                d = c.draft([ctx[-32:]], K_DRAFT, budget_us=1e6)[0]
                return d.tokens, d.tiers, d.orders
            res["daemon_full"] = replay(requests, daemon_full).result()

        print(f"generator path ({args.forward_ms} ms a forward) ...", file=sys.stderr)
        link = DaemonLink(daemon.endpoint, timeout_ms=5000)
        link.connect()
        src = NgramDrafter(DraftConfig(max_draft=K_DRAFT), link)
        asked0 = (src.asked, src.answered, src.used)
        gstate = {"ri": -1, "d": None}

        def gen_path(ctx, ri, pos):
            if ri != gstate["ri"]:
                if gstate["ri"] >= 0:
                    src.finish()
                link.maybe_reconnect()
                src.start(ctx, expected_new=args.output)
                gstate["ri"] = ri
            d = src.draft(K_DRAFT)
            gstate["d"] = d
            return d.tokens, d.tiers, d.orders

        def gen_step(n, emitted):
            src.accepted(gstate["d"], n)
            time.sleep(args.forward_ms / 1e3)  # the verify forward: the daemon's time
            src.extend(emitted)

        res["generator"] = replay(requests, gen_path, gen_step).result()
        src.finish()
        res["generator"]["daemon_asks"] = {
            "asked": src.asked - asked0[0], "answered_in_time": src.answered - asked0[1],
            "used": src.used - asked0[2]}
        link.close()
    finally:
        daemon.stop()
        shutil.rmtree(daemon.shm, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    res["command"] = " ".join(["python", "bench/bench_replay.py", *(argv or sys.argv[1:])])
    OUT.mkdir(exist_ok=True)
    (OUT / "replay.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


def report(r: dict) -> str:
    g, b, d, h = r["generator"], r["ram_bound"], r["daemon_full"], r["hf_prompt_lookup"]
    hb = r["hot_build"]
    lines = [f"machine: {r['machine']['cpu']}, {r['machine']['nproc']} cores",
             f"table: {r['table']['tokens'] / 1e6:.1f}M tokens of stdlib code -> "
             f"{r['table']['entries'] / 1e6:.1f}M entries; {r['settings']['requests_used']} "
             f"held-out requests of {r['settings']['prompt']} + {r['settings']['output']} "
             f"tokens, greedy, k = {K_DRAFT}, {r['settings']['forward_ms']} ms a forward", "",
             f"{'drafter':34s} {'AL':>6} {'accept':>7} {'drafted/step':>13}"]
    for name, x in (("generator path (defaults)", g), ("daemon full answer", d),
                    ("all-in-RAM bound (local + all)", b), ("HF prompt lookup", h)):
        lines.append(f"{name:34s} {x['al']:>6.2f} {x['acceptance']:>7.2f} "
                     f"{x['drafted_per_step']:>13.2f}")
    a = g["daemon_asks"]
    lines += ["",
              f"generator AL / all-in-RAM bound: {g['al'] / b['al']:.1%} (target >= 97%); "
              f"SuffixDecoding on the issue's replay: {SUFFIX_DECODING_AL} (not built here)",
              f"daemon asks: {a['asked']}, answered within a forward: {a['answered_in_time']}, "
              f"used: {a['used']}",
              "generator accepted tokens by tier: " + ", ".join(
                  f"{k} {v:.0%}" for k, v in sorted(g["accepted_share_by_tier"].items())),
              f"hot build (budget {hb['hot_bytes'] / 2**20:.0f} MiB): daemon RSS "
              f"{hb['rss_before_mb']:.0f} -> peak {hb['rss_peak_mb']:.0f} MB "
              f"(+{hb['rise_mb']:.0f} MB), {hb['seconds']:.1f} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
