"""``BatchDrafter``: an engine's batch without request ids, simulated the way vLLM's input batch
behaves (rows reused as requests finish, the batch compacted by moving its last row into a hole,
requests left out of a step and brought back, preempted ones recomputed), checked against one
``NgramDrafter`` per request fed the same tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ngram_generator.batch import BatchDrafter, BatchSettings
from ngram_generator.drafting import DraftConfig, NgramDrafter
from ngramd.wire.rules import DraftRules

CONFIG = DraftConfig(DraftRules(max_draft_len=6))
VOCAB = 1000


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FeedbackLink:
    """Records feedback; no daemon (the drafters use the request-local table only)."""

    state = "up"
    available = False

    def __init__(self, learn_prompts=False):
        self.learn_prompts = learn_prompts
        self.fed: list[list[int]] = []
        self.reports: list[tuple[dict, dict]] = []
        self.policy: list[dict] = []  # the draft-length policy figures sent with feedback

    def refresh(self):
        pass

    def hot_table(self):
        return None

    def feedback(self, seqs, drafted, accepted, keys=None, policy=None):
        self.fed.extend(np.asarray(s).tolist() for s in seqs)
        self.reports.append((drafted, accepted))
        self.policy.append(policy or {})


def texts(n: int, seed: int = 0) -> list[list[int]]:
    """What the "model" says after each request's prompt: repetitive token streams (drafts get
    accepted) sharing a common prefix, so rows cannot be told apart by their first tokens."""
    rng = random.Random(seed)
    out = []
    for r in range(n):
        motif = [rng.randrange(10, VOCAB) for _ in range(rng.randrange(3, 9))]
        out.append([1, 2, 3, 4] + [100 + r] + [t for _ in range(50) for t in motif])
    return out


def ends(requests, seed: int = 0) -> list[int]:
    """Where each request stops (its max_tokens): the model's text goes on past it."""
    rng = random.Random(seed)
    return [rng.randrange(40, len(r) - 2 * CONFIG.rules.max_draft_len) for r in requests]


class Engine:
    """A vLLM-like batch over ``requests`` (prompt = the first ``prompt_len`` tokens).

    Between steps, rows of finished requests leave and the batch is compacted (its last row
    moves into the hole), a request may be preempted (recomputed later, whole) or left out of a
    step, and waiting requests take free rows.  A step verifies each row's draft (kept per
    request, as the scheduler does), writes the accepted tokens plus one into the row, and then
    asks the drafter for the next drafts, finished rows included, as vLLM's model runner does
    in ``execute_model``.  A new row is prefilled in one step or, sometimes, in two chunks (the
    first samples nothing)."""

    def __init__(self, requests, rows: int, prompt_len: int = 12, seed: int = 1):
        self.req = requests
        self.end = ends(requests, seed)
        self.prompt_len = prompt_len
        self.rows = rows
        self.rng = random.Random(seed)
        self.width = max(len(r) for r in requests) + 16
        self.tokens = np.zeros((rows, self.width), np.int32)
        self.slot: list[int] = []  # request index in each row
        self.pos: dict[int, int] = {}  # request -> tokens its row holds
        self.waiting = list(range(len(requests)))
        self.chunked: set[int] = set()  # requests whose first prefill chunk ran
        self.sampled: dict[int, list[int]] = {}
        self.drafts: dict[int, list[int]] = {}
        self.accepted = 0

    def admit(self) -> None:
        while self.waiting and len(self.slot) < self.rows:
            r = self.waiting.pop(0)
            row = len(self.slot)
            self.slot.append(r)
            n = self.pos.get(r, self.prompt_len)  # a preempted request comes back whole
            self.tokens[row] = 0
            self.tokens[row, :n] = self.req[r][:n]
            self.pos[r] = n
            self.drafts.pop(r, None)
            if n == self.prompt_len and self.rng.random() < 0.3:
                self.chunked.add(r)  # its prefill runs in two steps

    def remove(self, row: int) -> int:
        r = self.slot[row]
        last = len(self.slot) - 1
        if row != last:  # condense: the last row moves into the hole
            self.tokens[row] = self.tokens[last]
            self.slot[row] = self.slot[last]
        self.slot.pop()
        return r

    def execute(self) -> None:
        for row, r in enumerate(self.slot):
            if r in self.chunked:  # the first chunk of a prefill: nothing sampled
                self.chunked.discard(r)
                self.sampled[r] = []
                continue
            n, want = self.pos[r], self.req[r]
            d = self.drafts.pop(r, [])
            acc = 0
            while acc < len(d) and d[acc] == want[n + acc]:
                acc += 1
            self.accepted += acc
            new = want[n:n + acc + 1]
            self.tokens[row, n:n + len(new)] = new
            self.pos[r] = n + len(new)
            self.sampled[r] = list(new)

    def finished(self) -> list[int]:
        return [row for row, r in enumerate(self.slot) if self.pos[r] >= self.end[r]]

    def outputs(self) -> list[list[int]]:
        """What each request's row held when it finished (past ``end`` when the last step
        accepted drafts beyond it, as vLLM's model runner holds them too)."""
        return [self.req[r][self.prompt_len:self.pos[r]] for r in range(len(self.req))]

    def view(self):
        sampled = [self.sampled[r] for r in self.slot]
        num = np.array([self.pos[r] for r in self.slot], np.int64)
        return sampled, num, self.tokens[:len(self.slot)]


