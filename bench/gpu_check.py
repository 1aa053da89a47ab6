"""Verify cost on a CUDA GPU, and the draft lengths it implies (issue 17, "Where a CUDA device is
available").

ARCHITECTURE §8.5: verifying k draft tokens is nearly free on a GPU at batch 1 but not on a CPU,
and the draft length is chosen from the verify cost measured on the running hardware.  This
script measures that cost where the product is meant to run: a random-weight model of
**Qwen3-4B's shape** (no weights needed: the cost of a forward does not depend on the values),
bf16, at batch 1 and 8 (``--batches``: rows per step, each row verifying the same n tokens, as
in a vLLM step), on the transformers generator's own code path:

* attention as the loader chooses it (``choose_attention``: ``sdpa``, and ``flash_attention_2``
  where ``flash_attn`` imports; why not is recorded), the model checked with
  ``check_cache_croppable`` like every loaded model;
* after a prefill of ``--contexts`` tokens a row (800, a typical prompt, and 4096, a long
  one), a forward over n new tokens a row with the KV cache (``spec.forward``,
  ``logits_to_keep=n`` as in a verify step), the cache cut back after each
  (``spec.crop_cache``), for n = 1 (a plain decode step) up to 33 (a 32-token draft plus the
  token before it);
* sizes round-robin, like ``Generator.calibrate``, one untimed round first; each forward timed
  with ``perf_counter`` around the forward and ``torch.cuda.synchronize`` (what ``calibrate``
  feeds the policy) and, on CUDA, with CUDA events too; medians of ``--repeats``.

Then every wall-clock sample goes into ``StepCost`` (as a step of batch × n tokens) and
``DraftLengthPolicy`` (generator/policy/) as ``calibrate`` feeds them, and the policy chooses,
with ``choose_batch`` over ``batch`` rows that each drafted the same draft, how many tokens to
verify for a few drafts (8 tokens at share 0.9, 0.6 and 0.3; 16 and 32 tokens at 0.95; one
falling 0.9 → 0.3), each token accepted with probability its share: ``fresh`` is a new
request's choice (acceptance estimated as 0.7 × share, the policy's prior), ``known`` the choice
once the acceptance is known to equal the share.  For each, ``true_speedup`` is the expected
tokens per second over plain decoding's with the true acceptance, against ``true_full``
(every row verifies its whole draft) and ``oracle_speedup``: a policy that knows how many
tokens the rows will accept and verifies what pays most on the same cost curve (usually
exactly those), the bound a length policy is judged against; ``vs_oracle`` is the ratio.

Prints a table per run and writes JSON (``--out``, default bench/out/gpu_check.json), rewritten
after every run, so a command stopped at its limit still leaves what it measured: versions of
torch, CUDA and transformers, the GPU's name and memory, whether flash_attn imported (and why
not), per run (attention, context, batch) the prefill time, peak memory, per n the medians and
samples (ms) and the ratio cost(n)/cost(1), and the policy's choices.  ``--budget-s`` (default 240 s) stops starting runs
once spent, so the whole script stays under 5 minutes on the device machine.

Here (no GPU; a tiny Qwen3: seconds, most of them imports; tests/test_gpu_check.py runs it)::

    .venv/bin/python bench/gpu_check.py --cpu --tiny

On the device machine (an NVIDIA H200, through the device tool's ``run``).  It is bare and
reaches no registry, so nothing can be ``pip install``-ed there from the network: its image's
``python3`` has torch, numpy, numba and accelerate (the device notes read torch 2.11.0+cu130
there in 2026-11), but transformers 5.17 where pyproject asks for >= 5.24.  So download here,
once, from the repository root, the transformers wheel and regex's (transformers 5.24 checks
regex >= 2025.10.22 at import) into ``.whl/`` (ignored by git; 14 MB)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 regex

then call ``run`` with ``carry=[".whl"]``, ``timeout_s=420`` and the command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT/gpu_check.json

(the repository is copied there, not installed: the script then imports the generator from the
checkout).  flash-attn has no binary wheel on PyPI (an sdist whose build compiles its CUDA
kernels for a long time and first tries a download from GitHub), so unless a wheel built for
that torch and CUDA is carried too, the flash_attention_2 rows are skipped with that reason.
Without the carried wheels the script still runs, on transformers 5.17, and records the version.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "out" / "gpu_check.json"


def _import_generator() -> str:
    """Make ``ngram_generator`` importable: the installed package, else this checkout's
    ``generator/`` (the device machine gets the repository copied, not installed).  Returns
    which ("installed" or "checkout")."""
    if importlib.util.find_spec("ngram_generator") is not None:
        return "installed"
    sys.path.insert(0, str(ROOT))  # ngramd/ sits at the root under its own name
    spec = importlib.util.spec_from_file_location(
        "ngram_generator", ROOT / "generator" / "__init__.py",
        submodule_search_locations=[str(ROOT / "generator")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ngram_generator"] = module
    spec.loader.exec_module(module)
    return "checkout"


GENERATOR_SOURCE = _import_generator()
from machine import machine_info  # noqa: E402  (bench/ is on sys.path: run as a script)
from ngram_generator.drafting import Draft  # noqa: E402
from ngram_generator.policy import AcceptanceModel, DraftLengthPolicy, StepCost  # noqa: E402
from ngram_generator.model import (ModelLoadError, check_cache_croppable,  # noqa: E402
                                   choose_attention, choose_device, choose_dtype,
                                   default_threads, flash_attn_available, set_threads)
from ngram_generator.spec import crop_cache, forward, new_cache  # noqa: E402

log = logging.getLogger("gpu_check")

#: Qwen3-4B's shape, from its config.json (huggingface.co/Qwen/Qwen3-4B, config.json: 726 bytes;
#: the same values stand in the config.json of fine-tunes that name Qwen/Qwen3-4B as their base,
#: e.g. huggingface.co/ngocbh/TrimKV-Qwen3-4B-Math): Qwen3ForCausalLM, hidden_size 2560,
#: intermediate_size 9728, num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8,
#: head_dim 128, vocab_size 151936, tie_word_embeddings true, rope_theta 1000000,
#: max_position_embeddings 40960, rms_norm_eps 1e-06, attention_bias false, no sliding window
#: (max_window_layers 36).  Qwen3-4B-Instruct-2507 differs in rope_theta 5e6 and 262144
#: positions, which change no cost measured here.  About 4.0B parameters, 8 GB in bf16.
QWEN3_4B = dict(
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960,
    rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False, max_window_layers=36,
    bos_token_id=151643, eos_token_id=151645)
#: the same architecture, small enough for a CPU test in seconds
TINY = dict(QWEN3_4B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
            max_window_layers=2, bos_token_id=1, eos_token_id=2)

#: forward sizes: n = 1 is a plain decode step; k + 1 verifies a k-token draft (k = 1..32)
SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)
#: rows per step: 1 (``ngram-generate``) and 8 (a vLLM batch: every row verifies n tokens)
BATCHES = (1, 8)
ATTENTIONS = ("sdpa", "flash_attention_2")
#: drafts the policy is asked about: name -> per-token share (the table's own estimate)
PROFILES = {
    "8 @ 0.9": [0.9] * 8,
    "8 @ 0.6": [0.6] * 8,
    "8 @ 0.3": [0.3] * 8,
    "8 falling 0.9-0.3": [0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3],
    "16 @ 0.95": [0.95] * 16,
    "32 @ 0.95": [0.95] * 32,
}
PROFILE_ORDER = 8  # the order the drafted tokens are said to come from (a fresh policy: no effect)
PINNED_TRANSFORMERS = (5, 24)  # pyproject's transformers>=5.24


# -------------------------------------------------------------------------------------------
# the environment
# -------------------------------------------------------------------------------------------
def flash_attn_state() -> dict:
    """Whether flash_attn imports (``model.flash_attn_available``), its version, and why not."""
    if flash_attn_available():
        import flash_attn

        return {"imported": True, "version": getattr(flash_attn, "__version__", None),
                "reason": None}
    if importlib.util.find_spec("flash_attn") is None:
        reason = ("flash_attn is not installed (PyPI has only its sdist, whose build compiles "
                  "CUDA kernels for a long time and first downloads a wheel from GitHub; a "
                  "machine without a registry needs a wheel built for its torch and CUDA "
                  "carried in)")
    else:
        try:
            import flash_attn  # noqa: F401
            reason = "flash_attn imported on a second try"  # not expected; say so
        except Exception as e:  # what flash_attn_available logged
            reason = f"flash_attn is installed but does not import: {type(e).__name__}: {e}"
    return {"imported": False, "version": None, "reason": reason}


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device) -> dict:
    """Versions, the device and its memory, flash_attn's state, the host (bench/machine.py)."""
    import transformers

    env = {"generator_source": GENERATOR_SOURCE, "torch": torch.__version__,
           "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "transformers_pinned": ">=%d.%d" % PINNED_TRANSFORMERS,
           "flash_attn": flash_attn_state(),
           "machine": machine_info(("numpy", "numba", "accelerate"))}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count, gpu_memory_bytes=total,
                   gpu_memory_free_bytes=free, cudnn=torch.backends.cudnn.version(),
                   driver=_driver_version())
    else:
        env.update(device_name="cpu", torch_threads=torch.get_num_threads())
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < PINNED_TRANSFORMERS:
        log.warning("transformers %s is older than pyproject's %s: measured anyway (carry the "
                    "wheel, see the docstring)", transformers.__version__,
                    env["transformers_pinned"])
    return env


