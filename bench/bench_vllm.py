"""ngramd as vLLM's proposer beside vLLM's own methods and plain decoding, in one run: same
engine settings, same prompts, methods alternating, every cell repeated.

Runs in vLLM's environment (``make vllm-env``), on the embedded SmolLM2-135M-Instruct written as
a checkpoint (``ngram_generator.export``), fp32, eager, vLLM's CPU build, greedy:

    .venv-vllm/bin/python bench/bench_vllm.py [--quick] [--contend 2]     (or: make bench-vllm)
    .venv-vllm/bin/python bench/bench_vllm.py --report quiet.json busy.json   (tables only)

Workloads (all prompts disjoint from the warm-up text):

* **code**: HumanEval prompts (function signature and docstring, completed raw);
* **dialogue**: chatterbot questions and chitchat openings through the chat template;
* **edit**: a request that rewrites code which is in its prompt ("Rewrite this function with
  type hints and a docstring", over standard-library functions the warm-up never saw);
* **repeat**: the second turn of a multi-turn request whose prompt carries the first turn's
  answer (other HumanEval tasks, completed by plain vLLM at the start of the run), asking for the
  whole function again with a usage example: an agent's or an edit loop's request, where most
  of the answer is already in the prompt.

Methods (``num_speculative_tokens`` = ``--k``): ``plain``; vLLM ``ngram`` (its defaults,
prompt lookup 5..5); vLLM ``suffix`` (SuffixDecoding, arctic-inference 0.3.0 built from its
sdist by bench/build_suffix.py; its global tree starts empty); ``ngramd`` at the defaults (the
draft-length policy) and ``ngramd full`` (every draft verified in full, as vLLM's ngram and
suffix verify theirs: ``[proposer] full_drafts = true``), each on a fresh copy of one table
warmed through the daemon with text disjoint from the prompts.  ``--cold-start`` adds
``ngramd cold``: the defaults, but each engine's draft-length policy starts from its priors
instead of the state its predecessor kept in the table (``[proposer] keep_policy = false``; the
A/B of keeping it), and ``--wall-clock`` ``ngramd wall`` (its steps timed by the wall clock).

Rounds, per repetition (``--reps``, fresh learning engines and table copies each time):

* **1**: every batch size and workload, the five methods back to back (``method_order``:
  reversed every other repetition, rotated every two, so no method always runs just after
  another), so a cell's ratios come from runs a few seconds apart;
* **2**: the same prompts again, the learning methods (suffix, ngramd, ngramd full) after they
  learned round 1 (ngramd through the table, suffix in its process);
* **restart**: a restarted server: the learning engines are closed, each ngramd daemon is
  stopped and started again with its /dev/shm directory wiped (a reboot: the hot tier comes
  back from the table's on-disk image), and fresh engines run round 2's prompts again: the
  table survives, suffix's tree does not.

plain and ngram learn nothing, but they run in every round too, alternating with the others,
so a round-2 or restart cell's ratios come from runs made back to back as round 1's do (the
host's state drifts over the 20-30 minutes between a cell's round 1 and its restart round;
``--peers-once`` runs them in round 1 only, as runs before 2026-12-07 did, and those cells
are read against round 1's plain and ngram).

Every engine runs without vLLM's prefix cache (``enable_prefix_caching=False``): the engines
live for different spans (plain and ngram the whole run, the learning ones a repetition, the
restarted ones a round), and a cache that held a cell's prompts from an earlier run made the
long-lived engines' prefills free and the fresh ones' not (batch-32 code: the same ngramd
engine at the same AL ran 143 tok/s in round 2 and 79 after the restart).  Every run prefills.

Each batch size gets prompts of its own (``max(batch, --prompts)`` per workload, disjoint
across batch sizes), so a learning engine's batch-8 round 1 is not a replay of what it learned
at batch 1.

Reported per cell (workload, batch, method, round): median output tokens/s over the
repetitions and their spread (min-max), the ratios to plain and to the best peer taken per
repetition (median, and their range: a cell below a target in every repetition is below it
beyond the run's noise), the engine's steps (vLLM's own count, one a scheduler step) against
the longest row of each batch (a cell's batch is closed, nothing queued behind it: its engine
takes at least that many steps, and a draft shortens the cell only where it shortens that row;
elsewhere it lets a row leave the batch sooner), the mean request's time (queued to its last
token, vLLM's own timestamps: what each user of the batch waited) and plain's over it, mean
accepted length (vLLM's counters), acceptance per position, and for ngramd the same-steps
tally of its proposer: the tokens/s its cost model gives plain decoding, full drafts and an
**oracle** that verifies exactly the tokens that were then accepted, over the very steps of
the cell (its measured step seconds rescaled by the cost curve).  Per ngramd engine: the
policy's calibration (predicted against observed acceptance per draft position).  A plain
decode step is timed at batch 1, 8, 32 and 64 and the proposer's ``propose()`` set against
it.  Greedy outputs of every method are compared with plain's.

Per cell, the CPU seconds each process used while it ran (``cpu_s``): the cell's engine
(its engine-core process and workers), the bench's own process (vLLM's front end), the
engine's own ngramd daemon, the other engines and daemons, and the busy processes: what
shared the cores with the engine, and whose work it was.

``--contend N`` runs N busy processes (a pure-Python loop each) for the whole run: the
busy-host row; ``--contend-pin`` holds each to one CPU, in turn, so every cell shares the
cores alike (vLLM's CPU worker holds its threads to one CPU: left to the scheduler, the busy
loops gave it 0.47-0.98 of a core from cell to cell).  ``--wall-clock`` adds a sixth method,
ngramd at defaults with its policy timing steps by the wall clock instead of the run clock
(``[proposer] step_clock``).  JSON to ``bench/out/vllm.json`` (``--out``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
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
                "bisect.py", "heapq.py", "keyword.py", "string.py", "calendar.py",
                "base64.py", "quopri.py", "sched.py", "netrc.py")
REPEAT_FOLLOW_UP = ("Now write the whole function again with your completion, and add one "
                    "example of calling it.")
METHODS = ("plain", "ngram", "suffix", "ngramd", "ngramd full")
LEARNING = ("suffix", "ngramd", "ngramd full")
#: ``--wall-clock``: also ngramd at defaults but its policy timing steps by the wall clock
#: (``[proposer] step_clock = "wall"``), the A/B of the run clock
WALL = "ngramd wall"
#: ``--cold-start``: also ngramd at defaults but each engine starting its policy from the priors
#: (``[proposer] keep_policy = false``), the A/B of the policy kept in the table
COLD = "ngramd cold"
ROUNDS = ("1", "2", "restart")
CPU_GROUPS = ("engine", "engine_core", "front", "own_daemon", "other_daemons", "other_engines",
              "busy")


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
    if len(funcs) < n:
        raise SystemExit(f"error: {n} edit prompts wanted, the edit modules have {len(funcs)}")
    return [EDIT_INSTRUCTION.format(code=f) for f in funcs[:n]]


def warm_corpus(tokenizer, budget: int, n_dialogue: int) -> list:
    """Standard-library code (not the edit modules) and dialogue not used as prompts (the
    first ``n_dialogue`` conversations are the prompts)."""
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
    _, chat, _ = dialogue(tokenizer, n_dialogue, budget - total)
    return seqs + chat


def humaneval_split(n: int) -> tuple[list[str], list[str], list[str]]:
    """Three disjoint sets of ``n`` HumanEval prompts: the code workload's, the first turns of
    the repeat workload's, and the engines' warm-up."""
    from bench_generate import code_prompts

    every = [p["prompt"] for p in code_prompts(164)]
    sets = every[0::3][:n], every[1::3][:n], every[2::3][:n]
    if min(map(len, sets)) < n:
        raise SystemExit(f"error: {n} prompts a workload wanted, HumanEval gives "
                         f"{len(every) // 3}")
    return sets


def repeat_prompts(tokenizer, first_turns: list[str], answers: list[str]) -> list[str]:
    """The repeat workload: each first turn, its answer, and a follow-up asking for all of it
    again (through the chat template)."""
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": q}, {"role": "assistant", "content": a},
         {"role": "user", "content": REPEAT_FOLLOW_UP}],
        tokenize=False, add_generation_prompt=True) for q, a in zip(first_turns, answers)]


def workloads(tokenizer, n: int, names: tuple[str, ...]) -> dict[str, list[str]]:
    """``n`` prompts of each workload in ``names`` (repeat: its first turns, answered later)."""
    from bench_generate import dialogue

    code, first, _ = humaneval_split(n)
    out = {}
    if "code" in names:
        out["code"] = code
    if "dialogue" in names:
        chats, _, _ = dialogue(tokenizer, n, 0)
        out["dialogue"] = [tokenizer.apply_chat_template(c["prompt"], tokenize=False,
                                                         add_generation_prompt=True)
                           for c in chats][:n]
    if "edit" in names:
        out["edit"] = edit_prompts(n)
    if "repeat" in names:
        out["repeat"] = first
    return out


def slices(batches: tuple[int, ...], per: int) -> dict[int, slice]:
    """The prompts of each batch size: ``max(b, per)`` of them, disjoint across sizes."""
    out, at = {}, 0
    for b in batches:
        out[b] = slice(at, at + max(b, per))
        at += max(b, per)
    return out


# ---------------------------------------------------------------------------------------------
# engines and tables
# ---------------------------------------------------------------------------------------------
def speculative(method: str, k: int, proposer: str = PROPOSER) -> dict | None:
    if method == "plain":
        return None
    if method.startswith("ngramd") or proposer != PROPOSER:
        return {"method": "custom_class", "model": proposer, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


class Engine:
    """One vLLM ``LLM`` (and, for ngramd, its daemon's endpoint and its proposer's stats
    file)."""

    def __init__(self, model: Path, method: str, k: int, stats_file: Path | None = None,
                 endpoint: str | None = None, proposer: str = PROPOSER):
        import vllm

        self.method = method
        if stats_file is not None:  # the proposer (in the engine's process) writes it
            cfg = stats_file.with_suffix(".toml")
            full = "true" if method == "ngramd full" else "false"
            clock = "wall" if method == WALL else "run"
            keep = "false" if method == COLD else "true"
            cfg.write_text(f"[proposer]\nfull_drafts = {full}\n"
                           f"step_clock = \"{clock}\"\nkeep_policy = {keep}\n")
            os.environ.update(NGRAM_PROPOSER_STATS=str(stats_file),
                              NGRAM_PROPOSER_CONFIG=str(cfg), NGRAMD_ENDPOINT=endpoint)
        self.stats_file, self.endpoint, self.requests = stats_file, endpoint, 0
        self._last_run = 0.0  # when the engine last finished a run (unix time)
        from data import parents

        me = os.getpid()  # the engine's processes: its core (its workers are below it)
        before = {p for p, up in parents().items() if up == me}
        t0 = time.perf_counter()
        # no prefix cache: the engines live for different spans (plain and ngram for the whole
        # run, the learning ones a repetition, restarted ones a round), and a long-lived
        # engine's cache holds the cells' prompts from earlier runs: ngramd full drafts ran
        # batch-32 code at 143 tok/s in round 2 (its engine had prefilled the prompts in round
        # 1) and at 79 tok/s after the restart, at the same AL (8.4-8.6); every run prefills
        self.llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True,
                            max_model_len=2048, max_num_seqs=64, seed=0,
                            enable_prefix_caching=False, disable_log_stats=False,
                            speculative_config=speculative(method, k, proposer))
        self.start_s = time.perf_counter() - t0
        self.pids = [p for p, up in parents().items() if up == me and p not in before]

    def warm_up(self, prompts: list[str], batches, max_tokens: int) -> None:
        """One short run at each batch size over prompts no cell uses: vLLM's CPU backend
        creates a kernel for each new shape on first use (a first run of 8 prompts took 2.8 s
        where the next took 0.9 s), and a fresh engine would pay it inside its first cells
        while the long-lived ones paid it earlier."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        t0 = time.perf_counter()
        for b in batches:
            self.llm.generate(prompts[:b], sp, use_tqdm=False)
            self.requests += len(prompts[:b])
        self.warm_s = time.perf_counter() - t0
        self._last_run = time.time()

    def counters(self) -> dict:
        """vLLM's speculative-decoding counters of this engine.  Read from its own Prometheus
        logger, not ``LLM.get_metrics()``: each new ``LLM`` in the process unregisters the
        earlier engines' metrics from the global registry, and the run keeps several alive."""
        out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
               "per_pos": [], "steps": 0}
        for logger in self.llm.llm_engine.logger_manager.stat_loggers:
            hist = getattr(logger, "histogram_iteration_tokens", None)
            if hist:  # one observation an engine step (its tokens): the count is the steps
                out["steps"] = int(sum(b.get() for b in hist[0]._buckets))
            prom = getattr(logger, "spec_decoding_prom", None)
            if prom is None or not prom.spec_decoding_enabled:
                continue
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                out[name] = getattr(prom, f"counter_spec_decode_{name}")[0]._value.get()
            out["per_pos"] = [c._value.get() for c in
                              prom.counter_spec_decode_num_accepted_tokens_per_pos.get(0, [])]
        return out

    def proposer(self, key: str = "proposer"):
        """``key`` of the proposer's stats file (``cost_steps``: the steps its cost curve was
        fitted to)."""
        if self.stats_file is None:
            return {}
        for _ in range(50):  # the file is replaced whole; it may not exist yet
            try:
                return json.loads(self.stats_file.read_text())[key]
            except (OSError, ValueError, KeyError):
                time.sleep(0.1)
        return {}

    def run(self, prompts: list[str], max_tokens: int, batch: int, cpu=dict,
            sampling: dict | None = None) -> dict:
        """The prompts through the engine ``batch`` at a time; tokens/s, AL, per position,
        and what ``cpu()`` (CPU seconds by process group) counted meanwhile.  ``sampling``:
        ``SamplingParams`` fields (``temperature``, ``top_p``; greedy when None)."""
        from vllm import SamplingParams

        sp = SamplingParams(**{"temperature": 0.0, **(sampling or {})}, max_tokens=max_tokens)
        c0 = self.counters()
        t0_tally = self._tally()
        cpu0 = cpu()
        outs, t0, longest, waits = [], time.perf_counter(), 0, []
        for i in range(0, len(prompts), batch):
            got = self.llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
            longest += max(len(o.outputs[0].token_ids) for o in got)
            # each request's time, queued to its last token (the engine core's clock)
            waits += [o.metrics.last_token_ts - o.metrics.queued_ts for o in got
                      if o.metrics is not None and o.metrics.queued_ts > 0]
            outs += got
        secs = time.perf_counter() - t0
        self._last_run = time.time()
        cpu1 = cpu()
        self.requests += len(prompts)
        c1 = self.counters()
        drafts = c1["num_drafts"] - c0["num_drafts"]
        accepted = c1["num_accepted_tokens"] - c0["num_accepted_tokens"]
        drafted = c1["num_draft_tokens"] - c0["num_draft_tokens"]
        per_pos = [b - a for a, b in zip(c0["per_pos"] or [0] * len(c1["per_pos"]),
                                         c1["per_pos"])]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        n_out = sum(len(t) for t in tokens)
        return {"seconds": round(secs, 3), "output_tokens": n_out,
                "same_steps": self._same_steps(t0_tally), "tok_s": round(n_out / secs, 2),
                "al": round(1 + accepted / drafts, 3) if drafts else 1.0,
                "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
                "steps": c1["steps"] - c0["steps"], "longest": longest,
                "request_s": round(sum(waits) / len(waits), 4) if waits else None,
                "drafts": drafts, "per_pos": [round(x / drafts, 3) if drafts else 0.0
                                              for x in per_pos],
                "cpu_s": {k: round(cpu1[k] - v, 2) for k, v in cpu0.items() if k in cpu1},
                "tokens": tokens, "texts": [o.outputs[0].text for o in outs]}

    def _tally(self) -> dict | None:
        """The proposer's same-steps tally so far (``StepTally``): cumulative tokens and seconds
        of the policy, plain, full drafts and the oracle over the same steps."""
        if self.stats_file is None:
            return None
        self._fresh()
        return (self.proposer().get("policy") or {}).get("same_steps")

    def _fresh(self, timeout_s: float = 10.0) -> None:
        """Wait until the proposer has rewritten its stats file since the engine's last run:
        it does once the engine has had no step for a moment (``NgramdProposer.QUIET_S``)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if self.stats_file.stat().st_mtime >= self._last_run:
                    return
            except OSError:
                pass
            time.sleep(0.05)

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

    def settle(self, timeout_s: float = 30.0) -> float:
        """Wait until the proposer fed back every request it saw and the daemon counted them
        (a later round must find them in the table, as it would minutes later on a server);
        returns the seconds waited."""
        from ngram_client import NgramClient

        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            s = self._stats()
            if (s.get("proposer", {}).get("finished", 0) >= self.requests
                    and not s.get("link", {}).get("queued_seqs")):
                break
            time.sleep(0.25)
        with NgramClient(self.endpoint, timeout_ms=120_000) as c:
            c.flush()
        return time.perf_counter() - t0

    def _stats(self) -> dict:
        try:
            return json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}

    def calibration(self) -> dict | None:
        """The policy's predicted against observed acceptance per draft position, over the
        positions scored 50 times or more (decayed counts, as the proposer reports them)."""
        pol = self.proposer().get("policy") or {}
        pred, obs, drafted = pol.get("predicted"), pol.get("observed"), pol.get("drafted")
        if not pred or not obs:
            return None
        err = [abs(p - o) for p, o, d in zip(pred, obs, drafted or [])
               if p is not None and o is not None and d >= 50]
        return {"predicted": pred, "observed": obs, "drafted": drafted,
                "max_error": round(max(err), 3) if err else None,
                "plain_share": pol.get("plain_share"), "cost_curve": pol.get("cost_curve"),
                "cost_8_a_row": pol.get("cost_8_a_row"),
                "beside_prefill": pol.get("beside_prefill"),
                "forgot": pol.get("forgot")}

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


class Table:
    """One ngramd daemon on a copy of the warm table, its shm dir of its own."""

    def __init__(self, root: Path, name: str, warm: Path, tokenizer):
        self.root, self.tok = root / name, tokenizer
        # the run's own directory in the name: a stale shm dir of an earlier run (a killed
        # daemon's) never collides with this one's
        self.shm = Path("/dev/shm") / f"{root.parent.name}-{root.name}-{name}"
        shutil.copytree(warm, self.root / "data")
        self.proc, self.endpoint = None, None
        self.start()

    def start(self) -> None:
        from bench_generate import start_daemon

        self.proc, self.endpoint = start_daemon(self.root, self.shm, self.tok.vocab_size,
                                                self.tok)

    def reboot(self) -> None:
        """Stop, wipe the shm dir (a reboot), start again on the same data dir."""
        self.stop()
        shutil.rmtree(self.shm, ignore_errors=True)
        self.start()

    def stop(self) -> None:
        from data import stop_process

        stop_process(self.proc)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def hot_source(self) -> dict:
        from ngram_client import NgramClient

        with NgramClient(self.endpoint, timeout_ms=10_000) as c:
            hot = c.stats().get("hot") or {}
        image = hot.get("image") or {}
        return {"source": hot.get("source"), "entries": hot.get("entries"),
                "behind_records": hot.get("behind_records"), "image": image.get("state")}


def warm_table(root: Path, tok, corpus) -> tuple[Path, dict]:
    """A daemon warmed with ``corpus`` (counted, hot tier published, its image written),
    stopped; returns its data dir and the warm-up's figures."""
    import bench_generate
    from data import stop_process

    shm = Path("/dev/shm") / f"{root.name}-warm"
    proc, endpoint = bench_generate.start_daemon(root / "warm", shm, tok.vocab_size, tok)
    try:
        figures = bench_generate.warm_table(endpoint, corpus)
    finally:
        stop_process(proc)
        shutil.rmtree(shm, ignore_errors=True)
    return root / "warm" / "data", figures


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1 repetition, batch 1 and 8, code and repeat, 24 tokens")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every cell")
    p.add_argument("--prompts", type=int, default=2,
                   help="prompts per workload at batch 1 (a batch-b cell runs max(b, this))")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--warm-tokens", type=int, default=1_000_000)
    p.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--workloads", default="code,dialogue,edit,repeat")
    p.add_argument("--contend", type=int, default=0, help="busy processes beside the run")
    p.add_argument("--contend-pin", action="store_true",
                   help="hold each busy process to one CPU, in turn (data.contention)")
    p.add_argument("--wall-clock", action="store_true",
                   help=f"also '{WALL}': ngramd at defaults, its policy timing steps by the wall "
                        f"clock (the run clock's A/B)")
    p.add_argument("--cold-start", action="store_true",
                   help=f"also '{COLD}': ngramd at defaults, each engine's policy starting from "
                        f"its priors, not from the state kept in the table (its A/B)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy, and outputs compared with "
                        "plain's; sampled outputs differ by chance and are not compared)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", default=",".join(ROUNDS),
                   help="the rounds to run, comma-separated, in their order (1, 2, restart)")
    p.add_argument("--peers-once", action="store_true",
                   help="run plain and vLLM ngram in round 1 only (they learn nothing); later "
                        "rounds' ratios are then against round 1's runs")
    p.add_argument("--out", default=str(OUT / "vllm.json"))
    p.add_argument("--report", nargs="+", metavar="JSON",
                   help="print the tables of earlier runs' JSON files (no run)")
    p.add_argument("--pool", action="store_true",
                   help="with --report: the runs' repetitions as one run's (pool_runs)")
    p.add_argument("--jump", action="store_true",
                   help="with --report: only what a step that verifies a draft costs beyond "
                        "its tokens, from the engines' timed steps (draft_jump)")
    args = p.parse_args(argv)
    if args.report:
        runs = [json.loads(Path(f).read_text()) for f in args.report]
        print(draft_jump(runs) if args.jump else
              report([pool_runs(runs)] if args.pool else runs))
        return 0
    if args.quick:
        args.reps, args.batches, args.max_tokens, args.warm_tokens = 1, "1,8", 24, 300_000
        args.workloads = "code,repeat"
    return run_and_report(args, run, report)


