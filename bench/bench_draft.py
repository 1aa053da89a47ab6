"""Per-draft cost of the three in-process drafting front ends, on a synthetic hot table.

Measured in one process (median µs):

1. ``HotReader.draft``: one context per call (a 32-token held-out context, 8 tokens asked);
2. ``HotReader.draft_batch``: batches of 256 such contexts, µs per context;
3. ``ngram_generator.drafting.NgramDrafter.draft``: requests of held-out text (a 64-token
   prompt, then one step per true token: ``draft(8)`` timed, ``extend`` not), its request-local
   table first, then the hot tier (through a stub link that offers the reader, no daemon);
4. ``ngram_generator.batch.BatchDrafter.step``, the vLLM proposer's ``propose()`` less vLLM's
   own glue, per step at batch 1, 8, 32 and 64: rows of held-out text in an engine-like loop
   (each row accepts the prefix of its draft that the text continues, plus one token), the
   draft-length policy on (its clock advanced 50 ms a step), the first 8 steps not timed.

The corpus is synthetic and fixed by ``--seed``: sequences of phrases (8-48 ids, Zipf-drawn from a
pool of 3,000 over a 20k vocabulary) with noise ids between them; the hot table is every n-gram
of orders 1..16 (``count_ngrams``) through ``build_hot`` (64 MiB budget, redundant rows pruned,
the pruned-key filter published), as the daemon builds it.  Contexts come from fresh sequences
of the same pool, so most drafts find long matches.  Numba is warmed before anything is timed.

A digest of every draft (tokens, orders, tiers, conf) is printed, so two trees can be checked
for identical drafts.  ``--against DIR`` (repeatable) runs this same script with
``DIR/.venv/bin/python`` (another checkout, e.g. an older commit in a ``git worktree``),
alternately with this one, ``--rounds`` times each, and prints every tree's medians and this
one's ratios to them: one run, same load.
Each tree gets its own ``NUMBA_CACHE_DIR`` (under the temp dir) and runs its own code (its
``.wtpath`` if it has one, else its venv's install; checked).

Usage: ``OMP_NUM_THREADS=1 flock /tmp/flashnest-heavy.lock python bench/bench_draft.py
[--against /tmp/old] [--rounds 3]``; writes ``bench/out/draft.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy: the box is shared

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"

VOCAB, POOL, N_SEQ, SEQ_PHRASES = 20_000, 3_000, 400, 60
CTX_LEN, DRAFT_LEN, BATCH, PROMPT = 32, 8, 256, 64
PROPOSE_BATCHES, PROPOSE_STEPS, PROPOSE_WARM = (1, 8, 32, 64), 48, 8
C_MIN, S_MIN, P_CUM = 1, 0.3, 0.1  # the TableConfig defaults
HOT_BUDGET_MB, MAX_PROBE = 64, 16


def corpus(rng, pool, n_seq: int) -> list[np.ndarray]:
    """``n_seq`` sequences of Zipf-drawn phrases from ``pool`` with 0-3 noise ids between."""
    w = 1.0 / np.arange(1, len(pool) + 1)
    w /= w.sum()
    seqs = []
    for _ in range(n_seq):
        parts = []
        for p in rng.choice(len(pool), SEQ_PHRASES, p=w):
            parts.append(pool[p])
            parts.append(rng.integers(0, VOCAB, rng.integers(0, 4)).astype(np.uint32))
        seqs.append(np.concatenate(parts))
    return seqs


def setup(seed: int, shm_dir: str):
    try:  # kernels as a package of topics; a tree from before the split (--against) has one file
        from ngramd.kernels.count import count_ngrams
    except ModuleNotFoundError:  # (by name: this tree has no ngramd.kernels.count_ngrams)
        count_ngrams = importlib.import_module("ngramd.kernels").count_ngrams
    from ngramd.hot.selection import build_hot, pruned_filter
    from ngramd.hot.shm import HotPublisher, HotReader
    from ngramd.wire.identity import TableIdentity

    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, VOCAB, rng.integers(8, 49)).astype(np.uint32) for _ in range(POOL)]
    train = corpus(rng, pool, N_SEQ)
    held = corpus(rng, pool, 40)
    toks = np.concatenate(train)
    offs = np.concatenate([[0], np.cumsum([len(s) for s in train])]).astype(np.int64)
    rows = count_ngrams(toks, offs, 1, 16, 4)
    slots, info, redundant = build_hot(rows, HOT_BUDGET_MB << 20, C_MIN, S_MIN, MAX_PROBE,
                                       return_pruned=True)
    words, nprobe = pruned_filter(redundant)
    ident = TableIdentity(n_min=1, n_max=16, cold_k=4, vocab_size=VOCAB)
    pub = HotPublisher(shm_dir, "b", ident, grace_s=0.0)
    pub.publish(slots, MAX_PROBE, pruned=words, pruned_nprobe=nprobe)
    reader = HotReader(shm_dir, "b", identity=ident)
    # held-out contexts: CTX_LEN tokens ending at random points of the held-out sequences
    ctx = []
    for _ in range(2000):
        s = held[rng.integers(len(held))]
        e = int(rng.integers(CTX_LEN, len(s)))
        ctx.append(np.ascontiguousarray(s[e - CTX_LEN:e]))
    return pub, reader, ctx, held, {"hot_slots": int(slots.shape[0]),
                                    "corpus_tokens": int(toks.size)}


_RULES: dict = {}


def _rules(reader):
    """(cached per reader) The rules argument of this checkout's ``HotReader.draft``: a ``DraftRules`` (since
    a869ab7), or the loose thresholds before (``--against`` runs older checkouts)."""
    got = _RULES.get(id(reader))
    if got is None:
        if "rules" in inspect.signature(reader.draft).parameters:
            from ngramd.wire.rules import DraftRules

            got = (DraftRules(n_min=reader.n_min, n_max=reader.n_max, c_min=C_MIN, s_min=S_MIN,
                              p_cum=P_CUM),)
        else:
            got = (C_MIN, S_MIN, P_CUM)
        _RULES[id(reader)] = got
    return got


def _draft(reader, c):
    return reader.draft(c, DRAFT_LEN, *_rules(reader))


def _draft_batch(reader, tokens, offs):
    return reader.draft_batch(tokens, offs, DRAFT_LEN, *_rules(reader))


def _draft_config(config_cls):
    """A ``DraftConfig`` drafting ``DRAFT_LEN`` tokens, in this checkout's API."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    if "rules" in names:
        from ngramd.wire.rules import DraftRules

        return config_cls(rules=DraftRules(max_draft_len=DRAFT_LEN), ask_below_order=0)
    return config_cls(max_draft=DRAFT_LEN, ask_below_order=0)