# -------------------------------------------------------------------------------------------
# the model and the measurement
# -------------------------------------------------------------------------------------------
def build_model(shape: dict, device: torch.device, dtype: torch.dtype, attn: str):
    """A random-weight Qwen3 of ``shape``, made on ``device`` (a 4B model is never built on the
    host first), checked like a loaded checkpoint (``check_cache_croppable``)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.to(device)
    model.eval()
    check_cache_croppable(model)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, float | None]:
    """``(wall seconds, CUDA-event seconds or None)`` of ``fn()``; the wall time ends after
    ``torch.cuda.synchronize``, as in ``Generator.calibrate``."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t, None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - t
    return wall, start.elapsed_time(end) / 1e3


@torch.inference_mode()
def measure(model, device: torch.device, context: int, sizes, repeats: int,
            batch: int = 1) -> dict:
    """Prefill ``batch`` rows of ``context`` random tokens, then time a forward over n new
    tokens a row for each n in ``sizes`` (a step of ``batch * n`` tokens), round-robin,
    ``repeats`` timed rounds after one untimed one, cutting the cache back to ``context`` after
    each.  Returns seconds: ``prefill``, ``wall[n]``, ``event[n]``."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(vocab, (batch, context), generator=gen).to(device)
    step = torch.randint(vocab, (batch, max(sizes)), generator=gen).to(device)
    forward(model, ids, new_cache(model), 1)  # untimed: first forwards allocate, pick kernels
    _sync(device)
    cache = new_cache(model)
    prefill, _ = timed(lambda: forward(model, ids, cache, 1), device)
    wall: dict[int, list[float]] = {n: [] for n in sizes}
    event: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            w, e = timed(lambda: forward(model, step[:, :n], cache, n), device)
            crop_cache(cache, context)
            if cache.get_seq_length() != context:
                raise RuntimeError(f"cache holds {cache.get_seq_length()} positions after a "
                                   f"crop to {context}")
            if r:
                wall[n].append(w)
                if e is not None:
                    event[n].append(e)
    return {"prefill": prefill, "wall": wall, "event": event}


def _ms(samples: list[float]) -> dict | None:
    if not samples:
        return None
    a = np.asarray(samples) * 1e3
    return {"median": round(float(np.median(a)), 4), "min": round(float(a.min()), 4),
            "max": round(float(a.max()), 4), "samples": [round(float(x), 4) for x in a]}


# -------------------------------------------------------------------------------------------
# what the costs imply
# -------------------------------------------------------------------------------------------
def wall_seconds(wall_ms: dict) -> dict[int, list[float]]:
    """A run's written wall-clock samples (``_ms``: milliseconds, rounded) back in seconds.
    The policy's columns are computed from these, in a run as in ``--reanalyse``, so that a
    choice on the edge between two lengths does not flip on the rounding (a CI run once got
    3 tokens from the run's own samples and 4 from the file's)."""
    return {int(n): [x / 1e3 for x in w["samples"]] for n, w in wall_ms.items()}


def cost_model(wall: dict[int, list[float]], device_type: str = "cuda",
               batch: int = 1) -> StepCost:
    """A ``StepCost`` fed every sample as a step of ``batch * n`` tokens, round-robin as
    ``Generator.calibrate`` feeds the policy's (samples of one repeat are close in time)."""
    cost = StepCost.for_device(device_type)
    for r in range(max(len(v) for v in wall.values())):
        for n, samples in wall.items():
            if r < len(samples):
                cost.observe(batch * n, samples[r], batch)
    cost.relative([1])  # fitted now
    return cost


