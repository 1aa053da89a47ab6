"""The acceptance model of a draft-length policy: P(a draft token matches the generated one |
the draft tokens before it matched), one model a sampling band (:func:`sampling_band`)."""

from __future__ import annotations

import math

import numpy as np

from ngramd.wire.commands import Draft
from ngramd.wire.constants import MAX_ORDER, TIER_NAMES

from .. import stepkernels
from .keep import STATE_CELLS, read_array

#: Positions in a draft the model and the report tell apart (later ones share the last).
POSITIONS = 32
_CONF_BUCKETS = 11  # share in tenths; 1.0 (a context seen with one continuation) on its own
_TIERS = len(TIER_NAMES)
#: The request's own recent acceptance, the model's fifth feature (``DraftScorer.history``):
#: 0 before any of its draft tokens was scored, then its match rate (each scored token weighs
#: ``HISTORY_DECAY`` times the one after it) binned at these edges: 1 .. len(edges) + 1
HISTORY_EDGES = (0.25, 0.5, 0.75, 0.9)
HISTORY_DECAY = 0.75
_HISTORY = len(HISTORY_EDGES) + 2
#: How far (in standard deviations) the outcomes since the last fit may fall from what the
#: model predicted for them before the model forgets its past at once (``SURPRISE_FORGET``:
#: its counts weigh that much at the next fit): the text changed (a second round, a request
#: that repeats itself, a new kind of prompt), and the old counts would hold the fit back
#: for many refits, under-predicting (or over-) meanwhile.
SURPRISE_Z = 4.0
SURPRISE_FORGET = 0.1
#: A span's (a draft's, or the part of it scored in one step) share of the surprise is held
#: within this many of its own binomial standard deviations: a draft's tokens match or miss
#: together (a passage pasted from the table matches all along), so 16 straight matches where
#: ~0.3 each was predicted are one odd draft, not ~6 standard deviations of evidence; a
#: change of text moves many spans the same way.
SURPRISE_CLIP = 2.5
#: Sampling bands, one acceptance model each: 0 greedy, then the temperatures up to each edge
#: and past the last.  A sampled draft token is accepted with the target's probability of it
#: (vLLM's rejection sampler; the generator's one-hot speculative sampling), which falls as
#: the temperature rises; a greedy draft token, when it is the target's argmax.  Learning
#: both in one model mixed two texts: a sampled phase after a greedy one read as a change of
#: text, and the greedy acceptance went on pricing the sampled drafts.
TEMPERATURE_EDGES = (0.5, 0.9)
BANDS = len(TEMPERATURE_EDGES) + 2
#: Each band's prior: the share of the table's continuation accepted, before any outcome
BAND_PRIOR_SCALE = (0.7, 0.6, 0.45, 0.35)


def sampling_band(temperature: float) -> int:
    """The acceptance model's band of a request sampled at ``temperature`` (0: greedy)."""
    if not temperature > 0:
        return 0
    return 1 + sum(temperature > e for e in TEMPERATURE_EDGES)


