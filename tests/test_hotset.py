"""Tests of the hot selection policy (``ngramd.hot.selection``): confidence, redundancy, ranking,
budget and probe bounds of ``build_hot``; ``HitCounts``; the streaming ``HotSelector``; the
pruned filter end to end.  The shared-memory transport is tested in test_hotshm.py."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ngramd import kernels as K
from ngramd.hot import selection as hotset
from ngramd.kernels.count import count_ngrams
from ngramd.kernels.drafting import draft_source
from ngramd.kernels.rank import hot_rank
from ngramd.kernels.local import local_add
from ngramd.kernels.slots import build_slots, probe
from ngramd.wire.constants import EMPTY_TOKEN, SHARE_SLACK, SLOT_WORDS
from ngramd.wire import errors
from ngramd.hot.selection import HitCounts, build_hot
from ngramd.hot.shm import HotPublisher, HotReader
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules
from test_hotshm import decode_all, rows_of

import reference as ref

E = int(EMPTY_TOKEN)


# ---------------------------------------------------------------------------------------------
# what is hot
# ---------------------------------------------------------------------------------------------
def make_rows(spec):
    """Rows from (key, parent, order, total, toks, cnts, hits) tuples."""
    m = len(spec)
    tok = np.full((m, 3), E, np.uint32)
    cnt = np.zeros((m, 3), np.uint32)
    for i, s in enumerate(spec):
        tok[i, :len(s[4])] = s[4]
        cnt[i, :len(s[5])] = s[5]
    col = lambda j, dt: np.array([s[j] for s in spec], dt)  # noqa: E731
    return dict(key=col(0, np.uint64), parent=col(1, np.uint64), order=col(2, np.uint8),
                total=col(3, np.uint32), tok=tok, cnt=cnt, hits=col(6, np.float32))


def placed_keys(slots):
    key = decode_all(slots)[0]
    return set(key[key != 0].tolist())


def test_pruning_rules():
    rows = make_rows([
        # key parent order total toks      cnts      hits
        (11, 0, 1, 10, [5, 6], [6, 4], 0),  # A: kept
        (21, 11, 2, 5, [5, 6], [3, 2], 4),  # B: best == A's best, share 0.6 <= A's -> redundant
        (22, 11, 2, 4, [6, 5], [3, 1], 0),  # C: differs from A -> kept
        (31, 21, 3, 4, [5, 6, 7], [2, 1, 1], 2),  # D: parent B passes (pruned itself) -> redundant
        (25, 11, 2, 3, [5], [3], 0),  # E: A's best, but share 1.0 > A's 0.6 -> kept
        (12, 0, 1, 10, [7, 8, 9], [2, 2, 2], 0),  # F: share 0.2 < 0.3 -> confidence
        (23, 12, 2, 3, [7], [3], 0),  # G: same best as F, but F fails -> kept
        (24, 99, 2, 1, [5], [1], 0),  # H: parent not a candidate -> kept
        (32, 22, 3, 2, [6, 1], [1, 1], 0),  # I: count 1 < c_min[3] = 2 -> confidence
        (41, 0, 1, 0, [], [], 0),  # J: no candidate at all -> confidence
    ])
    slots, info = build_hot(rows, 1 << 16, [0, 1, 1, 2], 0.3, 8)
    assert placed_keys(slots) == {11, 22, 25, 23, 24}
    assert (info["candidates"], info["pruned_redundant"], info["pruned_confidence"],
            info["placed"], info["dropped_budget"], info["dropped_probe"]) == (10, 2, 3, 5, 0, 0)
    slots, info = build_hot(rows, 1 << 16, [0, 1, 1, 2], 0.3, 8, prune_redundant=False)
    assert placed_keys(slots) == {11, 21, 22, 25, 31, 23, 24} and info["pruned_redundant"] == 0
    with pytest.raises(errors.BadInput):  # per-order thresholds must cover every order present
        build_hot(rows, 1 << 16, [0, 1, 1], 0.3, 8)


def test_pruned_children_credit_their_parent():
    # Z outranks A on its own hits; A's redundant children (hits 4 and 2) make A win the
    # only place (budget: 2 slots at load 0.7 -> 1 row)
    rows = make_rows([
        (11, 0, 1, 10, [5], [6], 0), (21, 11, 2, 5, [5], [3], 4), (31, 21, 3, 3, [5], [1], 2),
        (13, 0, 1, 10, [8], [6], 3),
    ])
    slots, info = build_hot(rows, 64, 1, 0.0, 2, min_capacity=1)
    assert info["capacity"] == 2 and info["placed"] == 1 and placed_keys(slots) == {11}
    rows["hits"][:] = [0, 0, 0, 3]  # without the children's hits Z wins
    assert placed_keys(build_hot(rows, 64, 1, 0.0, 2, min_capacity=1)[0]) == {13}


def test_ranking_and_budget():
    rng = np.random.default_rng(3)
    m = 1000
    total = rng.integers(1, 50, m).astype(np.uint32)
    best = np.minimum(total, rng.integers(1, 50, m)).astype(np.uint32)
    hits = rng.integers(0, 20, m).astype(np.float32)
    rows = dict(key=np.arange(1, m + 1, dtype=np.uint64), parent=np.zeros(m, np.uint64),
                order=np.ones(m, np.uint8), total=total,
                tok=np.stack([np.arange(m), np.full(m, E), np.full(m, E)], 1).astype(np.uint32),
                cnt=np.stack([best, np.zeros(m), np.zeros(m)], 1).astype(np.uint32), hits=hits)
    budget = 256 * 32 + 100  # room for 256 slots (not 512): ~179 rows at load 0.7
    slots, info = build_hot(rows, budget, 1, 0.0, 256)
    assert info["capacity"] == 256 and info["bytes"] == 8192 <= budget
    assert info["placed"] == int(256 * 0.7) and info["load"] <= 0.7
    assert info["dropped_budget"] == m - info["placed"] and info["dropped_probe"] == 0
    score = best / total * (hits + hotset.COUNT_WEIGHT * total)
    order = np.lexsort((rows["key"], -score))  # all order 1: ties by key
    assert placed_keys(slots) == set(rows["key"][order[:info["placed"]]].tolist())
    assert info["min_score"] == pytest.approx(score[order[info["placed"] - 1]])
    # a budget with room to spare: the smallest power of two at load <= 0.7
    _, info = build_hot(rows, 1 << 30, 1, 0.0, 64)
    assert info["capacity"] == 2048 and info["placed"] == m
    with pytest.raises(errors.BadInput):
        build_hot(rows, 16, 1, 0.0)


def test_bounded_probe():
    # 20 keys with the same home slot in a 64-slot table: only max_probe of them fit
    m = 20
    keys = (np.arange(1, m + 1, dtype=np.uint64) * np.uint64(64) + np.uint64(5))
    rows = dict(key=keys, parent=np.zeros(m, np.uint64), order=np.ones(m, np.uint8),
                total=np.full(m, 10, np.uint32), tok=np.ones((m, 3), np.uint32),
                cnt=np.ones((m, 3), np.uint32), hits=np.arange(m, dtype=np.float32)[::-1].copy())
    slots, info = build_hot(rows, 64 * 32, 1, 0.0, 4)
    assert info["capacity"] == 64 and info["placed"] == 4 and info["dropped_probe"] == m - 4
    assert placed_keys(slots) == set(keys[:4].tolist())  # the four best-scored
    for k in keys[:4]:
        assert probe(slots, 4, k) >= 0


@settings(max_examples=40, deadline=None)
@given(toks=st.lists(st.integers(0, 7), min_size=2, max_size=300),
       n_max=st.integers(1, 6), c2=st.lists(st.integers(1, 3), min_size=7, max_size=7),
       s_min=st.sampled_from([0.0, 0.3, 0.5]))
def test_pruning_keeps_first_draft_token(toks, n_max, c2, s_min):
    """With the drafter's thresholds and nothing dropped for space, the pruned hot table drafts
    the same first token as the full table for every context."""
    toks = np.array(toks, np.uint32)
    rows = rows_of(toks, 1, n_max, 3)
    rules = DraftRules(1, n_max, tuple(c2[:n_max]), s_min, p_cum=0.0)  # c_min: orders 1..n_max
    cap = 1 << int(np.ceil(np.log2(len(rows["key"]) * 2 + 2)))
    full, placed = build_slots(cap, cap, rows["key"], rows["order"], rows["tok"], rows["cnt"],
                               rows["total"])
    assert placed.all()
    pruned, info = build_hot(rows, 1 << 30, rules.by_order("c_min"), s_min, 1 << 20)
    assert info["dropped_budget"] == info["dropped_probe"] == 0
    # contexts: every prefix of the stream (its last n_max tokens), plus one ending unseen
    ctx_list = [toks[max(0, e - n_max):e] for e in range(1, len(toks) + 1)]
    ctx_list.append(np.array([toks[-1], 9], np.uint32))
    tok_ctx = np.concatenate(ctx_list)
    offs = np.concatenate([[0], np.cumsum([len(c) for c in ctx_list])]).astype(np.int64)
    out = {}
    for name, tab, mp_ in (("full", full, cap), ("pruned", pruned, pruned.shape[0])):
        bufs = K.draft_out(len(offs) - 1, 1)
        K.draft(draft_source((tab,), (K.TIER_HOT,), (True,), mp_),
                rules.kernel, tok_ctx, offs, 1, bufs)
        out[name] = np.where(bufs[4] > 0, bufs[0][:, 0].astype(np.int64), -1)
    assert np.array_equal(out["full"], out["pruned"])


def _hot_only_draft(slots, words, nprobe, ctx, n_max, max_len, s_min, p_cum):
    """Tokens the hot tier alone drafts after ``ctx`` (restart at n_max, the pruned filter)."""
    out = K.draft_out(1, max_len)
    ctx = np.asarray(ctx, np.uint32)
    K.draft(draft_source((slots,), (K.TIER_HOT,), (True,), slots.shape[0], words, nprobe, 0),
            DraftRules(1, n_max, 1, s_min, p_cum).kernel, ctx, np.array([0, ctx.size], np.int64),
            max_len, out)
    return out[0][0, :out[4][0]].tolist()


def _pruned_tier(seqs, n_max, s_min):
    toks = np.array([t for q in seqs for t in q], np.uint32)
    offs = np.concatenate([[0], np.cumsum([len(q) for q in seqs])]).astype(np.int64)
    rows = count_ngrams(toks, offs, 1, n_max, 3)
    slots, info, red = build_hot(rows, 1 << 30, 1, s_min, 1 << 20, return_pruned=True)
    assert info["dropped_budget"] == info["dropped_probe"] == 0
    return (slots, *hotset.pruned_filter(red)), info


def test_a_pruned_row_never_shortens_the_chain():
    """Issue 18: "1 2" -> 3 and "1 2 3" -> 4 were seen once (share 1.0); their parents draft
    the same tokens with share 0.5.  The rule before pruned both, the chain then drafted with
    0.5 x 0.5 and stopped below p_cum after one token, where the whole table drafts two."""
    seqs = [[1, 2, 3, 4], [7, 2, 3, 9], [8, 2, 5], [6, 2, 0]]
    table = ref.count(seqs, 1, 3)
    want = ref.draft(table, [1, 2], 1, 3, 4, s_min=0.3, p_cum=0.5, step_rule="full")
    assert [t for t, _ in want] == [3, 4]
    (slots, words, nprobe), info = _pruned_tier(seqs, 3, 0.3)
    assert _hot_only_draft(slots, words, nprobe, [1, 2], 3, 4, 0.3, 0.5) == [3, 4]
    assert info["pruned_redundant"] > 0  # what adds nothing is still pruned ("2 3 9" -> ...)


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=50), min_size=1,
                     max_size=4),
       n_max=st.integers(2, 6), s_min=st.sampled_from([0.0, 0.3]),
       p_cum=st.sampled_from([0.1, 0.3, 0.6]))
def test_pruned_tier_drafts_at_least_what_the_whole_table_drafts(seqs, n_max, s_min, p_cum):
    """Against the dict drafter of tests/reference.py over the whole table (restart at n_max,
    the p_cum stop): after every prefix of the streams, the pruned hot tier's draft starts
    with the whole table's (same tokens; a pruned row's confidence is its ancestor's, never
    lower than its own, so the chain never stops sooner)."""
    if not any(len(q) > 1 for q in seqs):
        return
    table = ref.count(seqs, 1, n_max)
    (slots, words, nprobe), _ = _pruned_tier(seqs, n_max, s_min)
    for q in seqs:
        for end in range(1, len(q) + 1):
            ctx = q[max(0, end - n_max):end]
            want = [t for t, _ in ref.draft(table, ctx, 1, n_max, 8, s_min=s_min,
                                            p_cum=p_cum, step_rule="full")]
            got = _hot_only_draft(slots, words, nprobe, ctx, n_max, 8, s_min, p_cum)
            assert got[:len(want)] == want, (ctx, got, want)


# ---------------------------------------------------------------------------------------------
# hits and the streaming selection of hot candidates
# ---------------------------------------------------------------------------------------------
def test_hit_counts_against_reference():
    """Against a dict: ``merge(d)`` decays what is stored by d, then adds what was staged;
    hits below 0.05 are forgotten."""
    rng = np.random.default_rng(7)
    h, stored, staged = HitCounts(max_keys=10_000), {}, {}
    for step in range(40):
        keys = rng.integers(1, 500, rng.integers(1, 80)).astype(np.uint64)
        h.add(keys)
        for k in keys.tolist():
            staged[k] = staged.get(k, 0.0) + 1.0
        if step % 5 == 4:
            d = float(rng.choice([0.5, 0.9, 1.0]))
            h.merge(d)
            stored = {k: v * d for k, v in stored.items()}
            for k, v in staged.items():
                stored[k] = stored.get(k, 0.0) + v
            staged = {}
            stored = {k: v for k, v in stored.items() if v >= 0.05}
    got = dict(zip(h.keys.tolist(), h.hits.tolist()))
    assert got.keys() == stored.keys()
    assert all(abs(got[k] - stored[k]) <= 1e-4 * stored[k] for k in stored)
    assert h.pending == sum(staged.values())
    # lookup: unknown keys have 0, known keys their hits
    q = np.array(sorted(got)[:20] + [10**9], np.uint64)
    assert np.allclose(h.lookup(q)[:-1], [got[k] for k in q[:-1].tolist()])
    assert h.lookup(q)[-1] == 0.0
    # bounded: the keys with the most hits stay
    small = HitCounts(max_keys=3)
    small.add(np.array([1, 1, 1, 2, 2, 3, 4, 4, 4, 4], np.uint64))
    small.merge(1.0)
    assert sorted(small.keys.tolist()) == [1, 2, 4]


def test_hit_counts_merge_is_exact_without_interleaving():
    h = HitCounts()
    h.add(np.array([5, 5, 9], np.uint64))
    h.merge(1.0)
    h.add(np.array([9, 11], np.uint64))
    h.merge(0.5)  # decays what was stored, then adds the new hits
    assert dict(zip(h.keys.tolist(), h.hits.tolist())) == {5: 1.0, 9: 1.5, 11: 1.0}


def test_selector_keeps_the_best_confident_rows_in_bounded_memory():
    rng = np.random.default_rng(3)
    m = 5000
    key = np.sort(rng.choice(2**62, m, replace=False).astype(np.uint64))
    parent = rng.integers(0, 2**62, m).astype(np.uint64)
    order = rng.integers(1, 9, m).astype(np.uint8)
    total = rng.integers(1, 50, m).astype(np.uint32)
    c0 = np.minimum(rng.integers(1, 50, m), total).astype(np.uint32)
    tok = np.full((m, 3), EMPTY_TOKEN, np.uint32)
    tok[:, 0] = rng.integers(0, 1000, m)
    cnt = np.zeros((m, 3), np.uint32)
    cnt[:, 0] = c0
    hits = rng.random(m) * 10
    sel = hotset.HotSelector(300, 1, 0.3, 8)
    for a in range(0, m, 250):  # slices, as from a scan
        b = a + 250
        sel.add(key[a:b], parent[a:b], order[a:b], total[a:b], tok[a:b], cnt[a:b], hits[a:b])
        assert sel._n < 2 * 300 + 250  # bounded
    conf = c0 >= 0.3 * total * SHARE_SLACK
    score = hotset.hot_score(hits, total, c0)
    want = set(key[conf][np.argsort(-score[conf], kind="stable")[:300]].tolist())
    r = sel.rows()
    assert sel.confident == int(conf.sum()) and sel.seen == m
    got = set(r["key"].tolist())
    # float32 scores may reorder exact ties at the cut: compare by score
    cut = np.sort(score[conf])[::-1][299]
    assert all(score[np.searchsorted(key, k)] >= cut * (1 - 1e-6) for k in got)
    assert len(got) == 300 and len(got & want) >= 295
    slots, info = hotset.HotBuilder().build(r, 1 << 14, 1, 0.3)
    assert info["placed"] > 0
    # a daemon's first build from an empty table: an empty, publishable slot array
    slots, info = build_hot(hotset.HotSelector(10, 1, 0.3, 8).rows(), 1 << 20, 1, 0.3)
    assert info["placed"] == 0 and info["capacity"] == 64 and not slots.any()


def test_selector_prunes_redundant_rows_while_selecting_and_keeps_their_hits():
    """A child whose parent (its order-1 suffix) has the same best token is pruned while
    selecting, its hits move to the parent, and the room goes to the next best rows."""
    tok = np.array([[7, EMPTY, EMPTY]] * 4 + [[9, EMPTY, EMPTY]], np.uint32)
    cnt = np.array([[5, 0, 0]] * 5, np.uint32)
    key = np.array([10, 20, 30, 40, 50], np.uint64)
    parent = np.array([0, 10, 20, 0, 0], np.uint64)  # 30 -> 20 -> 10, same best token 7
    order = np.array([1, 2, 3, 1, 1], np.uint8)
    total = np.array([5, 5, 5, 5, 5], np.uint32)
    hits = np.array([0.0, 0.0, 100.0, 0.0, 1.0])  # the redundant leaf has the demand
    sel = hotset.HotSelector(2, 1, 0.3, 8, grow=1.1)
    sel.add(key, parent, order, total, tok, cnt, hits)
    r = sel.rows()
    got = dict(zip(r["key"].tolist(), r["hits"].tolist()))
    assert sel.pruned_redundant == 2 and set(sel.redundant_keys().tolist()) == {20, 30}
    assert got == {10: 100.0, 50: 1.0}  # the root got the leaf's hits; 40 lost the last place


class _SmallSelector(hotset.HotSelector):
    MIN_ROWS = 256  # a small first buffer: the cuts before the last one happen on toy data


@pytest.mark.parametrize("keep", [150, 100_000])  # rows cut for space at each cut, or none
def test_selector_gives_the_same_rows_whether_a_scan_is_in_key_order_or_not(keep):
    """A scan gives rows in key order, and the selector's cuts then skip the sort by key and
    keep rows in key order between cuts (no ranking until the last).  Fed the same slices in
    key order and shuffled (the sorting path), it must choose the same rows, with the same
    hits moved up from pruned children, in the same rank order; and without any cut for
    space, every row that ranking the whole table at once keeps."""
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 40, 120) for _ in range(30)]  # a small vocabulary: repeats
    seqs += [np.tile(rng.integers(0, 40, 7), 12) for _ in range(6)]  # chains of one token
    g = np.concatenate(seqs).astype(np.uint32)
    offs = np.cumsum([0] + [len(x) for x in seqs]).astype(np.int64)
    c = count_ngrams(g, offs, 1, 8, 3)
    by_key = np.argsort(c["key"])
    rows = {f: c[f][by_key] for f in ("key", "parent", "order", "total", "tok", "cnt")}
    m = rows["key"].shape[0]
    rows["hits"] = rng.integers(0, 4, m).astype(np.float64)  # integers: sums are exact
    got = []
    for shuffle in (False, True):
        sel = _SmallSelector(keep, 1, 0.3, 8, grow=1.1)
        for a in range(0, m, 97):
            idx = np.arange(a, min(a + 97, m))
            if shuffle:
                idx = rng.permutation(idx)
            sel.add(*(rows[f][idx] for f in ("key", "parent", "order", "total", "tok", "cnt",
                                             "hits")))
        assert sel._key_sorted != shuffle  # each path was taken
        got.append((sel.rows(), sel.pruned_redundant, set(sel.redundant_keys().tolist())))
    (a, pa, ra), (b, pb, rb) = got
    assert a["key"].size and pa == pb and ra == rb
    for f in a:
        assert np.array_equal(a[f], b[f]), f
    if keep > m:  # nothing cut for space: every row the whole table's ranking keeps is
        # kept (and more: a child whose parent was pruned before it arrived stays)
        rank, *_ = hot_rank(rows["key"], rows["parent"], rows["order"], rows["total"],
                            np.ascontiguousarray(rows["tok"][:, 0]),
                            np.ascontiguousarray(rows["cnt"][:, 0]), rows["hits"],
                            np.ones(9, np.int64), np.full(9, 0.3), 0.5, True, True)
        whole = set(rows["key"][rank].tolist())
        assert whole and whole <= set(a["key"].tolist())


EMPTY = int(EMPTY_TOKEN)


def test_a_pruned_global_row_never_loses_to_a_shorter_local_match():
    """The global table says X (16 tokens) -> A at every order, so the hot build keeps the
    short suffix and prunes the rest as redundant.  The request itself once saw the last 5
    tokens of X followed by B.  The whole table would draft A (order 16 beats the local order
    5); with the pruned filter the hot tier does too, without it the local B won."""
    rng = np.random.default_rng(11)
    x = rng.choice(np.arange(1000, 2000), 16, replace=False).astype(np.uint32)
    a, b = np.uint32(7), np.uint32(9)
    g = np.concatenate([rng.integers(100, 200, 30).astype(np.uint32), x, [a]] * 3)
    c = count_ngrams(g, np.array([0, g.size]), 1, 16, 3)
    rows = dict(key=c["key"], parent=c["parent"], order=c["order"], total=c["total"],
                tok=c["tok"], cnt=c["cnt"])
    slots, info, redundant = build_hot(rows, 1 << 16, 1, 0.3, 16, return_pruned=True)
    assert info["pruned_redundant"] >= 15  # X's orders 2..16 repeat their parent's A
    words, nprobe = hotset.pruned_filter(redundant)
    full, _ = build_hot(rows, 1 << 16, 1, 0.3, 16, prune_redundant=False)
    # the request: noise, then x[-5:] -> B once, then noise, then X (the context to draft after)
    ctx = np.concatenate([rng.integers(300, 400, 20).astype(np.uint32), x[-5:], [b],
                          rng.integers(300, 400, 20).astype(np.uint32), x])
    local = np.zeros((1 << 12, SLOT_WORDS), np.uint32)
    local_add(local, 16, ctx, 0, ctx.size, 1, 16)
    rules = DraftRules(1, 16, 1, 0.3, p_cum=0.0).kernel

    def first(table, flt, nprobe, table_restarts):
        out = K.draft_out(1, 4)
        K.draft(draft_source((local, table), (K.TIER_LOCAL, K.TIER_HOT),
                               (False, table_restarts), 16, flt, nprobe, 1),
                rules, ctx, np.array([0, ctx.size], np.int64), 4, out)
        return int(out[0][0, 0]), int(out[1][0, 0]), int(out[2][0, 0])
    assert first(full, np.zeros(0, np.uint64), 0, False) == (a, 16, K.TIER_HOT)  # the truth
    assert first(slots, np.zeros(0, np.uint64), 0, True)[0] == b  # pruned, no filter: wrong
    assert first(slots, words, nprobe, True) == (a, 16, K.TIER_HOT)  # pruned + filter
    # the same through a published segment and a reader with a local table
    with tempfile.TemporaryDirectory() as d:
        ident = TableIdentity(n_min=1, n_max=16, cold_k=3, vocab_size=4000)
        with HotPublisher(d, "t", ident, grace_s=0.0) as pub:
            pub.publish(slots, 16, pruned=words, pruned_nprobe=nprobe)
            r = HotReader(d, "t", identity=ident)
            rules = DraftRules(n_min=1, n_max=16, c_min=1, s_min=0.3, p_cum=0.0)
            dr = r.draft(ctx, 4, rules, local_slots=local, local_max_probe=16)
            assert int(dr.tokens[0]) == a and int(dr.orders[0]) == 16
            r.close()


# ---------------------------------------------------------------------------------------------
# when a scheduled rebuild may run
# ---------------------------------------------------------------------------------------------
def test_rebuild_budget_keeps_rebuilds_to_their_cpu_share():
    """Issue 18: rebuilds of a big table every 30 s kept a core busy.  A rebuild's CPU time is
    a debt paid off at cpu_share CPU-s a second; scheduled rebuilds wait for it, so whatever
    the table, rebuilds average at most cpu_share of a core (plus the first, free one)."""
    b = hotset.RebuildBudget(0.05, now=100.0)
    assert b.allows(100.0) == "paid"  # the first one runs at once
    b.charge(60.0, now=160.0)  # a 60 CPU-s rebuild (it took 60 s of wall time)
    assert b.due_in(160.0) == pytest.approx(1200.0) and b.allows(160.0) is None  # 60 / 0.05
    assert b.due_in(760.0) == pytest.approx(600.0) and b.allows(1360.0) == "paid"
    # a bulk ingest counted into twice the rows the tier saw: once an hour, debt or not
    assert b.allows(170.0, catch_up=True) == "catch-up"
    b.charge(60.0, now=230.0, why="catch-up")
    assert b.allows(300.0, catch_up=True) is None and b.due_in(300.0) > 2000
    # a loop that rebuilds whenever allowed over ten hours of 60 CPU-s rebuilds, the table
    # doubling all the while after bulk ingests (every rebuild could be a catch-up)
    now, cpu = 3000.0, 180.0
    while now < 3000.0 + 36_000:
        now += 30.0  # the check period
        why = b.allows(now, catch_up=True)
        if why:
            b.charge(60.0, now + 60.0, why)
            now += 60.0
            cpu += 60.0
    hours = (now - 100.0) / 3600
    assert cpu <= 0.05 * (now - 100.0) + 60.0 * (hours + 2), (cpu, now)
    st = b.stats(now)
    assert st["rebuilds"] == b.rebuilds and 9 <= st["catch_ups"] <= 12
    assert st["cpu_share_since_start"] <= 0.05 + 60 / 3600 + 0.005
    # a small table's cheap rebuilds wait a little
    small = hotset.RebuildBudget(0.05, now=0.0)
    small.charge(0.01, now=1.0)
    assert small.due_in(1.0) == pytest.approx(0.2)
    with pytest.raises(errors.BadInput):
        hotset.RebuildBudget(0.0, now=0.0)