def _digest(h, *arrays) -> None:
    for a in arrays:
        h.update(np.ascontiguousarray(a).astype(np.float64).tobytes())


def time_single(reader, ctx, rounds: int, h) -> float:
    for c in ctx[:200]:  # warm
        _draft(reader, c)
    clock, ns = time.perf_counter_ns, []
    for _ in range(rounds):
        for c in ctx:
            t0 = clock()
            _draft(reader, c)
            ns.append(clock() - t0)
    for c in ctx:
        d = _draft(reader, c)
        _digest(h, d.tokens, d.orders, d.tiers, d.conf)
    return float(np.median(ns)) / 1e3


def time_batch(reader, ctx, rounds: int, h) -> float:
    batches = []
    for i in range(0, len(ctx) - BATCH + 1, BATCH):
        part = ctx[i:i + BATCH]
        offs = np.concatenate([[0], np.cumsum([len(c) for c in part])]).astype(np.int64)
        batches.append((np.concatenate(part), offs))
    _draft_batch(reader, *batches[0])  # warm
    clock, ns = time.perf_counter_ns, []
    for _ in range(rounds * 4):
        for tokens, offs in batches:
            t0 = clock()
            _draft_batch(reader, tokens, offs)
            ns.append((clock() - t0) / BATCH)
    for tokens, offs in batches:
        d = _draft_batch(reader, tokens, offs)
        _digest(h, d.lengths)
        for b in range(BATCH):
            n = int(d.lengths[b])
            _digest(h, d.tokens[b, :n], d.orders[b, :n], d.tiers[b, :n], d.conf[b, :n])
    return float(np.median(ns)) / 1e3


