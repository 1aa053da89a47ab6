"""llama.cpp drafting from ngramd (``ngram_generator.llamacpp``) beside plain llama.cpp and
llama-cpp-python's own prompt lookup, in one run: same ``Llama`` settings, same prompts, the
methods alternating prompt by prompt, every cell repeated.

Runs in the main environment with the ``[llamacpp]`` extra (``make llamacpp``), on the embedded
SmolLM2-135M-Instruct GGUF (Q4_1), batch 1, llama-cpp-python's ``Llama.generate``:

    .venv/bin/python bench/bench_llamacpp.py [--contend 2] [--flash-attn off,on] ...
    .venv/bin/python bench/bench_llamacpp.py --report a.json b.json        (tables only)

Methods: ``plain`` (a ``Llama`` without a draft model); ``pld`` (llama-cpp-python's
``LlamaPromptLookupDecoding`` at its defaults: ngrams up to 2, 10 tokens); ``pld-best`` (the
same with the ``num_pred_tokens`` of ``--pld-sweep`` that ran fastest on round-1 prompts at the
start of the run); ``ngramd`` (``NgramdDraftModel``, its defaults: the draft-length policy,
the policy kept in the table), on a fresh copy of one table warmed through the daemon with text
disjoint from the prompts (standard-library code and dialogue, tokenized by the GGUF).  With
``--server PATH`` (a ``llama-server`` built by bench/build_llama_server.py), llama.cpp's own
``--spec-type`` n-gram methods too (``--server-types``: ngram-mod, ngram-cache), over its HTTP
API on loopback, beside that server's plain decoding (``server``), each a process of its own
(their n-gram state lives as long as it: a restart round starts them anew).

Workloads: bench_vllm's (code: HumanEval prompts completed raw; dialogue: chat openings through
the chat template; edit: "rewrite this function" over standard-library code in the prompt;
repeat: a second turn asking for the whole first answer again, the first answered by plain
llama.cpp at the start of the run).  Rounds per repetition and sampling mode (each pair on a
table of its own, so a sampled round 1 never drafts the greedy one's outputs): **1**, **2** (the
same prompts, after round 1 was fed back, counted and published hot) and **restart** (daemon
stopped, its /dev/shm wiped, started again; every ``Llama`` and draft model made anew).
Sampling: greedy, and ``t0.8`` (temperature 0.8, top-p 0.9, llama.cpp's defaults top-k 40 and
min-p 0.05), one seed a prompt shared by the methods.

Per cell (workload, sampling, round, method): output tokens/s (new tokens over the request's
whole time, its prefill included; median over repetitions, min-max), its ratio to plain in the
same repetition (median, range), AL (tokens emitted per eval after the prefill), greedy outputs
against plain's (and sampled ones: a seeded run emits plain's tokens, see the module doc of
``ngram_generator.llamacpp``), for ngramd the share of steps the policy drafted and the hook's
mean time a call against plain's time a token.  ``--contend N``: N busy processes for the whole
run (the busy row).  JSON to ``bench/out/llamacpp.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
METHODS = ("plain", "pld", "pld-best", "ngramd")
ROUNDS = ("1", "2", "restart")
SAMPLINGS = {"greedy": {"temperature": 0.0},
             "t0.8": {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05}}


# ---------------------------------------------------------------------------------------------
# model, prompts, table
# ---------------------------------------------------------------------------------------------
def gguf_path() -> Path:
    from ngram_generator.model import resolve_checkpoint

    directory, name = resolve_checkpoint(None, None)
    return Path(directory) / name


def prompts(tok, n: int, names: tuple[str, ...], answer) -> dict[str, list[list[int]]]:
    """Token ids of ``n`` prompts of each workload (``bench_vllm.workloads``); the repeat
    workload's first turns answered by ``answer(ids) -> text`` (plain llama.cpp)."""
    from bench_vllm import repeat_prompts, workloads

    work = workloads(tok, n, names)
    if "repeat" in work:
        firsts = work["repeat"]
        answers = [answer(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=True))
                   for q in firsts]
        work["repeat"] = repeat_prompts(tok, firsts, answers)
    return {w: [tok.encode(p) for p in ps] for w, ps in work.items()}