def _features(drafts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The orders, tiers and shares of ``drafts``' tokens, concatenated in the dtypes the
    kernels of ``stepkernels`` take (int64, int64, float64)."""
    return (np.concatenate([d.orders for d in drafts], dtype=np.int64),
            np.concatenate([d.tiers for d in drafts], dtype=np.int64),
            np.concatenate([d.conf for d in drafts], dtype=np.float64))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1.0 - p))

class AcceptanceModel:
    """P(a draft token matches the generated one | the tokens before it in the draft matched).

    ``logit p = logit(prior_scale × share) + w_order[o] + w_tier[t] + w_pos[i] + w_share[s]
    + w_hist[h]``: the table's share is the starting estimate (1.0 for a context seen once, so
    a fresh request still speculates on confident long matches), and one weight per value of
    each feature corrects it.  The last feature is the request's own: how its recent draft
    tokens fared (``DraftScorer.history``).  The table's features cannot tell a request that
    repeats text it has seen (an agent's loop, a second round: every draft token matches)
    from one that merely resembles it; the request's record can, within a few tokens.  One
    weight per value keeps the model calibrated per value: at the optimum of the log loss, the
    mean prediction over the tokens with one value (a position, an order) equals their
    observed rate.

    Outcomes are kept as counts per cell of the four features (decayed by ``decay`` per
    ``refit`` tokens, so the model follows the text), and the weights are the exact
    ridge-penalised maximum-likelihood fit of those counts (Newton steps over the ~80 weights),
    redone after every ``refit`` new outcomes, and sooner while the model is young.  ``refit``
    is in outcomes, which grow with the batch (a batch of 32 scores ~256 a step): 1024 (with
    ``decay`` 0.9 per 256 outcomes) fits at most every ~4 steps there, where a fit every step
    cost a large share of ``propose()`` (ARCHITECTURE §13).
    ``ridge`` is the prior's weight, in tokens: a value seen a few times moves little.

    When the outcomes since the last fit missed the predictions made for them by more than
    ``SURPRISE_Z`` standard deviations (binomial, from the predictions; each span's share held
    within ``SURPRISE_CLIP`` of its own), the model refits at
    once, with the counts from before them scaled by ``SURPRISE_FORGET`` instead of
    ``decay``: it reads the new text within a step or two, not a blend for many refits.
    Without it an engine that ran round 1 and then round 2 under-predicted round 2's
    acceptance by up to 0.07 a position (bench/RESULTS.md, "Forgetting when the text
    changes").
    """

    def __init__(self, prior_scale: float = 0.7, ridge: float = 4.0, refit: int = 1024,
                 decay: float = 0.9 ** 4):
        self.prior_scale = prior_scale
        self.ridge, self.refit, self.decay = ridge, refit, decay
        self._sizes = (MAX_ORDER + 1, _TIERS, POSITIONS, _CONF_BUCKETS, _HISTORY)
        self._offsets = np.cumsum((0,) + self._sizes)  # weight index of each feature's values
        self._caps = np.array(self._sizes, np.int64) - 1  # the last index of each feature
        self._coef = np.zeros(int(self._offsets[-1]))
        # outcomes per cell, matches, sum of shares: up to the last fit ([0]) and since ([1])
        self._counts = np.zeros((2, 3) + self._sizes)
        self._n, self._k, self._conf = self._counts[0]
        self._new = 0  # outcomes since the last fit
        # since the last fit: sum of (outcome - prediction) (each span's clipped:
        # SURPRISE_CLIP), and of its binomial variance
        self._surprise, self._variance = 0.0, 0.0
        self.forgot = 0  # fits that forgot the past at once (SURPRISE_Z)
        self.seen = 0

    @staticmethod
    def features(draft: Draft, start: int = 0, end: int | None = None,
                 history: int = 0) -> tuple[np.ndarray, ...]:
        """Feature indices of ``draft``'s tokens ``start .. end``: order, tier, position,
        share bucket, the request's history, and the share itself."""
        n = len(draft) if end is None else end
        return AcceptanceModel.features_of(draft.orders[start:n], draft.tiers[start:n],
                                           np.arange(start, n), draft.conf[start:n], history)

    @staticmethod
    def features_of(orders, tiers, positions, conf, history=0) -> tuple[np.ndarray, ...]:
        """:meth:`features` of tokens given as arrays (several drafts' at once; ``history``
        one value or one a token)."""
        conf = conf.astype(np.float64)
        hist = np.broadcast_to(np.asarray(history, np.int64), conf.shape)
        return (np.minimum(orders.astype(np.int64), MAX_ORDER),
                np.minimum(tiers.astype(np.int64), _TIERS - 1),
                np.minimum(positions, POSITIONS - 1),
                np.minimum((conf * 10).astype(np.int64), 10),
                np.minimum(hist, _HISTORY - 1),
                conf)

    def _offset(self, conf: np.ndarray) -> np.ndarray:
        return _logit(self.prior_scale * conf)

    def predict(self, feats) -> np.ndarray:
        """P(match) of each token with features ``feats``."""
        w, off = self._coef, self._offsets
        z = self._offset(feats[5])
        for j in range(5):
            z = z + w[off[j] + feats[j]]
        return 1.0 / (1.0 + np.exp(-z))

    def learn_spans(self, orders, tiers, shares, bases, starts, lens, missed, hists,
                    out) -> None:
        """Record outcomes, span by span: span ``j`` covers positions ``starts[j]`` ..
        ``+ lens[j]`` of a draft whose tokens' orders, tiers and shares begin at ``bases[j]``
        of ``orders``, ``tiers``, ``shares`` (int64, int64, float64: the drafts
        concatenated); every one matched but the span's last when ``missed[j]``; the
        request's history was ``hists[j]`` when the draft was made.  The predictions made
        for them before, the outcomes and their count go to ``out`` by position (the
        calibration report: ``scoring._Outcomes``).  One numba call (``stepkernels.learn``);
        a fit when enough are new."""
        n, k, conf = self._counts[1]
        m, surprise, variance = stepkernels.learn(
            orders, tiers, shares, bases, starts, lens, missed, hists, self._coef,
            self._offsets, self._caps, self.prior_scale, SURPRISE_CLIP, n, k, conf, out.scored,
            out.matched, out.predicted)
        self._surprise += surprise
        self._variance += variance
        self._new += m
        self.seen += m
        surprised = self._surprised()
        if surprised or self._new >= min(self.refit, max(4, self.seen // 4)):
            self._fit(forget=surprised)

    def _surprised(self) -> bool:
        """Whether the outcomes since the last fit are off its predictions beyond chance
        (``SURPRISE_Z``)."""
        return abs(self._surprise) > SURPRISE_Z * math.sqrt(self._variance + 1.0)

    def rate(self) -> list[float]:
        """The observed match rate of the scored tokens (decayed counts) and their count."""
        n, k = self._counts[:, 0].sum(), self._counts[:, 1].sum()
        return [round(float(k / n), 3) if n >= 1 else None, round(float(n))]

    def by_history(self) -> list[list[float]]:
        """Per value of the request's history (0 none, then the bins of ``HISTORY_EDGES``):
        the observed match rate of the scored tokens and their (decayed) count."""
        n = self._counts[:, 0].sum(axis=(0, 1, 2, 3, 4))
        k = self._counts[:, 1].sum(axis=(0, 1, 2, 3, 4))
        return [[round(float(b / a), 3) if a >= 1 else None, round(float(a))]
                for a, b in zip(n, k)]

    def _fit(self, forget: bool = False, steps: int = 4) -> None:
        """Fold the new counts in and refit; ``forget``: the text changed (``_surprised``)."""
        old, new = self._counts
        if forget:
            old *= SURPRISE_FORGET  # the text changed: forget the past at once
            self.forgot += 1
        elif self._new >= self.refit:  # forget a little, once per refit's worth of outcomes
            old *= self.decay
        old += new
        new[:] = 0.0
        self._new = 0
        self._surprise, self._variance = 0.0, 0.0
        # Newton on the penalised log likelihood (stepkernels.fit)
        self._coef = stepkernels.fit(self._n, self._k, self._conf, self._coef, self._offsets,
                                     self.prior_scale, self.ridge, steps)

    # -- state that outlives the engine (DraftLengthPolicy.state) ------------------------------
    def export_state(self, max_cells: int = STATE_CELLS) -> dict:
        """The outcome counts (those since the last fit folded in) of the cells that hold any,
        at most ``max_cells`` of them (the most outcomes), and the weights: what a restarted
        generator takes up (:meth:`restore_state`)."""
        n, k, conf = self._counts[0] + self._counts[1]
        flat = n.ravel()
        cells = np.flatnonzero(flat > 1e-3)  # the cells the fit reads (stepkernels.fit)
        if cells.size > max_cells:
            cells = np.sort(cells[np.argpartition(flat[cells], -max_cells)[-max_cells:]])
        return {"sizes": list(self._sizes), "prior_scale": self.prior_scale,
                "seen": int(self.seen), "cells": cells.astype("<i4").tobytes(),
                **{name: a.ravel()[cells].astype("<f4").tobytes()
                   for name, a in (("n", n), ("k", k), ("conf", conf))},
                "coef": self._coef.astype("<f8").tobytes()}

    def restore_state(self, d: dict) -> int:
        """Take up :meth:`export_state`'s counts beside those learned since start (they add:
        the restored ones count as older) and refit; returns the outcomes restored.  A state
        of another shape or prior is a ``ValueError`` and changes nothing."""
        if list(d.get("sizes") or ()) != list(self._sizes) \
                or d.get("prior_scale") != self.prior_scale:
            raise ValueError(f"acceptance model of another shape or prior ({d.get('sizes')}, "
                             f"{d.get('prior_scale')}; this one {list(self._sizes)}, "
                             f"{self.prior_scale})")
        cells = read_array(d, "cells", "<i4")
        n, k, conf = (read_array(d, name, "<f4", cells.size) for name in ("n", "k", "conf"))
        total = int(np.prod(self._sizes))
        if cells.size and (cells.min() < 0 or cells.max() >= total
                           or np.unique(cells).size != cells.size):
            raise ValueError("acceptance model: cell indices out of range or repeated")
        if not (np.isfinite(n).all() and (n >= 0).all() and (k >= 0).all()
                and (k <= n * 1.001 + 1e-3).all() and (conf >= 0).all()
                and (conf <= n * 1.001 + 1e-3).all()):
            raise ValueError("acceptance model: counts not finite, negative or inconsistent")
        coef = read_array(d, "coef", "<f8", self._coef.size)
        if not np.isfinite(coef).all():
            raise ValueError("acceptance model: weights not finite")
        old = self._counts[0].reshape(3, total)
        for row, v in zip(old, (n, k, conf)):
            row[cells] += v
        if not self.seen:  # nothing learned here yet: the fit starts from the restored weights
            self._coef = coef.copy()
        seen = d.get("seen")
        restored = int(seen) if isinstance(seen, int) and seen > 0 else int(n.sum())
        self.seen += restored
        self._fit()
        return restored
