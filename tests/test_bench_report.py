"""bench_vllm's report helpers: several runs' repetitions read as one run's (`--pool`), what a
step that verifies a draft costs, read from pairs of steps (`--jump`), and which runs a cell's
ratios are taken against (`summarise`, `targets`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_vllm():
    spec = importlib.util.spec_from_file_location("bench_vllm_under_test",
                                                  BENCH / "bench_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(workloads: str, reps: int, tok_s: float, wall_s: int) -> dict:
    cells = [{"workload": w, "batch": 1, "method": "plain", "round": "1", "rep": r,
              "tok_s": tok_s + r} for w in ("code", "repeat") for r in range(reps)]
    cells.append({"workload": "repeat", "batch": 1, "method": "plain", "round": "1",
                  "rep": -1, "tok_s": 0.0})  # a warm-up, numbered -1: stays -1
    return {"cells": cells, "engines": [{"rep": r, "method": "ngramd"} for r in range(reps)],
            "steps": {"1": {"plain_step_ms": wall_s}},
            "settings": {"workloads": workloads, "reps": reps, "wall_s": wall_s,
                         "command": f"bench_vllm.py --workloads {workloads}"}}


def test_pooled_runs_number_repetitions_on_and_keep_the_last_runs_workloads():
    pool = _bench_vllm().pool_runs([_run("code,repeat", 3, 10.0, 100),
                                    _run("repeat", 2, 20.0, 50)])
    reps = sorted((c["tok_s"], c["rep"]) for c in pool["cells"] if c["rep"] >= 0)
    # the first run's repeat cells as repetitions 0-2, the second's as 3-4; no code cells
    assert reps == [(10.0, 0), (11.0, 1), (12.0, 2), (20.0, 3), (21.0, 4)]
    assert {c["workload"] for c in pool["cells"]} == {"repeat"}
    assert [c["rep"] for c in pool["cells"] if c["rep"] < 0] == [-1, -1]
    assert [e["rep"] for e in pool["engines"]] == [0, 1, 2, 3, 4]
    assert pool["settings"]["reps"] == 5 and pool["settings"]["wall_s"] == 150
    assert pool["steps"] == {"1": {"plain_step_ms": 50}}  # the last run's
    assert " + " in pool["settings"]["command"]


def test_the_draft_jump_is_read_from_pairs_of_steps_of_the_same_rows():
    # 8 rows: a step costs 70 ms x 1.01 a draft token, x 1.10 when it verifies any; the load
    # drifts 20% over the run, and steps of other rows sit between (pairs only within rows)
    import numpy as np

    rng = np.random.default_rng(3)
    steps, load = [], 1.0
    for i in range(400):
        load *= float(np.exp(rng.normal(0, 0.01)))
        d = int(rng.choice([0, 0, 2, 4, 8]))
        steps.append([8 + d, 8, 70.0 * load * 1.01 ** d * (1.10 if d else 1.0)])
        if i % 50 == 0:
            steps.append([1, 1, 40.0])
    got = _bench_vllm().draft_jump([{"engines": [{"cost_steps": steps}]}, {"cells": []}])
    row = [ln for ln in got.splitlines() if ln.startswith("| 8 |")]
    assert row, got
    jump, per_token = (float(x) for x in row[0].strip("| ").split(" | ")[3:5])
    assert abs(jump - 1.10) < 0.01 and abs(per_token - 1.01) < 0.002, got
    assert "| 1 |" not in got  # one-row steps never follow each other: no pair, no row


def _cell(method: str, rnd: str, rep: int, tok_s: float) -> dict:
    return {"workload": "code", "batch": 8, "method": method, "round": rnd, "rep": rep,
            "tok_s": tok_s, "al": 1.0, "identical": True, "seconds": 1.0, "output_tokens": 1}


def test_later_rounds_read_against_their_own_plain_and_ngram_runs_when_there_are_some():
    bv = _bench_vllm()
    cells = []
    for rep, drift in enumerate((1.0, 1.0, 0.5)):  # repetition 2's host halves in round 2
        cells += [_cell("plain", "1", rep, 100.0), _cell("ngram", "1", rep, 90.0),
                  _cell("suffix", "1", rep, 95.0), _cell("ngramd", "1", rep, 96.0 + rep),
                  _cell("suffix", "2", rep, 150.0 * drift),
                  _cell("ngramd", "2", rep, 160.0 * drift)]
    once = {"cells": cells}
    every = {"cells": cells + [_cell("plain", "2", rep, 100.0 * d)
                               for rep, d in enumerate((1.0, 1.0, 0.5))]
             + [_cell("ngram", "2", rep, 90.0 * d) for rep, d in enumerate((1.0, 1.0, 0.5))]}

    def row(results, rnd):
        return next(x for x in bv.summarise(results)["rows"]
                    if x["method"] == "ngramd" and x["round"] == rnd)

    # plain in round 1 only (--peers-once, older runs): round 2 is read against round 1's
    assert row(once, "2")["vs_plain_range"] == (0.8, 1.6)
    # plain in every round: against the run made beside it, drift and all
    assert row(every, "2")["vs_plain_range"] == (1.6, 1.6)
    assert row(every, "2")["vs_plain"] == 1.6
    r1 = row(every, "1")
    assert r1["vs_plain"] == 0.97 and r1["vs_plain_range"] == (0.96, 0.98)
    assert r1["vs_best_peer_range"] == (96 / 95, 98 / 95)
    # below 0.97x plain in the median, but not in every repetition: not beyond the noise
    every["engines"], every["steps"], every["settings"] = [], {}, {}
    t = bv.targets([every])[0]
    assert t["measured"].startswith("min 0.97x; none below"), t
    for c in every["cells"]:
        if c["method"] == "ngramd" and c["round"] == "1":
            c["tok_s"] = 90.0 + c["rep"]  # 0.90-0.92x plain in all three repetitions
    t = bv.targets([every])[0]
    assert "below in every repetition: quiet b8 code r1" in t["measured"], t


def test_a_cell_is_also_read_by_each_requests_own_time():
    bv = _bench_vllm()
    cells = []
    for rep in range(3):  # a closed batch: ngramd's longest row as slow as plain's, the rest not
        cells += [{**_cell("plain", "1", rep, 100.0), "request_s": 4.0},
                  {**_cell("ngramd", "1", rep, 95.0), "request_s": 3.2 + 0.1 * rep}]
    run = {"cells": cells, "engines": [], "steps": {}, "settings": {}}
    row = next(x for x in bv.summarise(run)["rows"] if x["method"] == "ngramd")
    assert row["vs_plain"] == 0.95 and abs(row["vs_plain_by_request"] - 4.0 / 3.3) < 1e-9
    t = bv.targets([run])
    assert "below: quiet b8 code r1 0.95x" in t[0]["measured"]
    assert t[1]["figure"].startswith("the same by each request's own time")
    assert t[1]["measured"] == "min 1.21x; none below", t[1]  # the median repetition's
    # runs that timed no request: no such row
    for c in cells:
        del c["request_s"]
    assert not any("own time" in x["figure"] for x in bv.targets([run]))