def _speedup(cost: StepCost, rates, counts) -> tuple[float, float]:
    """(expected tokens per row and step, tokens per second over plain decoding's) for a step
    whose rows verify the first ``counts[i]`` tokens of a draft whose tokens are accepted with
    ``rates`` (given the ones before were), as ``DraftLengthPolicy.choose_batch`` estimates
    them."""
    chain = np.concatenate([[0.0], np.cumsum(np.cumprod(rates))])
    rows = len(counts)
    expected = rows + float(sum(chain[k] for k in counts))
    rel = cost.relative(np.array([rows, rows + sum(counts)]))
    return expected / rows, expected / rows * float(rel[0] / rel[1])


def accepted_distribution(rates, rows: int) -> np.ndarray:
    """P(the ``rows`` rows accept ``s`` draft tokens in all), s = 0 .. rows * len(rates): each
    row accepts a leading run of its draft, token i with probability ``rates[i]`` given the ones
    before were, independently of the other rows."""
    rates = np.asarray(rates, np.float64)
    reach = np.concatenate([[1.0], np.cumprod(rates)])  # P(a >= j), j = 0 .. k
    one = reach - np.concatenate([reach[1:], [0.0]])  # P(a == j)
    dist = np.ones(1)
    for _ in range(rows):
        dist = np.convolve(dist, one)
    return dist


