"""The vLLM proposer's settings, guards and life cycle, without vLLM (its engine tests are
tests/vllm): the proposer class is built on a stand-in for vLLM's config, against a real
ngramd."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ngram_generator.vllm import NgramdProposer, ProposerSettings, require_v1_runner

from conftest import QWEN3_TOKENIZER


def test_settings_from_a_file_then_the_environment(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[proposer]\nendpoint = "ipc:///file.sock"\ntimeout_ms = 250\n'
                   'park_s = 1.5\nfull_drafts = true\nlearn_prompts = true\n'
                   'step_clock = "wall"\n')
    s = ProposerSettings.load({"NGRAM_PROPOSER_CONFIG": str(cfg)})
    assert (s.endpoint, s.timeout_ms, s.park_s, s.full_drafts, s.learn_prompts,
            s.step_clock) == ("ipc:///file.sock", 250, 1.5, True, True, "wall")
    s = ProposerSettings.load({"NGRAM_PROPOSER_CONFIG": str(cfg),
                               "NGRAMD_ENDPOINT": "ipc:///env.sock",
                               "NGRAM_SERVER_KEY": "/k/server.key",
                               "NGRAM_PROPOSER_STATS": "/tmp/s.json"})
    assert (s.endpoint, s.server_key, s.stats_file) == ("ipc:///env.sock", "/k/server.key",
                                                        "/tmp/s.json")
    assert ProposerSettings.load({}) == ProposerSettings()


@pytest.mark.parametrize("text, message", [
    ("[proposer]\ntimeout = 5\n",
     "unknown key(s) in [proposer]: 'timeout' (did you mean 'timeout_ms'?)"),
    ("[proposer]\ntimeout_ms = '5'\n",
     "[proposer] timeout_ms: expected an integer, got a string ('5')"),
    ("[proposer]\nfull_drafts = 1\n", "[proposer] full_drafts: expected true or false, got an integer"),
    ("[proposer]\npark_s = true\n", "[proposer] park_s: expected a number, got a boolean"),
    ("[proposer]\nendpoint = 3\n", "[proposer] endpoint: expected a string, got an integer"),
    ("[proxy]\nendpoint = 'x'\n", "unknown section(s) in the config: 'proxy'; known: proposer"),
    ("proposer = 3\n", "[proposer]: expected a table of settings, got an integer"),
    ("[proposer\n", "not TOML"),
    ("[proposer]\nstep_clock = 'cpu'\n",
     "step_clock must be one of ['run', 'wall'], got 'cpu'"),
])
def test_bad_settings_name_the_key(tmp_path, text, message):
    cfg = tmp_path / "p.toml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"NGRAM_PROPOSER_CONFIG={cfg}: ")) as e:
        ProposerSettings.load({"NGRAM_PROPOSER_CONFIG": str(cfg)})
    assert message in str(e.value)


def test_a_missing_settings_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        ProposerSettings.load({"NGRAM_PROPOSER_CONFIG": str(tmp_path / "nope.toml")})


def test_the_v2_model_runner_is_refused():
    for ok in (None, "0", "false"):
        require_v1_runner({} if ok is None else {"VLLM_USE_V2_MODEL_RUNNER": ok})
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        require_v1_runner({"VLLM_USE_V2_MODEL_RUNNER": "1"})


def _vllm_config(model: str) -> SimpleNamespace:
    """What the proposer reads of vLLM's config: a CPU engine of ``model``, 6-token drafts,
    the packaged Qwen3 tokenizer (the test daemon's table's)."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=6),
        model_config=SimpleNamespace(model=model, max_model_len=8192,
                                     tokenizer=str(Path(QWEN3_TOKENIZER).parent),
                                     get_vocab_size=lambda: 1000),
        device_config=SimpleNamespace(device_type="cpu"))


def _serve(proposer: NgramdProposer, steps: int, seed: int = 0) -> None:
    """``steps`` engine steps of 4 rows whose text repeats a motif (drafts get accepted): each
    row takes the draft's tokens that match its text, and one more."""
    rng = np.random.default_rng(seed)
    rows = np.stack([np.tile(rng.integers(10, 900, 7), 2 * steps) for _ in range(4)])
    num = np.full(4, 30)
    sampled = [[int(rows[i, 29])] for i in range(4)]
    for _ in range(steps):
        drafts = proposer.propose(sampled, num, rows.astype(np.int32))
        for i, d in enumerate(drafts):
            n, acc = int(num[i]), 0
            while acc < len(d) and d[acc] == rows[i, n + acc]:
                acc += 1
            sampled[i] = rows[i, n:n + acc + 1].tolist()
            num[i] = n + acc + 1


