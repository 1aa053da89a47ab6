"""Shared fixtures: a real ``ngramd`` subprocess with its own RocksDB dir, runtime dir and shm
dir (under /dev/shm, removed afterwards).

    def test_x(daemon):                 # a running daemon, one per test
        with daemon.client() as c: ...
    def test_y(start_daemon):           # start your own, with config overrides
        d = start_daemon(server={"max_batch": 4})
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ngram_client.cli import default_tokenizer_path

START_TIMEOUT_S = 120  # first start compiles numba kernels into the cache

# tests/vllm runs in vLLM's own environment (make test runs it there with NGRAM_VLLM_TESTS=1);
# this environment has no vLLM to import
collect_ignore = [] if os.environ.get("NGRAM_VLLM_TESTS") == "1" else ["vllm"]


QWEN3_TOKENIZER = default_tokenizer_path()  # the packaged Qwen3 tokenizer.json, or None


def _toml(d: dict, section: str = "") -> str:
    scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
    subs = {k: v for k, v in d.items() if isinstance(v, dict)}
    out = [f"[{section}]"] if section and scalars else []
    out += [f"{k} = {json.dumps(v)}" for k, v in scalars.items()]
    for k, v in subs.items():
        out.append(_toml(v, f"{section}.{k}" if section else k))
    return "\n".join(out) + "\n"


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


class Daemon:
    """One ngramd subprocess; ``restart()`` reuses its config (and so its data).
    ``launcher``: what runs instead of ``-m ngramd.service`` (a test's patched daemon, as
    tests/slow_counting.py); set it to None before a ``start()`` for the real one again."""

    def __init__(self, root: Path, config: dict, name: str, env: dict | None = None,
                 launcher: list[str] | None = None):
        self.root = root
        self.extra_env = env or {}
        self.launcher = launcher
        self.config_path = root / f"{name}.toml"
        self.config_path.write_text(_toml(config))
        self.config = config
        self.endpoint = config["server"]["endpoints"][0]
        self.shm_dir = Path(config["table"]["shm_dir"])
        self.log_path = root / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> "Daemon":
        env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("NOTIFY_SOCKET", None)  # never talk to a real systemd from a test
        env.update(self.extra_env)
        self._log = open(self.log_path, "ab")
        run = self.launcher or ["-m", "ngramd.service"]
        self.proc = subprocess.Popen([sys.executable, *run, "--config", str(self.config_path)],
                                     cwd=self.root, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        from ngram_client import DaemonUnavailable, NgramClient

        deadline = time.monotonic() + timeout_s
        with NgramClient(self.endpoint, timeout_ms=500, retries=0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ngramd exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    c.ping()
                    return
                except DaemonUnavailable:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"ngramd not ready in {timeout_s} s:\n{self.log()}")

    def client(self, **kw):
        from ngram_client import NgramClient

        kw.setdefault("timeout_ms", 10_000)
        return NgramClient(self.endpoint, **kw)

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 60) -> int:
        """Send ``sig`` and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> "Daemon":
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class DaemonFactory:
    """Starts daemons under ``root`` with the small test settings plus ``overrides``
    (``start(table={...}, server={...})``); ``close()`` kills leftovers and removes shm dirs."""

    def __init__(self, root: Path):
        self.root = root
        self.started: list[Daemon] = []

    def start(self, name: str = "t", wait: bool = True, env: dict | None = None,
              launcher: list[str] | None = None, **overrides) -> Daemon:
        shm = Path("/dev/shm") / f"ngramd-test-{uuid.uuid4().hex[:10]}"
        base = {
            "table": {"name": name, "data_dir": str(self.root / "data"), "shm_dir": str(shm),
                      "tokenizer": str(QWEN3_TOKENIZER or ""),
                      "hot_budget_mb": 1.0, "hot_rebuild_s": 0.0, "hot_grace_s": 0.5,
                      "cold": {"block_cache_mb": 8, "write_buffer_mb": 8, "read_threads": 2}},
            "server": {"endpoints": [f"ipc://{self.root}/run/{name}.sock"],
                       "runtime_dir": str(self.root / "run"), "log_level": "INFO",
                       "drain_s": 5.0},
        }
        d = Daemon(self.root, _merge(base, overrides), name, env, launcher)
        self.started.append(d)
        return d.start(wait=wait)

    def close(self) -> None:
        for d in self.started:
            if d.proc is not None and d.proc.poll() is None:
                d.kill()
            shutil.rmtree(d.shm_dir, ignore_errors=True)


