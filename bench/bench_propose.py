"""What one ``propose()`` step costs with a real daemon: ``BatchDrafter.step`` (the vLLM
proposer less vLLM's glue) over a live ``ngramd``, in an engine-like loop.

1. A daemon at its defaults (its own data, shm and runtime dirs) is warmed through the ingest
   op with ``--train-tokens`` of the standard library (Qwen3 tokenizer, split by file) and
   waited for until its hot generation holds all of it.
2. One process per measurement (a fresh one: its mappings of the hot tier are new, as in an
   engine that just started or remapped a generation) runs, at each batch size, ``--steps``
   steps of rows of held-out files: each row accepts the prefix of its draft that the file
   continues, plus one token, as an engine would, and between steps a 32 MiB buffer is
   rewritten and the loop sleeps ``--gap-ms`` (a model's forward evicts the caches and takes
   time).  The first 10 steps are not timed.  It reports the median and mean wall time of a
   step, its CPU time, the minor page faults a step took, and the daemon's CPU time a step
   (its answers to the rows' asks: work on the host the model runs on, which ``propose()``'s
   own time does not show).
3. ``--costly``: the policy's step-cost model believes a draft token costs a thousand plain
   steps and learns nothing (``bench/spec_null.py``'s ``PlainChoosingProposer`` in vLLM), so
   it chooses plain at every step, probes aside: what ``propose()`` costs where drafting
   cannot pay (the back-off's case).
4. ``--against DIR``: another checkout's code (``DIR/.wtpath`` on the path: a git worktree
   with links ``ngramd``, ``ngram_client``, ``ngram_generator`` to its packages) measured
   alternately with this one, ``--rounds`` times each, on the same daemon: one run, same load.

Usage: ``OMP_NUM_THREADS=1 python bench/bench_propose.py [--costly] [--against /tmp/old]
[--rounds 2]``; prints a table, writes ``bench/out/propose.json``.  Nothing else should run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy: the box is shared

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out"
BATCHES, PROMPT, WARM, THRASH_MB = (1, 8, 32, 64), 64, 10, 32


def held_and_train(train_tokens: int, holdout: int = 200):
    """Files of the standard library split at random: ``holdout`` files (of 600+ tokens)
    held out, then ``train_tokens`` of the others."""
    import data

    toks, offs = data.stdlib_corpus()
    seqs = [toks[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
    order = np.random.default_rng(0).permutation(len(seqs))
    held = [seqs[i] for i in order[:holdout] if len(seqs[i]) > 600]
    train, n = [], 0
    for i in order[holdout:]:
        train.append(seqs[i])
        n += len(seqs[i])
        if n >= train_tokens:
            break
    return held, train, n


def warm_daemon(root: Path, train_tokens: int):
    """A daemon at its defaults, warmed; ``(proc, endpoint, shm dir, tokens)``."""
    import data
    from ngram_client import NgramClient
    from ngramd.wire.identity import tokenizer_fingerprint

    shm = f"/dev/shm/bench-propose-{os.getpid()}"
    endpoint = f"ipc://{root}/run/p.sock"
    (root / "run").mkdir(parents=True)
    log = root / "ngramd.log"
    proc = subprocess.Popen(data.daemon_args("p", root, shm), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    data.wait_ready(endpoint, proc, log)
    _, train, n = held_and_train(train_tokens)
    fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
    with NgramClient(endpoint, timeout_ms=600_000, tokenizer_fingerprint=fp) as c:
        last = c.ingest(train)[1]
        while c.stats()["hot"].get("counted_seq", -1) < last:
            time.sleep(1.0)
    return proc, endpoint, shm, n


def measure(endpoint: str, steps: int, gap_ms: float, costly: bool, daemon_pid: int) -> dict:
    """One process's figures at every batch size (module doc, item 2)."""
    import data
    from ngram_generator.batch import BatchDrafter
    from ngram_generator.drafting import DraftConfig, settings_from_table
    from ngram_generator.remote import DaemonLink
    from ngramd.wire.identity import tokenizer_fingerprint
    from ngramd.wire.rules import DraftRules
    from spec_null import SteepCost  # the cost vLLM's plain-choosing proposer believes

    held, _, _ = held_and_train(0)
    fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
    link = DaemonLink(endpoint, tokenizer_fingerprint=fp)
    link.connect()
    config = settings_from_table(link.info, DraftConfig(DraftRules(max_draft_len=8)),
                                 {"max_draft_len": 8})
    vocab = data.qwen_tokenizer().get_vocab_size()
    thrash = np.zeros((THRASH_MB << 20) // 8)
    out = {}
    for b in BATCHES:
        drafter = BatchDrafter(config, link, vocab_size=vocab,
                               **({"cost": SteepCost()} if costly else {}))
        texts = [held[i % len(held)][(i // len(held)) * 97:] for i in range(b)]
        tokens = np.zeros((b, max(len(t) for t in texts)), np.int32)  # vLLM's token_ids_cpu
        for i, t in enumerate(texts):
            tokens[i, :len(t)] = t
        num = np.full(b, PROMPT, np.int64)
        sampled = [[int(tokens[i, PROMPT - 1])] for i in range(b)]
        wall, cpu, faults = [], [], []
        for step in range(steps):
            if step == WARM:
                d0 = data.cpu_s(daemon_pid)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.thread_time()
            drafts = drafter.step(sampled, num, tokens, 8)
            t1, c1 = time.perf_counter(), time.thread_time()
            if step >= WARM:
                wall.append(t1 - t0)
                cpu.append(c1 - c0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            for i, d in enumerate(drafts):
                n, acc = int(num[i]), 0
                while acc < len(d) and d[acc] == tokens[i, n + acc]:
                    acc += 1
                sampled[i] = tokens[i, n:n + acc + 1].tolist()
                num[i] = min(n + acc + 1, tokens.shape[1] - 10)
            thrash += 1.0
            time.sleep(gap_ms / 1e3)
        daemon_ms = 1e3 * (data.cpu_s(daemon_pid) - d0) / (steps - WARM)
        rep = drafter.report()
        pol = rep["policy"]
        out[str(b)] = {"median_ms": 1e3 * float(np.median(wall)),
                       "mean_ms": 1e3 * float(np.mean(wall)),
                       "cpu_ms": 1e3 * float(np.median(cpu)),
                       "faults": float(np.median(faults)), "daemon_cpu_ms": daemon_ms,
                       "asks": rep["asks_sent"],
                       "plain_share": pol["plain_share"], "skipped": pol.get("skipped")}
        drafter.finish_all()
    link.close()
    return out


def child(tree: Path | None, endpoint: str, daemon_pid: int, args) -> dict:
    """One measuring process of ``tree``'s code (None: this checkout's)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree / ".wtpath")
    cmd = [sys.executable, __file__, "--child", endpoint, "--daemon-pid", str(daemon_pid),
           "--steps", str(args.steps),
           "--gap-ms", str(args.gap_ms)] + (["--costly"] if args.costly else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    if out.returncode:
        raise RuntimeError(f"{tree or REPO}: the child failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    where = Path(res.pop("code")).resolve()
    if not where.is_relative_to(tree.resolve() if tree else REPO):
        raise RuntimeError(f"{tree or REPO}: the child ran the code of {where}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-tokens", type=int, default=2_000_000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--costly", action="store_true",
                    help="the policy believes tokens cost 1000x: plain is chosen")
    ap.add_argument("--against", type=Path, help="another checkout, with a .wtpath")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--daemon-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "bench"))
    if args.child:
        import ngram_generator

        res = measure(args.child, args.steps, args.gap_ms, args.costly, args.daemon_pid)
        print(json.dumps({"code": ngram_generator.__file__, **res}))
        return 0
    from data import stop_process
    from machine import machine_info

    root = Path(tempfile.mkdtemp(prefix="bench-propose-"))
    trees = ([("against", args.against)] if args.against else []) + [("this", None)]
    runs: dict[str, list] = {name: [] for name, _ in trees}
    proc, shm = None, None
    try:
        proc, endpoint, shm, n = warm_daemon(root, args.train_tokens)
        for _ in range(args.rounds):  # alternate: both trees see the same load
            for name, tree in trees:
                runs[name].append(child(tree, endpoint, proc.pid, args))
    finally:
        if proc is not None:
            stop_process(proc)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    print(f"BatchDrafter.step with a live daemon ({n} warm tokens), "
          f"{'costly tokens (plain chosen)' if args.costly else 'drafts accepted as the text goes'}"
          f"; ms a step, median (mean) per process, {args.steps - WARM} steps timed")
    print(f"{'tree':<8} " + " ".join(f"{'batch ' + str(b):>22}" for b in BATCHES)
          + "   faults/step (median)   daemon CPU ms/step")
    for name, _ in trees:
        for r in runs[name]:
            print(f"{name:<8} " + " ".join(
                f"{r[str(b)]['median_ms']:>13.3f} ({r[str(b)]['mean_ms']:.3f})" for b in BATCHES)
                  + "   " + " ".join(f"{r[str(b)]['faults']:.0f}" for b in BATCHES)
                  + "   " + " ".join(f"{r[str(b)]['daemon_cpu_ms']:.2f}" for b in BATCHES))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "propose.json").write_text(json.dumps(
        {"runs": runs, "train_tokens": n, "settings": {k: str(v) for k, v in vars(args).items()},
         "machine": machine_info()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
