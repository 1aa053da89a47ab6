"""The cost side of a draft-length policy: the shape of a step's cost against its token count
(:class:`StepCost`, one curve a kind of step: :func:`step_kind`), and the clock steps are timed
with (:class:`RunClock`)."""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np

from .keep import read_array

#: Kinds of step, one cost curve each: only greedy rows; a sampled row; a row with top-p or
#: top-k.  A sampled position costs more than a greedy one to verify (vLLM computes its
#: distribution; with top-p or top-k it sorts the vocabulary for it, for every row of the
#: batch once any row asks for it), so a step's cost against its tokens depends on its kind.
STEP_KINDS = ("greedy", "sampled", "filtered")
#: Each kind's prior slope, as a multiple of the greedy one (``StepCost.for_device``)
KIND_SLOPE = (1.0, 1.25, 2.5)


def step_kind(temperatures, filtered: bool = False) -> int:
    """The kind of a step (``STEP_KINDS``) over rows sampled at ``temperatures`` (0: greedy),
    ``filtered`` when any row asks for top-p or top-k (which a batch of greedy rows skips)."""
    if not any(t > 0 for t in temperatures):
        return 0
    return 2 if filtered else 1


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
        at the data's edge (a GPU's flat stretch ends; a CPU's stays linear).  A bound that
        pulled the trend back to the prior read far counts well above the truth (ARCHITECTURE
        §13, ``tests/test_generator_sampling.py``)."""
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
        of R rows, for each R in ``rows`` (the report's)."""
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
        steps = read_array(d, "steps", "<f8")
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
