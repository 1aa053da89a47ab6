"""What a vLLM step with speculation costs when nothing is drafted, split in two: vLLM's own
speculative path, and ngramd's ``propose()``.  (Issue 27: round-1 cells at batch 8 and 32 where
ngramd at its defaults ran below plain although its policy's own tally said it should not.)

Three engines on the same prompts, alternating within each repetition (the bench_vllm setup:
SmolLM2-135M-Instruct, fp32, eager, vLLM's CPU build, greedy, ``num_speculative_tokens`` 8):

* ``plain``: no speculation;
* ``null``: ``custom_class`` = ``spec_null.NullProposer``, which proposes nothing and does
  nothing: vLLM's speculative path alone;
* ``ngramd-discard``: ngramd's proposer at its defaults (warm table, daemon, policy) whose
  drafts are thrown away after it made them (``spec_null.DiscardingProposer``): the cost of
  ``propose()`` on top.

So ``null / plain`` is what enabling speculation costs in vLLM with no draft, and ``discard /
null`` what ngramd's ``propose()`` costs.  (ngramd drafting for real is bench_vllm's: here its
table would have learned every prompt from the discarding proposer's feedback.)

    .venv-vllm/bin/python bench/bench_spec_overhead.py [--reps 3] [--batches 8,32]
        [--workloads code,dialogue] [--contend 2] [--engines plain,null,ngramd-discard]

``--engines`` adds ``ngramd-plain`` and ``ngramd-plain-noback`` (``spec_null``): ngramd's
proposer with a policy that always chooses plain, with and without its back-off, so their
ratio is what the back-off saves where drafting cannot pay; and ``ngramd-discard-everyask``
(``ask_backoff`` 1: every short draft asks the daemon, as before ``AskGate``), so
``ngramd-discard / ngramd-discard-everyask`` is what the asks' back-off saves (the daemon's
answers run on the same host as the model).  ``wrong-1`` and ``wrong-rows`` verify one
draft token (never accepted) on the first row, or on every row, of every step: ``wrong-1 /
null`` is what a step that verifies any draft costs beyond plain (the "draft jump"),
``wrong-rows / null`` the same with a draft token a row, ``wrong-2x``/``4x``/``8x`` with 2, 4
or 8 a row (the cost of a step against its rows and its draft tokens); ``right-8x`` drafts the
8 tokens each row will emit, replayed from the plain engine's outputs (recorded before the
repetitions), so ``right-8x / wrong-8x`` set the same verified tokens with nine times the
tokens emitted.  Those engines' steps, as a step clock reads them (``spec_null``'s module doc),
are reported by rows under the table.  Each ngramd engine's
``propose()`` times (median and mean a step, per batch size, from its stats file) are reported
under the table.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# standard library only at module level (bench_vllm's module doc says why)

OUT = Path(__file__).resolve().parent / "out"
ENGINES = {"plain": None, "null": "spec_null.NullProposer",
           "ngramd-discard": "spec_null.DiscardingProposer",
           "ngramd-discard-everyask": "spec_null.DiscardingEveryAsk",
           "ngramd-plain": "spec_null.PlainChoosingProposer",
           "ngramd-plain-noback": "spec_null.PlainChoosingNoBackOff",
           "wrong-1": "spec_null.OneWrongToken", "wrong-rows": "spec_null.WrongTokenEveryRow",
           "wrong-2x": "spec_null.WrongTokens2", "wrong-4x": "spec_null.WrongTokens4",
           "wrong-8x": "spec_null.WrongTokens8", "right-8x": "spec_null.RightTokens8"}
DEFAULT_ENGINES = "plain,null,ngramd-discard"
# the ratios reported, (numerator, denominator), when both engines ran
RATIOS = (("null", "plain"), ("ngramd-discard", "null"), ("ngramd-discard", "plain"),
          ("ngramd-discard-everyask", "plain"), ("ngramd-discard", "ngramd-discard-everyask"),
          ("ngramd-plain", "plain"), ("ngramd-plain-noback", "plain"),
          ("ngramd-plain", "ngramd-plain-noback"), ("wrong-1", "null"), ("wrong-rows", "null"),
          ("wrong-2x", "null"), ("wrong-4x", "null"), ("wrong-8x", "null"),
          ("right-8x", "wrong-8x"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", default="8,32")
    p.add_argument("--workloads", default="code,dialogue")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--warm-tokens", type=int, default=1_000_000)
    p.add_argument("--contend", type=int, default=0, help="busy processes beside the run")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy; outputs then compared)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"comma-separated, of {', '.join(ENGINES)} (plain is always run)")
    p.add_argument("--out", default=str(OUT / "spec-overhead.json"))
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier run")
    args = p.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}: choose from {', '.join(ENGINES)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from data import contention

    with contention(args.contend):
        res = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(report(res))
    return 0


def run(args) -> dict:
    import bench_vllm as bv
    from machine import machine_info

    t0 = time.time()
    model, tok, batches, where, work, warm_up = bv.prepare(args.batches, 2, args.workloads)
    root = Path(tempfile.mkdtemp(prefix="bench-spec-overhead-"))
    engines: dict = {}
    table = None
    cells = []
    os.environ["SPEC_NULL_STEPS"] = str(root / "steps")  # the engines' processes inherit these
    os.environ["SPEC_NULL_REPLAY"] = str(root / "replay.json")
    (root / "steps").mkdir()
    try:
        warm, warm_fig = bv.warm_table(root, tok, bv.warm_corpus(tok, args.warm_tokens,
                                                                 where[batches[-1]].stop))
        table = bv.Table(root, "t", warm, tok)
        chosen = {n: ENGINES[n] for n in ENGINES
                  if n == "plain" or n in args.engines.split(",")}
        for name, cls in chosen.items():
            learns = cls is not None and not tableless(cls)
            stats = root / f"{name}-stats.json" if learns else None
            method = "plain" if cls is None else "ngramd"
            engines[name] = bv.Engine(model, method, args.k, stats,
                                      table.endpoint if learns else None,
                                      **({"proposer": cls} if cls else {}))
            engines[name].warm_up(*warm_up)
            if name == "plain" and "right-8x" in chosen:
                record(engines[name], root / "replay.json", batches, where, work,
                       args.max_tokens)
        names = list(chosen)
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for b in batches:
                for w, prompts in work.items():
                    for name in order:
                        r = engines[name].run(prompts[where[b]], args.max_tokens, b,
                                              sampling=sampling)
                        cells.append({"rep": rep, "batch": b, "workload": w, "engine": name,
                                      "tok_s": r["tok_s"], "al": r["al"],
                                      "seconds": r["seconds"], "tokens": r["tokens"]})
                        print(f"  rep {rep} batch {b} {w:8s} {name:15s} {r['tok_s']:7.1f} "
                              f"tok/s AL {r['al']:.2f}", file=sys.stderr, flush=True)
        propose = {name: {k: e.proposer().get(k) for k in ("propose_ms_p50_by_batch",
                                                            "propose_ms_mean_by_batch")}
                   for name, e in engines.items() if e.stats_file is not None}
        clocked = step_clock(root / "steps", chosen)
    finally:
        for e in engines.values():
            e.close()
        if table is not None:
            table.close()
        shutil.rmtree(root, ignore_errors=True)
    plain = {(c["batch"], c["workload"]): c["tokens"] for c in cells if c["engine"] == "plain"}
    for c in cells:
        c["identical"] = c.pop("tokens") == plain.get((c["batch"], c["workload"]))
    return {"cells": cells, "propose": propose, "step_clock": clocked,
            "warm_table": warm_fig, "machine": machine_info(),
            "settings": vars(args) | {"command": " ".join(sys.argv),
                                      "wall_s": round(time.time() - t0)}}


def record(plain, path: Path, batches, where, work, max_tokens: int) -> None:
    """Every prompt of the run through the plain engine, greedy: the token sequences (prompt
    and output) ``right-8x`` replays (``spec_null.RightTokens8``)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seqs = []
    for b in batches:
        for prompts in work.values():
            for o in plain.llm.generate(prompts[where[b]], sp, use_tqdm=False):
                seqs.append(list(o.prompt_token_ids) + list(o.outputs[0].token_ids))
    path.write_text(json.dumps(seqs))