def run_and_report(args, run_fn, report_fn) -> int:
    """``run_fn(args, busy pids)`` beside ``args.contend`` busy processes (``--contend-pin``:
    each held to one CPU), its JSON written to ``args.out`` and ``report_fn``'s tables printed
    (bench_serve's main too)."""
    from data import contention

    with contention(args.contend, pin=args.contend_pin) as busy:
        results = run_fn(args, [p.pid for p in busy])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report_fn([results]))
    return 0


def prepare(batches: str, prompts: int, names: str) -> tuple:
    """What every vLLM bench here starts from: the model (written as a checkpoint once), its
    tokenizer, the batch sizes of ``batches`` ("1,8,32"), each size's slice of the prompts
    (``slices``), the prompts of the workloads ``names`` ("code,dialogue") and the engines'
    warm-up arguments (``Engine.warm_up``)."""
    from transformers import AutoTokenizer

    from ngram_generator.export import export_hf

    model = export_hf(OUT / "smollm2-135m-hf")
    tok = AutoTokenizer.from_pretrained(model)
    sizes = tuple(sorted({int(b) for b in batches.split(",")}))
    where = slices(sizes, prompts)
    work = workloads(tok, where[sizes[-1]].stop, tuple(names.split(",")))
    return model, tok, sizes, where, work, (humaneval_split(max(sizes))[2], sizes, 24)


