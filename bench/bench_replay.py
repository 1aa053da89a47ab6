"""Held-out code replayed through every drafter, on a table warmed through the daemon (issue 18).

The regime the product exists for: a warm table that matters, a daemon on its own schedule,
a steady stream of feedback, and (``--contend N``) a busy host.

Workloads, one row each (``--workloads``):

* **warm** (``--project``, default ``transformers``): the Python files of one large installed
  project, split by file at random (``--seed``) into warm-up and held-out (``--holdout``).  A
  request is a held-out file with at least ``--prompt`` + ``--output`` tokens: prompt = its
  first ``--prompt`` tokens (800), output = the next ``--output`` (256).  The warm-up is the
  other files in random order, up to ``--train-tokens`` (7.6M).  **Workload check**: the
  all-in-RAM bound's AL on the warmed table must be at least 1.6x its AL on an empty table
  (request-local drafting only), else the workload does not test the table; printed either
  way.  Measured here: torch (1.22x) and numpy+scipy (1.17x) fail it, transformers passes
  (its model files share templates: "Copied from" blocks, generated code).
* **stdlib**: the standard library, split the same way (``--stdlib-*``).

Greedy, so the "model" is the file itself: a drafted token is accepted when it equals the
next token of the file, and each verify step emits the accepted tokens plus one (AL counts it).
k = 8 draft tokens a step for every drafter.

Drafters, on the same requests, in one run:

* **generator path**: ``NgramDrafter`` + ``DaemonLink`` at their defaults against a real
  ``ngramd`` at its defaults, as ``ngram-generate`` drafts: request-local table, hot and recent
  tiers in shared memory, asynchronous daemon asks; each verify step sleeps ``--forward-ms``
  (15, a GPU forward), and after each request its text is fed back (``link.feedback``: the
  prompt too when the table's ``learn_prompts`` says so, per-order counts, the hot keys used)
  as ``ngram_generator.spec`` does.  The table is warmed through the ingest op (the
  ``ngram-client ingest`` path, no flush), then the daemon runs its own schedule: the bench
  waits until the daemon has counted the warm-up and published a hot generation built from it
  on its own, and forces nothing during the replay.  With ``--contend N`` the path runs
  again on a second daemon warmed the same way, with N busy processes (pure-Python loops at
  normal priority) beside the daemon and the replay from the end of the warm-up to the end
  (``--contend-warmup``: from before the daemon starts; its niced rebuild of the warm table
  then waits for CPU: 472 s instead of 55 s for 1.5M tokens under 2 busy processes here).
* **SuffixDecoding** (ArcticInference 0.3.0, ``bench/build_suffix.py``; ``make suffix-peer``),
  used as ArcticInference's vLLM runner uses ``SuffixDecodingCache`` (its defaults: tree depth
  64, spec factor 1.0, offset 0, min token prob 0.1): the warm-up files are added to its
  global tree as finished responses; per request ``start_request(prompt)``, ``speculate`` on
  the last 64 tokens, ``add_active_response`` of what was emitted, ``stop_request`` (the
  response stays in the global tree: it learns across requests, outputs only, by design).
* **HF prompt lookup**: transformers' prompt-lookup decoding (n-gram match in the request,
  ``max_ngram_size`` 3), reimplemented.
* **all-in-RAM bound**: request-local table + every row the warm-up counts (counted by the
  daemon's own counting code, ``ColdStore.bulk_load``, in a scratch table), unpruned, in one
  slot table, longest match restarted at n_max each step, the daemon's stop rules.  Only rows
  whose context occurs in a request's text are kept: a drafted token counts only while every
  token before it was right, so the AL is exact (its drafted count may be lower).  It learns
  no feedback (the generator and SuffixDecoding do).  "empty table" is the same with no rows.

Also reported: the daemon's hot tier (size and why, rebuilds and their CPU), link drops and
drafts made while the link was down, daemon asks, and the stall lines the daemon logged.
Prints the issue's target table; writes ``bench/out/replay.json``.
``--restart`` (issue 28): instead of the live daemon, warm one, snapshot it, stop it, wipe its
shm dir, restore the snapshot as a new table and replay on a fresh daemon started on it (with
``--contend N`` beside it): time to its first hot draft and to a hot tier reflecting the whole
table, AL, accepted tokens by tier.  ``--without-image`` also removes the hot image from the
restored table, so the start must rebuild the tier from the table (the rebuild that must not
starve).

Usage: ``OMP_NUM_THREADS=1 python bench/bench_replay.py [--contend 4] [--quick]`` (under the
heavy lock; ~25 min, --quick ~6 min).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ngram_client import NgramClient
from ngram_generator.drafting import DraftConfig, NgramDrafter, settings_from_table
from ngram_generator.remote import DaemonLink
from ngramd import kernels as K
from ngramd.kernels.hashing import suffix_hashes
from ngramd.kernels.local import local_add
from ngramd.kernels.slots import insert_rows
from ngramd.wire.constants import HOT_K, SLOT_WORDS, TIER_NAMES
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.drafttiers import LOCAL_FIRST, DraftTiers, SharedTiers
from ngramd.wire.identity import TableIdentity, tokenizer_fingerprint
from ngramd.wire.rules import DraftRules

import data
from machine import machine_info

OUT = Path(__file__).resolve().parent / "out"
K_DRAFT = 8
WORKLOAD_CHECK = 1.6  # the bound's AL on the warm table over its AL on an empty one
N_MIN, N_MAX = 1, 16  # the daemon's default orders
SUFFIX_DEPTH = 64  # ArcticInference's suffix_cache_max_depth
INGEST_BATCH_TOKENS = 1 << 19


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------
def load_workload(name: str, files: list[Path], tok, *, holdout: float, train_tokens: int,
                  n_requests: int, prompt: int, output: int, seed: int) -> dict:
    """Warm-up sequences and ``(prompt, output)`` requests of one project, split by file."""
    seqs = data.file_tokens(tok, files, name)
    warm_idx, hold_idx = data.split_by_file(seqs, holdout, seed)
    warm, n = [], 0
    for i in warm_idx:
        if n >= train_tokens:
            break
        s = seqs[i][:train_tokens - n]
        if s.size >= 2:
            warm.append(s)
            n += s.size
    need = prompt + output
    reqs = [(seqs[i][:prompt], seqs[i][prompt:need]) for i in hold_idx if seqs[i].size >= need]
    return {"name": name, "warm": warm, "requests": reqs[:n_requests],
            "info": {"files": len(files), "warm_files": len(warm), "warm_tokens": n,
                     "heldout_files": len(hold_idx), "long_enough": len(reqs),
                     "requests": min(n_requests, len(reqs))}}


# ---------------------------------------------------------------------------------------------
# the replay: greedy on the text, k tokens a step
# ---------------------------------------------------------------------------------------------
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
                self.by_tier[TIER_NAMES[int(t)] if int(t) < 4 else str(int(t))] += 1
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


class Drafter:
    """A drafter the replay drives through a request's life (no-op hooks by default)."""

    def start(self, prompt: np.ndarray) -> None:
        pass

    def draft(self, ctx: np.ndarray):
        """``(tokens, tiers or None, orders or None)`` after ``ctx``."""
        raise NotImplementedError

    def step(self, n_accepted: int, emitted: np.ndarray) -> None:
        pass

    def finish(self, prompt: np.ndarray, out: np.ndarray, drafted: dict, accepted: dict):
        pass