def time_drafter(reader, held, rounds: int, h) -> float:
    from ngram_generator.drafting import DraftConfig, NgramDrafter

    link = SimpleNamespace(hot_table=lambda: reader, available=False)
    src = NgramDrafter(_draft_config(DraftConfig), link)
    clock, ns = time.perf_counter_ns, []
    for r in range(rounds + 1):  # round 0 warms and digests
        for s in held[:20]:
            src.start(s[:PROMPT], expected_new=256)
            for i in range(PROMPT, min(len(s), PROMPT + 256)):
                t0 = clock()
                d = src.draft(DRAFT_LEN)
                t1 = clock()
                if r:
                    ns.append(t1 - t0)
                else:
                    _digest(h, d.tokens, d.orders, d.tiers, d.conf)
                src.extend(s[i:i + 1])
            src.finish()
    return float(np.median(ns)) / 1e3


def time_propose(reader, held, rounds: int, h) -> dict:
    """Median µs of ``BatchDrafter.step`` at each batch size (module doc, item 4)."""
    link = SimpleNamespace(hot_table=lambda: reader, available=False, refresh=lambda: None,
                           state="off", learn_prompts=False)
    res = {}
    for b in PROPOSE_BATCHES:
        ns = []
        for r in range(rounds + 1):  # round 0 warms and digests
            got = _propose_run(link, held, b, h if r == 0 else None)
            if r:
                ns += got
        res[f"propose_{b}_us"] = float(np.median(ns)) / 1e3
    return res