def method_order(rep: int, methods: tuple[str, ...] = METHODS) -> tuple[str, ...]:
    """The methods' order in repetition ``rep``: reversed every other repetition and rotated
    every two, so no method always runs right after another (a daemon's background work left
    by one cell lands on the next engine; round 2 starts right after both tables settled)."""
    shift = (rep // 2) % len(methods)
    order = methods[shift:] + methods[:shift]
    return order[::-1] if rep % 2 else order


def cpu_by_group(engines: dict, daemons: dict, busy: list[int]) -> dict:
    """CPU seconds so far of each engine's processes (and of its engine-core process alone:
    it polls while the worker computes), each ngramd daemon (its SST writer included), the
    bench's own process (vLLM's front end) and the busy processes."""
    from data import cpu_s, tree_cpu_s

    names = [(f"engine:{m}", e.pids) for m, e in engines.items()]
    names += [(f"daemon:{m}", [t.proc.pid]) for m, t in daemons.items() if t.proc is not None]
    flat = tree_cpu_s(*(p for _, pids in names for p in pids))
    out, i = {}, 0
    for name, pids in names:
        out[name] = sum(flat[i:i + len(pids)])
        i += len(pids)
    cores = {f"core:{m}": sum(map(cpu_s, e.pids)) for m, e in engines.items()}
    return out | cores | {"front": cpu_s(os.getpid()), "busy": sum(map(cpu_s, busy))}


def cpu_groups(method: str, raw: dict) -> dict:
    """``cpu_by_group``'s differences over one cell, seen from the cell's engine: its own
    processes and daemon, everyone else's."""
    def others(kind):
        return round(sum(v for k, v in raw.items()
                         if k.startswith(kind) and k != f"{kind}{method}"), 2)

    return {"engine": raw.get(f"engine:{method}", 0.0),
            "engine_core": raw.get(f"core:{method}", 0.0), "front": raw.get("front", 0.0),
            "own_daemon": raw.get(f"daemon:{method}", 0.0), "other_engines": others("engine:"),
            "other_daemons": others("daemon:"), "busy": raw.get("busy", 0.0)}


def run(args, busy: list[int] = ()) -> dict:
    from machine import machine_info

    t_start = time.time()
    extra = tuple(m for m, on in ((WALL, getattr(args, "wall_clock", False)),
                                  (COLD, getattr(args, "cold_start", False))) if on)
    methods, learning = METHODS + extra, LEARNING + extra
    model, tok, batches, where, work, warm_up = prepare(args.batches, args.prompts,
                                                        args.workloads)
    n = where[batches[-1]].stop
    rounds = [r for r in ROUNDS if r in args.rounds.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict = {"cells": [], "steps": {}, "engines": [], "tables": [],
                     "settle_s": []}
    want: dict = {}
    engines: dict[str, Engine] = {}
    tables: list[Table] = []
    try:
        engines["plain"] = _started(results, -1, "plain", model, args.k, None, None, warm_up)
        if "repeat" in work:  # the first turns' answers, by plain vLLM (greedy, 2x the tokens)
            from vllm import SamplingParams

            sp = SamplingParams(temperature=0.0, max_tokens=2 * args.max_tokens)
            firsts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in work["repeat"]]
            answers = [o.outputs[0].text for o in
                       engines["plain"].llm.generate(firsts, sp, use_tqdm=False)]
            work["repeat"] = repeat_prompts(tok, work["repeat"], answers)
        for b in (1, 8, 32, 64):
            results["steps"][b] = {"plain_step_ms": round(
                engines["plain"].step_ms(work[next(iter(work))], b), 3)}
        engines["ngram"] = _started(results, -1, "ngram", model, args.k, None, None, warm_up)
        warm, results["warm_table"] = warm_table(
            root, tok, warm_corpus(tok, args.warm_tokens, n))

        for rep in range(args.reps):
            order = method_order(rep, methods)
            tables = []
            for m in learning:
                stats = None
                if m.startswith("ngramd"):
                    tables.append(Table(root, f"r{rep}-{m.replace(' ', '-')}", warm, tok))
                    stats = root / f"r{rep}-{m.replace(' ', '-')}-stats.json"
                engines[m] = _started(results, rep, m, model, args.k, stats,
                                      tables[-1].endpoint if stats else None, warm_up)
            for rnd in rounds:
                if rnd == "restart":  # a rebooted host: fresh engines, daemons on empty shm
                    for m in learning:
                        _closed(results, rep, "2", engines.pop(m))
                    for t in tables:
                        t.reboot()
                        results["tables"].append({"rep": rep, "name": t.root.name,
                                                  "after_reboot": t.hot_source()})
                    for m, t in zip(learning[1:], tables):
                        engines[m] = _started(results, rep, m, model, args.k,
                                              root / f"r{rep}-{m.replace(' ', '-')}-stats-2.json",
                                              t.endpoint, warm_up)
                    engines["suffix"] = _started(results, rep, "suffix", model, args.k, None,
                                                 None, warm_up)
                for b in batches:
                    for w, prompts in work.items():
                        for m in order:
                            if rnd != "1" and m not in learning and args.peers_once:
                                continue
                            daemons = dict(zip(learning[1:], tables))
                            r = engines[m].run(prompts[where[b]], args.max_tokens, b,
                                               lambda: cpu_by_group(engines, daemons, busy),
                                               sampling(args))
                            r["cpu_s"] = cpu_groups(m, r["cpu_s"])
                            results["cells"].append(cell(w, b, m, rnd, rep, r, want,
                                                         sampling(args) is not None))
                            u = r["cpu_s"]
                            print(f"  rep {rep} round {rnd} batch {b} {w:8s} {m:12s} "
                                  f"{r['tok_s']:7.1f} tok/s AL {r['al']:.2f}  cpu s: engine "
                                  f"{u['engine']:.1f} (core {u['engine_core']:.1f}) front "
                                  f"{u['front']:.1f} daemon "
                                  f"{u['own_daemon']:.1f} others {u['other_daemons']:.1f}+"
                                  f"{u['other_engines']:.1f} busy {u['busy']:.1f} "
                                  f"({r['seconds']:.1f} s, {r['steps']} steps, longest row "
                                  f"{r['longest']}, mean request {r['request_s']} s)",
                                  file=sys.stderr, flush=True)
                for m in learning:  # what this round taught the table, counted before the next
                    if engines[m].stats_file is not None:
                        results["settle_s"].append(round(engines[m].settle(), 2))
            if rep == args.reps - 1:
                results["steps"]["proposer"] = propose_by_batch(engines["ngramd"],
                                                                work[next(iter(work))])
            for m in learning:
                _closed(results, rep, "restart", engines.pop(m))
            for t in tables:
                t.close()
            tables = []
            partial = Path(args.out).with_suffix(".partial.json")  # a run cut short keeps these
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({**results, "cells": [
                {k: v for k, v in c.items() if k not in ("tokens", "texts")}
                for c in results["cells"]]}))
    finally:
        for e in engines.values():
            e.close()
        for t in tables:
            t.close()
        shutil.rmtree(root, ignore_errors=True)
        for shm in Path("/dev/shm").glob(f"{root.name}-*"):
            shutil.rmtree(shm, ignore_errors=True)

    for b, s in results["steps"].items():
        if b != "proposer":
            s["propose_ms"] = results["steps"].get("proposer", {}).get(b)
    results["machine"] = machine_info()
    results["settings"] = {k: v for k, v in vars(args).items() if k != "report"} | {
        "command": " ".join(sys.argv), "wall_s": round(time.time() - t_start),
        "prompts_per_batch": {b: s.stop - s.start for b, s in where.items()}}
    for c in results["cells"]:
        c.pop("tokens", None)
        c.pop("texts", None)
    return results


