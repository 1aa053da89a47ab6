"""The hot-size curve: drafting quality against the hot tier's size, from one ranking scan.

ARCHITECTURE §4.7 (and the seed's lesson 7): what to set ``hot_budget_mb`` to is decided by data.
:func:`hot_curve` ranks the whole table once, the way the daemon's hot build ranks it, then for
each budget (a fraction of the table's entries) builds the hot slot table of the best-ranked
rows and replays held-out token sequences through it: greedy on the text itself, a drafted
token is accepted when it equals the next token of the sequence (as ``bench/bench_replay.py``
does).  It returns, per budget, AL (tokens per verify step, the bonus token counted),
acceptance, per-order hit rates and accepted tokens, and the smallest budget that keeps a
given share of the full table's AL from there up (:func:`recommend`).

Why one scan serves every budget
--------------------------------
``kernels.rank.hot_rank`` orders the confident, non-redundant rows by score once; the hot build
then places the first ``capacity x load_factor`` of them (``build_hot``: ``rank[:n_fit]``).
The ranking does not depend on the budget, so the hot set of a smaller budget is a prefix of
the ranking, and every point of the curve is a prefix of one ranked array.  The one place
where the budget enters the placement is the bounded probe (a row that finds no slot within
``max_probe`` of its home is dropped), which depends on the capacity: each point places its
prefix into a table of its own capacity, so those drops are counted as the daemon would.

The daemon's rebuild (``HotCycle.rebuild``) ranks with a *streaming* ``HotSelector`` whose
buffer is bounded by the budget: a redundant row (its parent drafts the same token) is pruned
only when its parent is in the buffer at a cut, so at small budgets the daemon may keep a
redundant child whose parent fell below the cut, where the global ranking here prunes it.  The
curve is therefore exact for ``build_hot``'s global ranking and, at small budgets, a slight
underestimate of what the daemon's tier drafts.  Here the selector runs with a buffer that
holds every confident row, so it never cuts before the end and its ranking is the global one.

At 100% of the entries the hot tier plus its redundant-key filter drafts the same tokens as
every row of the table in RAM (same restart rule); with ``p_cum`` > 0 a chain may only be
longer, since a pruned row drafts with its ancestor's confidence, which is never lower than its
own (``tests/test_hotcurve.py``).  Per-order hit rates are measured at every position of the
held-out continuations (not only where a replay stopped), so they depend on the hot set alone
and grow with the budget; AL with the request-local table first need not (a hot match can
replace a longer local one), AL of the hot tier alone does.

Memory: the selector's buffer (~53 B x 1.25 x entries) plus ``hot_rank``'s temporaries
(~100 B a confident row) plus the largest point's slots (32 B / 0.7 a row): ~2.3 GB for a
15M-entry table.  This is a planning tool, not something the daemon runs while serving.

Used by ``bench/placement.py``; a daemon operation and ``ngram-client hot-curve`` can call
:func:`hot_curve` on the daemon's open ``ColdStore`` (it only reads ``reader.scan_rows`` and the
identity).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

from .. import kernels as K
from ..kernels.bloom import bbloom_may_batch
from ..kernels.hashing import suffix_hashes
from ..kernels.local import local_add
from ..kernels.slots import gather_slots, probe_batch
from ..wire.constants import HOT_K, MAX_ORDER, SLOT_BYTES, SLOT_WORDS
from ..drafttiers import LOCAL_FIRST, DraftTiers, SharedTiers
from ..cold.rows import slice_rows

from .selection import COUNT_WEIGHT, LOAD_FACTOR, MAX_PROBE, HotSelector, pruned_filter
from ..wire.rules import DEFAULT_RULES, DraftRules

log = logging.getLogger("ngramd.hotcurve")  # the name operators know (kept)

#: default budgets, as fractions of the table's entries (0.1% ... 100%)
DEFAULT_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: the share of the full table's AL a recommended budget keeps (ARCHITECTURE §9: two-tier >= 97%)
DEFAULT_KEEP = 0.97
_SLICE = 1 << 16  # rows per selector call (each numpy call on them holds the GIL ~10 ms)


@dataclass
class Ranking:
    """The whole table's confident, non-redundant rows in hot rank order (best first), the keys
    pruned as redundant, and how many entries the scan saw."""

    rows: dict  # key, parent, order, total, tok (m, HOT_K), cnt (m, HOT_K), hits
    redundant: np.ndarray  # uint64 keys pruned as redundant
    entries: int  # rows scanned (the table's entries)
    confident: int  # rows passing the confidence rule
    scan_s: float

    @property
    def ranked(self) -> int:
        return int(self.rows["key"].shape[0])


def rank_table(cold, c_min=1, s_min=0.3, *, hits=None, count_weight: float = COUNT_WEIGHT,
               prune_redundant: bool = True, max_rows: int | None = None,
               stop: threading.Event | None = None) -> Ranking:
    """One streaming scan of ``cold`` (a ``ColdStore``: ``reader.scan_rows``, ``identity``) ranked
    as the daemon's hot build ranks it, without its budget-bound cuts.

    ``c_min``/``s_min``: the drafters' thresholds (scalar or indexed by order).  ``hits``: an
    optional callable ``keys (uint64) -> decayed hits (float64)`` (a daemon passes
    ``HitCounts.lookup``; offline there are none and the score is counts only).
    ``max_rows``: keep only the best rows (the daemon's bounded selector, which cuts its
    buffer as it goes: memory follows the largest budget, not the table)."""
    t0 = time.perf_counter()
    n_max = cold.identity.n_max
    total_rows = int(cold.stats().get("entries_total") or 0) if hasattr(cold, "stats") else 0
    sel = HotSelector(max(total_rows if max_rows is None else max_rows, 1), c_min, s_min,
                      n_max, count_weight=count_weight, prune_redundant=prune_redundant)
    for rs in cold.reader.scan_rows(stop):
        for a in range(0, len(rs), _SLICE):
            b = min(a + _SLICE, len(rs))
            part = slice_rows(rs, a, b)
            tok, cnt = part.padded(HOT_K)
            h = hits(part.key) if hits is not None else np.zeros(b - a, np.float64)
            if max_rows is None and sel.seen + (b - a) > sel.keep:  # grew since stats()
                sel.keep = 2 * (sel.seen + (b - a))
            sel.add(part.key, part.parent, part.order, part.total, tok, cnt,
                    np.asarray(h, np.float64))
    rows = {f: np.ascontiguousarray(v) for f, v in sel.rows().items()}
    return Ranking(rows, sel.redundant_keys(), sel.seen, sel.confident,
                   time.perf_counter() - t0)


def hot_slots(ranking: Ranking, n_rows: int, max_probe: int = MAX_PROBE,
              load_factor: float = LOAD_FACTOR) -> tuple[np.ndarray, dict]:
    """The hot slot table of the best ``n_rows`` ranked rows: capacity the smallest power of two
    holding them at ``load_factor``, rows placed in rank order (``kernels.slots.gather_slots``)."""
    r = ranking.rows
    n = max(0, min(int(n_rows), ranking.ranked))
    cap = 1 << max(6, int(math.ceil(max(n, 1) / load_factor) - 1).bit_length())
    slots, placed = gather_slots(cap, int(max_probe), np.arange(n, dtype=np.int64), r["key"],
                                 r["order"], r["tok"], r["cnt"], r["total"])
    n_placed = int(np.count_nonzero(placed))
    return slots, {"rows": n, "placed": n_placed, "dropped_probe": n - n_placed,
                   "capacity": cap, "bytes": cap * SLOT_BYTES,
                   "hot_budget_mb": cap * SLOT_BYTES / 2**20}


@dataclass(frozen=True)
class ReplaySettings:
    """How the replay drafts: the drafters' ``rules`` (the table's: ``Table.rules``, or
    ``DraftRules.from_info`` of its ``info()``), and the replay's own settings."""

    rules: DraftRules = DEFAULT_RULES
    max_len: int = 8  # draft tokens per step (k)
    max_probe: int = MAX_PROBE
    local: bool = True  # a request-local table first, as a generator drafts
    local_slots: int = 1 << 16


