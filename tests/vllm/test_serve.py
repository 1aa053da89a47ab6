"""The serving story: ``vllm serve`` (the OpenAI-compatible server) with the ngramd proposer,
asked through the official ``openai`` client; two servers on one ngramd, where what server A
generated is drafted by server B."""

from __future__ import annotations

import time

import pytest

from vllm_helpers import code_prompts


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
