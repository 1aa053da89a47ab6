"""The hot-size curve (ngramd/hot/curve.py) on a small real table: a ColdStore in a tmp dir,
bulk-loaded with standard-library code through the Qwen3 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from ngramd.hot import curve as hotcurve
from ngramd import kernels as K
from ngramd.kernels.drafting import draft_source
from ngramd.kernels.slots import insert_rows
from ngramd.wire.constants import HOT_K, SLOT_WORDS
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules

from corpus import qwen_token_stream

SMALL = ColdOptions(block_cache_mb=8, write_buffer_mb=4, read_threads=2, sync_log=False)
FRACTIONS = (0.01, 0.05, 0.2, 0.5, 1.0)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A table warmed with argparse.py (first 12k tokens); requests from textwrap.py."""
    train = qwen_token_stream(12_000, "argparse.py")
    held = qwen_token_stream(3_000, "textwrap.py")
    ident = TableIdentity(n_min=1, n_max=8, cold_k=8, vocab_size=151_936, tokenizer="")
    store = ColdStore(tmp_path_factory.mktemp("hotcurve") / "db", ident, SMALL)
    store.bulk_load(train, np.array([0, train.size], np.int64), threads=1, mem_mb=64)
    # prompts of 200 tokens, continuations of 100: held-out and in-corpus text (the latter
    # drafts long, so the curve has something to lose)
    reqs = [(held[i:i + 200], held[i + 200:i + 300]) for i in range(0, 2_400, 600)]
    reqs += [(train[i:i + 200], train[i + 200:i + 300]) for i in range(0, 6_000, 1_500)]
    yield store, reqs
    store.close()


def test_curve_is_monotone_in_the_budget(table):
    store, reqs = table
    res = hotcurve.hot_curve(store, reqs, FRACTIONS)
    pts = res["points"]
    assert [p["fraction"] for p in pts] == sorted(FRACTIONS)
    assert res["entries"] == store.stats()["entries_total"] > 0
    assert 0 < res["ranked"] <= res["confident"] <= res["entries"]
    for a, b in zip(pts, pts[1:]):
        assert a["placed"] <= b["placed"]
        # a smaller budget's hot set is a prefix of a larger one's: the global table's drafts
        # only get longer or equal, so AL and hit rate cannot fall
        assert a["hot_only"]["al"] <= b["hot_only"]["al"] + 1e-12
        assert a["hit_rate"] <= b["hit_rate"] + 1e-12
    # 100%: every ranked row is hot but for those the bounded probe drops
    assert pts[-1]["placed"] + pts[-1]["dropped_probe"] == res["ranked"]
    assert pts[-1]["dropped_probe"] < 0.01 * res["ranked"]
    assert pts[-1]["hot_only"]["al"] > pts[0]["hot_only"]["al"]
    rec = res["recommended"]
    bar = 0.97 * pts[-1]["with_local"]["al"]
    assert rec is not None and rec["al"] >= bar
    assert all(p["with_local"]["al"] >= bar for p in pts if p["fraction"] >= rec["fraction"])
    below = [p for p in pts if p["fraction"] < rec["fraction"]]
    assert not below or below[-1]["with_local"]["al"] < bar


