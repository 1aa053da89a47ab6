"""The draft-length policy's choice (:class:`DraftLengthPolicy`): per step, the draft prefixes
that maximise expected tokens per unit of step cost, and its figures (:func:`summary`)."""

from __future__ import annotations

import math

import msgpack
import numpy as np

from ngramd.wire.commands import Draft

from .. import stepkernels
from .acceptance import (BAND_PRIOR_SCALE, BANDS, HISTORY_EDGES, POSITIONS, TEMPERATURE_EDGES,
                         AcceptanceModel, _features)
from .cost import KIND_SLOPE, STEP_KINDS, StepCost
from .keep import STATE_CELLS, STATE_VERSION
from .scoring import DraftScorer, StepTally, _Outcomes

#: A step that carries a prefill chunk keeps the first token of that request waiting: drafts
#: beside it may make it at most this much longer, by the cost model (time to first token)
BESIDE_GROWTH = 1.05


class DraftLengthPolicy:
    """Per step, verify the draft prefixes that maximise expected tokens per second (module
    doc).  ``cost`` is the step-cost shape of greedy steps (:class:`StepCost`; each other kind
    of step, ``STEP_KINDS``, gets its own curve from the same prior, steeper by
    ``KIND_SLOPE``), ``model`` the acceptance model of greedy requests (each sampling band,
    ``sampling_band``, gets its own, from ``BAND_PRIOR_SCALE``); every ``probe_every``
    decisions with a draft, one may verify another count than chosen (``_probe``), so the
    cost of counts the policy stopped using is measured again (0: never)."""

    PROBE_SUPPORT = 8  # recent steps of a count's neighbourhood that make probing it needless
    PROBE_SHARE = 0.03  # of a step's cost, by the model, that probes may spend on average
    # log of the expected speed-up a step must promise over plain decoding to speculate: the
    # tokens chosen are those whose estimates are highest, so their estimates err high (in a
    # README run at load ~8, 35 verified steps predicted ~0.66 and accepted 0.37)
    MARGIN = math.log(1.05)
    # the back-off (``skip_step``): after BACKOFF_AFTER decisions in a row that chose plain
    # (probes aside), only one step in 2 drafts and decides, then one in 4 after as many more,
    # at most one in BACKOFF_MAX; the first decision that verifies a token ends it
    BACKOFF_AFTER = 16
    BACKOFF_MAX = 8

    def __init__(self, cost: StepCost | None = None, model: AcceptanceModel | None = None,
                 *, probe_every: int = 16, window: float = 2048.0):
        stepkernels.warm()  # compiled (or loaded) now, not in a first step
        #: one step-cost curve per kind of step (``STEP_KINDS``; made when first needed)
        self.costs: list[StepCost | None] = [cost or StepCost()] + [None] * (
            len(STEP_KINDS) - 1)
        #: one acceptance model per sampling band (``BANDS``; made when first needed)
        self.models: list[AcceptanceModel | None] = [model or AcceptanceModel()] + [None] * (
            BANDS - 1)
        self.probe_every = probe_every
        self._decay = 1.0 - 1.0 / window  # report sums forget with this factor per step
        self._since_probe = 0
        self._probe_budget = 0.5  # in step costs; grows by PROBE_SHARE a decision, up to 4
        self.steps = self.plain_steps = self.probes = self.skipped = 0
        self.beside_steps = 0  # decisions for a step with a prefill beside (choose_batch)
        self._plain_run = 0  # decisions in a row whose choice (before a probe) was plain
        self._skip_left = 0  # steps still to skip before the next decision
        self.out = _Outcomes()
        self.tally = StepTally(self.cost_of)
        # (draft, start, end, missed, history, band) not yet learned
        self._outcomes: list[tuple] = []
        self._figures_sent: dict[str, float] = {}  # figures() as of its previous call

    @property
    def cost(self) -> StepCost:
        """The step cost of greedy steps (the kind every generator has)."""
        return self.costs[0]

    @cost.setter
    def cost(self, cost: StepCost) -> None:
        self.costs[0] = cost

    @property
    def model(self) -> AcceptanceModel:
        """The acceptance model of greedy requests."""
        return self.models[0]

    def cost_of(self, kind: int) -> StepCost:
        """The step cost of steps of ``kind`` (``STEP_KINDS``), made from the greedy prior."""
        cost = self.costs[kind]
        if cost is None:
            base = self.costs[0]
            cost = self.costs[kind] = StepCost(
                base.slope * KIND_SLOPE[kind], window=base.window, block=base.block,
                refit=base.refit, ridge=base.ridge, smooth=base.smooth)
        return cost

    def model_of(self, band: int) -> AcceptanceModel:
        """The acceptance model of requests in sampling band ``band`` (``sampling_band``)."""
        model = self.models[band]
        if model is None:
            base = self.models[0]
            model = self.models[band] = AcceptanceModel(
                BAND_PRIOR_SCALE[band], ridge=base.ridge, refit=base.refit, decay=base.decay)
        return model

    def scorer(self, band: int = 0) -> DraftScorer:
        """A scorer for one request's drafts (sampled in ``band``: ``sampling_band``)."""
        self.model_of(band)
        return DraftScorer(self, band)

    def timed(self, tokens: int, seconds: float, rows: int = 1, kind: int = 0) -> None:
        """A step of ``kind`` over ``tokens`` tokens (``rows`` rows and their draft tokens)
        took ``seconds``: that kind's cost model learns it, and when it is the step the policy
        chose last, the tally counts it."""
        self.cost_of(kind).observe(tokens, seconds, rows)
        if self.steps:
            self.tally.timed(self.steps - 1, seconds)

    # -- learning ----------------------------------------------------------------------------
    def learn(self, draft: Draft, start: int, end: int, missed: bool, history: int = 0,
              band: int = 0) -> None:
        """Outcomes of ``draft``'s positions ``start .. start + end``: every one matched but
        the last when ``missed``; ``history``: its request's when it was drafted, ``band`` its
        sampling band (kept, and learned together at the next decision or report: one model
        update a step and band, not one a draft)."""
        if end > 0:
            self._outcomes.append((draft, start, start + end, missed, history, band))

    def update(self) -> None:
        """Learn the outcomes kept since the last update (each decision does it first), each
        band's by its model."""
        if not self._outcomes:
            return
        got, self._outcomes = self._outcomes, []
        bands = {g[5] for g in got}
        for band in sorted(bands):
            some = got if len(bands) == 1 else [g for g in got if g[5] == band]
            self._learn(self.model_of(band), some)

    def _learn(self, model: AcceptanceModel, got: list[tuple]) -> None:
        m = len(got)
        drafts = [g[0] for g in got]  # whole (no slices): a draft's offset is its base
        sizes = np.fromiter((len(d) for d in drafts), np.int64, m)
        model.learn_spans(
            *_features(drafts),
            np.cumsum(sizes) - sizes, np.fromiter((g[1] for g in got), np.int64, m),
            np.fromiter((min(e, len(d)) - s for d, s, e, _, _, _ in got), np.int64, m),
            np.fromiter((g[3] for g in got), np.bool_, m),
            np.fromiter((g[4] for g in got), np.int64, m), self.out)

    def verified(self, draft: Draft, accepted: int) -> None:
        """The first ``len(draft)`` tokens were verified and ``accepted`` of them accepted
        (the report's counts; learning comes from the scorer)."""
        n = len(draft)
        if n:
            o = self.out
            o.verified[:min(n, POSITIONS)] += 1
            o.accepted[:min(accepted, POSITIONS)] += 1

    # -- choosing ----------------------------------------------------------------------------
    def skip_step(self) -> bool:
        """Whether this step drafts nothing and decides nothing (the back-off): while the
        policy keeps choosing plain, drafting every row, scoring its draft and asking the
        daemon is work for nothing on most steps (a speculating vLLM engine whose proposer
        drafts nothing already runs at 0.92-1.00x plain on a CPU: bench/RESULTS.md).  Steps
        between decisions are plain steps; the drafts of the decisions still score every
        position, so the acceptance keeps being learned, and the first decision that
        verifies a token drafts every step again.  Call it once a step, before drafting."""
        if self._skip_left <= 0:
            return False
        self._skip_left -= 1
        self.skipped += 1
        self.steps += 1
        self.plain_steps += 1
        return True

    def _back_off(self, plain: bool) -> None:
        """After a decision: how many steps to skip before the next (``skip_step``)."""
        self._plain_run = self._plain_run + 1 if plain else 0
        level = min(self._plain_run // self.BACKOFF_AFTER, self.BACKOFF_MAX.bit_length() - 1)
        self._skip_left = (1 << level) - 1

    def choose(self, draft: Draft, history: int = 0, band: int = 0, kind: int = 0) -> int:
        """How many tokens of ``draft`` to verify (0..len(draft)) in a step of one row (its
        request's ``DraftScorer.history`` and sampling band, the step's kind)."""
        return self.choose_batch([draft], [history], bands=[band], kind=kind)[0]

    def choose_batch(self, drafts: list[Draft], history=None, beside: int = 0, bands=None,
                     kind: int = 0, weights=None) -> list[int]:
        """How many tokens of each row's draft to verify in one step over ``len(drafts)`` rows
        (``history``: each row's request's ``DraftScorer.history``; None: none known), beside
        ``beside`` tokens of other work in the step (a prefill chunk: ``StepCost.beside``).
        ``bands``: each row's sampling band (``sampling_band``; None: greedy), which acceptance
        model prices its draft; ``kind``: the step's (``step_kind``), which cost curve prices
        it; ``weights``: what a token of each row is worth (None: 1 each; a batch that drains
        values its longest rows: ``BatchDrafter``).

        A step over ``T`` tokens (one per row plus the draft tokens verified, plus ``beside``)
        costs ``f(T)`` and yields on average one token per row plus the chain probability of
        every verified draft token, each weighed by its row's weight.  Tokens are taken best
        first (a row's chain only falls along its draft, so a row always gets a prefix), and
        the number taken is the one that maximises the expected weighed tokens per unit cost,
        0 included.  Beside a prefill, the step may grow by at most ``BESIDE_GROWTH`` (its
        request's first token waits for it), and no probe is made (its seconds are not timed:
        nothing would be measured)."""
        self.update()
        counts = self._choose(drafts, history, max(0, int(beside)), bands, kind, weights)
        self.tally.chosen(self.steps, len(drafts), [k for d, k in zip(drafts, counts) if len(d)],
                          kind)
        self.steps += 1
        return counts

    def _choose(self, drafts: list[Draft], history, beside: int, bands, kind: int,
                weights) -> list[int]:
        rows = len(drafts)
        sizes = np.fromiter((len(d) for d in drafts), np.int64, rows)
        total = int(sizes.sum())
        self._age()
        if not total:
            self._back_off(True)
            return [0] * rows
        ranked = np.empty(total, np.int64)  # the row of each token, best first
        band = (np.zeros(rows, np.int64) if bands is None
                else np.fromiter(bands, np.int64, rows))
        models = [self.model_of(b) for b in range(int(band.max()) + 1)]
        log_cost = self.cost_of(kind).log_relative(rows + beside + np.arange(total + 1))
        if beside:  # the prefill's request waits: grow the step by BESIDE_GROWTH at most
            log_cost[log_cost - log_cost[0] > math.log(BESIDE_GROWTH)] = np.inf
        best, gain = stepkernels.choose(
            *_features(drafts), sizes,
            np.zeros(rows, np.int64) if history is None else np.fromiter(history, np.int64, rows),
            band, np.ones(rows) if weights is None else np.fromiter(weights, np.float64, rows),
            np.stack([m._coef for m in models]), models[0]._offsets, models[0]._caps,
            np.array([m.prior_scale for m in models]), log_cost, self.out.drafted, ranked)
        if gain < self.MARGIN:  # not clearly better than plain: plain
            best = 0
        self._back_off(best == 0)
        if beside:
            self.beside_steps += 1
        else:  # a probe's step must be timed
            self._since_probe += 1
            self._probe_budget = min(self._probe_budget + self.PROBE_SHARE, 4.0)
            if self.probe_every and self._since_probe >= self.probe_every:
                best = self._probe(best, total, rows, self.cost_of(kind))
        if best == 0:
            self.plain_steps += 1
            return [0] * rows
        return np.bincount(ranked[:best], minlength=rows).tolist()

    def _probe(self, best: int, total: int, rows: int, cost: StepCost) -> int:
        """A count other than ``best`` whose cost the recent steps measured least, so the cost
        of counts the policy stopped verifying is measured again: more tokens (2, 4, 8 or 16
        more) or fewer (half, or none — the plain-step reference that a policy drafting in full
        never sees).  ``best`` itself when every candidate was measured ``PROBE_SUPPORT`` times
        among the recent steps, or costs more than the probe budget holds (probes spend
        ``PROBE_SHARE`` of the steps' cost, by the model: at load ~8 on this host, unbudgeted
        probes of 16 more tokens on a curve that read f(17) = 12 cost the README walk-through's
        round 1 a quarter of its speed)."""
        self._since_probe = 0
        extra = max(1, rows // 4)
        options = sorted({min(total, best + m * extra) for m in (2, 4, 8, 16)} | {best // 2, 0}
                         - {best})
        # what a probe costs beyond the chosen step, by the model: probes spend at most
        # PROBE_SHARE of the steps' cost (a steep curve, true or not, is probed gently)
        rel = cost.relative(np.array([rows + best] + [rows + k for k in options]))
        extra_cost = np.maximum(rel[1:] / rel[0] - 1.0, 0.0)
        affordable = [i for i, c in enumerate(extra_cost) if c <= self._probe_budget]
        if not affordable:
            return best
        support = cost.support([rows + options[i] for i in affordable])
        j = int(np.argmin(support))
        if support[j] >= self.PROBE_SUPPORT:
            return best
        i = affordable[j]
        self._probe_budget -= float(extra_cost[i])
        self.probes += 1
        return options[i]

    def _age(self) -> None:
        self.out.block *= self._decay

    # -- state that outlives the engine --------------------------------------------------------
    def state(self) -> bytes:
        """What this policy learned, as bytes (msgpack; ``STATE_VERSION``): each sampling
        band's acceptance model (outcome counts and weights) and each kind of step's recent
        steps.  A generator keeps it in the table (``ngramd``'s ``save_policy``), and the next
        one to start (a restarted engine, another engine of the fleet) takes it up with
        :meth:`restore` instead of starting from the priors (bench/RESULTS.md: a fresh engine
        relearning on its first requests).  The report's figures stay the engine's own."""
        self.update()
        models = {b: m for b, m in enumerate(self.models) if m is not None}
        return msgpack.packb({
            "v": STATE_VERSION,
            "acceptance": {b: m.export_state(STATE_CELLS // len(models))
                           for b, m in models.items()},
            "cost": {k: c.export_state() for k, c in enumerate(self.costs) if c}},
            use_bin_type=True)

    def restore(self, blob: bytes) -> dict:
        """Take up a :meth:`state` (beside what was learned since start: both count, the
        restored as older).  Each part (a band's model, a kind's steps) is taken or refused on
        its own (a state from another device has cost curves that do not apply here, and
        acceptance models that do); returns what was taken (``outcomes``, ``steps``) and why
        a part was refused (``refused``).  Bytes that are not a state are a ``ValueError``
        that changes nothing."""
        try:
            d = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several types
            raise ValueError(f"not a policy state ({type(e).__name__}: {e})") from None
        version = d.get("v") if isinstance(d, dict) else type(d).__name__
        if version not in (1, STATE_VERSION):
            raise ValueError(f"not a policy state of version {STATE_VERSION} (got {version!r})")
        self.update()
        out: dict = {"outcomes": 0, "steps": 0, "refused": {}}
        for part, what, count, get in (("acceptance", "outcomes", BANDS, self.model_of),
                                       ("cost", "steps", len(STEP_KINDS), self.cost_of)):
            parts = d.get(part)
            if version == 1:  # one part: greedy
                parts = {0: parts}
            if not isinstance(parts, dict) or not parts:
                out["refused"][part] = f"no {part} part"
                continue
            for i, sub in parts.items():
                name = f"{part}[{i}]" if version != 1 else part
                try:
                    if not isinstance(i, int) or not 0 <= i < count or not isinstance(sub, dict):
                        raise ValueError(f"not a {part} part: {i!r}")
                    out[what] += get(i).restore_state(sub)
                except ValueError as e:
                    out["refused"][name] = str(e)
        return out

    # -- figures -----------------------------------------------------------------------------
    def report(self, positions: int = 8) -> dict:
        """What the policy did and believes, for logs and stats: per position (the first
        ``positions``), tokens drafted, verified and accepted (decayed over ~``window``
        steps), predicted against observed acceptance of the scored positions; the cost curve
        (relative to a one-token step) and the share of steps that chose plain decoding."""
        self.update()
        o = self.out
        n = positions

        def rnd(a):
            return [round(float(x), 1) for x in a[:n]]

        scored = np.maximum(o.scored[:n], 1e-9)
        seen = o.scored[:n] >= 1
        return {
            "steps": self.steps, "plain_share": round(self.plain_steps / self.steps, 3)
            if self.steps else 0.0, "probes": self.probes, "skipped": self.skipped,
            "beside_prefill": self.beside_steps,
            "drafted": rnd(o.drafted), "verified": rnd(o.verified), "accepted": rnd(o.accepted),
            "observed": [round(float(x), 3) if s else None
                         for x, s in zip(o.matched[:n] / scored, seen)],
            "predicted": [round(float(x), 3) if s else None
                          for x, s in zip(o.predicted[:n] / scored, seen)],
            "cost_curve": self.cost.curve(),
            "cost_8_a_row": self.cost.by_rows(8),
            # the other kinds' curves, those seen (STEP_KINDS)
            "cost_curves": {STEP_KINDS[k]: c.curve() for k, c in enumerate(self.costs)
                            if c is not None and k and c.observed},
            "same_steps": self.tally.report(),
            "by_history": self.model.by_history(),
            # per sampling band seen: the match rate of its scored draft tokens, their count
            "by_band": {b: m.rate() for b, m in enumerate(self.models) if m is not None
                        and m.seen},
            # refits that forgot the past (the text changed), all bands
            "forgot": sum(m.forgot for m in self.models if m is not None),
        }

    def figures(self) -> dict[str, float]:
        """What happened since the previous call, for the daemon's stats (``report``'s
        ``policy``; ``ngramd.wire.commands.POLICY_FIGURES``): steps with a draft, those that
        verified none, and the same-steps tally's tokens and seconds per policy.  Empty when
        nothing did."""
        now = {"steps": float(self.steps), "plain_steps": float(self.plain_steps),
               **{f"{k}_tokens": v for k, v in self.tally.tokens.items()},
               **{f"{k}_seconds": v for k, v in self.tally.seconds.items()}}
        last, self._figures_sent = self._figures_sent, now
        delta = {k: v - last.get(k, 0.0) for k, v in now.items()}
        return delta if delta["steps"] > 0 or delta["policy_seconds"] > 0 else {}

    def calibration_error(self, min_scored: float = 50.0) -> float:
        """Largest |predicted - observed| acceptance over positions scored ``min_scored``
        times or more (0 when none is)."""
        self.update()
        o = self.out
        ok = o.scored >= min_scored
        if not ok.any():
            return 0.0
        return float(np.max(np.abs(o.predicted[ok] - o.matched[ok]) / o.scored[ok]))


def summary(r: dict) -> str:
    """The draft-length policy's figures (``DraftLengthPolicy.report``) in five lines."""
    def cells(xs, fmt):
        return " ".join("-" if x is None else format(x, fmt) for x in xs)

    return (f"draft lengths: {r['steps']} steps, plain in {100 * r['plain_share']:.0f}% "
            f"({r.get('skipped', 0)} backed off: not drafted), {r['probes']} probes, "
            f"{r.get('beside_prefill', 0)} beside a prefill; "
            f"cost of a step by tokens (x a 1-token step): "
            + ", ".join(f"{t}: {c:.2f}" for t, c in r["cost_curve"].items()) + "\n"
            f"  by draft position 1..{len(r['drafted'])}: drafted {cells(r['drafted'], '.0f')}"
            f" | verified {cells(r['verified'], '.0f')} | accepted {cells(r['accepted'], '.0f')}"
            "\n"
            f"  acceptance predicted {cells(r['predicted'], '.2f')} | observed "
            f"{cells(r['observed'], '.2f')}\n"
            + _by_history(r.get("by_history"), r.get("forgot", 0)) + _by_band(r)
            + _same_steps(r["same_steps"]))


def _by_band(r: dict) -> str:
    """The sampled bands' acceptance and the other kinds' cost curves, when any was seen."""
    bands = {int(b): v for b, v in (r.get("by_band") or {}).items() if int(b)}
    curves = r.get("cost_curves") or {}
    if not bands and not curves:
        return ""
    edges = (0.0,) + TEMPERATURE_EDGES
    names = [f"T {edges[b - 1]}-{edges[b]}" if b < len(edges) else f"T > {edges[-1]}"
             for b in range(1, BANDS)]
    out = "  sampled: " + ", ".join(
        f"{names[b - 1]} match rate {'-' if rate is None else format(rate, '.2f')} ({n})"
        for b, (rate, n) in sorted(bands.items()))
    for kind, curve in curves.items():
        out += f"; cost of a {kind} step by tokens: " + ", ".join(
            f"{t}: {c:.2f}" for t, c in list(curve.items())[:6])
    return out + "\n"


def _by_history(h, forgot: int) -> str:
    if not h:
        return ""
    names = ["none"] + [f"<{e}" for e in HISTORY_EDGES] + [f">={HISTORY_EDGES[-1]}"]
    return ("  acceptance by the request's record: " + ", ".join(
        f"{name} {'-' if rate is None else format(rate, '.2f')} ({n})"
        for name, (rate, n) in zip(names, h))
        + f"; the text changed (the model forgot its past) {forgot} times\n")


def _same_steps(t: dict) -> str:
    if not t["steps"]:
        return "  same steps: none closed yet"
    return (f"  same {t['steps']} steps, tokens/s by the cost model: this policy "
            f"{t['policy_tok_s']:.1f}, plain {t['plain_tok_s']:.1f}, full drafts "
            f"{t['full_tok_s']:.1f}, oracle {t['oracle_tok_s']:.1f} (this policy: "
            f"{t['vs_plain']:.2f}x plain, {t['vs_full']:.2f}x full, "
            f"{100 * t['vs_oracle']:.0f}% of the oracle)")