def run(engine: Engine, drafter: BatchDrafter, clock: Clock, *, skip_rate=0.0, preempt_rate=0.0,
        references: dict | None = None, limit: int = 5000) -> None:
    """Drive ``engine`` with ``drafter`` to the end; compare every draft with that of a fresh
    ``NgramDrafter`` over the same tokens when ``references`` is given."""
    rng = engine.rng
    for _ in range(limit):
        for row in sorted(engine.finished(), reverse=True):
            engine.remove(row)
        if engine.slot and rng.random() < preempt_rate:  # recomputed later, whole
            engine.waiting.append(engine.remove(rng.randrange(len(engine.slot))))
        engine.admit()
        if not engine.slot:
            break
        # rows left out of this step (not scheduled): the engine drops them from its batch and
        # puts them back at the next one
        skipped = [row for row in range(len(engine.slot)) if rng.random() < skip_rate]
        for row in sorted(skipped, reverse=True):
            engine.waiting.insert(0, engine.remove(row))
        engine.execute()
        sampled, num, tokens = engine.view()
        drafts = drafter.step(sampled, num, tokens, CONFIG.rules.max_draft_len)
        for row, r in enumerate(engine.slot):
            engine.drafts[r] = drafts[row]
            if references is not None and sampled[row]:
                ref = references.setdefault(r, NgramDrafter(CONFIG))
                ref.start(np.asarray(tokens[row, :num[row]], np.uint32))
                assert drafts[row] == ref.draft(CONFIG.rules.max_draft_len).tokens.tolist(), (r, row)
        clock.t += 0.01
    for _ in range(2):  # the batch empty: every request leaves it, then park_s passes
        drafter.step([], np.zeros(0, np.int64), np.zeros((0, 1), np.int32), CONFIG.rules.max_draft_len)
        clock.t += 10.0


@pytest.mark.parametrize("skip_rate, preempt_rate", [(0.0, 0.0), (0.15, 0.0), (0.1, 0.05)])
def test_rows_reused_moved_skipped_and_preempted_keep_their_requests(skip_rate, preempt_rate):
    requests = texts(24)
    engine = Engine(requests, rows=5)
    link, clock = FeedbackLink(), Clock()
    drafter = BatchDrafter(CONFIG, link, vocab_size=VOCAB, clock=clock,
                           settings=BatchSettings(park_s=5.0, full_drafts=True))
    run(engine, drafter, clock, skip_rate=skip_rate, preempt_rate=preempt_rate, references={})
    s = drafter.report()
    # every request started once and was fed back once, whatever happened to its rows
    assert s["started"] == s["finished"] == len(requests)
    assert sorted(link.fed) == sorted(engine.outputs())
    assert s["accepted_tokens"] == engine.accepted > 0
    # per position (the metrics' counters): every verified token at its place in its draft
    verified, accepted = s["verified_by_position"], s["accepted_by_position"]
    assert sum(verified) == s["drafted_tokens"] and sum(accepted) == s["accepted_tokens"]
    assert all(a <= v for a, v in zip(accepted, verified))
    assert verified[:-1] == sorted(verified[:-1], reverse=True) and accepted[0] > 0
    if skip_rate or preempt_rate:
        assert s["resumed"] > 0 and s["moved"] > 0