def test_full_budget_drafts_what_the_whole_table_in_ram_drafts(table):
    """100% of the entries: the pruned hot table plus its redundant-key filter drafts, token
    for token, what one unpruned slot table holding every row drafts (same restart rule).  The
    orders may differ: a pruned row's draft is reported at its ancestor's order (ngramd.hot,
    "Redundancy")."""
    store, reqs = table
    ident = store.identity
    ranking = hotcurve.rank_table(store)
    hot, info = hotcurve.hot_slots(ranking, ranking.entries, max_probe=64)
    assert info["dropped_probe"] == 0
    words, nprobe = hotcurve.pruned_filter(ranking.redundant)
    rows = ranking.entries
    full = np.zeros((1 << int(np.ceil(np.log2(rows / 0.5))), SLOT_WORDS), np.uint32)
    for rs in store.reader.scan_rows():
        tok, cnt = rs.padded(HOT_K)
        assert insert_rows(full, 64, rs.key, rs.order, tok, cnt, rs.total) == 0
    def draft(slots, ctx, filt, p_cum):
        out = K.draft_out(1, 8)
        K.draft(draft_source((slots,), (K.TIER_HOT,), (True,), 64, *filt, 0),
                DraftRules(ident.n_min, ident.n_max, 1, 0.3, p_cum).kernel, ctx,
                np.array([0, ctx.size], np.int64), 8, out)
        return out[0][0, :out[4][0]].tolist()

    no_filter = (np.zeros(0, np.uint64), 0)
    compared = drafted = 0
    for prompt, cont in reqs:
        seq = np.concatenate([prompt, cont])
        for pos in range(prompt.size, seq.size):
            # without the p_cum stop: the same tokens, the whole chain
            a = draft(hot, seq[:pos], (words, nprobe), 0.0)
            assert a == draft(full, seq[:pos], no_filter, 0.0), pos
            # with it, the chain may only be longer (the confidence multiplied is the
            # ancestor's, never lower than the pruned row's own: issue 18)
            b, c = draft(hot, seq[:pos], (words, nprobe), 0.1), draft(full, seq[:pos],
                                                                       no_filter, 0.1)
            assert b[:len(c)] == c, pos
            compared += 1
            drafted += len(a)
    assert compared and drafted  # the comparison drafted something

    # and the curve's 100% point replays the same AL as the whole table in RAM (no p_cum)
    rules = DraftRules(n_min=ident.n_min, n_max=ident.n_max, p_cum=0.0)
    cfg = hotcurve.ReplaySettings(rules=rules, local=False, max_probe=64)
    got = hotcurve.replay(hot, (words, nprobe), reqs, cfg)
    want = hotcurve.replay(full, no_filter, reqs, cfg)
    assert got["al"] == want["al"] and got["steps"] == want["steps"]


def test_recommend_picks_the_smallest_budget_that_keeps_the_share():
    pts = [{"fraction": f, "placed": i, "bytes": 32 * i, "hot_budget_mb": i / 1e3,
            "with_local": {"al": al}} for i, (f, al) in
           enumerate([(0.01, 1.0), (0.05, 1.95), (0.1, 1.99), (1.0, 2.0)])]
    assert hotcurve.recommend(pts, 0.97)["fraction"] == 0.05
    assert hotcurve.recommend(pts, 0.999)["fraction"] == 1.0
    assert hotcurve.recommend([], 0.97) is None
    # a small budget that passes by chance, with a larger one below the bar, is not chosen
    pts[0]["with_local"]["al"] = 2.0
    pts[1]["with_local"]["al"] = 1.5
    assert hotcurve.recommend(pts, 0.97)["fraction"] == 0.1


# ---------------------------------------------------------------------------------------------
# the live table's curve: the `hot_curve` op and `ngram-client hot-curve`
# ---------------------------------------------------------------------------------------------
def test_a_live_daemon_draws_its_curve_and_the_cli_prints_it(start_daemon, tmp_path):
    import os
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from ngram_client import DaemonError

    d = start_daemon(table={"hot_budget_mb": 0.25})
    train = qwen_token_stream(12_000, "argparse.py")
    with d.client(timeout_ms=120_000) as c:
        c.ingest([train[i:i + 2_000] for i in range(0, train.size, 2_000)])
        c.flush()
        held = [train[:600], qwen_token_stream(800, "textwrap.py")]
        r = c.hot_curve(held, points=4, prompt_tokens=100)
        pts = r["points"]
        assert len(pts) == 4 and r["configured_hot_budget_mb"] == 0.25
        # budgets halve from 4x the configured one; more room never drafts less
        assert [p["hot_budget_mb"] for p in pts] == [0.125, 0.25, 0.5, 1.0]
        hits = [p["hit_rate"] for p in pts]
        assert hits == sorted(hits) and hits[-1] > 0
        assert r["recommended"]["hot_budget_mb"] in [p["hot_budget_mb"] for p in pts]
        with pytest.raises(DaemonError, match="8x hot_budget_mb"):
            c.hot_curve(held, max_mb=4.0)
        with pytest.raises(DaemonError, match="longer than prompt_tokens"):
            c.hot_curve([train[:50]], prompt_tokens=100)
    f = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint", d.endpoint,
                          "hot-curve", str(f), "--points", "3", "--prompt-tokens", "100"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    assert "recommended: hot_budget_mb =" in out.stdout and "AL hot" in out.stdout