class Table:
    """One ngramd on a copy of the warm table (or an empty one: ``warm=None``), its shm dir
    of its own; its table records the GGUF's tokenizer."""

    def __init__(self, root: Path, name: str, gguf: Path, vocab: int, warm: Path | None):
        self.root, self.gguf, self.vocab = root / name, gguf, vocab
        self.shm = Path("/dev/shm") / f"{root.name}-{name}"
        self.root.mkdir(parents=True)
        if warm is not None:
            shutil.copytree(warm, self.root / "data")
        self.proc = self.endpoint = None
        self.start()

    def start(self) -> None:
        import os
        import subprocess

        from data import wait_ready

        self.endpoint = f"ipc://{self.root / 'run' / 'llama.sock'}"
        (self.root / "run").mkdir(exist_ok=True)
        args = [sys.executable, "-m", "ngramd.service", "--name", "llama", "--data-dir",
                str(self.root / "data"), "--shm-dir", str(self.shm), "--runtime-dir",
                str(self.root / "run"), "--endpoint", self.endpoint, "--log-level", "WARNING",
                "--tokenizer", str(self.gguf), "--set", f"table.vocab_size={self.vocab}",
                "--set", "table.hot_rebuild_s=0"]
        log = open(self.root / "ngramd.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(
            os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
        wait_ready(self.endpoint, self.proc, self.root / "ngramd.log", timeout_s=180, poll_s=0)

    def publish(self) -> None:
        """What was fed back: counted, and published in the hot tier."""
        from ngram_client import NgramClient

        with NgramClient(self.endpoint, timeout_ms=600_000) as c:
            c.flush(timeout_ms=600_000)
            c.rebuild_hot(timeout_ms=600_000)

    def reboot(self) -> None:
        from data import stop_process

        stop_process(self.proc)
        shutil.rmtree(self.shm, ignore_errors=True)
        self.start()

    def close(self) -> None:
        from data import stop_process

        stop_process(self.proc)
        shutil.rmtree(self.shm, ignore_errors=True)


def warm_table(root: Path, gguf: Path, vocab: int, seqs) -> tuple[Path, dict]:
    import bench_generate

    t = Table(root, "warm", gguf, vocab, None)
    try:
        figures = bench_generate.warm_table(t.endpoint, seqs)
    finally:
        t.close()
    return t.root / "data", figures


# ---------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------
class Engines:
    """One ``Llama`` a method (and ngramd's draft model), made anew at a restart."""

    def __init__(self, args, gguf: Path, n_ctx: int, fa: bool, pld_best: int):
        self.args, self.gguf, self.n_ctx, self.fa, self.pld_best = args, gguf, n_ctx, fa, pld_best
        self.llms: dict = {}
        self.servers: dict = {}
        self.draft = None

    def start(self, methods, endpoint: str | None) -> None:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ngram_generator.llamacli import load_llama, run_request
        from ngram_generator.llamacpp import NgramdDraftModel

        drafts = {"plain": lambda: None, "pld": LlamaPromptLookupDecoding,
                  "pld-best": lambda: LlamaPromptLookupDecoding(num_pred_tokens=self.pld_best)}
        for m in methods:
            if m.startswith("server"):
                spec = m.partition(" ")[2] or None
                self.servers[m] = Server(self.args.server, self.gguf, spec, self.n_ctx,
                                         self.args.threads, self.fa,
                                         Path(endpoint.removeprefix("ipc://")).parent /
                                         f"{m.replace(' ', '-')}.log")
                self.servers[m].run([1, 2, 3, 4, 5, 6, 7, 8], 8, {}, 0)  # warm: untimed
                continue
            if m == "ngramd":
                self.draft = NgramdDraftModel(self.gguf, endpoint)
                d = self.draft
            else:
                d = drafts[m]()
            self.llms[m] = load_llama(self.gguf, n_ctx=self.n_ctx, threads=self.args.threads,
                                      flash_attn=self.fa, draft_model=d)
            run_request(self.llms[m], [1, 2, 3, 4, 5, 6, 7, 8], 8)  # buffers set up: untimed
        if self.draft is not None:
            self.draft.finish()

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()  # feeds back what runs, keeps the policy
        for s in self.servers.values():
            s.close()
        self.llms, self.servers, self.draft = {}, {}, None


class Server:
    """A ``llama-server`` (``--server``) on a loopback port, one slot, its prompt cache on as
    llama-cpp-python's prefix reuse is; ``spec``: its ``--spec-type`` (None: plain)."""

    def __init__(self, binary: str, gguf: Path, spec: str | None, n_ctx: int, threads,
                 fa: bool, log: Path):
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(n_ctx), "-np", "1", "-fa", "on" if fa else "off", "--no-webui"]
        if threads:
            args += ["-t", str(threads), "-tb", str(threads)]
        if spec:
            args += ["--spec-type", spec]
        self.proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server {args} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def run(self, ids: list[int], max_tokens: int, sampling: dict, seed: int) -> dict:
        import urllib.request

        body = {"prompt": ids, "n_predict": max_tokens, "seed": seed, "return_tokens": True,
                "temperature": sampling.get("temperature", 0.0),
                "top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k", 0),
                "min_p": sampling.get("min_p", 0.0), "typical_p": 1.0, "repeat_penalty": 1.0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            got = json.loads(r.read())
        total = time.perf_counter() - t0
        t = got.get("timings") or {}
        new = int(t.get("predicted_n", len(got.get("tokens") or [])))
        acc = int(t.get("draft_n_accepted", 0) or 0)
        return {"tokens": list(got.get("tokens") or []), "new": new, "total_s": total,
                "ttft_s": t.get("prompt_ms", 0.0) / 1e3, "decode_s": t.get("predicted_ms", 0.0) / 1e3,
                "evals": max(new - 1 - acc, 0), "drafted": int(t.get("draft_n", 0) or 0),
                "accepted": acc, "hook_s": 0.0, "policy_steps": 0, "policy_drafted": 0}

    def close(self) -> None:
        from data import stop_process

        stop_process(self.proc, timeout_s=30)