def _started(results: dict, rep: int, method: str, model: Path, k: int, stats, endpoint,
             warm: tuple) -> Engine:
    """A fresh engine, warmed up (``warm``: ``Engine.warm_up``'s arguments)."""
    e = Engine(model, method, k, stats, endpoint)
    e.warm_up(*warm)
    results["engines"].append({"rep": rep, "method": method, "start_s": round(e.start_s, 1),
                               "warm_up_s": round(e.warm_s, 1)})
    return e


def _closed(results: dict, rep: int, rnd: str, e: Engine) -> None:
    if e.stats_file is not None:
        results["engines"].append({"rep": rep, "method": e.method, "after_round": rnd,
                                   "calibration": e.calibration(),
                                   "cost_steps": e.proposer("cost_steps")})
    e.close()


def sampling(args) -> dict | None:
    """The runs' ``SamplingParams`` fields: None for greedy (the default)."""
    t = getattr(args, "temperature", 0.0)
    return {"temperature": t, "top_p": getattr(args, "top_p", 1.0)} if t > 0 else None


def cell(workload: str, batch: int, method: str, rnd: str, rep: int, r: dict,
         want: dict, sampled: bool = False) -> dict:
    """One run's figures; its greedy tokens against plain's for the same prompts (plain runs
    first in the first repetition: ``want`` is filled from it).  Sampled outputs differ from
    plain's by chance: they count as identical (nothing to compare)."""
    key = (workload, batch)
    if method == "plain" and key not in want:
        want[key] = r["tokens"]
    same = sampled or r["tokens"] == want.get(key)
    return {"workload": workload, "batch": batch, "method": method, "round": rnd, "rep": rep,
            "identical": same, **r}