@pytest.fixture
def start_daemon(tmp_path):
    """``start_daemon(table={...}, server={...}, env={...}, launcher=[...])`` -> a started
    ``Daemon``."""
    f = DaemonFactory(tmp_path)
    yield f.start
    f.close()


@pytest.fixture
def daemon(start_daemon) -> Daemon:
    """A running daemon with the default test settings, one per test."""
    return start_daemon()


def _factory(tmp_path_factory):
    f = DaemonFactory(tmp_path_factory.mktemp("ngramd"))
    yield f
    f.close()


@pytest.fixture(scope="module")
def daemon_factory(tmp_path_factory) -> DaemonFactory:
    """A ``DaemonFactory`` for a whole module: its daemons live until the module ends."""
    yield from _factory(tmp_path_factory)


@pytest.fixture(scope="session")
def session_daemon_factory(tmp_path_factory) -> DaemonFactory:
    """A ``DaemonFactory`` whose daemons live until the run ends (for fixtures that start
    early, like tests/vllm's ``serve_pair``)."""
    yield from _factory(tmp_path_factory)


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory) -> Daemon:
    """One running daemon shared by a test module (tests must tolerate each other's data)."""
    f = DaemonFactory(tmp_path_factory.mktemp("ngramd"))
    yield f.start()
    f.close()


