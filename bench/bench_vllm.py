"""ngramd as vLLM's proposer beside vLLM's own, in one run: same engine settings, same prompts.

Runs in vLLM's environment (``make vllm-env``), on the embedded SmolLM2-135M-Instruct written as
a checkpoint (``ngram_generator.export``), fp32, eager, vLLM's CPU build, greedy:

    .venv-vllm/bin/python bench/bench_vllm.py [--quick]      (or: make bench-vllm)

Workloads (all prompts disjoint from the warm-up text):

* **code**: HumanEval prompts (function signature and docstring, completed raw);
* **dialogue**: chatterbot questions and chitchat openings through the chat template;
* **edit**: a request that rewrites code which is in its prompt ("Rewrite this function with
  type hints and a docstring", over standard-library functions the warm-up never saw).

Methods, each in an engine of its own (``num_speculative_tokens`` = ``--k``):

* ``plain``; vLLM ``ngram`` (its defaults: prompt_lookup 5..5); vLLM ``suffix``
  (SuffixDecoding, arctic-inference 0.3.0 built from its sdist by bench/build_suffix.py; its
  global tree starts empty);
* ``ngramd cold``: ngramd on an empty table; ``ngramd warm``: on a table warmed through the
  daemon with text disjoint from the prompts (standard-library code outside the edit set,
  chatterbot and chitchat conversations not used as prompts); both at the defaults (``full_drafts = false``:
  each step verifies the tokens the measured step cost pays for);
  ``ngramd warm full``: the same warm table (a fresh copy) with every draft verified in full,
  as vLLM's ngram and suffix verify theirs (the proposer's default): the drafter's own
  accepted length;
* **round 2**: the warm ngramd engine and the suffix engine run every workload again, after
  both learned round 1 (ngramd through the table, suffix in its process);
* **restart**: a fresh engine of each (a restarted server) runs round 2's prompts again: the
  table survives, suffix's tree does not.

Batch 1 (prompts one at a time) and batch 8 (all at once); the methods that learn across
requests (suffix, ngramd) run each batch size in an engine of their own (ngramd: on a table of
its own), so batch 8's round 1 does not replay prompts the engine learned at batch 1.  Reported per workload, batch and
method: output tokens/s (decode + prefill wall time of the run, the same for every method),
mean accepted length (AL = 1 + accepted / drafts, vLLM's own counters), acceptance per draft
position, and for ngramd the proposer's ``propose()`` time per step (its stats file).  A plain
step is timed at batch 1, 8 and 32 (``ignore_eos`` runs of 65 and 1 tokens, differenced) and the
proposer's step time at the same batch sizes is set against it.  Greedy outputs of every
method are compared with plain's.

Figures are one run's; tokens/s on this shared 2-core VM swings with load (medians over the
runs of a cell are not taken: each cell is one run, the same prompts for every method).  JSON
to ``bench/out/vllm.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# Only the standard library at module level: vLLM spawns its engine and worker processes,
# which import this module again, and vllm-cpu 0.32's worker fails at start ("'_lib_fn_wrapper'
# object has no attribute 'get'", its kernel-override scan over llvmlite) when numba is already
# imported there.  Everything else is imported inside the functions.

OUT = Path(__file__).resolve().parent / "out"
PROPOSER = "ngram_generator.vllm.NgramdProposer"
EDIT_INSTRUCTION = ("Rewrite the following Python function with type hints and a short "
                    "docstring. Keep its logic.\n\n```python\n{code}```\n")
EDIT_MODULES = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "colorsys.py",
                "bisect.py", "heapq.py", "keyword.py", "string.py", "calendar.py")


# ---------------------------------------------------------------------------------------------
# prompts and the warm-up corpus
# ---------------------------------------------------------------------------------------------
def edit_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` edit requests over short top-level functions of ``EDIT_MODULES``."""
    import ast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    funcs = []
    for name in EDIT_MODULES:
        src = (stdlib / name).read_text(encoding="utf-8")
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and 6 <= node.end_lineno - node.lineno <= 30:
                funcs.append(ast.get_source_segment(src, node))
    random.Random(seed).shuffle(funcs)
    return [EDIT_INSTRUCTION.format(code=f) for f in funcs[:n]]