@pytest.mark.skipif(QWEN3_TOKENIZER is None, reason="no packaged Qwen3 tokenizer")
def test_a_restarted_proposer_takes_up_the_policy_its_predecessor_kept_in_the_table(daemon):
    # issue 27: a fresh vLLM engine started its draft-length policy from the priors, and
    # verified 2-8% fewer tokens than full drafts on its first batch-1 requests after a
    # restart while it relearned what the engine before it knew (bench/RESULTS.md)
    settings = ProposerSettings(endpoint=daemon.endpoint, log_interval_s=3600.0)
    first = NgramdProposer(_vllm_config("/models/tiny"), settings=settings)
    assert first.policy_key == "cpu:/models/tiny"
    assert first.drafter.policy.model.seen == 0  # nothing kept yet
    _serve(first, 120)
    pol = first.drafter.policy
    pol.update()
    learned = pol.model.seen, pol.cost.observed, pol.model.predict(
        pol.model.features_of(np.full(6, 8), np.ones(6), np.arange(6), np.ones(6)))
    assert learned[0] > 0 and learned[1] > 0
    first.close()  # keeps the state in the table
    daemon.restart()  # which keeps it on disk
    second = NgramdProposer(_vllm_config("/models/tiny"), settings=settings)
    pol = second.drafter.policy
    assert pol.model.seen >= learned[0] and pol.cost.observed == min(learned[1], pol.cost.window)
    assert pol.model.predict(pol.model.features_of(
        np.full(6, 8), np.ones(6), np.arange(6), np.ones(6))) == pytest.approx(learned[2], abs=0.02)
    second.close()
    # another model keeps its own; and with keep_policy off nothing is taken up
    for model, keep in (("/models/other", True), ("/models/tiny", False)):
        p = NgramdProposer(_vllm_config(model),
                           settings=ProposerSettings(endpoint=daemon.endpoint, keep_policy=keep))
        assert p.drafter.policy.model.seen == 0 and p.drafter.policy.cost.observed == 0
        p.close()


@pytest.mark.parametrize("key", ["", "x" * 129, "tab\tkey", "caf\u00e9"])
def test_a_bad_policy_key_is_named(key):
    with pytest.raises(ValueError, match="policy_key must be"):
        ProposerSettings(policy_key=key)


@pytest.mark.skipif(QWEN3_TOKENIZER is None, reason="no packaged Qwen3 tokenizer")
def test_the_proposers_figures_wait_for_a_step_in_progress(daemon):
    # the figures learn what the steps kept (the policy's update): read from the idle watch
    # or a metrics scrape while vLLM's thread steps, they must not run inside a step
    import threading

    p = NgramdProposer(_vllm_config("/models/tiny"),
                       settings=ProposerSettings(endpoint=daemon.endpoint, log_interval_s=3600.0,
                                                 keep_policy=False))
    try:
        _serve(p, 40)
        got = []
        with p._lock:  # a step in progress
            reader = threading.Thread(target=lambda: got.append(p.stats()))
            reader.start()
            reader.join(0.3)
            assert reader.is_alive() and not got
        reader.join(5.0)
        assert got and got[0]["proposer"]["steps"] == 40
    finally:
        p.close()


class _InputBatch:
    """The part of vLLM's ``InputBatch`` the proposer reads."""

    def __init__(self, temps, top_p=False):
        self.token_ids_cpu = np.zeros((len(temps), 16), np.int32)
        self.temperature_cpu = np.array(temps, np.float32)
        self.no_top_p, self.no_top_k = not top_p, True


class _Runner:
    """vLLM's model runner, as far as the proposer's call goes."""

    def __init__(self, view, batch):
        self.view, self.input_batch = view, batch

    def propose_draft_token_ids(self, token_ids):
        return self._propose(token_ids)

    def _propose(self, token_ids):  # the proposer's propose(): reads the view itself
        return self.view.read(token_ids, 2)


def test_the_proposer_reads_each_rows_sampling_from_the_runner_that_calls_it():
    # issue 50: vLLM gives a custom_class proposer no sampling parameters; its runner calls
    # propose() with its input batch's own token array, and that batch holds them
    from ngram_generator.vllm import SamplingView

    view = SamplingView()
    batch = _InputBatch([0.0, 0.8, 0.8], top_p=True)
    runner = _Runner(view, batch)
    temps, filtered = runner.propose_draft_token_ids(batch.token_ids_cpu)
    assert temps.tolist() == pytest.approx([0.0, 0.8]) and filtered
    # vLLM replaced its input batch: found again
    runner.input_batch = other = _InputBatch([0.3, 0.0])
    temps, filtered = runner.propose_draft_token_ids(other.token_ids_cpu)
    assert temps.tolist() == pytest.approx([0.3, 0.0]) and not filtered
    # an array that is no runner's batch: greedy for all (None), and not searched again
    stray = np.zeros((2, 16), np.int32)
    assert runner.propose_draft_token_ids(stray) is None
    assert view.read(stray, 2) is None
