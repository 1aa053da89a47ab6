"""How many draft tokens to verify: one policy for ``ngram-generate`` (batch 1) and the vLLM
proposer (batch B).

Per step and row, the policy verifies the prefix of each row's draft that maximises the batch's
expected output tokens per second; verifying nothing (plain decoding) is always a candidate, so
by its own estimates speculation never makes a step slower (ARCHITECTURE §8).  Two estimates
feed the choice, both learned while generating and both built to survive a busy host:

* :class:`AcceptanceModel` — the probability that a drafted token matches the token that is
  generated, given the draft tokens before it matched.  It is an online logistic model over the
  drafted token's features (matched order, the table's share, tier, position in the draft),
  started at the table's own estimate (``prior_scale`` × share).  It learns from **every**
  position of the full draft, verified or not: :class:`DraftScorer` keeps each step's full draft
  and scores its positions against the tokens generated afterwards (a draft token is accepted
  exactly when it equals the token the target emits at its place — greedy — or with the same
  probability — sampling with a one-hot draft), so a policy that stops verifying long drafts
  still learns that they would have paid, with no exploration.
* :class:`StepCost` — the shape of a step's cost against its token count, ``f(T)``, never its
  absolute seconds.  The decision divides expected tokens by ``f(T)``, so a factor common to
  every step (the host's load) cancels; and the shape is fitted to recent steps with a free
  level per block of a few consecutive steps, which absorbs the load as it drifts, and with
  robust weights, so a stall of 6x moves the curve little.  Priors: nearly flat on a GPU, about
  linear on a CPU.  Counts never verified follow their neighbours (a prior plus a smooth
  residual in log T), past the data no dearer than the cost per token at its edge goes on
  (a guess too high is never verified, so never corrected), and an occasional probe
  measures them: every ``probe_every`` decisions
  with a draft, the policy verifies the count the recent steps measured least (more tokens
  than it would, or fewer: none, a plain step).

:class:`DraftLengthPolicy` joins them (``choose`` for one row, ``choose_batch`` for an engine's
batch) and keeps the figures an operator reads (``report``): tokens drafted, verified and
accepted per position, predicted against observed acceptance, the cost curve and the share of
steps that chose plain decoding.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from typing import Callable

import msgpack
import numpy as np

from ngramd.wire.commands import MAX_POLICY_KEY_BYTES, Draft, Field
from ngramd.wire.errors import BadInput
from ngramd.wire.constants import MAX_ORDER, TIER_NAMES

from . import stepkernels

#: The layout of ``DraftLengthPolicy.state``: 2 keeps a part per sampling band and kind of
#: step; 1 (one model, one curve: greedy) is read as band 0 and kind 0; others are refused
STATE_VERSION = 2
#: The most cells of outcome counts a state holds (16 bytes each: within the daemon's 1 MiB a
#: state, ``MAX_POLICY_STATE_BYTES``, beside the cost fit's 12 KiB of steps); the model has
#: ~279k, a run fills a few thousand
STATE_CELLS = 1 << 15
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
#: Kinds of step, one cost curve each: only greedy rows; a sampled row; a row with top-p or
#: top-k.  A sampled position costs more than a greedy one to verify (vLLM computes its
#: distribution; with top-p or top-k it sorts the vocabulary for it, for every row of the
#: batch once any row asks for it), so a step's cost against its tokens depends on its kind.
STEP_KINDS = ("greedy", "sampled", "filtered")
#: Each kind's prior slope, as a multiple of the greedy one (``StepCost.for_device``)
KIND_SLOPE = (1.0, 1.25, 2.5)
#: A step that carries a prefill chunk keeps the first token of that request waiting: drafts
#: beside it may make it at most this much longer, by the cost model (time to first token)
BESIDE_GROWTH = 1.05


def sampling_band(temperature: float) -> int:
    """The acceptance model's band of a request sampled at ``temperature`` (0: greedy)."""
    if not temperature > 0:
        return 0
    return 1 + sum(temperature > e for e in TEMPERATURE_EDGES)