def tableless(cls: str) -> bool:
    """Whether the proposer class ``cls`` is one of ``spec_null``'s own (a ``NullProposer``:
    no table, no daemon, no stats file; it times steps instead)."""
    import spec_null

    module, name = cls.rsplit(".", 1)
    return module == "spec_null" and issubclass(getattr(spec_null, name), spec_null.NullProposer)


def step_clock(folder: Path, chosen: dict) -> dict:
    """Per ``spec_null`` engine and row count (``"R"``; ``"R+d"`` for the steps that verified
    a draft): its steps as the step clock read them (median ms; median draft tokens verified,
    tokens emitted, tokens the step before emitted)."""
    out = {}
    for name, cls in chosen.items():
        if cls is None or not tableless(cls):
            continue
        rows_of = []
        for f in folder.glob(cls.split(".")[-1] + "-*.json"):
            rows_of += [json.loads(line) for line in f.read_text().splitlines() if line]
        by_rows: dict = {}  # (rows, whether the step verified a draft) -> its steps
        for r, d, e, before, ms, fwd in rows_of:
            by_rows.setdefault((r, d > 0), []).append((d, e, before, ms, fwd))
        out[name] = {f"{r}+d" if drafting else str(r): {
                         "steps": len(v), "ms": statistics.median(x[3] for x in v),
                         "forward_ms": statistics.median(x[4] for x in v if x[4] is not None)
                         if any(x[4] is not None for x in v) else None,
                         "drafted": statistics.median(x[0] for x in v),
                         "emitted": statistics.median(x[1] for x in v),
                         "emitted_before": statistics.median(x[2] for x in v)}
                     for (r, drafting), v in sorted(by_rows.items()) if len(v) >= 10}
    return out


