"""llama.cpp drafting from ngramd through llama-cpp-python's draft-model hook
(``ngram_generator.llamacpp``), on the embedded SmolLM2-135M GGUF and real daemons.

``make test`` installs the ``[llamacpp]`` extra (``make llamacpp``, from the cached wheel) and
sets ``NGRAM_LLAMACPP_TESTS=1``: there these tests fail, never skip, when llama-cpp-python does
not import.  A bare ``pytest`` in an environment without the extra skips them, saying so.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

if os.environ.get("NGRAM_LLAMACPP_TESTS") != "1" and importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (make llamacpp; make test installs it and "
                "fails without it)", allow_module_level=True)

import llama_cpp  # noqa: E402,F401  (make test: an ImportError here fails the run)

from ngram_generator import cli  # noqa: E402
from ngram_generator.llamacli import LlamaTokenizer, load_llama, run_request  # noqa: E402
from ngram_generator.llamacpp import NgramdDraftModel, gguf_vocab_size  # noqa: E402
from ngram_generator.model import resolve_checkpoint  # noqa: E402
from test_readme import readme_block  # noqa: E402

MARKER = "<!-- llamacpp-readme:"
PROMPT = "Write a Python function that checks whether a string is a palindrome."
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.05}


@pytest.fixture(scope="module")
def gguf() -> Path:
    directory, name = resolve_checkpoint(None, None)  # the embedded SmolLM2 (make install)
    return Path(directory) / name


@pytest.fixture(scope="module")
def smol_table(daemon_factory, gguf):
    """A daemon whose table records the GGUF's tokenizer (``ngramd --tokenizer model.gguf``)."""
    return daemon_factory.start(name="llama", table={"tokenizer": str(gguf),
                                                     "vocab_size": gguf_vocab_size(gguf),
                                                     "hot_budget_mb": 4.0})


@pytest.fixture(scope="module")
def tok(gguf) -> LlamaTokenizer:
    from llama_cpp import Llama

    return LlamaTokenizer(Llama(model_path=str(gguf), vocab_only=True, verbose=False))


def chat(tok: LlamaTokenizer, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=True)


def publish(daemon) -> None:
    """What was fed back: counted, and in the hot tier."""
    with daemon.client() as c:
        c.flush(timeout_ms=60_000)
        c.rebuild_hot(timeout_ms=60_000)


def shared_accepted(draft: NgramdDraftModel) -> int:
    by_tier = draft.stats()["draft_model"]["accepted_by_tier"]
    return sum(n for tier, n in by_tier.items() if tier != "local")


# -------------------------------------------------------------------------------------------
# llama.cpp with the draft model
# -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flash_attn", [False, True], ids=["fa-off", "fa-on"])
def test_greedy_is_plain_llamacpps_and_round_2_drafts_what_round_1_fed_back(
        gguf, tok, smol_table, flash_attn):
    """Greedy outputs equal plain llama.cpp's with the same FlashAttention setting, in both
    rounds; round 1's output, fed back once the request finished, is drafted and accepted in
    round 2 from the shared tiers (the request's own table holds only the prompt).  Every
    draft verified in full: on this CPU the policy rightly verifies little (an eval of n
    tokens costs about n single-token evals), and here every draft must be verified."""
    draft = NgramdDraftModel(gguf, smol_table.endpoint, full_drafts=True)
    try:
        assert draft.link.state == "up"
        ids = chat(tok, PROMPT)
        plain = load_llama(gguf, n_ctx=512, flash_attn=flash_attn)
        spec = load_llama(gguf, n_ctx=512, flash_attn=flash_attn, draft_model=draft)
        want, _ = run_request(plain, ids, 96)
        got1, m1 = run_request(spec, ids, 96)
        draft.finish()
        assert draft.flush(30.0)
        publish(smol_table)
        before = shared_accepted(draft)
        got2, m2 = run_request(spec, ids, 96)
        draft.finish()
        assert got1 == want and got2 == want and len(want) > 32
        assert shared_accepted(draft) > before, draft.stats()
        assert m2.mean_accepted_length > m1.mean_accepted_length, (m1, m2)
        assert m2.verify_forwards + 1 < len(want)  # fewer evals than tokens
    finally:
        draft.close()


def test_sampling_with_a_seed_emits_plain_llamacpps_tokens(gguf, tok):
    """llama-cpp-python samples each position of a verified draft and keeps a draft token
    when the sample equals it: one draw a token emitted, as plain decoding takes, so a seeded
    sampled run emits plain's tokens (lossless by construction, not only in distribution).
    Every draft verified in full here, so the steps really verify several tokens."""
    draft = NgramdDraftModel(gguf, "none", full_drafts=True)
    try:
        ids = chat(tok, "Repeat this list twice: apple, pear, plum, cherry, apple, pear, plum.")
        plain = load_llama(gguf, n_ctx=512)
        spec = load_llama(gguf, n_ctx=512, draft_model=draft)
        for seed in (1, 2):
            want, _ = run_request(plain, ids, 64, seed=seed, **SAMPLED)
            got, m = run_request(spec, ids, 64, seed=seed, **SAMPLED)
            assert got == want, seed
            assert m.drafted > 0 and m.accepted > 0, m
    finally:
        draft.close()


# -------------------------------------------------------------------------------------------
# the hook alone: requests, feedback, timing
# -------------------------------------------------------------------------------------------
class StepClock:
    """A step clock that moves by ``dt`` seconds a read."""

    def __init__(self, dt: float = 0.01):
        self.t, self.dt = 0.0, dt

    def __call__(self) -> float:
        self.t += self.dt
        return self.t