def replay(hot: np.ndarray, pruned: tuple[np.ndarray, int],
           requests: Iterable[tuple[np.ndarray, np.ndarray]],
           cfg: ReplaySettings = ReplaySettings()) -> dict:
    """Replay ``requests`` (``(prompt, continuation)`` uint32 arrays) drafting from ``hot`` (a
    slot table; ``pruned`` its redundant-key filter ``(words, probes)``), greedy on the text.

    Returns AL, acceptance, drafted per step, the share of steps whose draft came from the hot
    tier, and per order the drafted and accepted tokens (by the order that drafted them)."""
    words, nprobe = pruned
    n_min, n_max = cfg.rules.n_min, cfg.rules.n_max
    local = np.zeros((cfg.local_slots, SLOT_WORDS), np.uint32) if cfg.local else None
    # as NgramDrafter drafts in a generator: the request-local table first, then hot
    tiers = DraftTiers(LOCAL_FIRST, local, cfg.max_probe,
                       SharedTiers(hot, pruned=words, pruned_nprobe=nprobe,
                                   max_probe=cfg.max_probe))
    drafted = np.zeros(MAX_ORDER + 1, np.int64)
    accepted = np.zeros(MAX_ORDER + 1, np.int64)
    steps = emitted = n_draft = n_acc = hot_steps = 0
    for prompt, cont in requests:
        seq = np.concatenate([np.asarray(prompt, np.uint32), np.asarray(cont, np.uint32)])
        pos, end = int(len(prompt)), int(seq.size)
        if cfg.local:
            if local.shape[0] < 2 * (n_max - n_min + 1) * end:
                local = np.zeros((1 << (2 * (n_max - n_min + 1) * end).bit_length(),
                                  SLOT_WORDS), np.uint32)
                tiers.set_first(local)
            else:
                local[:] = 0
        added = 0
        while pos < end:
            if cfg.local:
                local_add(local, cfg.max_probe, seq, added, pos, n_min, n_max)
                added = pos
            k = min(cfg.max_len, end - pos - 1)
            d = tiers.draft(seq, pos, k, cfg.rules) if k > 0 else None
            length = len(d) if d is not None else 0
            n = 0
            while n < length and d.tokens[n] == seq[pos + n]:
                n += 1
            steps += 1
            n_draft += length
            n_acc += n
            emitted += n + 1
            if length and d.tiers[0] == K.TIER_HOT:
                hot_steps += 1
            for i in range(length):
                drafted[d.orders[i]] += 1
                if i < n:
                    accepted[d.orders[i]] += 1
            pos += n + 1
    orders = range(n_min, n_max + 1)
    return {
        "steps": steps, "al": emitted / max(steps, 1),
        "acceptance": n_acc / max(n_draft, 1), "drafted_per_step": n_draft / max(steps, 1),
        "hot_draft_share": hot_steps / max(steps, 1),
        "per_order": {str(o): {"drafted": int(drafted[o]), "accepted": int(accepted[o]),
                               "accepted_per_step": float(accepted[o] / max(steps, 1))}
                      for o in orders},
    }


