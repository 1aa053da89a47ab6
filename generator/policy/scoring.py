"""What a draft-length policy learns from and reports: each request's full drafts scored
against the tokens generated after them (:class:`DraftScorer`), and the same steps under other
policies (:class:`StepTally`)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ngramd.wire.commands import Draft

from .acceptance import HISTORY_DECAY, HISTORY_EDGES, POSITIONS

class _Outcomes:
    """Decayed sums per position for the report: drafted, verified, accepted (of the verified),
    scored (positions whose outcome became known), matched, predicted; rows of one ``block``
    (aged in one operation)."""

    __slots__ = ("block", "drafted", "verified", "accepted", "scored", "matched", "predicted")

    def __init__(self):
        self.block = np.zeros((6, POSITIONS))
        (self.drafted, self.verified, self.accepted, self.scored, self.matched,
         self.predicted) = self.block


class DraftScorer:
    """The full drafts of one request waiting for the tokens that score them.

    ``drafted(draft, at)`` before a step (the full draft, before the policy cut it, following
    the first ``at`` tokens of the request), then ``emitted(tokens, at)`` with the tokens the
    request gained at position ``at``.  A draft position is scored when the token at its place
    is known, and only while the positions before it matched (the model's probability is
    conditional on that); the outcomes go to the policy's :class:`AcceptanceModel`.  A draft
    whose next position is not where the emitted tokens start (a request that was cut and
    resumed) is dropped unscored.  Drafts are kept until they are resolved: at most one per
    step of their length.  A resolved draft's matched prefix also goes to the policy's
    :class:`StepTally` (what other policies would have made of the same step).

    ``band`` is the request's sampling band (``sampling_band``): its outcomes teach that
    band's acceptance model.  ``history`` is the request's record, the acceptance model's fifth
    feature: 0 until one of
    its draft tokens was scored, then its recent match rate (``rate``: each scored token of
    its newest scored draft moves it by ``1 - HISTORY_DECAY``) binned by ``HISTORY_EDGES``.
    Only the newest draft counts at each emission: the drafts of consecutive steps overlap,
    and would count one token several times."""

    __slots__ = ("policy", "_open", "rate", "history", "band")

    def __init__(self, policy, band: int = 0):  # policy: a choice.DraftLengthPolicy
        self.policy = policy
        self.band = band  # the request's sampling band (``sampling_band``): its model
        # [draft, position of its first token, positions scored, step, tokens verified,
        #  the draft's tokens as a list, the request's history when it was drafted]
        self._open: list[list] = []
        self.rate = 0.5
        self.history = 0

    def drafted(self, draft: Draft, at: int) -> None:
        """``draft`` (in full) is proposed at the policy's next step (its choice sets the
        tokens verified)."""
        if len(draft):
            entry = [draft, int(at), 0, self.policy.steps, 0, draft.tokens.tolist(),
                     self.history]
            self._open.append(entry)
            self.policy.tally.drafted(entry)

    def emitted(self, tokens, at: int) -> None:
        if not self._open or not len(tokens):
            return
        # a few tokens against drafts of at most a few dozen: Python lists beat numpy here
        got = tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]
        still = []
        tally = self.policy.tally
        newest = None  # (matched, missed) of the newest draft scored now
        for entry in self._open:
            draft, first, done = entry[:3]
            if first + done != at:
                tally.resolved(entry, done)  # not contiguous with what was scored: drop it
                continue
            want = entry[5][done:done + len(got)]
            end, miss = 0, False
            for w, g in zip(want, got):
                end += 1
                if w != g:
                    miss = True
                    break
            self.policy.learn(draft, done, end, miss, entry[6], self.band)
            if end:
                newest = (end - miss, miss)
            entry[2] = done + end
            if not miss and entry[2] < len(draft):
                still.append(entry)
            else:
                tally.resolved(entry, entry[2] - (1 if miss else 0))
        self._open = still
        if newest is not None:
            matched, miss = newest
            rate = 1.0 - (1.0 - self.rate) * HISTORY_DECAY ** matched
            self.rate = rate * HISTORY_DECAY if miss else rate
            self.history = 1 + sum(self.rate >= e for e in HISTORY_EDGES)

    def clear(self) -> None:
        """End of the request: positions not yet known stay unscored."""
        for entry in self._open:
            self.policy.tally.resolved(entry, entry[2])  # matched at least that far
        self._open = []


class _Step:
    """One chosen step in the tally: its rows, the tokens verified, its seconds (once timed),
    and its drafts: those still open, and the resolved ones' sums."""

    __slots__ = ("rows", "tokens", "seconds", "drafts", "open", "full", "matched", "kept",
                 "kind")

    def __init__(self):
        self.rows = self.tokens = self.open = self.full = self.matched = self.kept = 0
        self.kind = 0
        self.seconds = None
        self.drafts: list = []