def step_kind(temperatures, filtered: bool = False) -> int:
    """The kind of a step (``STEP_KINDS``) over rows sampled at ``temperatures`` (0: greedy),
    ``filtered`` when any row asks for top-p or top-k (which a batch of greedy rows skips)."""
    if not any(t > 0 for t in temperatures):
        return 0
    return 2 if filtered else 1


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
    ``decay`` 0.9 per 256 outcomes) fits at most every ~4 steps there, where 256 fitted every
    step and cost ~1 ms of a 4 ms ``propose()``.
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
                    out: "_Outcomes") -> None:
        """Record outcomes, span by span: span ``j`` covers positions ``starts[j]`` ..
        ``+ lens[j]`` of a draft whose tokens' orders, tiers and shares begin at ``bases[j]``
        of ``orders``, ``tiers``, ``shares`` (int64, int64, float64: the drafts
        concatenated); every one matched but the span's last when ``missed[j]``; the
        request's history was ``hists[j]`` when the draft was made.  The
        predictions made for them before, the outcomes and their count go to ``out`` by
        position (the calibration report).  One numba call (``stepkernels.learn``); a fit
        when enough are new."""
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
        cells = _array(d, "cells", "<i4")
        n, k, conf = (_array(d, name, "<f4", cells.size) for name in ("n", "k", "conf"))
        total = int(np.prod(self._sizes))
        if cells.size and (cells.min() < 0 or cells.max() >= total
                           or np.unique(cells).size != cells.size):
            raise ValueError("acceptance model: cell indices out of range or repeated")
        if not (np.isfinite(n).all() and (n >= 0).all() and (k >= 0).all()
                and (k <= n * 1.001 + 1e-3).all() and (conf >= 0).all()
                and (conf <= n * 1.001 + 1e-3).all()):
            raise ValueError("acceptance model: counts not finite, negative or inconsistent")
        coef = _array(d, "coef", "<f8", self._coef.size)
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


def _array(d: dict, name: str, dtype: str, size: int | None = None) -> np.ndarray:
    """Field ``name`` of a state part: bytes read as a flat ``dtype`` array (of ``size``
    values when given); a ``ValueError`` when it is not."""
    raw = d.get(name)
    item = np.dtype(dtype).itemsize
    if not isinstance(raw, bytes) or len(raw) % item:
        raise ValueError(f"{name}: expected bytes of {dtype} values")
    a = np.frombuffer(raw, dtype).astype(np.dtype(dtype).newbyteorder("="))
    if size is not None and a.size != size:
        raise ValueError(f"{name}: {a.size} values where {size} were expected")
    return a