def test_feedback_carries_what_the_policy_did_since_the_last_feedback():
    """The daemon's stats show the generators' draft-length policy (``ngram-client stats``):
    each feedback carries the policy's figures since the previous one, so the daemon's sums are
    the policy's totals, none counted twice."""
    engine = Engine(texts(12), rows=4)
    link, clock = FeedbackLink(), Clock()
    drafter = BatchDrafter(CONFIG, link, vocab_size=VOCAB, clock=clock,
                           settings=BatchSettings(park_s=5.0))
    run(engine, drafter, clock)
    sent = {}
    for figures in link.policy:
        for k, v in figures.items():
            sent[k] = sent.get(k, 0.0) + v
    policy = drafter.policy
    assert sent["steps"] == policy.steps > 0 and sent["plain_steps"] == policy.plain_steps
    assert policy.tally.tokens["policy"] > 0 and policy.tally.seconds["oracle"] > 0
    assert sent["policy_tokens"] == pytest.approx(policy.tally.tokens["policy"])
    assert sent["oracle_seconds"] == pytest.approx(policy.tally.seconds["oracle"])
    assert policy.figures() == {}  # nothing new since the last feedback


def test_a_request_back_after_park_s_feeds_back_only_what_is_new():
    """Parked past ``park_s``, a preempted request is finished and fed back; when it returns
    (whole, as a recomputed request) it is a new request that feeds back only what follows:
    with ``learn_prompts``, the pieces of each request, in order, are its tokens once."""
    requests = texts(8, seed=3)
    engine = Engine(requests, rows=3)
    link, clock = FeedbackLink(learn_prompts=True), Clock()
    drafter = BatchDrafter(CONFIG, link, vocab_size=VOCAB, clock=clock,
                           settings=BatchSettings(park_s=0.0, full_drafts=True))
    run(engine, drafter, clock, preempt_rate=0.3)
    assert drafter.tracker.counts.continued > 0
    whole = [engine.req[r][:engine.pos[r]] for r in range(len(requests))]
    fed: dict[int, list[int]] = {r: [] for r in range(len(requests))}
    for seq in link.fed:
        owners = [r for r, w in enumerate(whole) if _is_piece(seq, w)]
        assert len(owners) == 1, seq
        fed[owners[0]].extend(seq)
    assert [fed[r] for r in range(len(requests))] == whole, "each token fed back once"


def _is_piece(seq, whole):
    n = len(seq)
    return any(whole[i:i + n] == seq for i in range(len(whole) - n + 1))


def test_drafts_are_cut_at_the_model_vocabulary_and_limits_are_per_row():
    link, clock = FeedbackLink(), Clock()
    drafter = BatchDrafter(CONFIG, link, vocab_size=50, clock=clock,
                           settings=BatchSettings(full_drafts=True))
    row = np.array([[7, 8, 60, 7, 8, 60, 7, 8, 9, 9], [5, 6, 5, 6, 5, 6, 5, 6, 5, 0]], np.int32)
    out = drafter.step([[8], [6]], np.array([8, 9]), row, [4, 0])
    assert out[0] == [] and out[1] == []  # 60 >= vocab: cut; max_len 0: nothing
    out = drafter.step([[9], [6]], np.array([9, 9]), row, [4, 3])
    assert out[1] == [6, 5, 6]


def test_prefill_rows_get_no_draft_and_an_empty_step_finishes_nothing_early():
    link, clock = FeedbackLink(), Clock()
    drafter = BatchDrafter(CONFIG, link, vocab_size=VOCAB, clock=clock,
                           settings=BatchSettings(full_drafts=True))
    row = np.array([[5, 6, 5, 6, 5, 6, 5, 0]], np.int32)
    assert drafter.step([[]], np.array([7]), row, 4) == [[]]
    assert drafter.tracker.counts.started == 0
    assert drafter.step([[5]], np.array([7]), row, 4) == [[6, 5, 6, 5]]
    drafter.step([], np.zeros(0, np.int64), row[:0], 4)
    clock.t += 1.0
    drafter.step([], np.zeros(0, np.int64), row[:0], 4)
    assert link.fed == []  # parked, not finished yet
    clock.t += 5.0
    drafter.step([], np.zeros(0, np.int64), row[:0], 4)
    assert link.fed == [[5]]  # the output: what followed the 6-token prompt