def propose_by_batch(e: Engine, prompts: list[str]) -> dict:
    """The proposer's median step time at batch 1, 8, 32 and 64 (ignore_eos runs)."""
    from vllm import SamplingParams

    out = {}
    for b in (1, 8, 32, 64):
        rows = (prompts * (b // len(prompts) + 1))[:b]
        e.llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                       use_tqdm=False)
        time.sleep(0.6)
        out[b] = e.proposer().get("propose_ms_p50_by_batch", {}).get(str(b))
    return out


# ---------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(results: dict) -> dict:
    """Per cell (workload, batch, round, method): the repetitions' tok/s (median, min, max),
    AL, ngramd's same-steps ratios; per repetition ratios to that repetition's plain and best
    peer, then their medians."""
    cells = results["cells"]
    by = {}
    for c in cells:
        by.setdefault((c["workload"], c["batch"], c["round"], c["method"]), []).append(c)
    reps = sorted({c["rep"] for c in cells})
    rows = []
    for (w, b, rnd, m), cs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0],
                                                                   ROUNDS.index(kv[0][2]),
                                                                   _method_rank(kv[0][3]))):
        tps = [c["tok_s"] for c in cs]
        row = {"workload": w, "batch": b, "round": rnd, "method": m, "reps": len(cs),
               "tok_s": _median(tps), "min": min(tps), "max": max(tps),
               "al": _median([c["al"] for c in cs]),
               "steps": _median([c.get("steps") for c in cs]),
               "request_s": _median([c.get("request_s") for c in cs]),
               "longest": _median([c.get("longest") for c in cs]),
               "identical": all(c["identical"] for c in cs),
               "cores": {k: _median([c["cpu_s"][k] / c["seconds"] for c in cs
                                     if k in c.get("cpu_s", {}) and c["seconds"]])
                         for k in CPU_GROUPS},
               "engine_ms_a_token": _median([1e3 * c["cpu_s"]["engine"] / c["output_tokens"]
                                             for c in cs if c.get("cpu_s")
                                             and c["output_tokens"]]),
               "worker_ms_a_token": _median([
                   1e3 * (c["cpu_s"]["engine"] - c["cpu_s"]["engine_core"]) / c["output_tokens"]
                   for c in cs if "engine_core" in c.get("cpu_s", {}) and c["output_tokens"]])}
        vs_plain, vs_peer, by_request = [], [], []
        for rep in reps:
            mine = by_rep(by, w, b, rnd, m, rep)
            plain = peer_run(by, w, b, rnd, "plain", rep)
            peers = [x for x in (peer_run(by, w, b, rnd, "ngram", rep),
                                 by_rep(by, w, b, rnd, "suffix", rep)) if x]
            if mine and plain:
                vs_plain.append(mine["tok_s"] / plain["tok_s"])
                if mine.get("request_s") and plain.get("request_s"):
                    by_request.append(plain["request_s"] / mine["request_s"])
            if mine and peers:
                vs_peer.append(mine["tok_s"] / max(x["tok_s"] for x in peers))
        row["vs_plain"], row["vs_best_peer"] = _median(vs_plain), _median(vs_peer)
        row["vs_plain_range"] = (min(vs_plain), max(vs_plain)) if vs_plain else None
        row["vs_best_peer_range"] = (min(vs_peer), max(vs_peer)) if vs_peer else None
        # plain's mean request time over this one's: what the batch's users saw, each request
        # timed alone (a closed batch's tok/s is set by its longest row)
        row["vs_plain_by_request"] = _median(by_request)
        if m.startswith("ngramd"):
            tallies = [c["same_steps"] for c in cs if c.get("same_steps")]
            for key in ("vs_plain", "vs_full", "vs_oracle"):
                row[f"tally_{key}"] = _median([t.get(key) for t in tallies])
        rows.append(row)
    return {"rows": rows}