def oracle_speedup(cost: StepCost, rates, rows: int) -> float:
    """Tokens per second over plain decoding's of the oracle policy, which knows each step's
    outcome (``s`` draft tokens accepted over the rows, distributed as
    ``accepted_distribution``, computed exactly) and verifies the number ``v`` of tokens that
    gives most tokens per unit cost: ``rows + min(v, s)`` tokens at cost ``f(rows + v)``.
    Usually ``v = s`` (every verified token accepted); fewer where the cost rises more than a
    token's worth, more where the measured curve dips.  No policy that must choose before the
    outcome does better on the same curve: the bound a length policy is judged against."""
    dist = accepted_distribution(rates, rows)
    tokens = rows + np.arange(len(dist))
    rel = cost.relative(tokens)
    fewer = np.maximum.accumulate(tokens / rel)  # best v <= s
    cheapest = np.minimum.accumulate(rel[::-1])[::-1]  # the cheapest step of v >= s tokens
    best = np.maximum(fewer, tokens / cheapest)
    return float(dist @ best * rel[0] / rows)


def policy_choices(cost: StepCost, profiles: dict = PROFILES, batch: int = 1) -> list[dict]:
    """Per profile, how many tokens ``DraftLengthPolicy`` verifies in a step of ``batch`` rows
    that each drafted it, on a fresh request (acceptance prior: ``prior_scale`` × share) and
    with the acceptance known to equal the share: ``k`` (tokens a row, mean), ``counts`` (per
    row), ``speedup`` by the policy's own estimates, ``true_speedup`` with the true acceptance
    (the share), against ``true_full`` (every row verifies its whole draft) and
    ``oracle_speedup``."""
    rows = []
    for name, shares in profiles.items():
        k = len(shares)
        true = np.asarray(shares, np.float64)
        draft = Draft(np.zeros(k, np.int64), np.full(k, PROFILE_ORDER, np.int64),
                      np.zeros(k, np.int64), np.asarray(shares, np.float32))
        oracle = oracle_speedup(cost, true, batch)
        row = {"profile": name, "shares": shares, "batch": batch,
               "true_full": round(_speedup(cost, true, [k] * batch)[1], 4),
               "oracle_speedup": round(oracle, 4)}
        for label, policy in (
                ("fresh", DraftLengthPolicy(cost, probe_every=0)),
                ("known", DraftLengthPolicy(cost, AcceptanceModel(prior_scale=1.0),
                                            probe_every=0))):
            rates = policy.model.predict(policy.model.features(draft))
            counts = [int(c) for c in policy.choose_batch([draft] * batch)]
            expected, speedup = _speedup(cost, rates, counts)
            _, full = _speedup(cost, rates, [k] * batch)
            _, true_speedup = _speedup(cost, true, counts)
            row[label] = {"k": round(sum(counts) / batch, 4), "counts": counts,
                          "first_rate": round(float(rates[0]), 4),
                          "expected_tokens": round(expected, 4), "speedup": round(speedup, 4),
                          "speedup_full": round(full, 4),
                          "true_speedup": round(true_speedup, 4),
                          "vs_oracle": round(true_speedup / oracle, 4)}
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------------
# one run, the tables, the file
# -------------------------------------------------------------------------------------------
def run_one(model, device: torch.device, attn: str, context: int, sizes, repeats: int,
            batch: int = 1) -> dict:
    """Measure one (attention, context, batch) and what the policy makes of it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    got = measure(model, device, context, sizes, repeats, batch)
    wall, event = got["wall"], got["event"]
    base = float(np.median(wall[sizes[0]]))
    wall_ms = {str(n): _ms(wall[n]) for n in sizes}
    run = {"attn_requested": attn,
           "attn_ran": getattr(model.config, "_attn_implementation", None) or attn,
           "context": context, "batch": batch, "repeats": repeats,
           "prefill_ms": round(got["prefill"] * 1e3, 4),
           "wall_ms": wall_ms,
           "event_ms": {str(n): _ms(event[n]) for n in sizes} if device.type == "cuda" else None,
           "ratio": {str(n): round(float(np.median(wall[n])) / base, 4) for n in sizes},
           "policy": policy_choices(cost_model(wall_seconds(wall_ms), device.type, batch),
                                    batch=batch)}
    if device.type == "cuda":
        run["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    return run


def print_run(run: dict) -> None:
    peak = run.get("peak_memory_bytes")
    extra = f", peak {peak / 2**30:.2f} GiB" if peak else ""
    print(f"\n{run['attn_ran']}, context {run['context']}, batch {run['batch']} (n tokens a "
          f"row): prefill {run['prefill_ms']:.2f} ms{extra}, medians of {run['repeats']}")
    print(f"{'n':>4} {'wall ms':>9} {'event ms':>9} {'x n=1':>7}")
    for n, w in run["wall_ms"].items():
        e = (run["event_ms"] or {}).get(n)
        ev = f"{e['median']:9.3f}" if e else f"{'-':>9}"
        print(f"{n:>4} {w['median']:9.3f} {ev} {run['ratio'][n]:7.3f}")
    print("x plain with the true acceptance (the share); k: tokens verified a row (mean)")
    print(f"{'draft':<18} {'fresh k':>7} {'x':>6} {'known k':>7} {'x':>6} {'full':>6} "
          f"{'oracle':>6} {'known/oracle':>12}")
    for row in run["policy"]:
        f, k = row["fresh"], row["known"]
        print(f"{row['profile']:<18} {f['k']:>7.2f} {f['true_speedup']:6.2f} {k['k']:>7.2f} "
              f"{k['true_speedup']:6.2f} {row['true_full']:6.2f} {row['oracle_speedup']:6.2f} "
              f"{k['vs_oracle']:12.3f}")


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (tests; no CUDA needed)")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of Qwen3-4B's shape")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file to write")
    p.add_argument("--attn", action="append", choices=ATTENTIONS,
                   help="attention implementation(s) to measure (default: both)")
    p.add_argument("--contexts", type=int, nargs="+",
                   help="prefill lengths, tokens (default 800 4096; --tiny: 32 128)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="forward sizes n, tokens (n = k + 1 verifies a k-token draft)")
    p.add_argument("--batches", type=int, nargs="+",
                   help="rows per step (default 1 8; --tiny: 1 2)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 15; --tiny: 3)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: every usable core)")
    p.add_argument("--reanalyse", type=Path, metavar="JSON",
                   help="measure nothing: recompute the policy's choices from the samples of "
                        "an earlier run's JSON (here, no GPU needed) and write them to --out")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="start no run after this many seconds (the device allows 5 minutes)")
    args = p.parse_args(argv)
    args.contexts = args.contexts or ([32, 128] if args.tiny else [800, 4096])
    args.repeats = args.repeats or (3 if args.tiny else 15)
    args.batches = sorted(set(args.batches or ((1, 2) if args.tiny else BATCHES)))
    args.sizes = sorted(set(args.sizes))
    if args.sizes[0] != 1 or min(args.contexts) < 1 or args.repeats < 1 or args.batches[0] < 1:
        p.error("--sizes must include 1 (the plain step every ratio is against); contexts, "
                "batches and repeats must be >= 1")
    return args


def reanalyse(source: Path, out: Path) -> int:
    """The policy's choices recomputed, with this checkout's policy, from the wall-clock
    samples an earlier run measured (``--reanalyse``)."""
    report = json.loads(source.read_text())
    report.update(reanalysed_from=str(source), reanalysed_with=machine_info(())["git_commit"])
    for run in report["runs"]:
        run.setdefault("batch", 1)
        run["policy"] = policy_choices(cost_model(wall_seconds(run["wall_ms"]), report["device"],
                                                  run["batch"]),
                                       batch=run["batch"])
        print_run(run)
    write(report, out)
    print(f"\n{len(report['runs'])} runs reanalysed from {source}; wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse, args.out)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.perf_counter()
    try:
        device = torch.device("cpu") if args.cpu else choose_device("cuda")
        dtype = choose_dtype(device, args.dtype)
    except ModelLoadError as e:
        print(f"gpu_check: {e} (use --cpu to run without CUDA)", file=sys.stderr)
        return 2
    if device.type == "cpu":
        set_threads(args.threads or default_threads(False))
    shape = TINY if args.tiny else QWEN3_4B
    report = {"script": "bench/gpu_check.py", "command": sys.argv, "device": device.type,
              "tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."),
              "model": {"shape": "tiny Qwen3" if args.tiny else "Qwen3-4B", "config": shape},
              "sizes": args.sizes, "contexts": args.contexts, "batches": args.batches,
              "repeats": args.repeats,
              "profiles": PROFILES, **environment(device), "runs": [], "skipped": [],
              "errors": []}
    write(report, args.out)
    for attn in args.attn or ATTENTIONS:
        if time.perf_counter() - t0 > args.budget_s:
            report["skipped"].append({"attn": attn,
                                      "reason": f"over the {args.budget_s:.0f} s budget"})
            continue
        try:
            choose_attention(device, attn)
        except ModelLoadError as e:
            why = "no CUDA (--cpu)" if device.type != "cuda" else report["flash_attn"]["reason"]
            report["skipped"].append({"attn": attn, "reason": f"{e} [{why}]"})
            log.info("skipping %s: %s", attn, why)
            continue
        try:
            model = build_model(shape, device, dtype, attn)
        except Exception as e:  # a failed build (e.g. flash-attn vs this transformers) is a row
            log.exception("building the model with %s failed", attn)
            report["errors"].append({"attn": attn, "error": f"{type(e).__name__}: {e}"})
            continue
        report["model"]["parameters"] = sum(p.numel() for p in model.parameters())
        for context, batch in ((c, b) for b in args.batches for c in args.contexts):
            if time.perf_counter() - t0 > args.budget_s:
                report["skipped"].append({"attn": attn, "context": context, "batch": batch,
                                          "reason": f"over the {args.budget_s:.0f} s budget"})
                continue
            try:
                run = run_one(model, device, attn, context, args.sizes, args.repeats, batch)
            except Exception as e:  # e.g. out of memory: keep the other runs
                log.exception("%s at context %d, batch %d failed", attn, context, batch)
                report["errors"].append({"attn": attn, "context": context, "batch": batch,
                                         "error": f"{type(e).__name__}: {e}"})
                continue
            report["runs"].append(run)
            report["elapsed_s"] = round(time.perf_counter() - t0, 2)
            write(report, args.out)
            print_run(run)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    write(report, args.out)
    for s in report["skipped"]:
        print(f"skipped: {s}")
    for e in report["errors"]:
        print(f"error: {e}")
    print(f"\n{len(report['runs'])} runs in {report['elapsed_s']:.1f} s; wrote {args.out}")
    return 0 if report["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
