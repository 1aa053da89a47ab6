"""The drafting rules: what every drafter of one table must agree on (ARCHITECTURE §3.5).

``DraftRules`` holds the rules and their defaults once.  The daemon's ``[table]`` settings
(``ngramd.config.TableConfig``), a generator's (``ngram_generator.drafting.DraftConfig``) and
the hot-size replay (``ngramd.hotcurve.ReplaySettings``) take their defaults from
``DEFAULT_RULES``; at run time a generator drafts with the daemon's values, which ``info()``
sends (``drafting.settings_from_table``), so the defaults matter only without a daemon.

Per-order thresholds (``c_min``, ``s_min``) are a scalar (every order) or a sequence in the
one convention settings use: one value per order ``n_min..n_max``, as ``[table]`` lists them and
``info()`` sends them.  Only the arrays the kernels read are indexed by order (entry ``n`` for
order ``n``): ``validate.per_order`` and ``kernels.draft_rules`` make them.  (A generator's
``DraftConfig`` keeps them by order, 0..``MAX_ORDER``, because a local ``n_min``/``n_max``
override may widen the table's range: ``settings_from_table`` says how.)

Bounds: a draft has at most ``max_draft_len`` tokens (16 by default), the table's limit, sent
in ``info()``; ``constants.MAX_DRAFT_LEN`` (4,096) bounds that setting, the ``draft`` op's
``max_len`` and an in-process reader's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftRules:
    """Orders, stop rules and the draft limit (ARCHITECTURE §3.5): the defaults of every
    drafter's settings."""

    n_min: int = 1
    n_max: int = 16
    c_min: Any = 1  # the best candidate has at least this count
    s_min: Any = 0.3  # ... and at least this share of the context's total
    p_cum: float = 0.1  # stop when the product of shares along the chain falls below it
    f_cap: float = 0.0  # 0 = uncapped; else cap the draft at f_cap x the first matched order
    max_draft_len: int = 16  # tokens: the longest draft the daemon answers


DEFAULT_RULES = DraftRules()
