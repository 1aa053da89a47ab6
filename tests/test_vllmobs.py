"""The vLLM proposer's lines in vLLM's log and its Prometheus counters, without vLLM (on a
real engine: tests/vllm/test_serve.py)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

from ngram_generator.vllmobs import serve_metrics


def test_proposer_lines_reach_a_log_configured_as_vllm_configures_its_own():
    """vLLM gives its handler to the ``vllm`` logger only (propagate off): before, an INFO line
    of ``ngram_generator`` went to the root logger, which has no handler, and was lost."""
    code = """
import logging, sys
vllm = logging.getLogger("vllm")
h = logging.StreamHandler(sys.stdout)
h.setFormatter(logging.Formatter("VLLMFMT %(levelname)s %(name)s: %(message)s"))
vllm.addHandler(h); vllm.setLevel(logging.INFO); vllm.propagate = False
from ngram_generator.vllmobs import attach_to_vllm_log
print(attach_to_vllm_log())
logging.getLogger("ngram_generator.vllm").info("ngramd proposer: hello")
logging.getLogger("ngram_generator.remote").debug("not at INFO")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == [
        "True", "VLLMFMT INFO ngram_generator.vllm: ngramd proposer: hello"], out.stderr


def test_the_proposer_counters_are_served_for_prometheus():
    stats = {"proposer": {"steps": 7, "finished": 2, "drafted_by_tier": {"local": 5, "hot": 9},
                          "accepted_by_tier": {"hot": 6}, "propose_ms_p50": 0.5,
                          "propose_ms_p99": 2.0, "verified_by_position": [9, 4, 2],
                          "accepted_by_position": [6, 3, 0],
                          "policy": {"plain_share": 0.25,
                                     "same_steps": {"vs_plain": 1.3, "vs_oracle": 0.9}}},
             "link": {"state": "up", "queued_seqs": 1, "queued_tokens": 40, "feedback_sent": 3}}
    server = serve_metrics(lambda: stats, 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        stats["proposer"]["accepted_by_tier"]["hot"] = 8  # read at scrape time
        with urllib.request.urlopen(url, timeout=10) as r:
            again = r.read().decode()
    finally:
        server.shutdown()
    lines = set(text.splitlines())
    for want in ('ngram_proposer_steps_total 7.0', 'ngram_proposer_requests_finished_total 2.0',
                 'ngram_proposer_drafted_tokens_total{tier="hot"} 9.0',
                 'ngram_proposer_accepted_tokens_total{tier="hot"} 6.0',
                 'ngram_proposer_link_state{state="up"} 1.0',
                 'ngram_proposer_link_state{state="down"} 0.0',
                 'ngram_proposer_feedback_queued_sequences 1.0',
                 'ngram_proposer_feedback_sent_total 3.0',
                 'ngram_proposer_propose_seconds_p99 0.002',
                 'ngram_proposer_verified_by_position_total{position="1"} 9.0',
                 'ngram_proposer_accepted_by_position_total{position="2"} 3.0',
                 'ngram_proposer_accepted_by_position_total{position="3+"} 0.0',
                 'ngram_proposer_plain_share 0.25', 'ngram_proposer_speed_vs_plain 1.3',
                 'ngram_proposer_speed_vs_oracle 0.9'):
        assert want in lines, (want, text)
    assert 'ngram_proposer_accepted_tokens_total{tier="hot"} 8.0' in again.splitlines()
    assert "ngram_proposer_speed_vs_full" not in text  # no figure the tally does not have


def test_the_metrics_port_comes_from_the_environment_or_the_file(tmp_path):
    from ngram_generator.vllm import ProposerSettings

    assert ProposerSettings.load({}).metrics_port == 0  # off unless asked
    assert ProposerSettings.load({"NGRAM_PROPOSER_METRICS_PORT": "9465"}).metrics_port == 9465
    cfg = tmp_path / "p.toml"
    cfg.write_text("[proposer]\nmetrics_port = 9470\nmetrics_addr = '0.0.0.0'\n")
    s = ProposerSettings.load({"NGRAM_PROPOSER_CONFIG": str(cfg)})
    assert (s.metrics_port, s.metrics_addr) == (9470, "0.0.0.0")
    with pytest.raises(ValueError, match="NGRAM_PROPOSER_METRICS_PORT='x'"):
        ProposerSettings.load({"NGRAM_PROPOSER_METRICS_PORT": "x"})
