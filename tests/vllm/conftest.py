"""Fixtures of the vLLM tests, which run in vLLM's own environment (``make vllm-env`` builds
``.venv-vllm``; ``make test`` runs this directory there).  They need vLLM: where it does not
import, they fail, they do not skip.

* ``smol_dir``: the embedded SmolLM2-135M-Instruct as a safetensors checkpoint (vLLM loads no
  GGUF of this architecture here): the run's one read-only copy, ``smol_checkpoint``;
* ``smol_daemon``: a real ngramd whose table records SmolLM2's tokenizer, one per module;
* ``vllm_engine(**kw)``: an offline ``LLM`` on ``smol_dir`` (fp32, eager, CPU), shut down at the
  end of the module; engine start-up takes ~50 s here, so each module starts as few as it can;
* ``serve_pair``: two ``vllm serve`` processes with the proposer on a daemon of their own.  When
  the run selects a test that uses them, they start before the first test (their start-up,
  ~90 s for the two, then overlaps test_proposer.py's engines and tests, which leave a core
  mostly idle) and are waited for where they are used;
* ``readme_block_run``: the README's vLLM block run verbatim by bash (its own server and
  daemon, in namespaces of its own), started early the same way.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # custom_class lives in the V1 runner
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM's engines talk over ipc sockets named by a uuid in $VLLM_RPC_BASE_PATH (default: $TMPDIR,
# else /tmp) and leave them there, 5-7 an engine start (47 after one make test): a directory of
# the run's own, removed at its end (``vllm_scratch``), engines of server subprocesses included.
# The README's block is run as a new user runs it, without this variable and with a $TMPDIR of
# its own under RPC_DIR (short: socket paths are limited to 107 bytes); its test fails if the
# block leaves a socket there (its own VLLM_RPC_BASE_PATH is a directory it removes)
RPC_DIR = Path(tempfile.mkdtemp(prefix="flashnest-vllm-rpc-"))
os.environ["VLLM_RPC_BASE_PATH"] = str(RPC_DIR)

@atexit.register
def _remove_rpc_dir(pid: int = os.getpid()) -> None:
    """A run that stops early too; never in a forked engine process (its parent's engines may
    still bind there)."""
    if os.getpid() == pid:
        shutil.rmtree(RPC_DIR, ignore_errors=True)


import vllm  # noqa: E402  (the environment is the point: fail here rather than skip)

from vllm_helpers import SMOL_VOCAB, ReadmeBlock, Server, free_port  # noqa: E402


@pytest.fixture(scope="session")
def smol_dir(smol_checkpoint) -> Path:
    """The run's read-only SmolLM2 checkpoint (``tests/conftest.py``), the files
    ``ngram_generator.export`` writes: no copy of its own, removed at the end of the run."""
    return smol_checkpoint


def smol_table(smol_dir: Path) -> dict:
    """The ``[table]`` overrides of a daemon whose table records SmolLM2's tokenizer."""
    return {"tokenizer": str(smol_dir / "tokenizer.json"), "vocab_size": SMOL_VOCAB,
            "hot_rebuild_s": 1.0}


@pytest.fixture(scope="module")
def smol_daemon(daemon_factory, smol_dir):
    """A daemon whose table records SmolLM2's tokenizer (``daemon_factory`` starts others)."""
    return daemon_factory.start("smol", table=smol_table(smol_dir))


@pytest.fixture(scope="session")
def serve_pair(session_daemon_factory, smol_dir, tmp_path_factory):
    """``.servers``: servers "a" and "b" (``vllm serve`` with the proposer), started, not yet
    ready (``Server.wait_ready``); ``.daemon``: the one ngramd both talk to."""
    daemon = session_daemon_factory.start("serve", table=smol_table(smol_dir))
    root = tmp_path_factory.mktemp("serve")
    servers: list[Server] = []
    try:
        # a: the README's vLLM command and environment, vLLM's log at INFO, the proposer's
        # metrics on a free port (tests/vllm/test_serve.py)
        a_env = {"VLLM_LOGGING_LEVEL": "INFO", "NGRAM_PROPOSER_METRICS_PORT": str(free_port())}
        servers.append(Server("a", smol_dir, root, daemon.endpoint, env=a_env, readme=True))
        servers.append(Server("b", smol_dir, root, daemon.endpoint))
        yield SimpleNamespace(servers=servers, daemon=daemon)
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="session")
def readme_block_run(smol_dir, tmp_path_factory):
    """The README's vLLM block, run verbatim in the background (``vllm_helpers.ReadmeBlock``);
    started before the first test when a selected test uses it."""
    block = ReadmeBlock(smol_dir, tmp_path_factory.mktemp("readme-block"), RPC_DIR / "block-tmp")
    yield block
    block.stop()


@pytest.fixture(scope="session", autouse=True)
def vllm_scratch(tmp_path_factory):
    """The run's own directory for what vLLM leaves behind, removed when the run ends: its
    engines' ipc sockets (``RPC_DIR``) and, in ``RPC_DIR/tmp`` as ``$TMPDIR`` (and Python's
    ``tempfile.tempdir``) of this process and every engine and server it starts, the files
    vLLM makes with ``tempfile`` and never removes (a ``vllm_dist_<uuid>`` FileStore each
    engine start).  Pytest's own base temp is fixed first, so it stays where it was (failed
    tests' directories are kept); torch's compile cache is pinned where it would otherwise be
    (``/tmp/torchinductor_<user>``), a shared cache rather than a per-run copy."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    tmp_path_factory.getbasetemp()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    scratch = RPC_DIR / "tmp"
    scratch.mkdir()
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(scratch)
    yield scratch
    tempfile.tempdir = saved[1]
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    shutil.rmtree(RPC_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def servers_start_early(request, vllm_scratch):
    """Starts ``serve_pair`` before the first test when a selected test uses it (after
    ``vllm_scratch``, so their engines' leftovers land there)."""
    for name in ("readme_block_run", "serve_pair"):
        if any(name in item.fixturenames for item in request.session.items):
            request.getfixturevalue(name)


@pytest.fixture(scope="module")
def vllm_engine(smol_dir):
    """``vllm_engine(**LLM kwargs)`` -> an ``LLM`` over ``smol_dir``; all shut down at the end
    of the module."""
    engines = []

    def start(**kw):
        kw.setdefault("dtype", "float32")
        kw.setdefault("enforce_eager", True)
        kw.setdefault("max_model_len", 1024)
        kw.setdefault("max_num_seqs", 8)
        kw.setdefault("seed", 0)
        kw.setdefault("disable_log_stats", False)
        llm = vllm.LLM(model=str(smol_dir), **kw)
        engines.append(llm)
        return llm

    yield start
    for llm in engines:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
    engines.clear()
    gc.collect()