def _method_rank(m: str) -> int:
    return (*METHODS, WALL, COLD).index(m)


def by_rep(by: dict, w, b, rnd, m, rep) -> dict | None:
    for c in by.get((w, b, rnd, m), []):
        if c["rep"] == rep:
            return c
    return None


def peer_run(by: dict, w, b, rnd, m, rep) -> dict | None:
    """A method that learns nothing (plain, ngram) in round ``rnd`` of repetition ``rep``:
    its run of that round where it ran in every round, else its round-1 run (``--peers-once``
    and runs before it)."""
    return by_rep(by, w, b, rnd, m, rep) or by_rep(by, w, b, "1", m, rep)


def targets(runs: list[dict]) -> list[dict]:
    """Issue 27's target table over every run given (quiet and busy)."""
    rows, ngramd, identical, cal, forgot = [], [], True, [], []
    for r in runs:
        label = "busy" if r["settings"].get("contend") else "quiet"
        greedy = not r["settings"].get("temperature")
        for row in summarise(r)["rows"]:
            identical &= row["identical"] or not greedy
            if row["method"] == "ngramd":
                ngramd.append((label, row))
        cal += [e["calibration"]["max_error"] for e in r["engines"]
                if e.get("calibration") and e["calibration"].get("max_error") is not None
                and e["method"] == "ngramd"]
        forgot += [e["calibration"]["forgot"] for e in r["engines"] if e.get("calibration")
                   and e["calibration"].get("forgot") is not None and e["method"] == "ngramd"]

    def where(pairs):
        return ", ".join(f"{lab} b{x['batch']} {x['workload']} r{x['round']} "
                         f"{x['vs_plain' if key == 'p' else 'vs_best_peer']:.2f}x"
                         for lab, x, key in pairs)

    def beyond(pairs, key, bound):  # of the cells below: those below in every repetition
        if not pairs:
            return ""
        out = [f"{lab} b{x['batch']} {x['workload']} r{x['round']}" for lab, x, _ in pairs
               if x.get(f"{key}_range") and x[f"{key}_range"][1] < bound]
        return f"; below in every repetition: {', '.join(out) if out else 'none'}"

    vp = [(lab, x) for lab, x in ngramd if x["vs_plain"] is not None]
    low = [(lab, x, "p") for lab, x in vp if x["vs_plain"] < 0.97]
    rows.append({"figure": f"ngramd at defaults vs plain, every cell ({len(vp)} cells)",
                 "target": ">= 0.97x",
                 "measured": (f"min {min(x['vs_plain'] for _, x in vp):.2f}x; "
                              + (f"below: {where(low)}" if low else "none below")
                              + beyond(low, "vs_plain", 0.97))
                 if vp else "-"})
    req = [(lab, x) for lab, x in vp if x.get("vs_plain_by_request")]
    if req:  # runs before 2026-12-07 timed no request
        slow = [f"{lab} b{x['batch']} {x['workload']} r{x['round']} "
                f"{x['vs_plain_by_request']:.2f}x" for lab, x in req
                if x["vs_plain_by_request"] < 0.97]
        rows.append({"figure": f"the same by each request's own time (plain's mean request "
                               f"seconds / ngramd's; {len(req)} cells)", "target": ">= 0.97x",
                     "measured": f"min {min(x['vs_plain_by_request'] for _, x in req):.2f}x; "
                                 + (f"below: {', '.join(slow)}" if slow else "none below")})
    peer = [x["vs_best_peer"] for _, x in ngramd if x["vs_best_peer"]]
    rows.append({"figure": f"ngramd vs the best of vLLM ngram and suffix, geometric mean "
                           f"({len(peer)} cells)", "target": ">= 1.15x",
                 "measured": f"{math.exp(sum(map(math.log, peer)) / len(peer)):.2f}x"
                 if peer else "-"})
    late = [(lab, x) for lab, x in ngramd if x["round"] != "1" and x["vs_best_peer"]]
    miss = [(lab, x, "b") for lab, x in late if x["vs_best_peer"] < 1.0]
    rows.append({"figure": f"ngramd vs the best peer, every round-2 and restart cell "
                           f"({len(late)} cells)", "target": ">= 1.0x",
                 "measured": (f"min {min(x['vs_best_peer'] for _, x in late):.2f}x; "
                              + (f"below: {where(miss)}" if miss else "none below")
                              + beyond(miss, "vs_best_peer", 1.0))
                 if late else "-"})
    orc = [x["tally_vs_oracle"] for _, x in ngramd if x.get("tally_vs_oracle")]
    rows.append({"figure": f"ngramd vs the oracle policy (same steps), geometric mean and min "
                           f"({len(orc)} cells)", "target": ">= 85%",
                 "measured": f"{100 * math.exp(sum(map(math.log, orc)) / len(orc)):.0f}%, "
                             f"min {100 * min(orc):.0f}%" if orc else "-"})
    rows.append({"figure": f"calibration: |predicted - observed| acceptance per position, "
                           f"worst engine ({len(cal)} engines)", "target": "<= 0.05",
                 "measured": f"{max(cal):.3f} (median engine {_median(cal):.3f}"
                             + (f"; the model forgot its past {'/'.join(map(str, forgot))} "
                                f"times" if forgot else "") + ")"
                 if cal else "-"})
    greedy_runs = [r for r in runs if not r["settings"].get("temperature")]
    rows.append({"figure": "greedy outputs identical to plain vLLM (every cell, every run)",
                 "target": "identical",
                 "measured": ("yes" if identical else "NO") if greedy_runs
                 else "not compared: every run sampled"})
    for r in runs:
        label = "busy" if r["settings"].get("contend") else "quiet"
        for bs, s in r["steps"].items():
            if bs != "proposer" and s.get("propose_ms") is not None:
                rows.append({"figure": f"propose() per step / plain step, batch {bs} ({label})",
                             "target": "<= 2%",
                             "measured": f"{s['propose_ms']:.2f} / {s['plain_step_ms']:.1f} ms "
                                         f"= {100 * s['propose_ms'] / s['plain_step_ms']:.1f}%"})
    return rows