def report(res: dict) -> str:
    """Per cell: median tok/s (min-max) of each engine and the ratios."""
    cells = [c for c in res["cells"] if c["engine"] in ENGINES]
    keys = sorted({(c["batch"], c["workload"]) for c in cells})
    ran = [e for e in ENGINES if any(c["engine"] == e for c in cells)]
    ratios = [(a, z) for a, z in RATIOS if a in ran and z in ran]
    lines = ["| batch | workload | " + " | ".join(ran) + " | "
             + " | ".join(f"{a} / {z}" for a, z in ratios) + " | identical |",
             "|---|---|" + "---|" * (len(ran) + len(ratios) + 1)]
    for b, w in keys:
        tok = {e: [c["tok_s"] for c in cells if (c["batch"], c["workload"], c["engine"])
                   == (b, w, e)] for e in ran}
        med = {e: statistics.median(v) for e, v in tok.items() if v}

        def ratio(a, z):
            return f"{med[a] / med[z]:.3f}x" if med.get(a) and med.get(z) else "-"
        same = all(c["identical"] for c in cells if (c["batch"], c["workload"]) == (b, w))
        lines.append(f"| {b} | {w} | " + " | ".join(
            f"{med[e]:.1f} ({min(tok[e]):.1f}-{max(tok[e]):.1f})" if tok[e] else "-"
            for e in ran) + " | " + " | ".join(ratio(a, z) for a, z in ratios)
            + f" | {'yes' if same else 'NO'} |")
    for name, t in (res.get("propose") or {}).items():
        p50, mean = t.get("propose_ms_p50_by_batch") or {}, t.get("propose_ms_mean_by_batch") or {}
        lines.append(f"\npropose() ms a step, {name}: " + ", ".join(
            f"batch {b} {p50[b]:.2f} p50" + (f" / {mean[b]:.2f} mean" if b in mean else "")
            for b in sorted(p50, key=int)))
    clocked = res.get("step_clock") or {}
    if clocked:
        lines += ["\n| engine | rows | steps | ms a step (median) | vs null | forward to propose "
                  "ms | vs null | drafted | emitted | emitted the step before |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        null = clocked.get("null", {})
        for name, by_rows in clocked.items():
            for r, v in by_rows.items():
                base = null.get(r.split("+")[0]) or {}

                def rel(key):
                    return (f"{v[key] / base[key]:.3f}x" if v.get(key) and base.get(key)
                            else "-")
                fwd = f"{v['forward_ms']:.1f}" if v.get("forward_ms") else "-"
                lines.append(f"| {name} | {r} | {v['steps']} | {v['ms']:.1f} | {rel('ms')} | "
                             f"{fwd} | {rel('forward_ms')} | {v['drafted']:g} | "
                             f"{v['emitted']:g} | {v['emitted_before']:g} |")
    s = res["settings"]
    if s.get("temperature"):
        lines.append(f"\nsampled at temperature {s['temperature']}, top-p {s['top_p']} "
                     f"(outputs differ from plain's by chance: 'identical' reads no)")
    lines.append(f"\n{s['reps']} repetitions, {s['max_tokens']} tokens a request, "
                 f"--contend {s['contend']}, {s['wall_s']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