class StepTally:
    """The same steps under other draft-length policies, for reports and the benchmark.

    For every step the policy chose and that was timed (the engine's or the loop's seconds
    for it), once every draft of the step is resolved (its matched prefix ``m`` known), the
    step counts for four policies on the same drafts: ``policy`` (the ``k`` tokens it verified
    a row: ``rows + Σ min(m, k)`` tokens out), ``plain`` (none: ``rows`` out), ``full`` (every
    draft token) and ``oracle`` (of the ``m`` that matched, the count that pays best: all of
    them but where the curve is steeper than linear; the bound).  Their seconds
    are the step's measured seconds rescaled by the cost model of its kind (``cost_of(kind)``)
    to their token count (``f(T') / f(T)``), so the ratios between them are this run's, at
    this host's load.  Steps left unresolved (a scorer dropped without ``clear``) are
    forgotten past ``keep``."""

    POLICIES = ("policy", "plain", "full", "oracle")

    def __init__(self, cost_of: Callable, keep: int = 1024):  # kind -> a cost.StepCost
        self.cost_of = cost_of
        self.keep = keep
        self._steps: dict[int, _Step] = {}
        self.tokens = dict.fromkeys(self.POLICIES, 0.0)
        self.seconds = dict.fromkeys(self.POLICIES, 0.0)
        self.steps = 0

    def _at(self, step: int) -> _Step:
        rec = self._steps.get(step)
        if rec is None:
            rec = self._steps[step] = _Step()
            while len(self._steps) > self.keep:
                del self._steps[next(iter(self._steps))]
        return rec

    def drafted(self, entry: list) -> None:
        """A scorer entry (``DraftScorer``) was drafted for step ``entry[3]``."""
        rec = self._at(entry[3])
        rec.drafts.append(entry)
        rec.open += 1
        rec.full += len(entry[0])

    def chosen(self, step: int, rows: int, kept: list[int], kind: int = 0) -> None:
        """At ``step`` over ``rows`` rows (a step of ``kind``) the policy verifies ``kept[i]``
        tokens of the ``i``-th draft (the rows with a draft, in row order: as their entries
        were drafted)."""
        rec = self._at(step)
        rec.rows, rec.tokens, rec.kind = rows, rows + sum(kept), kind
        for entry, k in zip(rec.drafts, kept):
            entry[4] = k
        rec.drafts = []

    def timed(self, step: int, seconds: float) -> None:
        rec = self._steps.get(step)
        if rec is not None and rec.seconds is None and rec.rows:
            rec.seconds = seconds
            self._close(step, rec)

    def resolved(self, entry: list, matched: int) -> None:
        """``entry``'s draft matched the output for its first ``matched`` tokens."""
        rec = self._steps.get(entry[3])
        if rec is None:
            return
        rec.open -= 1
        rec.matched += matched
        rec.kept += min(matched, entry[4])
        self._close(entry[3], rec)

    def _close(self, step: int, rec: _Step) -> None:
        if rec.open > 0 or rec.seconds is None:
            return
        del self._steps[step]
        rows = rec.rows
        # the oracle verifies, of the tokens that matched, the count that pays best (all of
        # them unless the curve is steeper than linear there)
        cost = self.cost_of(rec.kind)
        sure = rows + np.arange(rec.matched + 1)
        best = int(sure[np.argmax(sure / cost.relative(sure))])
        tokens = (rec.tokens, rows, rows + rec.full, best)
        out = (rows + rec.kept, rows, rows + rec.matched, best)
        rel = cost.relative(np.array(tokens))
        for name, r, n in zip(self.POLICIES, rel, out):
            self.seconds[name] += rec.seconds * float(r / rel[0])
            self.tokens[name] += n
        self.steps += 1

    def report(self) -> dict:
        """Tokens a second of each policy over the closed steps, and ``policy``'s ratio to
        each of the others."""
        rate = {k: self.tokens[k] / self.seconds[k] if self.seconds[k] else 0.0
                for k in self.POLICIES}
        mine = rate["policy"]
        return {"steps": self.steps,
                **{f"{k}_tok_s": round(v, 2) for k, v in rate.items()},
                **{f"vs_{k}": round(mine / v, 3) if v else None
                   for k, v in rate.items() if k != "policy"},
                "tokens": {k: round(v, 1) for k, v in self.tokens.items()},
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}
