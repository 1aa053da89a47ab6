"""The drafting rules: what every drafter of one table must agree on (ARCHITECTURE §3.5).

``DraftRules`` is the one type of them: orders, stop rules and the draft limit, with their
defaults (``DEFAULT_RULES``), their validation and their conversion to the tuple
``kernels.draft`` takes (``DraftRules.kernel``, built once per rules object).  Every drafter
drafts with one: the daemon's table (``ngramd.config.TableConfig.rules``, from the ``[table]``
keys, which keep their flat names), a generator (``ngram_generator.drafting.DraftConfig.rules``),
the shared-memory reader (``HotReader.draft(ctx, max_len, rules)``) and the hot-size replay
(``ngramd.hot.curve.ReplaySettings.rules``).  ``info()`` sends the table's (``to_info``), and
a generator drafts with those (``from_info``, in ``drafting.settings_from_table``), so the
defaults matter only without a daemon.

One per-order convention: ``c_min`` and ``s_min`` are a scalar (every order) or one value per
order ``n_min..n_max``, as ``[table]`` lists them and ``info()`` sends them; a list becomes a
tuple.  Changing the orders (``with_orders``, ``updated``: a generator's local ``--n-min`` /
``--n-max``) fits such a tuple to the new range, its first and last values standing for the
orders below and above the old one.  Only the arrays the kernels read are indexed by order
(entry ``n`` for order ``n``, ``MAX_ORDER + 1`` entries): ``kernel`` and ``by_order`` make
them, with ``validate.per_order``.

Bounds: a draft has at most ``max_draft_len`` tokens (16 by default), the table's limit, sent
in ``info()``; ``constants.MAX_DRAFT_LEN`` (4,096) bounds that setting, the ``draft`` op's
``max_len`` and an in-process reader's buffers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .constants import MAX_DRAFT_LEN, MAX_ORDER
from .errors import BadInput
from .validate import per_order

_PER_ORDER = ("c_min", "s_min")


@dataclass(frozen=True)
class DraftRules:
    """Orders, stop rules and the draft limit (ARCHITECTURE §3.5).  Invalid values are a
    ``BadInput`` (a ``ValueError``) at construction."""

    n_min: int = 1
    n_max: int = 16
    c_min: Any = 1  # the best candidate has at least this count
    s_min: Any = 0.3  # ... and at least this share of the context's total
    p_cum: float = 0.1  # stop when the product of shares along the chain falls below it
    f_cap: float = 0.0  # 0 = uncapped; else cap the draft at f_cap x the first matched order
    max_draft_len: int = 16  # tokens: the longest draft

    def __post_init__(self):
        if not 1 <= self.n_min <= self.n_max <= MAX_ORDER:
            raise BadInput(f"need 1 <= n_min <= n_max <= {MAX_ORDER}, "
                           f"got {self.n_min}..{self.n_max}")
        if not 1 <= self.max_draft_len <= MAX_DRAFT_LEN:
            raise BadInput(f"max_draft_len must be in 1..{MAX_DRAFT_LEN}, got "
                           f"{self.max_draft_len!r}")
        for name in _PER_ORDER:
            v = getattr(self, name)
            if isinstance(v, np.ndarray):
                v = v.tolist()
            if isinstance(v, (list, tuple)):
                v = tuple(v)
                object.__setattr__(self, name, v)
                if len(v) != self.n_max - self.n_min + 1:
                    raise BadInput(f"{name}: expected one value per order "
                                   f"{self.n_min}..{self.n_max}, got {len(v)}")
        self.kernel  # noqa: B018 -- checks the thresholds (finite, >= 0) and builds it once

    @functools.cached_property
    def kernel(self) -> tuple:
        """The ``rules`` tuple of ``kernels.draft``: ``(n_min, n_max, c_min, s_min, p_cum,
        f_cap)``, the thresholds as uint32/float32 arrays of ``MAX_ORDER + 1`` entries indexed
        by order (0 below n_min, the last value repeated above n_max: never read).  Built once
        per rules object (a frozen dataclass: ``replace`` makes a new one)."""
        return (int(self.n_min), int(self.n_max), self._by_order("c_min", np.uint32),
                self._by_order("s_min", np.float32), float(self.p_cum), float(self.f_cap))

    def _by_order(self, name: str, dtype) -> np.ndarray:
        a = per_order(getattr(self, name), self.n_max, dtype, name, n_min=self.n_min)
        return np.concatenate([a, np.repeat(a[-1:], MAX_ORDER - self.n_max)])

    def by_order(self, name: str) -> np.ndarray:
        """``c_min`` or ``s_min`` as the kernels index it (``kernel``'s array; do not modify)."""
        return self.kernel[2 + _PER_ORDER.index(name)]

    # -- changes ---------------------------------------------------------------------------
    def with_orders(self, n_min: int, n_max: int) -> "DraftRules":
        """These rules over orders ``n_min..n_max``: a per-order tuple is fitted to them (its
        first value for orders below the old range, its last for orders above it)."""
        if (n_min, n_max) == (self.n_min, self.n_max):
            return self
        fit = {name: _fit(getattr(self, name), self.n_min, n_min, n_max)
               for name in _PER_ORDER if isinstance(getattr(self, name), tuple)}
        return replace(self, n_min=n_min, n_max=n_max, **fit)

    def updated(self, **changes) -> "DraftRules":
        """These rules with ``changes`` (field names; ``None`` values are unset): the orders
        first (``with_orders``), then the rest (a per-order list given here is one value per
        order of the new range)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = set(changes) - set(RULE_FIELDS)
        if unknown:
            raise BadInput(f"not a drafting rule: {', '.join(sorted(unknown))}")
        r = self.with_orders(changes.pop("n_min", self.n_min), changes.pop("n_max", self.n_max))
        return replace(r, **changes) if changes else r

    # -- info() ----------------------------------------------------------------------------
    def to_info(self) -> dict:
        """The rules as ``info()`` sends them: ``orders``, ``limits.max_draft_len`` and
        ``confidence`` (per-order lists for orders n_min..n_max, counts rounded up, shares to
        4 decimals)."""
        lo, hi = self.n_min, self.n_max + 1
        return {"orders": [self.n_min, self.n_max],
                "limits": {"max_draft_len": self.max_draft_len},
                "confidence": {"c_min": self.by_order("c_min")[lo:hi].tolist(),
                               "s_min": [round(float(x), 4)
                                         for x in self.by_order("s_min")[lo:hi]],
                               "p_cum": self.p_cum, "f_cap": self.f_cap}}

    @classmethod
    def from_info(cls, info: dict, base: "DraftRules | None" = None) -> "DraftRules":
        """``base`` (default ``DEFAULT_RULES``) with the rules a daemon's ``info()`` sends
        (``to_info``'s keys); what it lacks or sends in another shape stays ``base``'s.  A
        per-order list is fitted to the orders ``info`` names (``with_orders``' rule)."""
        base = DEFAULT_RULES if base is None else base
        sent: dict = {}
        orders = info.get("orders")
        if isinstance(orders, (list, tuple)) and len(orders) == 2:
            sent["n_min"], sent["n_max"] = int(orders[0]), int(orders[1])
        lo, hi = sent.get("n_min", base.n_min), sent.get("n_max", base.n_max)
        conf = info.get("confidence") or {}
        for name in _PER_ORDER:
            v = conf.get(name)
            if isinstance(v, list) and v:
                sent[name] = _fit(v, lo, lo, hi)
            elif isinstance(v, (int, float)):
                sent[name] = v
        for name in ("p_cum", "f_cap"):
            if isinstance(conf.get(name), (int, float)):
                sent[name] = float(conf[name])
        limit = (info.get("limits") or {}).get("max_draft_len")
        if isinstance(limit, int) and limit >= 1:
            sent["max_draft_len"] = limit
        return base.updated(**sent)


def _fit(values, first: int, n_min: int, n_max: int) -> tuple:
    """Per-order ``values`` (the first for order ``first``) as one value per order
    ``n_min..n_max``: orders outside them take the nearest end's value."""
    last = len(values) - 1
    return tuple(values[min(max(n - first, 0), last)] for n in range(n_min, n_max + 1))


#: the fields of ``DraftRules``, by name
RULE_FIELDS = tuple(f.name for f in fields(DraftRules))
DEFAULT_RULES = DraftRules()