def warm_corpus(tokenizer, budget: int) -> list:
    """Standard-library code (not the edit modules) and dialogue not used as prompts."""
    import numpy as np
    from bench_generate import dialogue

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(stdlib.glob("*.py")) if f.name not in EDIT_MODULES]
    random.Random(1).shuffle(files)
    seqs, total = [], 0
    for f in files:
        if total >= budget // 2:
            break
        ids = tokenizer(f.read_text(encoding="utf-8", errors="replace"),
                        add_special_tokens=False)["input_ids"]
        seqs.append(np.asarray(ids, np.uint32))
        total += len(ids)
    _, chat, _ = dialogue(tokenizer, 8, budget - total)
    return seqs + chat


def workloads(tokenizer, n: int) -> dict[str, list[str]]:
    from bench_generate import code_prompts, dialogue

    chats, _, _ = dialogue(tokenizer, n, 0)
    return {
        "code": [p["prompt"] for p in code_prompts(n)][:n],
        "dialogue": [tokenizer.apply_chat_template(c["prompt"], tokenize=False,
                                                   add_generation_prompt=True) for c in chats],
        "edit": edit_prompts(n),
    }


# ---------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------
def speculative(method: str, k: int) -> dict | None:
    if method == "plain":
        return None
    if method == "ngramd":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