def run_one(eng: Engines, method: str, ids: list[int], sampling: dict, seed: int,
            max_tokens: int) -> dict:
    """One request of ``method``: its tokens and figures."""
    from ngram_generator.llamacli import run_request

    if method in eng.servers:
        return eng.servers[method].run(ids, max_tokens, sampling, seed)
    pol = eng.draft.drafter.policy if method == "ngramd" else None
    before = (pol.steps, pol.plain_steps) if pol else (0, 0)
    out, m = run_request(eng.llms[method], ids, max_tokens, seed=seed, **sampling)
    if method == "ngramd":
        eng.draft.finish()  # fed back now (the hook is not told that a request ended)
    steps = (pol.steps - before[0], pol.plain_steps - before[1]) if pol else (0, 0)
    return {"tokens": out, "new": m.new_tokens, "total_s": m.total_s, "ttft_s": m.ttft_s,
            "decode_s": m.decode_s, "evals": m.verify_forwards, "drafted": m.drafted,
            "accepted": m.accepted, "hook_s": m.draft_s, "policy_steps": steps[0],
            "policy_drafted": steps[0] - steps[1]}


def pld_sweep(args, gguf: Path, n_ctx: int, fa: bool, work: dict, values: list[int]) -> dict:
    """Output tokens/s of prompt lookup at each ``num_pred_tokens`` against plain, greedy, on
    the first prompt of each workload: the geometric mean of the ratios per value."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ngram_generator.llamacli import load_llama, run_request

    def tok_s(llm, ids):
        _, m = run_request(llm, ids, args.max_tokens)
        return m.new_tokens / m.total_s

    plain = load_llama(gguf, n_ctx=n_ctx, threads=args.threads, flash_attn=fa)
    run_request(plain, [1, 2, 3, 4], 4)
    base = {w: tok_s(plain, ps[0]) for w, ps in work.items()}
    out = {}
    for v in values:
        llm = load_llama(gguf, n_ctx=n_ctx, threads=args.threads, flash_attn=fa,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=v))
        run_request(llm, [1, 2, 3, 4], 4)
        ratios = [tok_s(llm, ps[0]) / base[w] for w, ps in work.items()]
        out[v] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"  pld num_pred_tokens {v}: {out[v]:.3f}x plain (geomean)", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def run(args) -> dict:
    from llama_cpp import Llama

    from bench_vllm import warm_corpus
    from machine import machine_info
    from ngram_generator.llamacli import (LlamaTokenizer, context_size, load_llama, run_request,
                                          trained_context)
    from ngram_generator.llamacpp import gguf_vocab_size

    t_start = time.time()
    gguf = gguf_path()
    vocab = gguf_vocab_size(gguf)
    tok = LlamaTokenizer(Llama(model_path=str(gguf), vocab_only=True, verbose=False))
    names = tuple(args.workloads.split(","))
    first = load_llama(gguf, n_ctx=2048, threads=args.threads)
    work = prompts(tok, args.prompts, names,
                   lambda ids: tok.decode(run_request(first, ids, args.max_tokens)[0]))
    del first
    n_ctx = context_size([len(p) for ps in work.values() for p in ps], args.max_tokens,
                         trained_context(tok.llm))
    root = Path(tempfile.mkdtemp(prefix="bench-llama-"))
    results: dict = {"cells": [], "sweep": {}, "warm_table": None}
    try:
        warm, results["warm_table"] = warm_table(
            root, gguf, vocab, warm_corpus(tok, args.warm_tokens, args.prompts))
        for fa in [f == "on" for f in args.flash_attn.split(",")]:
            sweep = pld_sweep(args, gguf, n_ctx, fa, work,
                              [int(v) for v in args.pld_sweep.split(",")])
            best = max(sweep, key=sweep.get)
            results["sweep"]["on" if fa else "off"] = {"ratios": sweep, "best": best}
            for rep in range(args.reps):
                for sname in args.samplings.split(","):
                    table = Table(root, f"fa{int(fa)}-r{rep}-{sname}", gguf, vocab, warm)
                    try:
                        _rounds(args, results, Engines(args, gguf, n_ctx, fa, best), table,
                                work, sname, rep, fa)
                    finally:
                        table.close()
                        shutil.rmtree(table.root, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for shm in Path("/dev/shm").glob(f"{root.name}-*"):
            shutil.rmtree(shm, ignore_errors=True)
    results["machine"] = machine_info()
    results["settings"] = {k: v for k, v in vars(args).items() if k != "report"} | {
        "command": " ".join(sys.argv), "wall_s": round(time.time() - t_start), "n_ctx": n_ctx,
        "prompt_tokens": {w: [len(p) for p in ps] for w, ps in work.items()}}
    return results


def _rounds(args, results: dict, eng: Engines, table: Table, work: dict, sname: str, rep: int,
            fa: bool) -> None:
    """Rounds 1, 2 and restart of one repetition and sampling mode on ``table``."""
    methods = METHODS + ((("server",) + tuple(f"server {t}" for t in args.server_types.split(",")))
                         if args.server else ())
    rounds = [r for r in ROUNDS if r in args.rounds.split(",")]
    eng.start(methods, table.endpoint)
    try:
        for rnd in rounds:
            if rnd == "restart":  # a rebooted host: daemon on an empty /dev/shm, new Llamas
                eng.close()
                table.reboot()
                eng.start(methods, table.endpoint)
            for w, ps in work.items():
                for i, ids in enumerate(ps):
                    shift = (rep + i) % len(methods)
                    order = methods[shift:] + methods[:shift]
                    runs = {m: run_one(eng, m, ids, SAMPLINGS[sname], 1000 * rep + i,
                                       args.max_tokens) for m in order}
                    for m, r in runs.items():  # a server's against its own plain decoding
                        base = "server" if m.startswith("server") else "plain"
                        r["identical"] = r["tokens"] == runs[base]["tokens"]
                        results["cells"].append({"fa": "on" if fa else "off",
                                                 "sampling": sname, "round": rnd, "rep": rep,
                                                 "workload": w, "prompt": i, "method": m,
                                                 **{k: v for k, v in r.items() if k != "tokens"}})
                    print(f"  fa {int(fa)} rep {rep} {sname:6s} round {rnd:7s} {w:8s} #{i}: "
                          + "  ".join(f"{m} {r['new'] / r['total_s']:.1f}" for m, r in
                                      runs.items())
                          + f"  (ngramd AL {_al(runs['ngramd']):.2f})", file=sys.stderr,
                          flush=True)
            if eng.draft is not None:
                eng.draft.flush(30.0)
            table.publish()  # this round's outputs counted and hot before the next round
    finally:
        eng.close()


def _al(r: dict) -> float:
    return (r["new"] - 1) / r["evals"] if r["evals"] else 1.0


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(results: dict) -> list[dict]:
    """Per cell (fa, sampling, round, workload, method): output tokens/s over the cell's
    prompts per repetition (median, min, max), the ratio to plain per repetition (median,
    range), AL, greedy identity, the policy's drafted share and the hook's time a call
    against plain's time a token."""
    by: dict = {}
    for c in results["cells"]:
        key = (c["fa"], c["sampling"], c["round"], c["workload"], c["method"])
        by.setdefault(key, {}).setdefault(c["rep"], []).append(c)
    rows = []
    for key, reps in sorted(by.items()):
        fa, s, rnd, w, m = key
        plain = by.get((fa, s, rnd, w, "server" if m.startswith("server") else "plain"), {})
        tps, ratio, hook = [], [], []
        for rep, cs in reps.items():
            t = sum(c["new"] for c in cs) / sum(c["total_s"] for c in cs)
            p = plain.get(rep)
            tps.append(t)
            if p:
                ratio.append(t / (sum(c["new"] for c in p) / sum(c["total_s"] for c in p)))
                step = sum(c["decode_s"] for c in p) / max(sum(c["new"] - 1 for c in p), 1)
                calls = sum(c["evals"] for c in cs)
                if m == "ngramd" and calls:
                    hook.append(sum(c["hook_s"] for c in cs) / calls / step)
        cells = [c for cs in reps.values() for c in cs]
        evals = sum(c["evals"] for c in cells)
        steps = sum(c["policy_steps"] for c in cells)
        rows.append({"fa": fa, "sampling": s, "round": rnd, "workload": w, "method": m,
                     "reps": len(reps), "tok_s": _median(tps), "tok_s_min": min(tps),
                     "tok_s_max": max(tps), "vs_plain": _median(ratio),
                     "vs_plain_min": min(ratio, default=float("nan")),
                     "vs_plain_max": max(ratio, default=float("nan")),
                     "al": sum(c["new"] - 1 for c in cells) / evals if evals else 1.0,
                     "identical": sum(c["identical"] for c in cells), "runs": len(cells),
                     "drafted_share": (sum(c["policy_drafted"] for c in cells) / steps
                                       if steps else None),
                     "hook_vs_step": _median(hook) if hook else None})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| FA | sampling | round | workload | method | tok/s (min-max) | x plain (range) | AL "
           "| identical | policy drafted | hook / plain step |", "|" + "---|" * 11]
    for r in rows:
        share = "-" if r["drafted_share"] is None else f"{100 * r['drafted_share']:.0f}%"
        hook = "-" if r["hook_vs_step"] is None else f"{100 * r['hook_vs_step']:.1f}%"
        out.append(f"| {r['fa']} | {r['sampling']} | {r['round']} | {r['workload']} | "
                   f"{r['method']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})"
                   f" | {r['vs_plain']:.2f} ({r['vs_plain_min']:.2f}-{r['vs_plain_max']:.2f}) | "
                   f"{r['al']:.2f} | {r['identical']}/{r['runs']} | {share} | {hook} |")
    return "\n".join(out)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, read from the cells (ngramd's)."""
    ours = [r for r in rows if r["method"] == "ngramd"]
    greedy = [r for r in rows if r["sampling"] == "greedy" and r["method"] != "plain"]
    out = [f"greedy identical to plain: {sum(r['identical'] for r in greedy)}/"
           f"{sum(r['runs'] for r in greedy)} runs (every method)"]
    r1 = [r for r in ours if r["round"] == "1"]
    low = [f"{r['fa']}/{r['sampling']}/{r['workload']} {r['vs_plain']:.2f}" for r in r1
           if r["vs_plain"] < 1.0]
    out.append(f"round 1 >= 1.0x plain: {len(r1) - len(low)}/{len(r1)} cells"
               + (f"; below: {', '.join(low)}" if low else ""))
    later = [r for r in ours if r["round"] != "1" and r["workload"] in ("code", "edit", "repeat")]
    low = [f"{r['fa']}/{r['sampling']}/{r['round']}/{r['workload']} {r['vs_plain']:.2f}"
           for r in later if r["vs_plain"] < 2.5]
    out.append(f"round 2/restart >= 2.5x plain (code, edit, repeat): "
               f"{len(later) - len(low)}/{len(later)} cells" + (f"; below: {', '.join(low)}"
                                                                 if low else ""))
    ratios = []  # speed-ups over each method's own plain decoding (a server's: the server's)
    for r in ours:
        peers = [p["vs_plain"] for p in rows if p["method"] not in ("plain", "ngramd", "server")
                 and all(p[k] == r[k] for k in ("fa", "sampling", "round", "workload"))]
        if peers:
            ratios.append(r["vs_plain"] / max(peers))
    if ratios:
        out.append(f"vs the best llama.cpp n-gram method (speed-up over its own plain), "
                   f"geometric mean: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x "
                   f"over {len(ratios)} cells (range {min(ratios):.2f}-{max(ratios):.2f})")
    hooks = [r["hook_vs_step"] for r in ours if r["hook_vs_step"] is not None]
    if hooks:
        out.append(f"hook per call / plain eval step: median {100 * _median(hooks):.1f}%, "
                   f"max {100 * max(hooks):.1f}% (target <= 3%)")
    return out


def report(runs: list[dict]) -> str:
    out = []
    for res in runs:
        rows = summarise(res)
        s = res.get("settings", {})
        out += [f"## {s.get('command', '')} ({s.get('wall_s', '?')} s; contend "
                f"{s.get('contend', 0)})", "", table(rows), "",
                *[f"- {t}" for t in targets(rows)],
                f"- prompt-lookup sweep (num_pred_tokens: x plain): {res.get('sweep')}", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--workloads", default="code,dialogue,edit,repeat")
    p.add_argument("--samplings", default="greedy,t0.8", help=f"of {sorted(SAMPLINGS)}")
    p.add_argument("--rounds", default=",".join(ROUNDS))
    p.add_argument("--flash-attn", default="off,on", help="llama.cpp's FlashAttention: off,on")
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: llama-cpp-python's)")
    p.add_argument("--warm-tokens", type=int, default=300_000)
    p.add_argument("--pld-sweep", default="2,4,6,10,16",
                   help="prompt lookup's num_pred_tokens to try for pld-best")
    p.add_argument("--server", metavar="PATH",
                   help="a llama-server binary (bench/build_llama_server.py): its plain decoding "
                        "and its --spec-type methods (--server-types) too, over HTTP on loopback")
    p.add_argument("--server-types", default="ngram-mod,ngram-cache")
    p.add_argument("--contend", type=int, default=0, help="busy processes beside the run")
    p.add_argument("--out", default=str(OUT / "llamacpp.json"))
    p.add_argument("--report", nargs="+", metavar="JSON", help="print earlier runs' tables")
    args = p.parse_args(argv)
    if args.report:
        print(report([json.loads(Path(f).read_text()) for f in args.report]))
        return 0
    from data import contention

    with contention(args.contend):
        results = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report([results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
