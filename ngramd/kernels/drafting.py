"""Drafting: chained longest match over up to four slot tables (ARCHITECTURE §3.4).

One entry point, ``draft``, for every front end (HotReader, Table, NgramDrafter, the hot-size
curve).  Its inputs travel as three plain tuples with a fixed layout, built by the helpers
here (``draft_source``, ``draft_out``) and by ``wire.rules.DraftRules.kernel`` (the rules)::

  source = (t0, t1, t2, t3, tiers, restart_at_max, max_probe, pruned, pruned_nprobe,
            pruned_table)
      t0..t3          slot tables, earlier first (an absent one: an empty (0, 8) array);
      tiers           int64[4], the tier id reported for a token each table drafts;
      restart_at_max  bool[4], True for a table that omits rows (pruned): restart every step
                      at n_max instead of n + 1 (see draft);
      max_probe       int, the probe bound of every table (the largest one's is right for all);
      pruned, pruned_nprobe, pruned_table  the pruned-key filter (uint64 words, probes) of
                      table ``pruned_table`` (-1: none).
  rules  = (n_min, n_max, c_min, s_min, p_cum, f_cap)
      c_min uint32[MAX_ORDER + 1], s_min float32[MAX_ORDER + 1]: indexed by order
      (validate.per_order); p_cum, f_cap floats (0: off).
  out    = (tok uint32[B, L], order uint8[B, L], tier uint8[B, L], conf float32[B, L],
            length int32[B]): the result buffers, L >= max_len.

Plain tuples, not NamedTuples: numba types a plain tuple in its C dispatcher, a NamedTuple in
Python, which more than doubles the cost of a call (ARCHITECTURE §3.4).  The helpers fix the
dtypes, so one compiled specialisation serves a caller whatever thresholds it was given.

Drafting returns, for every drafted token, the order and the tier that produced it and its
confidence (share), so acceptance can be attributed per order; ``draft_keys`` and
``tally_drafts`` turn a draft's result into the keys behind its tokens and per-order counts.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..wire.constants import EMPTY_TOKEN, HOT_K, SHARE_SLACK
from .bloom import bbloom_may
from .hashing import key_hash, load_tail, suffix_hashes
from .slots import EMPTY_SLOTS, probe, slot_decode


@njit(cache=True)
def _best_at(slots, max_probe, hs, lo, hi, c_min, s_min, t3, c3):
    """Longest order in [lo, hi] (descending) whose key is present and whose best candidate
    passes the confidence rule.  Returns (order, total, probes) with the candidates decoded
    into ``t3``/``c3``, or (0, 0, probes)."""
    probes = 0
    if slots.shape[0] == 0:
        return 0, np.int64(0), 0
    for n in range(hi, lo - 1, -1):
        key = hs[n]
        if key == np.uint64(0):
            continue
        probes += 1
        idx = probe(slots, max_probe, key)
        if idx < 0:
            continue
        order, total = slot_decode(slots, idx, t3, c3)
        if order != n or t3[0] == EMPTY_TOKEN:
            continue  # a colliding key of another order: not ours
        if c3[0] < c_min[n] or c3[0] < s_min[n] * total * SHARE_SLACK:
            continue
        return n, total, probes
    return 0, np.int64(0), probes


@njit(cache=True, inline="always")
def _next_starts(restart_at_max, got, lows, n_min, n_max, start):
    """Where each table's next step starts probing: n + 1 after its match at n in a complete
    table, n_max in one that omits rows (``restart_at_max``) or that matched nothing."""
    for ti in range(4):
        if restart_at_max[ti]:
            start[ti] = n_max
        elif got[ti] > 0:
            start[ti] = min(got[ti] + 1, n_max)
        elif lows[ti] > n_min:  # probed only above an earlier table's match
            start[ti] = min(lows[ti], n_max)
        else:
            start[ti] = n_max


@njit(cache=True)
def _draft_one(source, rules, ctx, max_len, out_tok, out_order, out_tier, out_conf, scratch):
    """One context of ``draft`` (rules there); returns (length, probes).  ``scratch``: the
    buffers of ``draft``, reused by every context.  The step's match over the four tables is
    written out here, not in a helper: as an inlined helper (``inline="always"``) it made
    every draft slower (ARCHITECTURE §13; bench/bench_draft.py), as a called one slower still."""
    t0, t1, t2, t3, tiers, restart_at_max, max_probe, pruned, pruned_nprobe, pruned_table = source
    n_min, n_max, c_min, s_min, p_cum, f_cap = rules
    buf, hs, t3_, c3_, tb, cb, start, got, lows = scratch
    buf_len = n_max + max_len
    end = load_tail(ctx, n_max, buf)
    start[:] = n_max
    pcum, length, probes, cap = 1.0, 0, 0, max_len
    while length < max_len:
        avail = suffix_hashes(buf, end, n_max, hs)
        # the longest order that passes in any table (the earlier table on equal orders),
        # each table probed only above the best order found in the earlier ones
        best, best_tier, best_total = 0, 0, np.int64(0)
        for ti in range(4):
            if ti == 0:
                tab = t0
            elif ti == 1:
                tab = t1
            elif ti == 2:
                tab = t2
            else:
                tab = t3
            lo = max(n_min, best + 1)
            lows[ti] = lo
            got[ti] = 0
            if tab.shape[0] == 0:
                continue
            hi = min(start[ti], avail)
            n_i, total, p = _best_at(tab, max_probe, hs, lo, hi, c_min, s_min, t3_, c3_)
            probes += p
            if ti == pruned_table and n_i == 0 and pruned.shape[0] > 0 and lo > n_min:
                # nothing stored above lo: does a pruned chain reach past it from below?
                n_a, tot_a, p = _best_at(tab, max_probe, hs, n_min, lo - 1, c_min, s_min, t3_,
                                         c3_)
                probes += p
                if n_a > 0:
                    top = n_a
                    while top < avail and bbloom_may(pruned, hs[top + 1], pruned_nprobe):
                        top += 1
                    if top >= lo:
                        n_i, total = top, tot_a
            got[ti] = n_i
            if n_i > best:
                best, best_tier, best_total = n_i, tiers[ti], total
                for r in range(HOT_K):
                    tb[r] = t3_[r]
                    cb[r] = c3_[r]
        if best == 0:
            break
        _next_starts(restart_at_max, got, lows, n_min, n_max, start)
        share = cb[0] / max(best_total, 1)
        pcum *= share
        if length > 0 and pcum < p_cum:
            break
        if length == 0 and f_cap > 0:
            cap = min(max_len, max(1, int(f_cap * best)))
        out_tok[length] = tb[0]
        out_order[length] = best
        out_tier[length] = best_tier
        out_conf[length] = share
        length += 1
        if length >= cap:
            break
        # append and slide the window so it always holds the last n_max tokens
        if end == buf_len:
            for i in range(n_max - 1):
                buf[i] = buf[end - n_max + 1 + i]
            end = n_max - 1
        buf[end] = tb[0]
        end += 1
    return length, probes


@njit(cache=True)
def draft(source, rules, tokens, offsets, max_len, out):
    """Draft up to ``max_len`` tokens after each context ``tokens[offsets[b]:offsets[b+1]]``
    (only its last n_max tokens matter) from the tables of ``source`` into ``out`` (layouts
    in the module docstring); returns the slot-table probes spent.  The one drafting kernel
    of every front end: a single draft is a batch of one (``offsets = [0, len(ctx)]``).

    Per step, the longest match across the tables: the rule is ``count >= c_min[n]`` and
    ``count >= s_min[n] * total``; on equal orders the earlier table wins.  Taking the longer
    match rather than "a first" matters for a request-local table and a global one: a weak
    order-1 match in the request would otherwise hide an order-16 match in the global table.
    After a match at order n the next step starts at n + 1 in a *complete* table (every suffix
    of a stored context is stored, e.g. the request-local table): no longer order can match,
    so a draft costs about two probes per token.  A table that omits entries, such as the hot
    tier with redundant rows pruned, restarts every step at n_max (``restart_at_max``): the
    n + 1 rule over a pruned table loses accepted tokens (ARCHITECTURE §13).  Stops when nothing
    passes, when the product of shares falls below ``p_cum``, or (``f_cap > 0``) when the draft
    reaches ``f_cap`` times the order of its first match.

    ``pruned`` (a blocked Bloom filter, ``bbloom_*``, of the keys the hot builder left out as
    redundant) makes table ``pruned_table`` answer at the order the whole table would: a
    pruned key drafts the same token as its hot ancestor (its longest stored suffix), so when
    every order from the ancestor's up to p is stored or pruned, the match counts as order p.
    Without it a pruned order-12 row lost to an order-8 match of the request-local table that
    drafts something else (ARCHITECTURE §13).
    Requiring the whole chain keeps a filter false positive at one order from inflating it.

    The scratch buffers are allocated once per call, not per context (bench/bench_draft.py)."""
    n_max = rules[1]
    out_tok, out_order, out_tier, out_conf, out_len = out
    scratch = (np.empty(n_max + max_len, np.uint32), np.zeros(n_max + 1, np.uint64),
               np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32),
               np.empty(HOT_K, np.uint32), np.empty(HOT_K, np.uint32),
               np.full(4, n_max, np.int64), np.zeros(4, np.int64), np.zeros(4, np.int64))
    probes = 0
    for b in range(offsets.shape[0] - 1):
        ln, p = _draft_one(source, rules, tokens[offsets[b]:offsets[b + 1]], max_len,
                           out_tok[b], out_order[b], out_tier[b], out_conf[b], scratch)
        out_len[b] = ln
        probes += p
    return probes


#: a pruned-key filter of no keys (a source without one)
NO_FILTER = np.zeros(0, np.uint64)


def draft_source(tables, tiers, restart_at_max, max_probe: int, pruned=NO_FILTER,
                 pruned_nprobe: int = 0, pruned_table: int = -1) -> tuple:
    """The ``source`` tuple of ``draft`` (layout in the module docstring) from up to four
    slot tables, their tier ids and restart flags, earlier first; missing tables are empty.
    For tests of the kernel with layouts no drafter uses; drafters get theirs from
    ``ngramd.drafttiers.DraftTiers``."""
    n = len(tables)
    if not 1 <= n <= 4 or len(tiers) != n or len(restart_at_max) != n:
        raise ValueError("draft_source: 1..4 tables, one tier and one restart flag each")
    t = list(tables) + [EMPTY_SLOTS] * (4 - n)
    return (t[0], t[1], t[2], t[3], np.array(list(tiers) + [0] * (4 - n), np.int64),
            np.array(list(restart_at_max) + [True] * (4 - n), np.bool_), int(max_probe),
            np.ascontiguousarray(pruned, np.uint64), int(pruned_nprobe), int(pruned_table))


def draft_out(batch: int, max_len: int) -> tuple:
    """Result buffers of ``draft`` for ``batch`` contexts of up to ``max_len`` tokens."""
    shape = (batch, max_len)
    return (np.zeros(shape, np.uint32), np.zeros(shape, np.uint8), np.zeros(shape, np.uint8),
            np.zeros(shape, np.float32), np.zeros(batch, np.int32))


@njit(cache=True)
def draft_keys(tokens, offsets, out_tok, out_order, out_len, n_max, out_keys):
    """Key of the entry behind every drafted token (context + draft so far, at its order);
    returns how many were written.  Used to credit lookup hits to hot candidates."""
    m = 0
    buf = np.empty(n_max + out_tok.shape[1], np.uint32)
    for b in range(offsets.shape[0] - 1):
        end = load_tail(tokens[offsets[b]:offsets[b + 1]], n_max, buf)
        for j in range(out_len[b]):
            n = out_order[b, j]
            out_keys[m] = key_hash(buf[end - n:end])
            m += 1
            buf[end] = out_tok[b, j]
            end += 1
    return m


@njit(cache=True)
def tally_drafts(out_tier, out_order, out_len, counts):
    """``counts[tier, order] += 1`` for every drafted token (np.add.at costs ~40 µs a call)."""
    for b in range(out_len.shape[0]):
        for j in range(out_len[b]):
            counts[out_tier[b, j], out_order[b, j]] += 1