def replay(requests, d: Drafter) -> Tally:
    t = Tally()
    for prompt, out in requests:
        d.start(prompt)
        ctx = list(prompt)
        pos = 0
        drafted, accepted = Counter(), Counter()
        while pos < out.size:
            toks, tiers, orders = d.draft(np.asarray(ctx, np.uint32))
            toks = np.asarray(toks)[:min(K_DRAFT, out.size - pos - 1)]
            n = 0
            while n < toks.size and toks[n] == out[pos + n]:
                n += 1
            t.step(len(toks), n, tiers, orders)
            if orders is not None:
                drafted.update(int(o) for o in orders[:len(toks)])
                accepted.update(int(o) for o in orders[:n])
            emitted = out[pos:pos + n + 1]
            d.step(n, emitted)
            ctx.extend(emitted.tolist())
            pos += n + 1
        d.finish(prompt, out, dict(drafted), dict(accepted))
    return t


def hf_prompt_lookup(ctx: np.ndarray, k: int, max_ngram: int = 3) -> np.ndarray:
    """transformers' PromptLookupCandidateGenerator: the first earlier occurrence of the
    context's last n-gram (n = max_ngram..1), and the tokens that followed it."""
    n_ctx = ctx.shape[0]
    for n in range(max_ngram, 0, -1):
        if n_ctx <= n:
            continue
        pat = ctx[n_ctx - n:]
        win = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)
        for h in np.flatnonzero((win == pat).all(1)):
            start = h + n
            end = min(start + k, n_ctx)
            if start < end:
                return ctx[start:end]
    return ctx[:0]


class PromptLookup(Drafter):
    def draft(self, ctx):
        return hf_prompt_lookup(ctx, K_DRAFT), None, None


class LocalPlusTable(Drafter):
    """The all-in-RAM bound: request-local table, then ``slots`` (complete and unpruned:
    longest match restarted at n_max), the daemon's default stop rules."""

    def __init__(self, slots: np.ndarray):
        self.slots = slots
        self.local = np.zeros((1 << 17, SLOT_WORDS), np.uint32)
        self.rules = DraftRules(n_min=N_MIN, n_max=N_MAX, c_min=1, s_min=0.3, p_cum=0.1,
                                f_cap=0.0)
        # the generator's front end and layout, with ``slots`` (no pruned filter) as hot
        self.tiers = DraftTiers(LOCAL_FIRST, self.local, 64, SharedTiers(slots, max_probe=64))
        self.added = 0

    def start(self, prompt):
        self.local[:] = 0
        self.added = 0

    def draft(self, ctx):
        local_add(self.local, 64, ctx, self.added, ctx.size, N_MIN, N_MAX)
        self.added = ctx.size
        d = self.tiers.draft(ctx, None, K_DRAFT, self.rules)
        return d.tokens.copy(), d.tiers.copy(), d.orders.copy()