def condensed(results: dict) -> list[str]:
    """ngramd at defaults per cell against plain and the peers: one row per (batch, workload,
    round), medians over the repetitions."""
    rows = {(x["batch"], x["workload"], x["round"], x["method"]): x
            for x in summarise(results)["rows"]}
    out = ["| batch | workload | round | ngramd tok/s (min-max) | plain | vLLM ngram "
           "| vLLM suffix | ngramd full | vs plain (range) | vs best peer (range) | % of oracle |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (b, w, rnd, m), x in rows.items():
        if m != "ngramd":
            continue

        def tps(method, r=rnd):
            y = rows.get((b, w, r, method)) or rows.get((b, w, "1", method))
            return f"{y['tok_s']:.1f}" if y else ""

        orc = x.get("tally_vs_oracle")
        vs_plain = _fmt(x["vs_plain"]) + _spread(x.get("vs_plain_range"))
        vs_peer = _fmt(x["vs_best_peer"]) + _spread(x.get("vs_best_peer_range"))
        out.append(f"| {b} | {w} | {rnd} | {x['tok_s']:.1f} ({x['min']:.1f}-{x['max']:.1f}) | "
                   f"{tps('plain')} | {tps('ngram')} | {tps('suffix')} | "
                   f"{tps('ngramd full')} | {vs_plain} | {vs_peer} | "
                   f"{'' if orc is None else f'{100 * orc:.0f}%'} |")
    return out


def pool_runs(runs: list[dict]) -> dict:
    """Runs of the same code and settings (the workloads of the last) as one run: every cell
    of those workloads, repetitions numbered on from run to run, so medians and spreads are
    over all of them.  Step costs and ``propose()`` figures are the last run's."""
    keep = set(runs[-1]["settings"]["workloads"].split(","))
    pooled = json.loads(json.dumps(runs[-1]))
    pooled["cells"], pooled["engines"], offset = [], [], 0
    for r in runs:
        def renumber(x):
            rep = x.get("rep", -1)
            return {**x, "rep": rep + offset if rep is not None and rep >= 0 else rep}
        pooled["cells"] += [renumber(c) for c in r["cells"] if c["workload"] in keep]
        pooled["engines"] += [renumber(e) for e in r["engines"]]
        offset += r["settings"]["reps"]
    pooled["settings"].update(reps=offset, wall_s=sum(r["settings"]["wall_s"] for r in runs),
                              command=" + ".join(r["settings"]["command"] for r in runs))
    return pooled


def draft_jump(runs: list[dict]) -> str:
    """What a step that verifies a draft costs beyond what its draft tokens do, by rows: over
    every pair of consecutive steps of the same rows among the engines' timed steps
    (``cost_steps``: tokens, rows, ms), the least-squares fit of ``log(ms2 / ms1) = slope (D2 -
    D1) + log(jump) ([D2 > 0] - [D1 > 0])`` (``D``: draft tokens verified).  Only pairs where
    one step verified a draft and the other none inform the jump; they are counted."""
    import numpy as np  # in vLLM's environment, as the bench's other figures are

    pairs: dict[int, list] = {}
    for r in runs:
        for e in r.get("engines", []):  # runs before the engines' steps were kept: none
            steps = e.get("cost_steps") or []
            for (t1, r1, ms1), (t2, r2, ms2) in zip(steps, steps[1:]):
                if r1 == r2 and ms1 > 0 and ms2 > 0:
                    pairs.setdefault(int(r1), []).append((t1 - r1, t2 - r2, ms2 / ms1))
    lines = ["| rows | pairs | pairs that inform the jump | jump (x) | cost a draft token (x) |",
             "|---|---|---|---|---|"]
    for rows, p in sorted(pairs.items()):
        d1, d2, ratio = (np.array(c, np.float64) for c in zip(*p))
        x = np.column_stack([d2 - d1, (d2 > 0).astype(float) - (d1 > 0)])
        informing = int((x[:, 1] != 0).sum())
        if informing < 5:
            continue
        slope, jump = np.linalg.lstsq(x, np.log(ratio), rcond=None)[0]
        lines.append(f"| {rows} | {len(p)} | {informing} | {np.exp(jump):.3f} | "
                     f"{np.exp(slope):.4f} |")
    return "\n".join(lines)


def report(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        s = r["settings"]
        busy = (f"busy: {s['contend']} busy processes"
                + (", one held to each CPU in turn" if s.get("contend_pin") else ""))
        lines += [f"## {busy if s.get('contend') else 'quiet'}"
                  f" ({s['reps']} repetitions, {s['max_tokens']} tokens, prompts a cell "
                  f"{s.get('prompts_per_batch')}, {s['wall_s']} s)", "",
                  *condensed(r), "",
                  "| batch | workload | round | method | tok/s median (min-max) | AL | vs plain "
                  "| vs best peer | same steps: vs plain, vs full, % of oracle | identical "
                  "| engine CPU ms a token (its worker's) | cores: engine, front, own daemon, "
                  "other daemons, busy | engine steps (longest row) | mean request s "
                  "(plain's / this) |", "|---" * 14 + "|"]
        for x in summarise(r)["rows"]:
            tally = (f"{x['tally_vs_plain'] or 0:.2f}x, {x['tally_vs_full'] or 0:.2f}x, "
                     f"{100 * (x['tally_vs_oracle'] or 0):.0f}%"
                     if x.get("tally_vs_oracle") else "")
            lines.append(
                f"| {x['batch']} | {x['workload']} | {x['round']} | {x['method']} | "
                f"{x['tok_s']:.1f} ({x['min']:.1f}-{x['max']:.1f}) | {x['al']:.2f} | "
                f"{_fmt(x['vs_plain'])} | {_fmt(x['vs_best_peer'])} | {tally} | "
                f"{'yes' if x['identical'] else 'NO'} | {_num(x.get('engine_ms_a_token'))}"
                f"{_paren(x.get('worker_ms_a_token'))} | "
                f"{_cores(x.get('cores'))} | {_num(x.get('steps'), 0)}"
                f"{_paren(x.get('longest'), 0)} | {_num(x.get('request_s'), 2)}"
                f"{_paren(x.get('vs_plain_by_request'), 2)} |")
        lines.append("")
    lines += ["| figure | target | measured |", "|---|---|---|"]
    lines += [f"| {t['figure']} | {t['target']} | {t['measured']} |" for t in targets(runs)]
    return "\n".join(lines)


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2f}x"


def _spread(r) -> str:
    """A ratio's range over the repetitions, " (lo-hi)"."""
    return "" if not r else f" ({r[0]:.2f}-{r[1]:.2f})"


def _num(x, digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _paren(x, digits: int = 1) -> str:
    return "" if x is None else f" ({x:.{digits}f})"


def _cores(c: dict | None) -> str:
    """The cores each group kept busy over a cell (CPU seconds / the cell's seconds)."""
    keys = ("engine", "front", "own_daemon", "other_daemons", "busy")
    if not c or c.get("engine") is None:
        return ""
    return ", ".join(f"{c[k]:.2f}" for k in keys)


if __name__ == "__main__":
    sys.exit(main())