def _propose_run(link, held, batch: int, h) -> list[int]:
    from ngram_generator.batch import BatchDrafter
    from ngram_generator.drafting import DraftConfig

    now = SimpleNamespace(t=0.0)
    bd = BatchDrafter(_draft_config(DraftConfig), link, vocab_size=VOCAB, clock=lambda: now.t)
    texts = [held[i % len(held)][(i // len(held)) * 97:] for i in range(batch)]
    tokens = np.zeros((batch, max(len(t) for t in texts)), np.int32)  # vLLM's token_ids_cpu
    for i, t in enumerate(texts):
        tokens[i, :len(t)] = t
    num = np.full(batch, PROMPT, np.int64)
    sampled = [[int(tokens[i, PROMPT - 1])] for i in range(batch)]  # prefill's last token
    clock, ns = time.perf_counter_ns, []
    for step in range(PROPOSE_STEPS):
        t0 = clock()
        drafts = bd.step(sampled, num, tokens, DRAFT_LEN)
        t1 = clock()
        if step >= PROPOSE_WARM:
            ns.append(t1 - t0)
        for i, d in enumerate(drafts):
            n, acc = int(num[i]), 0
            while acc < len(d) and d[acc] == tokens[i, n + acc]:
                acc += 1
            sampled[i] = tokens[i, n:n + acc + 1].tolist()
            num[i] = n + acc + 1
            if h is not None:
                _digest(h, np.asarray(d, np.int64))
        now.t += 0.05
    return ns


def measure(seed: int, rounds: int) -> dict:
    from ngramd import kernels as K

    base = tempfile.mkdtemp(prefix="bench-draft-", dir="/dev/shm")
    try:
        pub, reader, ctx, held, props = setup(seed, os.path.join(base, "ngramd"))
        res = {"kernels": K.__file__, **props}
        for name, fn, arg in (("single_us", time_single, ctx), ("batch_us", time_batch, ctx),
                              ("drafter_us", time_drafter, held)):
            h = hashlib.sha256()
            res[name] = fn(reader, arg, rounds, h)
            res[name.replace("_us", "_digest")] = h.hexdigest()[:16]
        h = hashlib.sha256()
        res.update(time_propose(reader, held, rounds, h))
        res["propose_digest"] = h.hexdigest()[:16]
        reader.close()
        pub.close()
        return res
    finally:
        shutil.rmtree(base, ignore_errors=True)


def child(python: str, tree: Path, seed: int, rounds: int) -> dict:
    """One measuring run of ``tree``'s code with ``python``.  The tree's packages come first on
    the path when it has a ``.wtpath`` (a worktree sharing another's venv); otherwise the
    venv's own install is used: an inherited ``PYTHONPATH`` must not make two trees one."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if (tree / ".wtpath").is_dir():
        env["PYTHONPATH"] = str(tree / ".wtpath")
    # numba's cache, one per tree, outside the trees
    key = hashlib.sha256(str(tree).encode()).hexdigest()[:12]
    env["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "bench-draft-numba", key)
    out = subprocess.run([python, __file__, "--child", "--seed", str(seed), "--rounds",
                          str(rounds)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{python} failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(res["kernels"]).resolve().is_relative_to(tree):
        raise RuntimeError(f"{tree}: the child ran the code of {res['kernels']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, action="append", default=[],
                    help="another checkout with its own .venv (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations (and timing rounds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.seed, args.rounds)))
        return 0
    sys.path.insert(0, str(REPO / "bench"))
    from machine import machine_info

    trees = [(f"against{i}", str(d.resolve() / ".venv" / "bin" / "python"), d.resolve())
             for i, d in enumerate(args.against)] + [("this", sys.executable, REPO)]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in trees}
    for _ in range(args.rounds):  # alternate: both trees see the same load
        for name, py, tree in trees:
            runs[name].append(child(py, tree, args.seed, args.rounds))
    keys = ("single_us", "batch_us", "drafter_us") + tuple(f"propose_{b}_us"
                                                          for b in PROPOSE_BATCHES)
    med = {name: {k: float(np.median([r[k] for r in rs])) for k in keys}
           for name, rs in runs.items()}
    print(f"{'tree':<8} {'HotReader.draft':>16} {'draft_batch/ctx':>16} "
          f"{'NgramDrafter':>14}   (median µs, {args.rounds} alternations)")
    for name, _, tree in trees:
        m = med[name]
        print(f"{name:<8} {m['single_us']:>16.2f} {m['batch_us']:>16.2f} "
              f"{m['drafter_us']:>14.2f}   {tree}")
    for name, _, _ in trees[:-1]:
        ratio = {k: med["this"][k] / med[name][k] for k in keys}
        print(f"{'ratio':<8} {ratio['single_us']:>16.3f} {ratio['batch_us']:>16.3f} "
              f"{ratio['drafter_us']:>14.3f}   this / {name}")
        same = [runs["this"][0][k] == runs[name][0][k]
                for k in ("single_digest", "batch_digest", "drafter_digest", "propose_digest")]
        print(f"{'':<8} same drafts as {name} (single, batch, drafter, propose): {same}")
    print(f"\n{'tree':<8} " + " ".join(f"{'propose b=' + str(b):>14}" for b in PROPOSE_BATCHES)
          + "   (BatchDrafter.step, median µs a step)")
    for name, _, _ in trees:
        print(f"{name:<8} " + " ".join(f"{med[name][f'propose_{b}_us']:>14.1f}"
                                       for b in PROPOSE_BATCHES))
    for name, _, _ in trees[:-1]:
        print(f"{'ratio':<8} " + " ".join(
            f"{med['this'][f'propose_{b}_us'] / med[name][f'propose_{b}_us']:>14.3f}"
            for b in PROPOSE_BATCHES) + f"   this / {name}")
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(("numpy", "numba")), "command": sys.argv,
              "settings": {"ctx_len": CTX_LEN, "draft_len": DRAFT_LEN, "batch": BATCH,
                           "prompt": PROMPT, "c_min": C_MIN, "s_min": S_MIN, "p_cum": P_CUM,
                           "seed": args.seed, "rounds": args.rounds},
              "medians_us": med, "runs": runs}
    (OUT / "draft.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