def hit_rates(hot: np.ndarray, pruned: tuple[np.ndarray, int],
              requests: Iterable[tuple[np.ndarray, np.ndarray]],
              cfg: ReplaySettings = ReplaySettings()) -> dict:
    """Per-order hit rate of the hot tier over every position of the continuations (not only
    where a replay stopped, so that it depends on the hot set alone): at each position and
    order n, a lookup of the order-n context hits when the key is in the hot tier with that
    order, or was pruned as redundant (its ancestor drafts the same token)."""
    words, nprobe = pruned
    words = np.ascontiguousarray(words, np.uint64)
    n_min, n_max = cfg.rules.n_min, cfg.rules.n_max
    hs = np.zeros(n_max + 1, np.uint64)
    idx = np.zeros(n_max + 1, np.int64)
    may = np.zeros(n_max + 1, np.bool_)
    lookups = np.zeros(MAX_ORDER + 1, np.int64)
    hits = np.zeros(MAX_ORDER + 1, np.int64)
    orders = np.arange(n_max + 1)
    for prompt, cont in requests:
        seq = np.concatenate([np.asarray(prompt, np.uint32), np.asarray(cont, np.uint32)])
        for pos in range(int(len(prompt)), int(seq.size)):
            avail = suffix_hashes(seq, pos, n_max, hs)
            if avail < n_min:
                continue
            probe_batch(hot, cfg.max_probe, hs, idx)
            ok = idx >= 0
            ok[ok] = (hot[idx[ok], 7] & 0xFF) == orders[ok]
            if words.size:
                bbloom_may_batch(words, hs, nprobe, may)
                ok |= may
            lookups[n_min:avail + 1] += 1
            hits[n_min:avail + 1] += ok[n_min:avail + 1]
    rng = list(range(n_min, n_max + 1))
    return {"hit_rate": float(hits[rng].sum() / max(lookups[rng].sum(), 1)),
            "per_order": {str(o): {"lookups": int(lookups[o]), "hits": int(hits[o]),
                                   "hit_rate": float(hits[o] / lookups[o]) if lookups[o]
                                   else 0.0} for o in rng}}