class Engine:
    """One vLLM ``LLM`` (and, for ngramd, its proposer's stats file)."""

    def __init__(self, model: Path, method: str, k: int, stats_file: Path | None,
                 adaptive: bool = True):
        import vllm

        self.method = method
        if stats_file is not None:  # the proposer (in the engine's process) writes it
            cfg = stats_file.with_suffix(".toml")
            cfg.write_text(f"[proposer]\nlog_interval_s = 0.5\nfull_drafts = "
                           f"{'false' if adaptive else 'true'}\n")
            os.environ.update(NGRAM_PROPOSER_STATS=str(stats_file),
                              NGRAM_PROPOSER_CONFIG=str(cfg))
        self.stats_file = stats_file
        t0 = time.perf_counter()
        self.llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True,
                            max_model_len=2048, max_num_seqs=32, seed=0,
                            disable_log_stats=False, speculative_config=speculative(method, k))
        self.start_s = time.perf_counter() - t0

    def counters(self) -> dict:
        out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
               "per_pos": []}
        for m in self.llm.get_metrics():
            name = m.name.removeprefix("vllm:spec_decode_")
            if name == "num_accepted_tokens_per_pos":
                out["per_pos"] = list(m.values)
            elif name in out:
                out[name] = m.value
        return out

    def proposer(self) -> dict:
        if self.stats_file is None:
            return {}
        for _ in range(50):  # the file is rewritten every log_interval_s
            try:
                return json.loads(self.stats_file.read_text())["proposer"]
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        return {}

    def run(self, prompts: list[str], max_tokens: int, batch: int) -> dict:
        """The prompts through the engine ``batch`` at a time; tokens/s, AL, per position."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        c0 = self.counters()
        t0_tally = self._tally()
        outs, t0 = [], time.perf_counter()
        for i in range(0, len(prompts), batch):
            outs += self.llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
        secs = time.perf_counter() - t0
        c1 = self.counters()
        drafts = c1["num_drafts"] - c0["num_drafts"]
        accepted = c1["num_accepted_tokens"] - c0["num_accepted_tokens"]
        drafted = c1["num_draft_tokens"] - c0["num_draft_tokens"]
        per_pos = [b - a for a, b in zip(c0["per_pos"] or [0] * len(c1["per_pos"]),
                                         c1["per_pos"])]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        n_out = sum(len(t) for t in tokens)
        same = self._same_steps(t0_tally)
        return {"seconds": round(secs, 3), "output_tokens": n_out, "same_steps": same,
                "tok_s": round(n_out / secs, 2),
                "al": round(1 + accepted / drafts, 3) if drafts else 1.0,
                "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                "drafts": drafts, "per_pos": [round(x / drafts, 3) if drafts else 0.0
                                              for x in per_pos],
                "tokens": tokens}

    def _tally(self) -> dict | None:
        """The proposer's same-steps tally so far (``StepTally``): cumulative tokens and seconds
        of the policy, plain, full drafts and the oracle over the same steps."""
        if self.method != "ngramd":
            return None
        time.sleep(0.6)  # the stats file is rewritten every 0.5 s
        return (self.proposer().get("policy") or {}).get("same_steps")

    def _same_steps(self, before: dict | None) -> dict | None:
        """Tokens a second of each policy over the steps of one run (the tally's difference)."""
        after = self._tally()
        if not before or not after:
            return None
        rate = {}
        for k in after["tokens"]:
            secs = after["seconds"][k] - before["seconds"][k]
            rate[k] = (after["tokens"][k] - before["tokens"][k]) / secs if secs > 0 else 0.0
        mine = rate.get("policy", 0.0)
        return {"steps": after["steps"] - before["steps"],
                **{f"{k}_tok_s": round(v, 2) for k, v in rate.items()},
                **{f"vs_{k}": round(mine / v, 3) if v else None
                   for k, v in rate.items() if k != "policy"}}

    def step_ms(self, prompts: list[str], batch: int) -> float:
        """Milliseconds of one decode step at ``batch`` rows (plain engine): ignore_eos runs
        of 65 and 1 tokens, differenced."""
        from vllm import SamplingParams

        rows = (prompts * (batch // len(prompts) + 1))[:batch]
        times = {}
        for n in (1, 65):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            self.llm.generate(rows, sp, use_tqdm=False)
            times[n] = time.perf_counter() - t0
        return 1e3 * (times[65] - times[1]) / 64

    def close(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del self.llm
        gc.collect()


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="code only, 4 prompts, 48 tokens")
    p.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--warm-tokens", type=int, default=2_000_000)
    p.add_argument("--out", default=str(OUT / "vllm.json"))
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.warm_tokens = 4, 48, 300_000
    from transformers import AutoTokenizer

    from bench_generate import start_daemon, warm_table
    from data import stop_process
    from machine import machine_info
    from ngram_generator.export import export_hf

    t_start = time.time()
    model = export_hf(OUT / "smollm2-135m-hf")
    tok = AutoTokenizer.from_pretrained(model)
    work = workloads(tok, args.prompts)
    if args.quick:
        work = {"code": work["code"]}
    batches = tuple(sorted({min(int(b), args.prompts) for b in args.batches.split(",")}))
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict = {"cells": [], "steps": {}}
    daemons, corpus = [], None
    try:
        plain = Engine(model, "plain", args.k, None)
        want = {}
        for w, prompts in work.items():
            for b in batches:
                r = plain.run(prompts, args.max_tokens, b)
                want[(w, b)] = r["tokens"]
                results["cells"].append(cell(w, b, "plain", "1", r, want))
        for b in (1, 8, 32):
            results["steps"][b] = {"plain_step_ms": round(plain.step_ms(work["code"], b), 3)}
        plain.close()

        # Methods that learn across requests (suffix, ngramd) get a fresh engine (and a fresh
        # table) for each batch size: run in one engine, batch 8 would replay prompts the
        # engine learned at batch 1 and its "round 1" would be a round 2.
        e = Engine(model, "ngram", args.k, None)  # learns nothing: one engine for both
        for w, prompts in work.items():
            for b in batches:
                results["cells"].append(cell(w, b, "ngram", "1",
                                             e.run(prompts, args.max_tokens, b), want))
        e.close()
        for b in batches:
            e = Engine(model, "suffix", args.k, None)
            run_rounds(results, e, "suffix", ("1", "2"), work, b, args, want)
            e.close()

        # (label, warmed, adaptive draft lengths, rounds): "full" verifies every draft (the
        # drafter's own AL, as vLLM's ngram and suffix verify theirs); the default adapts the
        # draft length to the step cost it measures
        for label, warm, adaptive, rounds in (("ngramd cold", False, True, ("1",)),
                                              ("ngramd warm full", True, False, ("1",)),
                                              ("ngramd warm", True, True, ("1", "2"))):
            for b in batches:
                name = f"{label.replace(' ', '-')}-b{b}"
                proc, endpoint = start_daemon(root / name, _shm(root, name), tok.vocab_size, tok)
                daemons.append(proc)
                if warm:
                    corpus = corpus or warm_corpus(tok, args.warm_tokens)
                    results["warm_table"] = warm_table(endpoint, corpus)
                os.environ["NGRAMD_ENDPOINT"] = endpoint
                e = Engine(model, "ngramd", args.k, root / f"{name}-stats.json", adaptive)
                run_rounds(results, e, label, rounds, work, b, args, want)
                last = label == "ngramd warm" and b == batches[-1]
                if last:
                    results["steps"]["proposer"] = propose_by_batch(e, work["code"], args)
                e.close()
                if last:  # a restarted server: a fresh engine on the same table
                    e = Engine(model, "ngramd", args.k, root / "restart-stats.json")
                    run_rounds(results, e, label, ("restart",), work, b, args, want)
                    e.close()
                stop_process(proc)
        e = Engine(model, "suffix", args.k, None)  # a restarted suffix server: empty tree
        run_rounds(results, e, "suffix", ("restart",), work, batches[-1], args, want)
        e.close()
    finally:
        for proc in daemons:
            stop_process(proc)
        shutil.rmtree(root, ignore_errors=True)
        for shm in Path("/dev/shm").glob(f"bench-vllm-{root.name}-*"):  # a stopped daemon
            shutil.rmtree(shm, ignore_errors=True)  # leaves its hot tier there on purpose

    for b, s in results["steps"].items():
        if b != "proposer":
            s["propose_ms"] = results["steps"].get("proposer", {}).get(b)
    results["targets"] = targets(results, work, batches)
    results["machine"] = machine_info()
    results["settings"] = vars(args) | {"command": " ".join(sys.argv),
                                        "wall_s": round(time.time() - t_start)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for c in results["cells"]:
        c.pop("tokens", None)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


def _shm(root: Path, label: str) -> Path:
    return Path("/dev/shm") / f"bench-vllm-{root.name}-{label.replace(' ', '-')}"


def cell(workload: str, batch: int, method: str, rnd: str, r: dict, want: dict) -> dict:
    same = r["tokens"] == want[(workload, batch)]
    return {"workload": workload, "batch": batch, "method": method, "round": rnd,
            "identical": same, **r}


def run_rounds(results: dict, e: Engine, label: str, rounds, work: dict, batch: int, args,
               want: dict) -> None:
    """Every workload through ``e`` at ``batch``, once per round (the engine, and for ngramd
    its table, learning from each)."""
    for rnd in rounds:
        for w, prompts in work.items():
            results["cells"].append(cell(w, batch, label, rnd,
                                         e.run(prompts, args.max_tokens, batch), want))
        if e.method == "ngramd":
            time.sleep(2.0)  # the last requests leave the batch, are fed back and counted


def propose_by_batch(e: Engine, prompts: list[str], args) -> dict:
    """The proposer's median step time at batch 1, 8 and 32 (ignore_eos runs)."""
    from vllm import SamplingParams

    out = {}
    for b in (1, 8, 32):
        rows = (prompts * (b // len(prompts) + 1))[:b]
        e.llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                       use_tqdm=False)
        time.sleep(0.5)
        out[b] = e.proposer().get("propose_ms_p50_by_batch", {}).get(str(b))
    return out


def _get(results, workload, batch, method, rnd="1") -> dict | None:
    for c in results["cells"]:
        if (c["workload"], c["batch"], c["method"], c["round"]) == (workload, batch, method, rnd):
            return c
    return None


def targets(results: dict, work: dict, batches) -> list[dict]:
    """The issue's target table, from this run."""
    rows = []
    ident = all(c["identical"] for c in results["cells"])
    rows.append({"figure": "greedy outputs identical to plain vLLM (every cell)",
                 "target": "identical", "measured": "yes" if ident else "NO"})
    for b in batches:
        warm = _get(results, "code", b, "ngramd warm full")
        suffix, ngram = _get(results, "code", b, "suffix"), _get(results, "code", b, "ngram")
        if warm and suffix and ngram:
            rows.append({"figure": f"AL round 1, code, batch {b}: ngramd warm (full drafts) / "
                                   f"suffix, / ngram",
                         "target": ">= 1.2x, >= 1.3x",
                         "measured": f"{warm['al'] / suffix['al']:.2f}x, "
                                     f"{warm['al'] / ngram['al']:.2f}x"})
        w2, s2 = _get(results, "code", b, "ngramd warm", "2"), _get(results, "code", b, "suffix",
                                                                     "2")
        if w2 and s2:
            rows.append({"figure": f"AL round 2, code, batch {b}: ngramd / suffix",
                         "target": ">= 1.0x", "measured": f"{w2['al'] / s2['al']:.2f}x"})
    b = batches[-1]
    for method in ("ngramd warm", "suffix"):
        r2, rs = _get(results, "code", b, method, "2"), _get(results, "code", b, method,
                                                             "restart")
        if r2 and rs:
            rows.append({"figure": f"restarted server, code, batch {b}: {method} AL "
                                   f"(round 2 -> after restart)",
                         "target": "ngramd keeps it; suffix falls back",
                         "measured": f"{r2['al']:.2f} -> {rs['al']:.2f}"})
    warm, plain = _get(results, "code", 1, "ngramd warm"), _get(results, "code", 1, "plain")
    if warm and plain:
        rows.append({"figure": "output tok/s, ngramd warm / plain, batch 1, code",
                     "target": "> 1.0x", "measured": f"{warm['tok_s'] / plain['tok_s']:.2f}x"})
    for bs, s in results["steps"].items():
        if bs != "proposer" and s.get("propose_ms") is not None:
            rows.append({"figure": f"propose() per step / plain step, batch {bs}",
                         "target": "<= 5%",
                         "measured": f"{s['propose_ms']:.2f} / {s['plain_step_ms']:.1f} ms = "
                                     f"{100 * s['propose_ms'] / s['plain_step_ms']:.1f}%"})
    return rows


def report(results: dict) -> str:
    lines = ["| workload | batch | method | round | tok/s | AL | acceptance | per position "
             "(first 4) | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        pos = ", ".join(f"{x:.2f}" for x in c["per_pos"][:4])
        lines.append(f"| {c['workload']} | {c['batch']} | {c['method']} | {c['round']} | "
                     f"{c['tok_s']:.1f} | {c['al']:.2f} | {c['acceptance']:.2f} | {pos} | "
                     f"{'yes' if c['identical'] else 'NO'} |")
    same = [c for c in results["cells"] if c.get("same_steps")]
    if same:
        lines += ["", "Same steps, by the proposer's tally (tokens/s the cost model gives each "
                  "policy on the steps this run made):", "",
                  "| workload | batch | method | round | steps | policy | plain | full | oracle "
                  "| vs plain | vs full | % of oracle |", "|---|---|---|---|---|---|---|---|---|"
                  "---|---|---|"]
        for c in same:
            t = c["same_steps"]
            lines.append(
                f"| {c['workload']} | {c['batch']} | {c['method']} | {c['round']} | "
                f"{t['steps']} | {t['policy_tok_s']:.1f} | {t['plain_tok_s']:.1f} | "
                f"{t['full_tok_s']:.1f} | {t['oracle_tok_s']:.1f} | {t['vs_plain'] or 0:.2f} | "
                f"{t['vs_full'] or 0:.2f} | {100 * (t['vs_oracle'] or 0):.0f}% |")
    lines += ["", "| figure | target | measured |", "|---|---|---|"]
    lines += [f"| {t['figure']} | {t['target']} | {t['measured']} |" for t in results["targets"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
