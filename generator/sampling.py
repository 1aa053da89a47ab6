"""Token choice and lossless acceptance, as pure functions over tensors.

* :func:`processed_probs` — the distribution plain sampling draws from: temperature, then top-k,
  then top-p (the order transformers applies them), then softmax.
* :func:`greedy_accept` — the longest draft prefix equal to the target's argmax, plus the
  target's token after it (the *bonus* token).  Output equals plain greedy decoding token for
  token.
* :func:`speculative_accept` — speculative sampling with a one-hot draft: draft token ``x`` is
  accepted with probability ``p(x)``; on the first rejection the next token is drawn from ``p``
  with ``x`` removed and renormalised; if every draft token is accepted the bonus token is drawn
  from the next position's ``p``.  With ``q = onehot(x)`` this is the rule of Leviathan et al.
  (accept with ``min(1, p(x)/q(x))``, resample from ``norm(max(0, p - q))``), so each emitted
  token has exactly the distribution plain sampling would give it.

Randomness comes only from the ``torch.Generator`` passed in, so seeded runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens.  ``temperature == 0`` means greedy (top-p/top-k are then moot).

    ``top_k == 0`` and ``top_p == 1`` switch those filters off.  ``seed`` makes sampling
    reproducible (None: a fresh random seed per request).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (float32, same shape as ``logits[..., V]``) plain sampling draws from.

    Top-k keeps the k largest logits (ties at the k-th value are all kept); top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (always at least one).
    """
    if params.greedy:
        raise ValueError("processed_probs is for sampling; greedy decoding uses argmax")
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly better tokens
        drop_sorted = before >= params.top_p  # the first token always has before == 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a 1-D probability vector (need not sum to exactly 1)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def greedy_accept(draft: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """``(accepted, next_token)`` for greedy verification.

    ``target[i]`` is the argmax after the prefix plus ``draft[:i]``; ``len(target)`` is
    ``len(draft) + 1``.  ``next_token`` is the target's token at the first mismatch (or the
    bonus token after a fully accepted draft).
    """
    n = 0
    k = len(draft)
    while n < k and draft[n] == target[n]:
        n += 1
    return n, int(target[n])


def speculative_accept(draft: Sequence[int], probs: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """``(accepted, next_token)`` for speculative sampling with a one-hot draft.

    ``probs`` is ``[len(draft) + 1, V]``: row ``i`` is the processed target distribution after
    the prefix plus ``draft[:i]``.  Draws ``len(draft)`` uniforms and (unless the rejected
    token held all the mass) one categorical sample per call, so a seeded run with the same
    drafts consumes randomness reproducibly.
    """
    k = len(draft)
    n = k
    if k:
        idx = torch.as_tensor(list(draft), device=probs.device)
        p_x = probs[torch.arange(k, device=probs.device), idx]
        u = torch.rand(k, generator=generator, device=probs.device)
        rejected = (u >= p_x).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0].item())
    if n == k:
        return k, sample(probs[k], generator)
    residual = probs[n].clone()
    residual[draft[n]] = 0.0
    if not residual.sum() > 0:  # p(x) == 1 up to rounding: x is the only token with mass
        return n, int(draft[n])
    return n, sample(residual, generator)
