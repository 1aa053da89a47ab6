"""The vLLM proposer's settings and guards, without vLLM (its engine tests are tests/vllm)."""

from __future__ import annotations

import re

import pytest

from ngram_generator.vllm import ProposerSettings, require_v1_runner


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
