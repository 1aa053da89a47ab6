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

The policy's parts, one module each: :mod:`.acceptance` (the acceptance model, per sampling
band), :mod:`.cost` (the step cost, per kind of step, and the run clock), :mod:`.scoring`
(drafts scored against what was generated; the same-steps tally), :mod:`.choice` (the decision
and its figures) and :mod:`.keep` (what a generator keeps in the table for the next one).
"""

from .acceptance import (BAND_PRIOR_SCALE, BANDS, HISTORY_DECAY, HISTORY_EDGES, POSITIONS,
                         SURPRISE_CLIP, SURPRISE_FORGET, SURPRISE_Z, TEMPERATURE_EDGES,
                         AcceptanceModel, sampling_band)
from .choice import BESIDE_GROWTH, DraftLengthPolicy, summary
from .cost import KIND_SLOPE, STEP_KINDS, RunClock, StepCost, step_kind
from .keep import STATE_CELLS, STATE_VERSION, checked_key, state_key, take_up
from .scoring import DraftScorer, StepTally

__all__ = ["AcceptanceModel", "BAND_PRIOR_SCALE", "BANDS", "BESIDE_GROWTH", "DraftLengthPolicy",
           "DraftScorer", "HISTORY_DECAY", "HISTORY_EDGES", "KIND_SLOPE", "POSITIONS",
           "RunClock", "STATE_CELLS", "STATE_VERSION", "STEP_KINDS", "SURPRISE_CLIP",
           "SURPRISE_FORGET", "SURPRISE_Z", "StepCost", "StepTally", "TEMPERATURE_EDGES",
           "checked_key", "sampling_band", "state_key", "step_kind", "summary", "take_up"]