def test_requests_are_told_apart_by_their_tokens_and_each_is_fed_back_once(gguf, smol_table):
    """The hook gets only token histories.  A history that does not continue the last call's
    is another request (the last one is fed back then); one that grew by more than a step
    (the next turn of a chat, whose prompt holds this one) ends the request and starts a new
    one that feeds back only what follows it; ``finish`` feeds back the one running.  Every
    n-gram is counted once."""
    draft = NgramdDraftModel(gguf, smol_table.endpoint, keep_policy=False, full_drafts=True)
    rng = np.random.default_rng(7)
    a, b, turn = (rng.integers(1000, 40000, n).astype(np.intc) for n in (40, 40, 30))
    try:
        def steps(history, n):  # the hook after each of n single-token steps
            for i in range(n):
                draft(history[:len(history) - n + i + 1])

        steps(a, 10)  # request A: a 30-token prompt, 10 tokens
        steps(b, 10)  # request B ends A
        draft(np.concatenate([b, turn]))  # B's next turn: B ends, C continues it
        draft.finish()
        assert draft.drafter.tracker.counts.finished == 3
        assert draft.drafter.tracker.counts.continued == 1
        assert draft.flush(30.0)
        with smol_table.client() as c:
            c.flush(timeout_ms=60_000)
            got = c.lookup([a[:20], b[:20], np.concatenate([b, turn[:5]])])
        total = np.asarray(got["total"])
        assert total[0, 4] == 1 and total[1, 4] == 1 and total[2, 4] == 1, total[:, 1:6]
    finally:
        draft.close()


def test_the_policy_times_the_steps_between_calls_and_nothing_else(gguf):
    """The cost model learns from the time between one call's return and the next call: one
    eval of 1 + k tokens (k: the draft returned).  A new request's first call (its prefill
    came before) and a history that grew by more than a step are not timed."""
    clock = StepClock()
    draft = NgramdDraftModel(gguf, "none", full_drafts=True, step_clock=clock)
    try:
        seq = np.tile(np.arange(100, 120, dtype=np.intc), 6)  # repeats: drafts from the request
        k1 = len(draft(seq[:40]))  # a new request: not timed
        k2 = len(draft(seq[:41]))  # one token came (the draft rejected): 1 + k1 evaluated
        draft(seq[:42 + k2])  # the whole draft accepted, and one more: 1 + k2 evaluated
        draft(seq[:42 + k2 + 20])  # more than a step (20 > 1 + 16): not timed
        assert k1 > 0 and k2 > 0
        assert [s[0] for s in draft.drafter.policy.cost.recent()] == [1 + k1, 1 + k2]
    finally:
        draft.close()


def test_a_table_of_another_tokenizer_is_refused_as_the_other_generators_refuse_it(
        gguf, daemon, caplog):
    """A Qwen3 table (the test daemon's) is refused with the link's one warning, which the
    vLLM proposer and ngram-generate give too; drafting goes on from the request alone."""
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        draft = NgramdDraftModel(gguf, daemon.endpoint, full_drafts=True)
    try:
        assert draft.link.state == "refused"
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert said and "identity_mismatch" in said[0] and "ngramd --tokenizer" in said[0]
        seq = np.tile(np.arange(300, 310, dtype=np.intc), 4)
        assert len(draft(seq)) > 0  # from the request's own table
    finally:
        draft.close()


def test_ngram_generate_refuses_a_table_of_another_tokenizer(daemon, capsys):
    rc = cli.main(["--engine", "llamacpp", "--daemon", daemon.endpoint, "--max-new-tokens",
                   "8", "hello"])
    assert rc == 3
    assert "was made for another tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_ngram_generate_compare_on_llamacpp(smol_table, capsys, flash_attn):
    """``ngram-generate --engine llamacpp --compare``: plain and speculative llama.cpp on each
    prompt, greedy outputs compared (exit 1 if one differs)."""
    rc = cli.main(["--engine", "llamacpp", "--compare", "--daemon", smol_table.endpoint,
                   "--flash-attn", flash_attn, "--max-new-tokens", "48", PROMPT,
                   "Write a Python function that returns the largest of three numbers."])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "greedy outputs identical: 2/2" in out
    assert f"flash_attn {flash_attn}" in out and "draft lengths:" in out


# -------------------------------------------------------------------------------------------
# the README's section runs as written
# -------------------------------------------------------------------------------------------
def test_the_readme_llamacpp_section_runs_as_written(tmp_path, smol_table, gguf):
    """The README's Python block, verbatim, against a daemon whose table records the GGUF's
    tokenizer, twice: the second run drafts what the first fed back (a new process: the
    table and the policy it kept outlive the first)."""
    script = tmp_path / "readme_llamacpp.py"
    script.write_text(readme_block(MARKER, "python"))
    env = dict(os.environ, NGRAMD_ENDPOINT=smol_table.endpoint, MODEL=str(gguf),
               OMP_NUM_THREADS="1")
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        runs.append(p.stdout)
        publish(smol_table)
    answers = [r.split("\n---")[0] for r in runs]
    assert answers[0] == answers[1] and len(answers[0]) > 100, runs  # greedy: the same answer
    # the second run's drafts (scored against its output, verified or not) came from what the
    # first taught the table: the answer itself, position 1 matching nearly always
    observed = [re.search(r"observed ([0-9.]+|-)", r).group(1) for r in runs]
    assert observed[1] != "-" and float(observed[1]) >= 0.8, runs[1]
    assert observed[0] == "-" or float(observed[1]) > float(observed[0]) + 0.1, runs