def hot_curve(cold, requests: Sequence[tuple[np.ndarray, np.ndarray]],
              fractions: Sequence[float] = DEFAULT_FRACTIONS, *,
              settings: ReplaySettings | None = None, keep: float = DEFAULT_KEEP,
              load_factor: float = LOAD_FACTOR, hits=None, count_weight: float = COUNT_WEIGHT,
              max_rows: int | None = None, stop: threading.Event | None = None) -> dict:
    """The hot-size curve of an open table (``cold``: a ``ColdStore``) on ``requests``.

    ``fractions``: hot budgets as fractions of the table's entries (a budget of f holds the
    best ``f x entries`` ranked rows; 1.0 holds every confident, non-redundant row, i.e. the
    whole table's drafts).  ``settings``: how to draft (orders default to the table's).
    Each point is replayed twice: with a request-local table first (the generator's
    in-process path: the AL that matters) and with the hot tier alone (what the budget buys
    without the request's own context).  Returns the ranking's sizes, the points (budget in
    rows, bytes and the ``hot_budget_mb`` that holds them; both replays) and the recommended
    budget (:func:`recommend`)."""
    ident = cold.identity
    cfg = settings or ReplaySettings(rules=DEFAULT_RULES.with_orders(ident.n_min, ident.n_max))
    ranking = rank_table(cold, *_thresholds(cfg.rules), hits=hits, count_weight=count_weight,
                         max_rows=max_rows, stop=stop)
    pruned = pruned_filter(ranking.redundant)
    reqs = list(requests)
    local_cfg = _replace(cfg, local=True)
    alone_cfg = _replace(cfg, local=False)
    points = []
    for f in sorted(set(float(x) for x in fractions)):
        if not 0.0 < f <= 1.0:
            raise ValueError(f"budget fraction {f} outside (0, 1]")
        t0 = time.perf_counter()
        slots, info = hot_slots(ranking, int(round(f * ranking.entries)), cfg.max_probe,
                                load_factor)
        with_local = replay(slots, pruned, reqs, local_cfg)
        alone = replay(slots, pruned, reqs, alone_cfg)
        points.append({"fraction": f, **info, "with_local": with_local, "hot_only": alone,
                       **hit_rates(slots, pruned, reqs, cfg),
                       "seconds": round(time.perf_counter() - t0, 3)})
        log.info("hot curve: %.3g of entries -> %d rows, AL %.3f (hot alone %.3f)", f,
                 info["placed"], with_local["al"], alone["al"])
    return {"entries": ranking.entries, "confident": ranking.confident,
            "ranked": ranking.ranked, "redundant": int(ranking.redundant.shape[0]),
            "scan_s": round(ranking.scan_s, 3), "requests": len(reqs),
            "settings": {**asdict(cfg.rules), "max_len": cfg.max_len, "max_probe": cfg.max_probe,
                         "local": cfg.local, "local_slots": cfg.local_slots},
            "load_factor": load_factor, "points": points,
            "recommended": recommend(points, keep)}


def _thresholds(rules: DraftRules) -> tuple:
    """``c_min``, ``s_min`` as ``rank_table`` takes them: a scalar as it is, per-order values
    indexed by order (``DraftRules.by_order``)."""
    return tuple(rules.by_order(name) if isinstance(getattr(rules, name), tuple)
                 else getattr(rules, name) for name in ("c_min", "s_min"))


def _replace(cfg: ReplaySettings, **kw) -> ReplaySettings:
    from dataclasses import replace

    return replace(cfg, **kw)


def recommend(points: Sequence[dict], keep: float = DEFAULT_KEEP,
              path: str = "with_local") -> dict | None:
    """The smallest budget from which every larger budget's AL (``path``: "with_local" or
    "hot_only") is at least ``keep`` x the AL of the largest budget (a single small budget that
    happens to pass, with larger ones below the bar, is not chosen); None without points."""
    if not points:
        return None
    pts = sorted(points, key=lambda p: p["fraction"])
    top = pts[-1][path]["al"]
    i = len(pts) - 1
    while i > 0 and pts[i - 1][path]["al"] >= keep * top:
        i -= 1
    p = pts[i]
    return {"fraction": p["fraction"], "rows": p["placed"], "bytes": p["bytes"],
            "hot_budget_mb": p["hot_budget_mb"], "al": p[path]["al"], "al_full": top,
            "keep": keep, "path": path}