def request_keys(requests) -> np.ndarray:
    """Sorted keys of every context (orders N_MIN..N_MAX) at every position of the requests'
    text: the only rows a draft whose tokens are all right can read."""
    hs = np.zeros(N_MAX + 1, np.uint64)
    keys = []
    for prompt, out in requests:
        seq = np.concatenate([prompt, out])
        ks = np.zeros((seq.size, N_MAX), np.uint64)
        for pos in range(1, seq.size + 1):
            a = suffix_hashes(seq, pos, N_MAX, hs)
            ks[pos - 1, :a] = hs[1:a + 1]
        keys.append(ks[ks != 0])
    return np.unique(np.concatenate(keys))


def bound_slots(warm, requests, scratch: Path) -> tuple[np.ndarray, dict]:
    """The bound's slot table: the warm-up counted into a scratch table by the daemon's own
    counting code, every row on the requests' contexts (see the module docstring)."""
    t0 = time.perf_counter()
    keys = request_keys(requests)
    ident = TableIdentity(n_min=N_MIN, n_max=N_MAX, cold_k=8, vocab_size=151_936, tokenizer="")
    tokens, offsets = data.pack(warm)
    cap = 1 << int(np.ceil(np.log2(max(keys.size, 64) / 0.5)))
    slots = np.zeros((cap, SLOT_WORDS), np.uint32)
    with ColdStore(scratch, ident, ColdOptions(sync_log=False)) as s:
        run = s.bulk_load(tokens, offsets, threads=2, mem_mb=1024)
        kept = 0
        for rows in s.reader.scan_rows():
            i = np.minimum(np.searchsorted(keys, rows.key), keys.size - 1)
            m = keys[i] == rows.key
            if m.any():
                tk, ct = rows.padded(HOT_K)
                assert insert_rows(slots, 64, rows.key[m], rows.order[m], tk[m], ct[m],
                                   rows.total[m]) == 0
                kept += int(m.sum())
        disk = s.stats()["sst_bytes"]
    shutil.rmtree(scratch, ignore_errors=True)
    return slots, {"entries": int(run.rows if run else 0), "rows_on_requests": kept,
                   "cold_bytes": int(disk), "seconds": round(time.perf_counter() - t0, 1)}


class SuffixPeer(Drafter):
    """SuffixDecoding as ArcticInference's vLLM runner uses it (module docstring)."""

    def __init__(self, warm):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        rss0, t0 = _rss_kb(os.getpid()), time.perf_counter()
        self.cache = SuffixDecodingCache(max_tree_depth=SUFFIX_DEPTH, max_cached_requests=100_000)
        empty = np.zeros(0, np.int32)
        for i, s in enumerate(warm):
            self.cache.start_request(("warm", i), empty)
            self.cache.add_active_response(("warm", i), np.ascontiguousarray(s, np.int32))
            self.cache.stop_request(("warm", i))
        n = sum(s.size for s in warm)
        dt = time.perf_counter() - t0
        self.info = {"warm_s": round(dt, 1), "warm_tokens_per_s": round(n / max(dt, 1e-9)),
                     "rss_rise_mb": round((_rss_kb(os.getpid()) - rss0) / 1024)}
        self.rid = 0

    def start(self, prompt):
        self.rid += 1
        self.cache.start_request(self.rid, np.ascontiguousarray(prompt, np.int32))

    def draft(self, ctx):
        pat = np.ascontiguousarray(ctx[-SUFFIX_DEPTH:], np.int32)
        d = self.cache.speculate(self.rid, pat, max_spec_tokens=K_DRAFT, max_spec_factor=1.0,
                                 max_spec_offset=0.0, min_token_prob=0.1)
        return np.asarray(d.token_ids, np.int64), None, None

    def step(self, n, emitted):
        self.cache.add_active_response(self.rid, np.ascontiguousarray(emitted, np.int32))

    def finish(self, prompt, out, drafted, accepted):
        self.cache.stop_request(self.rid)


