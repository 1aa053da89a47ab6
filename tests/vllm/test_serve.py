"""The serving story: ``vllm serve`` (the OpenAI-compatible server) with the ngramd proposer,
asked through the official ``openai`` client; two servers on one ngramd, where what server A
generated is drafted by server B."""

from __future__ import annotations

import os
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_helpers import code_prompts, sockets_under


@pytest.fixture(scope="module")
def servers(serve_pair):
    """The two servers, ready (conftest's ``serve_pair`` started them before the first test)."""
    for s in serve_pair.servers:
        s.wait_ready()
    return serve_pair


def wait_for(cond, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_server_b_drafts_what_server_a_generated(servers):
    (a, b), daemon = servers.servers, servers.daemon
    prompts = code_prompts(6)
    # A: prompts the table has not seen
    before_a = a.accepted_tokens()
    answers = [a.complete(p) for p in prompts]
    learned_a = a.accepted_tokens() - before_a
    wait_for(lambda: a.stats().get("proposer", {}).get("finished", 0) >= len(prompts)
             and a.stats()["link"]["queued_seqs"] == 0)
    with daemon.client() as c:
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


def test_the_readme_server_learns_and_the_proposer_shows_in_vllm_log_and_metrics(servers):
    """Server a runs the README's vLLM command and environment, with VLLM_LOGGING_LEVEL=INFO
    (issue 30: the README's command did not start on this machine; no proposer line reached
    vLLM's log and nothing of it any /metrics): through the openai client, a repeated request
    accepts more draft tokens than the first; in the log a start line
    naming the endpoint, the table and the tokenizer check, summary lines, the counters on the
    port, and a last line at shutdown."""
    a, daemon = servers.servers[0], servers.daemon
    # the README's requests: the repeat accepts more, drafting what the first taught the table
    prompt, gained = "def quicksort(xs):", []
    for _ in range(2):
        before, done = a.accepted_tokens(), a.stats().get("proposer", {}).get("finished", 0)
        a.complete(prompt)
        gained.append(a.accepted_tokens() - before)
        wait_for(lambda: a.stats().get("proposer", {}).get("finished", 0) > done
                 and a.stats()["link"]["queued_seqs"] == 0)
        with daemon.client() as c:
            c.flush()
    print(f"server a (the README's command) accepted {gained} draft tokens on a repeat")
    assert gained[1] > gained[0], gained
    wait_for(lambda: "ngramd proposer: ngramd at" in a.log_path.read_text())
    log = a.log_path.read_text()
    assert f"ngramd proposer: ngramd at {daemon.endpoint}, table 'serve'; tokenizer matches" \
        in log, log[-4000:]
    wait_for(lambda: "requests done; drafted" in a.log_path.read_text())
    port = a.env["NGRAM_PROPOSER_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'ngram_proposer_link_state{state="up"} 1.0' in text, text
    steps = [line for line in text.splitlines() if line.startswith("ngram_proposer_steps_total")]
    assert steps and float(steps[0].split()[-1]) > 0, text
    assert "ngram_proposer_drafted_tokens_total{" in text
    first = [line for line in text.splitlines()
             if line.startswith('ngram_proposer_accepted_by_position_total{position="1"}')]
    assert first and float(first[0].split()[-1]) > 0, text  # the repeat accepted its drafts
    # the engines' ipc sockets are in the run's own directory, not /tmp (removed at the end)
    rpc = Path(os.environ["VLLM_RPC_BASE_PATH"])
    assert rpc != Path(tempfile.gettempdir()) and any(rpc.iterdir())
    # and vLLM's FileStore files (vllm_dist_<uuid>, one an engine start, never removed by
    # vLLM) in the run's own $TMPDIR inside it, not in /tmp
    scratch = Path(os.environ["TMPDIR"])
    assert scratch.parent == rpc and any(scratch.glob("vllm_dist_*")), list(scratch.iterdir())
    a.stop()
    assert "ngramd proposer: closed (engine shutdown)" in a.log_path.read_text()


def test_the_readme_vllm_block_runs_verbatim(readme_block_run):
    """The README's vLLM block, every line as written (activate, export, ngramd, ping, the
    server, the openai requests, the metrics and log greps, the shutdown), in a scratch
    directory with namespaces of its own (issue 30: the block as written did not start a
    server; nothing of the proposer reached vLLM's log or any /metrics).  Its output shows the
    proposer's start line, vLLM's and the proposer's accepted-token counters above zero, and
    vLLM's log the proposer's last line; the table sits beside the model, not inside it, and
    nothing is left in its /dev/shm."""
    rc, out = readme_block_run.wait()
    work = readme_block_run.work
    vlog = (work / "var" / "vllm.log")
    tail = f"{out[-3000:]}\n--- var/vllm.log:\n{vlog.read_text(errors='replace')[-3000:] if vlog.exists() else '(none)'}"
    assert rc == 0, tail
    vllm_acc = re.findall(r"^vllm:spec_decode_num_accepted_tokens_total\S* (\S+)$", out, re.M)
    ours = re.findall(r"^ngram_proposer_accepted_tokens_total\S* (\S+)$", out, re.M)
    assert vllm_acc and float(vllm_acc[0]) > 0, tail
    assert ours and sum(float(v) for v in ours) > 0, tail
    endpoint = f"ipc://{work}/var/smollm2-vllm.sock"
    assert f"ngramd proposer: ngramd at {endpoint}, table 'smollm2-vllm'; tokenizer matches" \
        in out, tail
    assert "ngramd proposer: closed" in vlog.read_text(errors="replace"), tail
    assert (work / "var" / "smollm2-vllm" / "CURRENT").is_file()
    assert not (work / "var" / "models" / "smollm2" / "CURRENT").exists()
    # nothing left in its /dev/shm: the block's clear-hot removed the hot tier and the shm dir
    left = (work / "shm-left.txt").read_text()
    assert "No such file" in left or not left.split(), left
    # nor in its $TMPDIR: vLLM's ipc sockets (uuid names, 7 a server run) went to the block's
    # VLLM_RPC_BASE_PATH, which it removes; nor a socket anywhere in what it keeps (var/)
    tmp = readme_block_run.tmpdir
    assert sockets_under(tmp, work / "var") == [], (sorted(os.listdir(tmp)), tail)
    assert os.listdir(tmp) == [], sorted(os.listdir(tmp))
    print(f"README vLLM block: vLLM accepted {vllm_acc[0]} draft tokens, the proposer "
          f"{sum(float(v) for v in ours):g}")