def _demean_blocks(v: np.ndarray, w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """``v`` (steps oldest first, one row each) less the ``w``-weighted mean of its block of
    ``b`` consecutive steps (the last block may be short), and the blocks' means: a free level
    per block, solved out of a weighted least-squares fit."""
    n = v.shape[0]
    nb = -(-n // b)
    tail = (1,) * (v.ndim - 1)
    vp = np.concatenate([v, np.zeros((nb * b - n,) + v.shape[1:])])
    wp = np.concatenate([w, np.zeros(nb * b - n)]).reshape((nb, b) + tail)
    mean = (vp.reshape((nb, b) + v.shape[1:]) * wp).sum(axis=1) / np.maximum(
        wp.sum(axis=1), 1e-12)
    return v - np.repeat(mean, b, axis=0)[:n], mean


class RunClock:
    """Seconds for timing steps: wall time less the time the calling thread waited for a CPU.

    On a busy host a step's wall time is its work plus the time its thread sat runnable while
    other processes held the cores, and that share swings from one minute to the next (beside
    2 busy processes on 2 cores, a vLLM CPU engine's worker got 0.53 to 0.97 of a core from one
    bench cell to the next: bench/RESULTS.md).  The kernel counts that wait per thread (the
    second field of ``/proc/self/task/<tid>/schedstat``); taking it out leaves the step's own
    cost: its computation, and what it blocks on (a GPU, the engine's other processes), which
    contention does not inflate.  What it cannot take out: another thread of the step (an
    OpenMP worker) that waited while this one spun or slept at a barrier.  The wait is the
    calling thread's, so a step is timed from one thread (the engine's, here).  Where the
    kernel has no schedstat, the wall clock (``time.perf_counter``).  A read is one ``pread``
    of a file kept open per thread (~2 us)."""

    def __init__(self):
        self._fds: dict[int, int | None] = {}
        self.available = self._fd() is not None

    def _fd(self) -> int | None:
        tid = threading.get_native_id()
        if tid not in self._fds:
            fd = None
            try:
                fd = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                int(os.pread(fd, 64, 0).split()[1])
            except (OSError, IndexError, ValueError):  # none, or not the format we read
                if fd is not None:
                    os.close(fd)
                fd = None
            self._fds[tid] = fd
        return self._fds[tid]

    def waited(self) -> float:
        """Seconds the calling thread has waited for a CPU since it started (0.0 unknown)."""
        for _ in range(2):  # a thread id reused by a new thread: the old file reads ESRCH
            fd = self._fd()
            if fd is None:
                return 0.0
            try:
                return int(os.pread(fd, 64, 0).split()[1]) * 1e-9
            except (OSError, IndexError, ValueError):
                os.close(fd)
                del self._fds[threading.get_native_id()]
        return 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self.waited()

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class StepCost:
    """The shape of a step's cost against its token count: ``relative(T) = f(T)``, up to a
    common factor (see the module doc).

    ``log f(T) = log(1 + slope (T - 1)) + r(log T)``: the prior line, and a residual ``r``
    interpolated between knots at powers of two (and 3, 6, 12, ...).  The residual is fitted to
    the last ``window`` steps as a regression with one free level per ``block`` consecutive
    steps: ``log seconds = level(block) + log f(T)``.  The levels absorb the host's load, which
    drifts but is about the same for steps a few apart, so only differences between steps of
    one block inform the shape; a block whose steps all had one count says nothing about it
    (the levels are solved out: each pass regresses the block-demeaned rows).  The fit is
    robust (Huber weights, a few reweighted passes: a 6x stall counts as a small error), pulled
    to the prior where the data are thin (``ridge``) and kept smooth in log T (``smooth``, on
    second differences), held to what a step can cost (never less for more tokens), and past
    the counts the recent steps measured (``MIN_SUPPORT``), never above the straight line that
    goes on at the measured curve's own cost per token (``_bounded``).  Redone every ``refit``
    steps: a few small solves, about a millisecond (a few tens of µs a step).

    A row and a draft token cost alike here: vLLM's CPU engine took ``50 + 2.9 R + 2.4 D`` ms
    for a decode step of ``R`` rows verifying ``D`` draft tokens (bench/RESULTS.md), so one
    curve in ``T = R + D`` serves every batch size; the steps keep their rows for ``recent``.
    """

    MIN_SUPPORT = 2.0  # steps (interpolation weight) at a knot for it to count as measured
    BESIDE_MIN = 1.5  # a step this much dearer than its verified tokens carried other work

    def __init__(self, slope: float = 0.1, *, window: int = 512, block: int = 8,
                 refit: int = 32, ridge: float = 0.01, smooth: float = 1.0,
                 max_tokens: int = 1 << 14):
        self.slope = slope
        self.window, self.block, self.refit = window, block, refit
        self.ridge, self.smooth = ridge, smooth
        knots = sorted({1} | {b * m for b in (2 ** j for j in range(15)) for m in (2, 3)})
        self._knots = np.log(np.array([k for k in knots if k <= 2 * max_tokens], np.float64))
        nk = self._knots.shape[0]
        # the penalties: ridge on each knot, and on the second differences of neighbouring
        # knots, so the residual goes on with the slope (in log T) it has at the data's edge
        # (first differences went on as the prior past the data); the ridge holds it to the prior
        # where the data are thin (a ridge on the touched knots alone extended the trend
        # exactly, and the policy then chose plain where full drafts were 5% faster:
        # tests/test_batch.py's steep case)
        diff = np.zeros((nk - 2, nk))
        k = np.arange(nk - 2)
        diff[k, k], diff[k, k + 1], diff[k, k + 2] = 1.0, -2.0, 1.0
        self._penalty = smooth * diff.T @ diff + ridge * np.eye(nk)
        # log f at the knots (the prior until the first fit), interpolated linearly in log T
        # between them (so a curve that does not fall at the knots does not fall between them)
        self._logf = self._prior(np.exp(self._knots))
        self._t = np.zeros(window, np.float64)  # ring of the last steps: tokens, rows,
        self._r = np.ones(window, np.float64)  # log seconds
        self._y = np.zeros(window, np.float64)
        self.observed = 0
        self._fitted = 0  # observations at the last fit
        self._level = None  # log seconds of f = 1 in the newest block (reports only)

    @classmethod
    def for_device(cls, device_type: str) -> "StepCost":
        """Priors: a GPU verifies a few more tokens at almost no cost; a CPU pays per token."""
        return cls(slope=0.003 if device_type == "cuda" else 0.12)

    def _prior(self, tokens: np.ndarray) -> np.ndarray:
        return np.log1p(self.slope * (np.maximum(tokens, 1.0) - 1.0))

    def log_relative(self, tokens) -> np.ndarray:
        if self.observed - self._fitted >= self.refit:
            self._fit()
        t = np.maximum(np.asarray(tokens, np.float64), 1.0)
        return np.interp(np.log(t), self._knots, self._logf)

    def relative(self, tokens) -> np.ndarray:
        """``f(T)`` for each token count in ``tokens``."""
        return np.exp(self.log_relative(tokens))

    def observe(self, tokens: int, seconds: float, rows: int = 1) -> None:
        """One step of ``tokens`` tokens over ``rows`` rows took ``seconds``."""
        if not seconds > 0 or tokens < 1:
            return
        i = self.observed % self.window
        self._t[i], self._r[i], self._y[i] = tokens, max(1, min(rows, tokens)), math.log(seconds)
        self.observed += 1
        if self.observed == self.block:  # enough for a first shape (calibration rounds)
            self._fit()

    def _recent(self):
        """Indices of the recent steps in the ring, oldest first."""
        n = min(self.observed, self.window)
        return np.arange(self.observed - n, self.observed) % self.window

    def recent(self) -> list[list[float]]:
        """The steps the fit sees, oldest first: [tokens, rows, milliseconds] each (the stats
        file's, to tell what the curve was learned on)."""
        return [[int(t), int(r), round(math.exp(y) * 1e3, 2)] for t, r, y in self._steps()]

    def _steps(self) -> np.ndarray:
        """The recent steps, oldest first: (tokens, rows, log seconds) a row."""
        idx = self._recent()
        return np.column_stack([self._t[idx], self._r[idx], self._y[idx]])

    def support(self, tokens) -> np.ndarray:
        """How many of the recent steps fell between the knots around each count in
        ``tokens`` (the evidence the fit has there)."""
        idx = self._recent()
        if not idx.size:
            return np.zeros(len(tokens), np.int64)
        have = np.searchsorted(self._knots, np.log(self._t[idx]), side="right")
        want = np.searchsorted(self._knots, np.log(np.maximum(np.asarray(tokens, float), 1.0)),
                               side="right")
        return np.array([int((have == w).sum()) for w in want], np.int64)

    def _knot_weights(self, t: np.ndarray) -> np.ndarray:
        """Each count's linear-interpolation weights on the knots (in log T), one row each."""
        nk = self._knots.shape[0]
        x = np.log(t)
        j = np.clip(np.searchsorted(self._knots, x, side="right") - 1, 0, nk - 2)
        a = np.clip((x - self._knots[j]) / (self._knots[j + 1] - self._knots[j]), 0.0, 1.0)
        w = np.zeros((t.shape[0], nk))
        w[np.arange(t.shape[0]), j] = 1.0 - a
        w[np.arange(t.shape[0]), j + 1] += a
        return w

    def _fit(self) -> None:
        """The robust ridge regression of the recent steps (class doc)."""
        self._fitted = self.observed
        idx = self._recent()
        t = self._t[idx]
        x, y = self._knot_weights(t), self._y[idx] - self._prior(t)
        w = np.ones(idx.shape[0])
        for _ in range(3):  # iteratively reweighted: Huber weights on the residuals
            xyd, xym = _demean_blocks(np.column_stack([x, y]), w, self.block)
            xd, yd, xm, ym = xyd[:, :-1], xyd[:, -1], xym[:, :-1], xym[:, -1]
            xw = xd * w[:, None]  # einsum, not BLAS: no thread pool on a busy host's step path
            coef = np.linalg.solve(np.einsum("ij,ik->jk", xw, xd) + self._penalty,
                                   np.einsum("ij,i->j", xw, yd))
            res = np.abs(np.einsum("ij,j->i", xd, coef) - yd)
            scale = max(1.4826 * float(np.median(res)), 0.05)
            w = np.minimum(1.0, 1.5 * scale / np.maximum(res, 1e-12))
        self._logf = self._bounded(coef, x.sum(axis=0) >= self.MIN_SUPPORT)
        self._level = float(ym[-1] - xm[-1] @ coef)

    def _bounded(self, r: np.ndarray, measured: np.ndarray) -> np.ndarray:
        """``log f`` at the knots from the fitted residual ``r``, held to what a step can cost:
        never less for more tokens; below the knots the recent steps measured, never less
        than in proportion to the count; above them, never more than the straight line
        through the last measured knot at the cost per token measured over the doubling below
        it (or in proportion to the count, when nothing was measured there).

        Past the data a curve is a guess, and the policy never learns that a guess was too
        high: it does not verify what it believes too dear, and its probes are priced on the
        same curve.  A guess too low is verified, timed, and corrected.  So past the data the
        curve is the cheapest a step plausibly costs: its cost does not grow more slowly than
        at the data's edge (a GPU's flat stretch ends; a CPU's stays linear).  The old bound
        (the trend in log T pulled back to the prior, at most proportional) read 300 tokens at
        1.29x the truth on a CPU-like curve measured to 40
        (``tests/test_generator_sampling.py``)."""
        x = self._knots
        logf = self._prior(np.exp(x)) + r
        idx = np.flatnonzero(measured)
        if idx.size:
            lo, hi = int(idx[0]), int(idx[-1])
            for j in range(lo - 1, -1, -1):
                logf[j] = max(logf[j], logf[j + 1] - (x[j + 1] - x[j]))
            t, f = np.exp(x), np.exp(logf)
            below = idx[t[idx] <= t[hi] / 1.9]
            per_token = f[hi] / t[hi]  # in proportion to the count
            if below.size:
                j0 = int(below[-1])
                per_token = min(per_token, max(0.0, (f[hi] - f[j0]) / (t[hi] - t[j0])))
            line = np.log(f[hi] + per_token * (t[hi + 1:] - t[hi]))
            logf[hi + 1:] = np.minimum(logf[hi + 1:], line)
        return np.maximum.accumulate(logf)

    def beside(self, tokens: int, seconds: float) -> int:
        """Tokens of other work a step of ``tokens`` verified tokens carried (a prefill
        chunk), had it taken ``seconds``: the count whose cost at the recent load is
        ``seconds``, less ``tokens``; 0 before a fit, or when the step took under
        ``BESIDE_MIN`` times what ``tokens`` alone cost (the load's noise)."""
        if self._level is None or not seconds > 0:
            return 0
        grid = tokens + np.concatenate([[0], 2 ** np.arange(16)])  # up to 32k more
        secs = np.maximum.accumulate(self.seconds(grid))
        if seconds < self.BESIDE_MIN * secs[0]:
            return 0
        return int(np.interp(math.log(seconds), np.log(secs) + np.arange(grid.size) * 1e-9,
                             grid)) - tokens

    def seconds(self, tokens) -> np.ndarray:
        """Seconds of a step of ``tokens`` tokens at the load seen lately (reports)."""
        rel = self.relative(tokens)
        return (math.exp(self._level) if self._level is not None else float("nan")) * rel

    def by_rows(self, k: int, rows=(1, 8, 32)) -> dict[int, float]:
        """``f`` of a step of R rows that verifies ``k`` draft tokens a row over a plain step's
        of R rows, for each R in ``rows`` (the report's; vLLM's CPU engine took 4.7-5.7x at
        32 rows and ~8 tokens a row)."""
        return {r: round(float(np.exp(np.subtract(*self.log_relative([(k + 1) * r, r])))), 3)
                for r in rows}

    def curve(self, points=(1, 2, 3, 5, 9, 17, 33, 65, 129, 257)) -> dict[int, float]:
        """``f(T) / f(points[0])`` at a few counts (the report's cost curve; up to 257: a
        batch of 32 verifies 32-288 tokens a step)."""
        rel = self.relative(np.array(points))
        return {int(p): round(float(r / rel[0]), 3) for p, r in zip(points, rel)}

    # -- state that outlives the engine (DraftLengthPolicy.state) ------------------------------
    def export_state(self) -> dict:
        """The recent steps (tokens, rows, log seconds, oldest first) and the prior's slope:
        what a restarted generator takes up (:meth:`restore_state`)."""
        return {"slope": self.slope, "steps": self._steps().astype("<f8").tobytes()}

    def restore_state(self, d: dict) -> int:
        """Take up :meth:`export_state`'s steps as older than those timed since start (the
        newest ``window`` of all are kept; each block's free level absorbs the load they ran
        at) and refit; returns the steps restored.  A state of another prior (another
        device) is a ``ValueError`` and changes nothing."""
        if d.get("slope") != self.slope:
            raise ValueError(f"step cost of another prior (slope {d.get('slope')}; this one "
                             f"{self.slope}): another device")
        steps = _array(d, "steps", "<f8")
        if steps.size % 3:
            raise ValueError("step cost: steps must be (tokens, rows, log seconds) triples")
        steps = steps.reshape(-1, 3)
        t, r, y = steps.T
        if not (np.isfinite(steps).all() and (t >= 1).all() and (r >= 1).all()
                and (r <= t).all() and (np.abs(y) < 50).all()):
            raise ValueError("step cost: steps not finite or out of range")
        both = np.concatenate([steps, self._steps()])[-self.window:]
        n = both.shape[0]
        self._t[:n], self._r[:n], self._y[:n] = both.T
        self.observed = n
        if n:
            self._fit()
        return int(steps.shape[0])


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

    def __init__(self, policy: "DraftLengthPolicy", band: int = 0):
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

    def __init__(self, cost_of: Callable[[int], "StepCost"], keep: int = 1024):
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


#: a key the daemon takes (``save_policy``'s field, checked by the same parser)
_POLICY_KEY = Field("policy_key", "ascii", 1, MAX_POLICY_KEY_BYTES)


def checked_key(key: str) -> str:
    """``key`` when the daemon takes it as a policy state's key; ``BadInput`` naming what is
    wrong with it otherwise."""
    return _POLICY_KEY.parse({"policy_key": key})


def state_key(device: str, model: str) -> str:
    """Where a generator keeps its policy's state in the table (``DraftLengthPolicy.state``):
    ``<device>:<model>`` (the step cost is the model's on that kind of device; the acceptance,
    the model's against the table), with a digest of the model in place of a name longer
    than the daemon takes or not printable ASCII."""
    try:
        return checked_key(f"{device}:{model}")
    except BadInput:
        return f"{device}:sha1:{hashlib.sha1(model.encode()).hexdigest()}"


def take_up(policy: DraftLengthPolicy, link, key: str) -> str:
    """Start ``policy`` from the state the table keeps under ``key`` (``link``: a
    ``DaemonLink``; ``DraftLengthPolicy.restore``), or leave it at its priors when the daemon
    is not up or keeps none, or what it keeps is unusable; returns what happened, for the
    log."""
    blob, saved_at = link.load_policy(key) if link.available else (None, None)
    if blob is None:
        return f"no draft-length policy kept under {key!r}: starting from the priors"
    try:
        got = policy.restore(blob)
    except ValueError as e:
        return f"the draft-length policy kept under {key!r} is unusable ({e}): starting " \
               f"from the priors"
    age = time.time() - saved_at if isinstance(saved_at, (int, float)) else float("nan")
    refused = "".join(f"; its {part} refused: {why}" for part, why in got["refused"].items())
    return (f"took up the draft-length policy kept under {key!r} (saved {age:.0f} s ago): "
            f"{got['outcomes']} outcomes, {got['steps']} timed steps{refused}")


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