def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------------------------------------
# the daemon and the generator's path
# ---------------------------------------------------------------------------------------------
class Daemon:
    """An ``ngramd`` at its defaults (paths aside) in ``root``."""

    def __init__(self, root: Path, name: str, sets=()):
        self.root, self.name, self.sets = root, name, list(sets)
        self.shm = f"/dev/shm/ngramd-bench-replay-{os.getpid()}-{name}"
        self.endpoint = f"ipc://{root}/run/{name}.sock"
        self.log = root / f"{name}.log"
        (root / "run").mkdir(parents=True, exist_ok=True)

    def start(self):
        args = data.daemon_args(self.name, self.root, self.shm, self.sets)
        self.proc = subprocess.Popen(args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        data.wait_ready(self.endpoint, self.proc, self.log)

    def stats(self) -> dict:
        with NgramClient(self.endpoint, timeout_ms=60_000) as c:
            return c.stats()

    def stop(self):
        data.stop_process(self.proc, 300)
        shutil.rmtree(self.shm, ignore_errors=True)


def warm_through_daemon(d: Daemon, warm, fp: str, limit_s: float = 3600) -> dict:
    """Send the warm-up through the ingest op, then wait until the daemon, on its own
    schedule, has counted it and published a hot generation built from all of it."""
    t0 = time.perf_counter()
    last = 0
    with NgramClient(d.endpoint, timeout_ms=600_000, tokenizer_fingerprint=fp) as c:
        batch, n = [], 0
        for s in warm + [None]:
            if s is not None:
                batch.append(s)
                n += s.size
            if batch and (s is None or n >= INGEST_BATCH_TOKENS):
                last = c.ingest(batch)[1]
                batch, n = [], 0
    t_ingest = time.perf_counter() - t0
    deadline = time.monotonic() + limit_s
    while True:
        st = d.stats()
        if st["hot"].get("counted_seq", -1) >= last:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no hot generation built from the warm-up in {limit_s} s")
        time.sleep(1.0)
    return {"ingest_s": round(t_ingest, 1), "ready_s": round(time.perf_counter() - t0, 1),
            "hot": _hot_summary(st)}


def _hot_summary(st: dict) -> dict:
    h = st["hot"]
    return {"generation": h.get("generation"), "bytes": h.get("bytes"),
            "placed": h.get("placed"), "build_s": h.get("build_s"),
            "sizing": h.get("sizing"), "rebuilds": h.get("rebuilds"),
            "entries": st["cold"].get("entries_total")}


class GeneratorPath(Drafter):
    """``NgramDrafter`` + ``DaemonLink`` at their defaults, fed back as the generator does."""

    def __init__(self, endpoint: str, fp: str, forward_ms: float, expected_new: int):
        self.link = DaemonLink(endpoint, tokenizer_fingerprint=fp)
        self.link.connect()
        cfg = settings_from_table(self.link.info, DraftConfig(), {"max_draft_len": K_DRAFT})
        self.src = NgramDrafter(cfg, self.link)
        self.forward_s = forward_ms / 1e3
        self.expected_new = expected_new
        self.last = None
        self.drops = self.down_steps = 0
        self._up = self.link.available
        self.asked0 = (self.src.asked, self.src.answered, self.src.used, self.src.gate.skipped)

    def start(self, prompt):
        self.link.refresh()
        self.src.start(prompt, expected_new=self.expected_new)

    def draft(self, ctx):
        up = self.link.available
        self.drops += self._up and not up
        self.down_steps += not up
        self._up = up
        self.last = d = self.src.draft(K_DRAFT)
        return d.tokens, d.tiers, d.orders

    def step(self, n, emitted):
        self.src.accepted(self.last, n)
        time.sleep(self.forward_s)  # the verify forward: the daemon's time to answer
        self.src.extend(emitted)

    def finish(self, prompt, out, drafted, accepted):
        link = self.link
        if link.available:  # as ngram_generator.spec.SpecDecoder._feedback
            seq = np.concatenate([prompt, out]) if link.learn_prompts else out
            link.feedback([np.asarray(seq, np.uint32)], drafted, accepted,
                          keys=self.src.used_keys())
        self.src.finish()

    def close(self) -> dict:
        self.link.flush(30.0)
        a = (self.src.asked, self.src.answered, self.src.used, self.src.gate.skipped)
        out = {"link_drops": self.drops, "drafts_with_link_down": self.down_steps,
               "link_failures": self.link.failures,
               "daemon_asks": {"asked": a[0] - self.asked0[0],
                               "answered_in_time": a[1] - self.asked0[1],
                               "used": a[2] - self.asked0[2],
                               "not_asked": a[3] - self.asked0[3]}}
        self.link.close()
        return out


def replay_generator(d: Daemon, w: dict, fp: str, args, **extra) -> dict:
    """The generator path against ``d`` over ``w``'s held-out requests: the replay's figures,
    the link's, its seconds, ``extra``, and the daemon's hot tier afterwards."""
    g = GeneratorPath(d.endpoint, fp, args.forward_ms, args.output)
    t0 = time.perf_counter()
    res = replay(w["requests"], g).result()
    res.update(g.close(), replay_s=round(time.perf_counter() - t0, 1), **extra,
               after=_hot_summary(d.stats()))
    return res


def generator_run(root: Path, name: str, w: dict, fp: str, args, contend: int) -> dict:
    """One daemon warmed with ``w``'s warm-up, the generator path over its requests; the
    ``contend`` busy processes run during the replay (and the warm-up with
    ``--contend-warmup``)."""
    d = Daemon(root, name)
    with data.contention(contend if args.contend_warmup else 0):
        d.start()
    try:
        with data.contention(contend if args.contend_warmup else 0):
            warmed = warm_through_daemon(d, w["warm"], fp)
        print(f"  [{name}] warmed: {json.dumps(warmed)}", file=sys.stderr)
        with data.contention(contend):
            res = replay_generator(d, w, fp, args, warmed=warmed, contend=contend)
    finally:
        d.stop()
    text = d.log.read_text(errors="replace")
    res["stall_log_lines"] = sum("kept from running" in line for line in text.splitlines())
    res["daemon_log_lines"] = text.count("\n")
    return res


# ---------------------------------------------------------------------------------------------
# --restart: warm, snapshot, wipe shared memory, a fresh daemon on the snapshot (issue 28)
# ---------------------------------------------------------------------------------------------
def snapshot_warm_table(root: Path, name: str, w: dict, fp: str) -> tuple[dict, dict]:
    """Warm a daemon through the ingest op, wait for its hot image, snapshot it to a directory
    (``ngramd snapshot --to-dir``'s op), stop it and wipe its shm dir.  Returns (warm-up
    summary, snapshot manifest)."""
    from ngramd.tools import ask_daemon

    d = Daemon(root, name, [f'fleet.snapshot_dir="{root / "snaps"}"'])
    d.start()
    try:
        warmed = warm_through_daemon(d, w["warm"], fp)
        deadline = time.monotonic() + 600
        while True:  # the image follows the generation's publication
            h = d.stats()["hot"]
            if h.get("image", {}).get("applied_seq") == h.get("applied_seq"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no hot image written: {h.get('image')}")
            time.sleep(0.5)
        snap = ask_daemon(d.endpoint, "snapshot", 600_000, to_dir=True)
    finally:
        d.stop()  # and its shm dir: a reboot
    return warmed, snap


def first_hot_draft(shm: str, name: str, probes: list[np.ndarray], proc, limit_s: float):
    """Seconds until a generator's in-process reader drafts a token from tier hot for one of
    ``probes`` (contexts of the warm-up), polled every 5 ms from the daemon's start; None
    when the daemon exits or ``limit_s`` passes."""
    from ngramd.hot.shm import HotReader
    from ngramd.wire.errors import NgramError

    rules, t0, reader = DraftRules(), time.monotonic(), None
    while time.monotonic() - t0 < limit_s and proc.poll() is None:
        try:
            reader = reader or HotReader(shm, name)
            for ctx in probes:
                if K.TIER_HOT in reader.draft(ctx, K_DRAFT, rules).tiers.tolist():
                    return round(time.monotonic() - t0, 3)
        except (NgramError, OSError):
            reader = None
        time.sleep(0.005)
    return None


def restart_run(root: Path, name: str, w: dict, fp: str, args, contend: int) -> dict:
    """The generator path on a fresh daemon started, beside ``contend`` busy processes, on a
    snapshot of a warmed table with an empty shm dir: time to its first hot draft and to a
    hot tier that reflects the whole table, then the replay."""
    warmed, snap = snapshot_warm_table(root, f"{name}-src", w, fp)
    r = Daemon(root, name)
    out = subprocess.run([*data.daemon_args(r.name, root, r.shm)[:3], "restore",
                          "--name", r.name, "--data-dir", str(root / "data"),
                          "--set", f'table.tokenizer="{data.qwen_tokenizer_path()}"',
                          snap["stored"]],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"restore failed: {out.stderr}")
    if args.without_image:  # the start must rebuild its hot tier from the table (issue 28)
        from ngramd.hot.image import image_path

        image_path(root / "data" / r.name).unlink()
    rng = np.random.default_rng(args.seed)
    probes = [np.ascontiguousarray(s[i:i + 24], np.uint32) for s in
              (w["warm"][j] for j in rng.integers(0, len(w["warm"]), 64)) if s.size > 64
              for i in (int(rng.integers(0, s.size - 32)),)]
    # the starts (the last one serves the replay): page cache kept (a restore, a new host)
    # and, with --cold-starts, dropped first (a reboot), alternating
    cold = [True, False] * min(args.starts, args.cold_starts)
    cold += [False] * (args.starts - len(cold) // 2) + [True] * (args.cold_starts - len(cold) // 2)
    starts = []
    for i, dropped in enumerate(cold):
        if dropped:  # a reboot: the image (and the daemon's code) come from the disk
            drop_page_cache()
        with data.contention(contend):
            t0 = time.monotonic()
            r.proc = subprocess.Popen(data.daemon_args(r.name, root, r.shm, r.sets),
                                      stdout=open(r.log, "ab"), stderr=subprocess.STDOUT,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
            try:
                first = first_hot_draft(r.shm, r.name, probes, r.proc, 600)
                data.wait_ready(r.endpoint, r.proc, r.log)
                ready = round(time.monotonic() - t0, 3)
                starts.append({"first_hot_draft_s": first, "ready_s": ready,
                               "page_cache_dropped": dropped})
                if i < len(cold) - 1:
                    continue  # (the finally stops it and wipes its shm dir: the next reboot)
                full = _wait_full_hot(r, t0, 1800)
                start_hot = r.stats()["hot"]
                res = replay_generator(r, w, fp, args, warmed=warmed, contend=contend)
            finally:
                r.stop()

    def median(dropped: bool):
        xs = [x["first_hot_draft_s"] for x in starts if x["page_cache_dropped"] == dropped]
        return float(np.median(xs)) if xs and None not in xs else None
    res["restart"] = {"first_hot_draft_s": first, "ready_s": ready, "full_hot_s": full,
                      "starts": starts, "first_hot_draft_median_s": median(False),
                      "first_hot_draft_median_cold_s": median(True),
                      "snapshot_mib": round(snap["bytes"] / 2**20, 1),
                      "hot_image_in_snapshot": snap.get("hot_image"),
                      "source": start_hot.get("source"), "image": start_hot.get("image"),
                      "build_s_when_full": start_hot.get("build_s"),
                      # the daemon accounts a rebuild's CPU after publishing it: read at the end,
                      # and only while the served tier is still the start's build
                      "start_build_cpu_s": (res["after"]["rebuilds"] or {}).get("last_cpu_s")
                      if res["after"]["build_s"] == start_hot.get("build_s") else None}
    text = r.log.read_text(errors="replace")
    res["stall_log_lines"] = sum("kept from running" in line for line in text.splitlines())
    return res


def drop_page_cache() -> None:
    """Empty the kernel's page cache (root), as a reboot does."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _wait_full_hot(d: Daemon, t0: float, limit_s: float):
    """Seconds from ``t0`` until the daemon's hot tier reflects every counted record."""
    while time.monotonic() - t0 < limit_s:
        h = d.stats()["hot"]
        if h.get("entries") and not h.get("behind_records") and not h.get("starved"):
            return round(time.monotonic() - t0, 3)
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------------------------------------
def run_workload(w: dict, args, root: Path, fp: str) -> dict:
    reqs = w["requests"]
    res = {"workload": w["info"]}
    print(f"[{w['name']}] {w['info']}", file=sys.stderr)
    slots, res["table"] = bound_slots(w["warm"], reqs, root / f"{w['name']}-bound")
    res["ram_bound"] = replay(reqs, LocalPlusTable(slots)).result()
    del slots
    res["empty_table"] = replay(reqs, LocalPlusTable(K.EMPTY_SLOTS)).result()
    res["check"] = res["ram_bound"]["al"] / res["empty_table"]["al"]
    print(f"[{w['name']}] bound {res['ram_bound']['al']:.3f}, empty table "
          f"{res['empty_table']['al']:.3f}: {res['check']:.2f}x", file=sys.stderr)
    res["hf_prompt_lookup"] = replay(reqs, PromptLookup()).result()
    if not args.no_suffix:
        peer = SuffixPeer(w["warm"])
        res["suffix_decoding"] = replay(reqs, peer).result() | {"warm": peer.info}
        del peer
    if args.restart:  # the restarted daemon only: its own figures, its own AL
        res["generator_restarted"] = restart_run(root, f"{w['name']}-restart", w, fp, args,
                                                 args.contend)
        return res
    res["generator"] = generator_run(root, f"{w['name']}-idle", w, fp, args, 0)
    if args.contend:
        res["generator_contended"] = generator_run(root, f"{w['name']}-busy", w, fp, args,
                                                   args.contend)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="warm,stdlib", help="warm, stdlib or both")
    ap.add_argument("--project", default="transformers",
                    help="package(s) of the warm workload, comma-separated (torch; numpy,scipy)")
    ap.add_argument("--holdout", type=float, default=0.15)
    ap.add_argument("--train-tokens", type=int, default=7_600_000)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--stdlib-holdout", type=float, default=0.1)
    ap.add_argument("--stdlib-train-tokens", type=int, default=4_000_000)
    ap.add_argument("--stdlib-requests", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=800)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-ms", type=float, default=15.0)
    ap.add_argument("--contend", type=int, default=0, help="busy processes for a second run")
    ap.add_argument("--contend-warmup", action="store_true",
                    help="the busy processes run during the second daemon's warm-up too")
    ap.add_argument("--restart", action="store_true",
                    help="instead of the live daemon: warm, snapshot, wipe shm, replay on a "
                         "fresh daemon restored from the snapshot (with --contend N beside it)")
    ap.add_argument("--without-image", action="store_true",
                    help="with --restart: remove the hot image from the restored table, so the "
                         "fresh daemon rebuilds its hot tier from an empty one (the rebuild that "
                         "must not starve, timed with --contend N)")
    ap.add_argument("--starts", type=int, default=1,
                    help="--restart: start the restored table this many times, each with its shm "
                         "dir empty (the times to the first hot draft: median, all); the last "
                         "start serves the replay")
    ap.add_argument("--cold-starts", type=int, default=0,
                    help="--restart: more starts, each after emptying the page cache as a "
                         "reboot does (root), alternating with the others")
    ap.add_argument("--no-suffix", action="store_true", help="skip SuffixDecoding")
    ap.add_argument("--quick", action="store_true",
                    help="1.5M warm tokens and 40 requests; stdlib 500k and 20")
    ap.add_argument("--dir", help="work directory (default: a temp dir under ./var)")
    args = ap.parse_args(argv)
    if args.without_image and not args.restart:
        ap.error("--without-image needs --restart (it removes the image from the restored table)")
    if (args.starts != 1 or args.cold_starts) and not args.restart:
        ap.error("--starts and --cold-starts need --restart")
    if args.starts < 0 or args.cold_starts < 0 or args.starts + args.cold_starts < 1:
        ap.error("--starts and --cold-starts: at least one start")
    if args.quick:
        args.train_tokens, args.requests = 1_500_000, 40
        args.stdlib_train_tokens, args.stdlib_requests = 500_000, 20
    if not args.no_suffix:
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except ImportError:
            sys.exit("SuffixDecoding is not built here: make suffix-peer (or --no-suffix)")
    Path("var").mkdir(exist_ok=True)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-replay-", dir="var")).resolve()
    tok = data.qwen_tokenizer()
    fp = tokenizer_fingerprint(data.qwen_tokenizer_path())
    res: dict = {"machine": machine_info(("numpy", "numba", "rocksdict")),
                 "settings": {k: v for k, v in vars(args).items() if k != "dir"} | {
                     "k": K_DRAFT, "orders": [N_MIN, N_MAX]},
                 "workloads": {}}
    t0 = time.perf_counter()
    try:
        for name in args.workloads.split(","):
            if name == "warm":
                w = load_workload(args.project.replace(",", "-"),
                                  data.package_files(args.project.split(",")), tok,
                                  holdout=args.holdout, train_tokens=args.train_tokens,
                                  n_requests=args.requests, prompt=args.prompt,
                                  output=args.output, seed=args.seed)
            else:
                w = load_workload("stdlib", data.stdlib_files(), tok,
                                  holdout=args.stdlib_holdout,
                                  train_tokens=args.stdlib_train_tokens,
                                  n_requests=args.stdlib_requests, prompt=args.prompt,
                                  output=args.output, seed=args.seed)
            res["workloads"][w["name"]] = run_workload(w, args, root, fp)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    res["seconds"] = round(time.perf_counter() - t0)
    res["command"] = " ".join(["python", "bench/bench_replay.py", *(argv or sys.argv[1:])])
    OUT.mkdir(exist_ok=True)
    (OUT / "replay.json").write_text(json.dumps(res, indent=2, default=float))
    print(report(res))
    return 0


# ---------------------------------------------------------------------------------------------
def report(r: dict) -> str:
    lines = [f"machine: {r['machine']['cpu']}, {r['machine']['nproc']} cores; "
             f"{r['seconds']} s; k = {K_DRAFT}, {r['settings']['forward_ms']} ms a forward", ""]
    for name, w in r["workloads"].items():
        lines += _workload_lines(name, w) + [""]
    first = next(iter(r["workloads"].values()))
    lines += _target_lines(first)
    return "\n".join(lines)


def _workload_lines(name: str, w: dict) -> list[str]:
    wi, t = w["workload"], w["table"]
    ok = "passes" if w["check"] >= WORKLOAD_CHECK else "FAILS: this workload does not test the table"
    out = [f"== {name}: {wi['warm_tokens'] / 1e6:.1f}M warm-up tokens from {wi['warm_files']} of "
           f"{wi['files']} files -> {t['entries'] / 1e6:.1f}M entries; {wi['requests']} "
           f"held-out requests",
           f"workload check: all-in-RAM bound {w['ram_bound']['al']:.3f} / empty table "
           f"{w['empty_table']['al']:.3f} = {w['check']:.2f}x (>= {WORKLOAD_CHECK}x: {ok})",
           f"{'drafter':38s} {'AL':>6} {'accept':>7} {'drafted/step':>13}"]
    rows = [("generator path (defaults), idle", w.get("generator")),
            (f"generator path, --contend {w.get('generator_contended', {}).get('contend')}",
             w.get("generator_contended")),
            (f"restarted daemon, --contend {w.get('generator_restarted', {}).get('contend')}",
             w.get("generator_restarted")),
            ("SuffixDecoding", w.get("suffix_decoding")),
            ("HF prompt lookup", w["hf_prompt_lookup"]),
            ("all-in-RAM bound (local + all)", w["ram_bound"]),
            ("empty table (local only)", w["empty_table"])]
    for label, x in rows:
        if x:
            out.append(f"{label:38s} {x['al']:>6.3f} {x['acceptance']:>7.2f} "
                       f"{x['drafted_per_step']:>13.2f}")
    for key in ("generator", "generator_contended", "generator_restarted"):
        g = w.get(key)
        if not g:
            continue
        if "restart" in g:
            out += _restart_lines(g)
        h, a = g["warmed"]["hot"], g["after"]
        out.append(f"  {key}: link drops {g['link_drops']}, drafts with the link down "
                   f"{g['drafts_with_link_down']}; asks {g['daemon_asks']}; accepted by tier "
                   + ", ".join(f"{k} {v:.0%}" for k, v in sorted(g["accepted_share_by_tier"]
                                                                 .items())))
        out.append(f"    warm-up: ingest {g['warmed']['ingest_s']} s, hot generation "
                   f"{h['generation']} ready after {g['warmed']['ready_s']} s; "
                   f"{(h.get('sizing') or {}).get('why')}")
        rb = a.get("rebuilds") or {}
        out.append(f"    during the replay ({g['replay_s']} s): hot generation "
                   f"{h['generation']} -> {a['generation']}; rebuilds {rb.get('rebuilds')}, "
                   f"last {rb.get('last_cpu_s')} CPU-s, {rb.get('cpu_share_since_start', 0):.1%}"
                   f" of a core since start; stall log lines {g['stall_log_lines']}")
    sd = w.get("suffix_decoding")
    if sd:
        out.append(f"  SuffixDecoding warm-up: {sd['warm']}")
    return out


def _restart_lines(g: dict) -> list[str]:
    """What the restarted daemon's start cost, and whether the hot tier supplied drafts (a run
    where it supplied nothing is a failure, not a figure)."""
    r = g["restart"]
    out = [f"  restart: first hot draft {r['first_hot_draft_s']} s after the start, ready "
           f"(ping) {r['ready_s']} s, hot tier reflecting the whole table {r['full_hot_s']} s; "
           f"served from {r['source']} ({r['image']}); snapshot {r['snapshot_mib']} MiB, "
           f"image in it: {r['hot_image_in_snapshot']}"]
    for dropped, label in ((False, "page cache kept"), (True, "page cache dropped (a reboot)")):
        xs = [x for x in r.get("starts") or () if x.get("page_cache_dropped") == dropped]
        if xs:
            key = "first_hot_draft_median_cold_s" if dropped else "first_hot_draft_median_s"
            out.append(f"  {len(xs)} starts, {label}: first hot draft median {r[key]} s, each "
                       f"{[x['first_hot_draft_s'] for x in xs]} s; ready "
                       f"{[x['ready_s'] for x in xs]} s")
    if r.get("source") != "image":
        out.append(f"  the start's rebuild (no image): {r['full_hot_s']} s of wall time to a "
                   f"hot tier reflecting the table, build {r['build_s_when_full']} s, "
                   f"{r['start_build_cpu_s']} CPU-s")
    if not g["accepted_share_by_tier"].get("hot"):
        out.append("  FAILURE: the hot tier supplied no accepted token after the restart")
    return out


def _target_lines(w: dict) -> list[str]:
    g, b, gc, sd = w.get("generator"), w["ram_bound"], w.get("generator_contended"), \
        w.get("suffix_decoding")

    def row(fig, now, target):
        return f"| {fig} | {now} | {target} |"
    out = ["| figure (warm workload, one run) | measured | target |", "|---|---|---|"]
    if g:
        out.append(row("generator path at defaults vs the all-in-RAM bound, idle host",
                       f"{g['al'] / b['al']:.1%} ({g['al']:.3f} vs {b['al']:.3f})", ">= 97%"))
        binds = ((g["warmed"]["hot"].get("sizing") or {}).get("limit_binds"))
        out.append(row("all-hot generator path vs the all-in-RAM bound",
                       "= the row above: the default tier held every row that can change a "
                       "draft" if binds is False else "n/a: the hot limit binds here",
                       ">= 99%"))
    gr = w.get("generator_restarted")
    if gr:
        r = gr["restart"]
        label = f"first hot draft after a start with shm empty, --contend {gr['contend']}"
        if "starts" not in r:  # a file from before --starts: one start
            out.append(row(label, f"{r['first_hot_draft_s']} s", "<= 2 s"))
        for dropped in (False, True):
            xs = [x for x in r.get("starts") or () if x["page_cache_dropped"] == dropped]
            if xs:
                key = "first_hot_draft_median_cold_s" if dropped else "first_hot_draft_median_s"
                out.append(row(label + (f", median of {len(xs)} starts" if len(xs) > 1 else "")
                               + (", page cache dropped (a reboot)" if dropped else ""),
                               f"{r[key]} s", "<= 2 s"))
        out.append(row("restarted daemon vs the all-in-RAM bound",
                       f"{gr['al'] / b['al']:.1%} ({gr['al']:.3f} vs {b['al']:.3f})", ">= 97%"))
        if sd:
            out.append(row("restarted daemon vs SuffixDecoding", f"{gr['al'] / sd['al']:.3f}x",
                           ">= 1.02x"))
    if g and gc:
        out.append(row(f"the same with --contend {gc['contend']} vs idle",
                       f"{gc['al'] / g['al']:.1%}, {gc['link_drops']} link drops",
                       ">= 95%, 0 link drops"))
    if g and sd:
        out.append(row("generator path vs SuffixDecoding", f"{g['al'] / sd['al']:.3f}x "
                       f"({g['al']:.3f} vs {sd['al']:.3f})", ">= 1.02x"))
    for x, label in ((g, "idle"), (gc, "contended")):
        if x:
            mins = max(x["replay_s"], 1) / 60
            out.append(row(f"stall log lines, {label} run", f"{x['stall_log_lines']} in "
                           f"{mins + x['warmed']['ready_s'] / 60:.1f} min", "<= 1 a minute"))
    return out


if __name__ == "__main__":
    sys.exit(main())
