"""bench/bench_serve.py end to end on its tiniest matrix: real api_servers (plain and ngramd
on a real daemon over a warmed table), vLLM's own serving client, one workload at
concurrency 1, greedy, 16 tokens.  Where vLLM, its client or the servers do not work, this
fails (the bench exits non-zero)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_serve.py"


def test_the_serving_bench_runs_plain_and_ngramd_through_vllms_client(tmp_path):
    out, runs = tmp_path / "serve.json", tmp_path / "runs"
    cmd = [sys.executable, str(BENCH), "--methods", "plain,ngramd", "--loads", "1",
           "--workloads", "code", "--temperatures", "0", "--rounds", "1", "--reps", "1",
           "--prompts", "2", "--max-tokens", "16", "--warm-tokens", "20000",
           "--out", str(out), "--runs-dir", str(runs), "--keep-runs"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    res = json.loads(out.read_text())
    cells = {c["method"]: c for c in res["cells"]}
    assert set(cells) == {"plain", "ngramd"}, res["cells"]
    for m, c in cells.items():
        assert c["completed"] == 2 and c["failed"] == 0 and not c["errors"], c
        assert c["tok_s"] > 0 and c["ttft_p99"] > 0 and c["tpot_p50"] > 0, c
        assert c["steps"] > 0, c  # the server's step histogram moved over the cell
        # the figures' source: the client's own --save-result JSON of that run
        saved = json.loads(next(runs.glob(f"*-{m}.json")).read_text())
        assert saved["output_throughput"] == c["tok_s"]
        assert len(saved["generated_texts"]) == 2
    d = cells["ngramd"]
    assert d["p_steps"] > 0, d  # the proposer drafted (or chose not to) for every step
    assert d["differ"] == 0, d  # greedy: every request's text as plain's
    assert cells["plain"]["drafts"] == 0 and cells["plain"]["al"] is None
    assert "ngramd: output tok/s vs plain, every cell" in p.stdout
    assert "T 0 · concurrency 1 · code · round 1 (1 reps)" in p.stdout