@pytest.fixture
def shm_dir():
    """A /dev/shm directory of the test's own for a table's hot tier, removed after it."""
    d = Path("/dev/shm") / f"ngramd-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_table(tmp_path, shm_dir):
    """``make(**table_config)``: an in-process ``Table`` named "t" (Qwen3's vocabulary, no
    scheduled hot rebuild, data under ``tmp_path/data``, hot tier in ``shm_dir``, each
    overridable), closed after the test."""
    from ngramd.config import TableConfig  # not at import: tests/vllm load this file too
    from ngramd.table import Table

    made = []

    def make(**kw):
        kw.setdefault("hot_rebuild_s", 0)
        kw.setdefault("data_dir", str(tmp_path / "data"))
        kw.setdefault("shm_dir", str(shm_dir))
        t = Table(TableConfig(name="t", vocab_size=151_936, **kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


#: the files that take longest, in that order (``--durations`` on 2 cores: the README
#: walk-through ~2 min beside its spinning process, the model cache's three GGUF conversions
#: ~2.4 min, the fault and fleet files ~1-2 min each).  They go first, so on xdist the longest
#: start at once and the many short files fill the other workers around them; taken last (xdist
#: orders files by test count), the walk-through alone ran 10 min after everything else ended.
LONGEST_FIRST = ("test_readme.py", "test_model_cache.py", "test_reliability.py",
                 "test_faults_recovery.py", "test_fleet.py", "test_cold.py", "test_generator.py",
                 "test_server.py", "test_tools.py", "test_client_cli.py", "test_hotimage.py")


def pytest_collection_modifyitems(config, items):
    """The files of ``LONGEST_FIRST`` first, in its order; the rest as collected (stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    """With xdist (``-n N``): files are handed out in the collected order (``LONGEST_FIRST``),
    not xdist's by-test-count order; and numba's cache is filled once in the controller, before
    the workers start: each worker's ``numba_cache`` below then loads what this compiled.  Left
    to the workers, every one of them compiled every kernel at the same time (~90 s each on 2
    cores in a 2-worker run, against ~27 s for one compile alone)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    config.option.loadscopereorder = False
    subprocess.run([sys.executable, str(Path(__file__).with_name("numba_warm.py"))], check=True)


@pytest.fixture(scope="session", autouse=True)
def numba_cache(tmp_path_factory):
    """Every kernel compiled (or loaded from numba's cache) once, before the first test, so no
    daemon of the run compiles under a test's deadline (tests/numba_warm.py)."""
    from numba_warm import warm

    warm(tmp_path_factory.mktemp("numba-warm"), str(QWEN3_TOKENIZER or ""))


MODEL_CACHE = "model-cache"  # the run's converted-checkpoint cache, under its base temp dir


def _run_root(tmp_path_factory) -> Path:
    """The run's base temp dir: an xdist worker's parent (the controller's), shared by all
    the workers of a run; without xdist, the basetemp itself."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """One converted-checkpoint cache (``ngram_generator.modelcache``) for the whole run, never
    the user's ``~/.cache``: the embedded SmolLM2 GGUF is converted by the first test that loads
    it (~17 s) and read in under a second by every later load, subprocesses included (the
    README walk-through's two ``ngram-generate`` runs).  Shared by the xdist workers of one
    run (their basetemps' parent): a worker that misses while another converts waits for its
    entry (``modelcache.converting``), so the run converts once.  The tests of the cache itself
    set ``$NGRAM_MODEL_CACHE`` to a directory of their own.

    The run's other Flash Nest caches (tokenizer fingerprints, one small file per tokenizer
    file a test writes: ~25 a run) go beside it through ``$CACHE_DIRECTORY``, so a run adds
    nothing to the user's ``~/.cache``; tests of the cache location set their own.

    The cache is removed when the run ends, passed or failed (``pytest_sessionfinish``): pytest
    keeps a failed run's base temp dir, and a kept failure must cost megabytes, not the 517 MB
    converted checkpoint."""
    run = _run_root(tmp_path_factory)
    root = run / MODEL_CACHE
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NGRAM_MODEL_CACHE", str(root))
        mp.setenv("CACHE_DIRECTORY", str(run / "flash-nest-cache"))
        yield root


@pytest.fixture(scope="session")
def smol_checkpoint(model_cache) -> Path:
    """The embedded SmolLM2 as one safetensors directory for the whole run, read-only: the
    run's model-cache entry of its GGUF, converted by the first worker that asks (the others
    wait for it, ``modelcache.converting``) and read by every test and subprocess that loads
    the default model.  Tests never copy it: what they need to change (the cache's own tests)
    they make themselves.  Read-only (files 0444, directory 0555), so a test that tried to
    write into it fails rather than changing the others' model (root is not stopped)."""
    from ngram_generator import modelcache as mc
    from ngram_generator.model import default_model, load_model

    directory, name = default_model()
    key = mc.source_key(Path(directory) / name)
    entry = mc.entry_dir(model_cache, key)
    if not mc.valid_entry(entry, key):
        lm = load_model(None, threads=1)  # converts and writes it, or reads another's
        assert lm.cache_entry == str(entry), (lm.source, lm.cache_entry, entry)
        del lm
    for p in entry.iterdir():
        p.chmod(0o444)
    entry.chmod(0o555)
    return entry


def _remove_writable(path: Path) -> None:
    """``rm -rf path``, read-only directories included (``smol_checkpoint``)."""
    for d, _, _ in os.walk(path):
        os.chmod(d, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session):
    """The run's model cache goes, whatever the outcome (``model_cache``): removed by the
    process that owns the run's base temp dir (the xdist controller, or the only process)
    once every test of the run has ended."""
    if hasattr(session.config, "workerinput"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is None or getattr(factory, "_basetemp", None) is None:
        return  # nothing made one
    root = factory.getbasetemp() / MODEL_CACHE
    if root.exists():
        _remove_writable(root)


def wait_until(cond, timeout_s: float, step_s: float = 0.05):
    """Poll ``cond`` until it returns something truthy or ``timeout_s`` passes; returns that
    value (``True`` for a plain predicate), or ``cond``'s last, falsy, value at the deadline,
    so ``assert wait_until(...)`` reads as the state it waits for and ``x = wait_until(...)``
    keeps what it found.  Tests synchronise on a state they can observe rather than on a fixed
    sleep, so a busy host only makes them slower; the bound is for a product that never gets
    there."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() > deadline:
            return got
        time.sleep(step_s)
    return got