_NO_COMPILE_IN_STEPS = """
import sys
sys.path.insert(0, sys.argv[1])
from numba.core import event
import test_batch as T

clock = T.Clock()
drafter = T.BatchDrafter(T.CONFIG, T.FeedbackLink(), vocab_size=T.VOCAB, clock=clock,
                         settings=T.BatchSettings(park_s=5.0))
with event.install_recorder("numba:compile") as compiled:  # rows join, change and leave
    T.run(T.Engine(T.texts(12), rows=4), drafter, clock)
assert drafter.report()["finished"] == 12
print([str(e.data["dispatcher"]) for _, e in compiled.buffer if e.is_start])
"""


def test_a_new_process_compiles_nothing_in_its_steps(tmp_path):
    """Everything numba compiles for a step is compiled when the drafter is made: a vLLM
    engine's first steps took 0.4 s each where a row's table was replaced or the batch shrank
    (the typed list's methods, compiled on first use and never cached).  In a process of its
    own: this one has compiled everything long ago."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_COMPILE_IN_STEPS,
                          os.path.dirname(__file__)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# --------------------------------------------------------------------------------------------
# draft lengths by the step cost (DraftLengthPolicy.choose_batch)
# --------------------------------------------------------------------------------------------
def _draft(conf, order=8):
    from ngram_generator.drafting import Draft

    k = len(conf)
    return Draft(np.arange(10, 10 + k), np.full(k, order), np.full(k, 1),
                 np.asarray(conf, np.float32))


def _policy(cost_per_token: float, base: float = 1.0):
    """A policy whose step cost is ``base + cost_per_token`` per token verified."""
    from ngram_generator.policy import DraftLengthPolicy, StepCost

    cost = StepCost()
    for _ in range(4):
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            cost.observe(n, base + cost_per_token * n)
    return DraftLengthPolicy(cost, probe_every=0)


def test_a_batch_on_flat_cost_verifies_every_draft_and_on_steep_cost_only_likely_tokens():
    drafts = [_draft([1.0] * 8), _draft([0.9, 0.5, 0.3, 0.3]), _draft([0.35] * 6), _draft([])]
    flat = _policy(0.0).choose_batch(drafts)  # all but tokens of chain below ~5%
    assert flat[0] == 8 and flat[1] >= 2 and flat[2] >= 2 and flat[3] == 0
    steep = _policy(0.2).choose_batch(drafts)
    assert steep[0] > steep[2] and steep[3] == 0 and sum(steep) < 18
    # the confident row keeps more than the weak one, and the weak one may get nothing
    assert steep[0] >= steep[1] >= steep[2]


def test_one_row_chooses_what_the_single_request_policy_chooses():
    """``choose_batch`` of one draft is ``choose`` (one fed token plus k drafts, the same
    expected-tokens-per-second rule)."""
    rng = np.random.default_rng(3)
    for slope in (0.0, 0.05, 0.2, 1.0):
        for _ in range(20):
            d = _draft(rng.uniform(0.2, 1.0, rng.integers(1, 9)).round(2).tolist(),
                       order=int(rng.integers(1, 17)))
            assert _policy(slope).choose_batch([d]) == [_policy(slope).choose(d)]


def _engine_emits(drafts, rows, n) -> list[list[int]]:
    """What an engine samples for each row of ``rows`` (its text) that holds ``n[i]`` tokens
    and verified ``drafts[i]``: the draft's matching prefix, then its own token (``n``
    advances)."""
    sampled = []
    for i in range(len(n)):
        acc = 0
        while acc < len(drafts[i]) and drafts[i][acc] == rows[i, n[i] + acc]:
            acc += 1
        sampled.append(rows[i, n[i]:n[i] + acc + 1].tolist())
        n[i] += acc + 1
    return sampled


def _engine_loop(per_token: float, every: int, full: bool = False, plain: bool = False,
                 steps: int = 120) -> float:
    """Four requests whose text repeats but for every ``every``-th token (where drafts fail),
    run through a BatchDrafter as an engine would; each step the (fake) clock advances by the
    step's cost, ``0.01 (1 + per_token x tokens verified)``.  Returns tokens a second over the
    second half (the policy has learned by then)."""
    from ngram_generator.batch import BatchSettings

    rng = np.random.default_rng(5)
    texts = [np.concatenate([[r], np.tile(rng.integers(10, 900, 5), 40 * steps)])
             for r in range(4)]
    for i, t in enumerate(texts):
        t[every::every] = 900 + i
    clock = Clock()
    drafter = BatchDrafter(CONFIG, FeedbackLink(), vocab_size=VOCAB, clock=clock,
                           settings=BatchSettings(full_drafts=full))
    rows = np.stack(texts).astype(np.int32)
    n, drafts = np.full(4, 30), [[] for _ in range(4)]
    for step in range(steps):
        sampled = _engine_emits(drafts, rows, n)
        if step == steps // 2:
            t0, n0 = clock.t, int(n.sum())
        drafts = drafter.step(sampled, n, rows, 0 if plain else 6)
        clock.t += 0.01 * (1 + per_token * (4 + sum(len(d) for d in drafts)))
    return (int(n.sum()) - n0) / (clock.t - t0)


@pytest.mark.parametrize("per_token", [0.0, 1.0, 4.0])
def test_the_batch_drafter_learns_the_step_cost_and_is_never_slower_than_full_or_plain(
        per_token):
    """Free draft tokens, tokens that cost as much as a whole plain step, and four times that
    (a step of four rows and their drafts): over the second half of 300 steps, the policy's
    tokens a second are within 3% of the better of full drafts and plain decoding, or above."""
    got = _engine_loop(per_token, 11, steps=300)
    best = max(_engine_loop(per_token, 11, full=True, steps=300),
               _engine_loop(per_token, 11, plain=True, steps=300))
    assert got >= 0.97 * best, (got, best)




def test_the_drafter_backs_off_while_plain_is_chosen_and_drafts_again_when_drafts_pay(
        monkeypatch):
    """Drafts that fail every other token on a CPU-like curve (a token costs as much as a
    plain step's row): the policy chooses plain, and after ``BACKOFF_AFTER`` such decisions
    the drafter skips drafting (the kernel, the scoring, the daemon's asks) on most steps.
    When the text turns predictable, the next decision verifies and every step drafts again,
    at the tokens a second of full drafts."""
    import ngram_generator.batch as B

    calls = []
    real = B.draft_rows
    monkeypatch.setattr(B, "draft_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(7)
    switch, steps = 260, 400

    def loop(full: bool):
        texts = [np.concatenate([[r], np.tile(rng.integers(10, 900, 5), 400)]) for r in range(4)]
        for i, t in enumerate(texts):
            t[2:switch:2] = rng.integers(900, 1000, len(t[2:switch:2]))  # unpredictable
        rows = np.stack(texts).astype(np.int32)
        clock = Clock()
        drafter = BatchDrafter(CONFIG, FeedbackLink(), vocab_size=VOCAB, clock=clock,
                               settings=BatchSettings(full_drafts=full))
        n, drafts, marks = np.full(4, 30), [[] for _ in range(4)], {}
        for step in range(steps):
            sampled = _engine_emits(drafts, rows, n)
            marks[step] = (len(calls), clock.t, int(n.sum()), drafter.policy.skipped)
            drafts = drafter.step(sampled, n, rows, 6)
            clock.t += 0.01 * (1 + (4 + sum(len(d) for d in drafts)))
        return drafter, marks, n

    drafter, marks, n = loop(full=False)
    assert int(n.min()) > switch + 100, "every row reached the predictable text"
    # backed off: well under half the steps drafted while plain was chosen
    k0, _, _, s0 = marks[120]
    k1, _, _, s1 = marks[220]
    assert k1 - k0 <= 100 // 3 and s1 - s0 >= 100 // 2, (k1 - k0, s1 - s0)
    report = drafter.report()["policy"]
    assert report["skipped"] == drafter.policy.skipped >= s1 and report["plain_share"] > 0.5
    # after the switch (the rows reach it by ~step 230): drafting every step again, at full
    # drafts' speed
    k2, t2, n2, s2 = marks[300]
    k3, t3, n3, s3 = marks[steps - 1]
    assert k3 - k2 >= 0.95 * (steps - 1 - 300) and s3 == s2, (k3 - k2, s3 - s2)
    _, full, _ = loop(full=True)
    f2, f3 = full[300], full[steps - 1]
    assert (n3 - n2) / (t3 - t2) >= 0.9 * (f3[2] - f2[2]) / (f3[1] - f2[1])


def test_the_rows_of_a_batch_ask_the_daemon_less_while_its_answers_beat_no_draft(daemon):
    """A real ngramd whose table holds none of the rows' text: its answers (every short draft
    asks at first, the rows' asks in one message a step) never beat the rows' own drafts, and
    the rows, sharing one ``AskGate``, ask for one short draft in 64 at most, within a few
    hundred steps.  Fails with every short draft asking (the gate removed: interval 1)."""
    import time

    from ngram_generator.remote import DaemonLink

    link = DaemonLink(daemon.endpoint, timeout_ms=5000)
    assert link.connect()
    try:
        bd = BatchDrafter(CONFIG, link, vocab_size=VOCAB,
                          settings=BatchSettings(full_drafts=True))  # no policy back-off
        rows = 8
        tokens = np.random.default_rng(3).integers(0, VOCAB, (rows, 4000)).astype(np.int32)
        num = np.full(rows, 32, np.int64)
        sampled = [[int(tokens[i, 31])] for i in range(rows)]
        deadline = time.monotonic() + 120  # answers late on a busy host count for nothing
        while bd.gate.interval < 64 and time.monotonic() < deadline and num[0] < 3900:
            drafts = bd.step(sampled, num, tokens, 6)
            for i, d in enumerate(drafts):
                n, acc = int(num[i]), 0
                while acc < len(d) and d[acc] == tokens[i, n + acc]:
                    acc += 1
                sampled[i] = tokens[i, n:n + acc + 1].tolist()
                num[i] = n + acc + 1
            time.sleep(0.002)  # the verify forward: the daemon's time to answer
        rep = bd.report()
        assert rep["ask_interval"] == 64, rep
        assert rep["asks_sent"] >= 6 * 32  # every level of the back-off heard 32 answers
        assert rep["asks_not_sent"] > 4 * rep["asks_sent"], rep
        assert link.state == "up"
    finally:
        link.close()


def _prefill_loop(per_token: float, chunk: int, steps: int = 260, start: int = 180,
                  end: int = 200):
    """Four requests whose text repeats but for every 4th token, run through a BatchDrafter
    as an engine would, on a CPU-like cost (``0.01 (1 + per_token x tokens)`` a step); from
    step ``start`` to ``end`` a fifth request computes its prompt ``chunk`` tokens a step
    (chunked prefill: its row samples nothing, and each step carries the chunk).  Returns the
    draft tokens verified a decoding row, per step."""
    rng = np.random.default_rng(11)
    texts = [np.concatenate([[r], np.tile(rng.integers(10, 900, 5), 40 * steps)])
             for r in range(4)]
    for t in texts:  # every 4th token unforeseeable
        t[4::4] = rng.integers(900, 1000, len(t[4::4]))
    clock = Clock()
    drafter = BatchDrafter(CONFIG, FeedbackLink(), vocab_size=VOCAB, clock=clock)
    rows = np.stack(texts).astype(np.int32)
    prompt = rng.integers(10, 900, rows.shape[1]).astype(np.int32)
    n, drafts, verified = np.full(4, 30), [[] for _ in range(4)], []
    for step in range(steps):
        sampled = _engine_emits(drafts, rows, n)
        prefill = start <= step < end
        if prefill:  # the fifth row: in prefill (nothing sampled), its prompt all known
            out = drafter.step(sampled + [[]], np.append(n, 2000), np.vstack([rows, prompt]), 6)
        else:
            out = drafter.step(sampled, n, rows, 6)
        drafts = out[:4]
        verified.append(sum(len(d) for d in drafts) / 4)
        others = chunk if start - 1 <= step < end - 1 else 0  # the chunk the next step computes
        clock.t += 0.01 * (1 + per_token * (len(out) + sum(len(d) for d in out) + others))
    return np.array(verified), drafter


def test_drafts_beside_a_prefill_are_priced_with_it():
    """Drafts that miss every 4th token, on a CPU-like curve (a token costs a step's fixed
    part): in pure decoding steps they do not pay, and the policy verifies none.  While a
    fifth request is prefilled 512 tokens a step (vLLM's chunked prefill), each step is ~100x
    a plain one and the drafts' share of it small: the policy verifies them.  Fails with the
    prefill left out of the cost (``StepCost.beside`` 0): none verified there either."""
    verified, drafter = _prefill_loop(per_token=1.0, chunk=512)
    decoding, beside = verified[150:180].mean(), verified[181:200].mean()
    assert decoding < 0.5 and beside > 2.0, (decoding, beside)
    assert verified[205:].mean() < 0.5  # after the prefill: none again
    assert drafter.report()["policy"]["beside_prefill"] >= 15  # (back-off skips a few)
    # a step only a little dearer than its tokens (the load's noise) is no prefill
    cost = drafter.policy.cost
    assert cost.beside(20, 1.2 * float(cost.seconds([20])[0])) == 0
    assert 400 < cost.beside(20, float(cost.seconds([532])[0])) < 650


def test_a_draining_batch_weighs_the_rows_that_will_end_last():
    """Issue 50: in a closed batch (nothing waits), the batch lasts as long as its longest row,
    so tokens gained on rows that end early gain nothing (round 1 dialogue ran at 0.90-0.95x
    plain in closed batches, every speculative method below plain).  Once a request left and
    none came in for ``drain_after`` steps, each row's tokens weigh by how far it is behind
    the row with the fewest output tokens; a request coming in ends it."""
    reqs = texts(6, seed=3)
    engine = Engine(reqs, rows=4, seed=5)  # 6 requests, 4 rows: two wait, then none does
    engine.end = [60, 90, 120, 150, 70, 80]
    clock = Clock()
    drafter = BatchDrafter(CONFIG, FeedbackLink(), vocab_size=VOCAB, clock=clock)
    seen: list = []
    choose = drafter.policy.choose_batch

    def spy(drafts, *args, weights=None, **kwargs):
        seen.append((len(engine.waiting), [engine.pos[r] - engine.prompt_len
                                           for r in engine.slot], weights))
        return choose(drafts, *args, weights=weights, **kwargs)

    drafter.policy.choose_batch = spy
    run(engine, drafter, clock)
    weighed = [(out, w) for waiting, out, w in seen if w is not None]
    assert weighed and drafter.stats.draining_steps == len(weighed)
    assert all(w is None for waiting, _, w in seen if waiting)  # requests waited: no drain
    for out, w in weighed:
        least = min(out)
        assert max(w) == pytest.approx(1.0)
        for o, x in zip(out, w):  # the rows furthest ahead weigh least
            assert x == pytest.approx(np.exp(-(o - least) / drafter.settings.drain_slack))


def test_a_drain_begins_drain_after_steps_after_a_request_left_and_ends_when_one_comes():
    from ngram_generator.tracker import Rows, TrackedRequest

    drafter = BatchDrafter(CONFIG, FeedbackLink(), vocab_size=VOCAB)

    def req(out):
        return TrackedRequest(10 + out, b"", b"", 10, 0)

    a, b, c = req(5), req(9), req(20)

    def step(requests, started=()):
        w = drafter._drain_weights(Rows(requests, list(started), not started))
        drafter.stats.steps += 1
        return w

    assert step([a, b, c], started=[0, 1, 2]) is None
    assert step([a, b, c]) is None  # nothing left: a full batch may still be an open one
    assert step([a, b]) is None  # c left; a client's next request may be on its way
    assert step([a, b]) is None
    w = step([a, b])  # drain_after (2) steps without one: the batch drains
    assert w == pytest.approx([1.0, float(np.exp(-4 / drafter.settings.drain_slack))])
    assert step([a, b, None]) is None  # a row in prefill: a request came in
    assert step([a, b]) is None and step([a]) is None  # one row: nothing to weigh
