"""Kernels against the plain-Python reference (tests/reference.py), on random and real streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ngramd import kernels as K
from ngramd.kernels.count import count_ngrams
from ngramd.kernels.drafting import draft_source
from ngramd.kernels.hashing import key_hash, suffix_hashes
from ngramd.kernels.local import local_add
from ngramd.kernels.slots import build_slots, probe, probe_batch, slot_decode, write_slot
from ngramd.wire.constants import EMPTY_TOKEN, HOT_K, SLOT_WORDS, U16_MAX
from ngramd.wire.rules import DraftRules

import reference as ref
from corpus import qwen_token_stream


@pytest.fixture(scope="module")
def qwen_tokens():
    return qwen_token_stream(8000)

EMPTY = np.zeros((0, SLOT_WORDS), np.uint32)

streams = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=60), min_size=1, max_size=4)


def _flat(seqs):
    lens = [len(s) for s in seqs]
    offs = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    toks = np.array([t for s in seqs for t in s], np.uint32)
    return toks, offs


def _slots_from(seqs, n_min, n_max, k=8):
    toks, offs = _flat(seqs)
    agg = count_ngrams(toks, offs, n_min, n_max, k)
    cap = 1 << int(np.ceil(np.log2(max(len(agg["key"]), 1) * 2 + 2)))
    slots, placed = build_slots(cap, 64, agg["key"], agg["order"], agg["tok"], agg["cnt"],
                                agg["total"])
    assert placed.all()
    return slots, agg


def _draft(slots, ctx, n_min, n_max, max_len, c_min=1, s_min=0.0, p_cum=0.0, f_cap=0.0,
           slots_b=EMPTY):
    res = K.draft_out(1, max_len)
    ctx = np.asarray(ctx, np.uint32)
    K.draft(draft_source((slots, slots_b), (K.TIER_LOCAL, K.TIER_HOT), (False, False), 64),
            DraftRules(n_min, n_max, c_min, s_min, p_cum, f_cap).kernel, ctx,
            np.array([0, ctx.size], np.int64), max_len, res)
    n = res[4][0]
    out = [a[0] for a in res[:4]]
    return [(int(t), int(o)) for t, o in zip(out[0][:n], out[1][:n])], out[2][:n], out[3][:n]


def test_hash_matches_reference_and_is_fixed():
    ctx = np.array([1, 2, 3, 151_935], np.uint32)
    hs = np.zeros(5, np.uint64)
    assert suffix_hashes(ctx, 4, 4, hs) == 4
    for n in range(1, 5):
        assert int(hs[n]) == ref.key_hash(ctx[4 - n:])
        assert int(key_hash(ctx[4 - n:])) == int(hs[n])
    assert ref.key_hash([5]) != ref.key_hash([5, 5])  # the order is part of the key


def test_hash_pinned_values():
    # The hash is part of the shared-memory format: pinned, so that a change is deliberate
    # (old segments and running readers would silently disagree with a new daemon).
    assert int(key_hash(np.array([1, 2, 3], np.uint32))) == 0x788576BB5EF6DF70
    assert int(key_hash(np.array([0], np.uint32))) == 0x00F3F24045583A2B


@settings(max_examples=40, deadline=None)
@given(seqs=streams, n_min=st.integers(1, 3), span=st.integers(0, 5))
def test_count_matches_reference(seqs, n_min, span):
    n_max = n_min + span
    toks, offs = _flat(seqs)
    agg = count_ngrams(toks, offs, n_min, n_max, 3)
    table = ref.count(seqs, n_min, n_max)
    assert len(agg["key"]) == len(table)
    got = {}
    for i in range(len(agg["key"])):
        n, p = int(agg["order"][i]), int(agg["pos"][i])
        ctx = tuple(int(t) for t in toks[p - n:p])
        assert int(agg["key"][i]) == ref.key_hash(ctx)
        if n > 1:
            assert int(agg["parent"][i]) == ref.key_hash(ctx[1:])
        pairs = [(int(t), int(c)) for t, c in zip(agg["tok"][i], agg["cnt"][i]) if c]
        got[ctx] = (int(agg["total"][i]), pairs)
    for ctx, c in table.items():
        assert got[ctx] == (sum(c.values()), ref.topk(c, 3))


@settings(max_examples=40, deadline=None)
@given(seqs=streams, data=st.data())
def test_probe_and_decode_roundtrip(seqs, data):
    slots, agg = _slots_from(seqs, 1, 4, k=3)
    t3 = np.empty(3, np.uint32)
    c3 = np.empty(3, np.uint32)
    for i in range(len(agg["key"])):
        idx = probe(slots, 64, agg["key"][i])
        assert idx >= 0
        order, total = slot_decode(slots, idx, t3, c3)
        assert order == agg["order"][i] and total == agg["total"][i]
        assert list(t3) == list(agg["tok"][i]) and list(c3) == list(agg["cnt"][i])
    absent = data.draw(st.integers(1, 2**64 - 1))
    if absent not in set(int(k) for k in agg["key"]):
        assert probe(slots, 64, np.uint64(absent)) == -1
    out = np.empty(len(agg["key"]), np.int64)
    probe_batch(slots, 64, agg["key"], out)
    assert (out >= 0).all()


@settings(max_examples=60, deadline=None)
@given(seqs=streams, n_min=st.integers(1, 2), n_max=st.integers(2, 6),
       max_len=st.integers(1, 8), s_min=st.sampled_from([0.0, 0.3, 0.6]),
       p_cum=st.sampled_from([0.0, 0.1]), f_cap=st.sampled_from([0.0, 1.0]),
       ctx_len=st.integers(1, 12))
def test_draft_matches_reference(seqs, n_min, n_max, max_len, s_min, p_cum, f_cap, ctx_len):
    n_max = max(n_min, n_max)
    slots, _ = _slots_from(seqs, n_min, n_max)
    table = ref.count(seqs, n_min, n_max)
    longest = max(seqs, key=len)
    ctx = longest[:ctx_len] if len(longest) >= 1 else [0]
    ctx = ctx or [0]
    got, tiers, conf = _draft(slots, ctx, n_min, n_max, max_len, s_min=s_min, p_cum=p_cum,
                              f_cap=f_cap)
    want = ref.draft(table, ctx, n_min, n_max, max_len, s_min=s_min, p_cum=p_cum, f_cap=f_cap)
    assert got == want
    assert (tiers == K.TIER_LOCAL).all()
    assert ((conf > 0) & (conf <= 1)).all()


def test_share_exactly_at_the_threshold_passes():
    # "0" is followed by 0 six times out of ten: share 0.6 must pass s_min = 0.6 although the
    # threshold travels as float32 (0.6000000238); found by hypothesis
    seq = [0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1]
    slots, _ = _slots_from([seq], 1, 2)
    got, _, _ = _draft(slots, [0], 1, 2, 1, s_min=0.6)
    assert got == ref.draft(ref.count([seq], 1, 2), [0], 1, 2, 1, s_min=0.6) == [(0, 1)]


@settings(max_examples=40, deadline=None)
@given(seqs=streams, ctx_len=st.integers(1, 12))
def test_next_order_stepping_is_exact_without_share_threshold(seqs, ctx_len):
    # With every present key passing (s_min = 0), starting each step at the last order + 1
    # finds the same longest match as a full scan from n_max: the stepping rule loses nothing.
    slots, _ = _slots_from(seqs, 1, 6)
    table = ref.count(seqs, 1, 6)
    ctx = (max(seqs, key=len)[:ctx_len]) or [1]
    got, _, _ = _draft(slots, ctx, 1, 6, 8)
    assert got == ref.draft(table, ctx, 1, 6, 8, step_rule="full")


def test_known_text_drafts_its_continuation():
    text = ("def add(a, b):\n    return a + b\n\n" * 3).encode()
    seq = list(text)
    slots, _ = _slots_from([seq], 1, 16)
    prefix = seq[: len(seq) // 3 + 5]
    got, _, _ = _draft(slots, prefix, 1, 16, 10)
    assert [t for t, _ in got] == seq[len(prefix): len(prefix) + 10]
    assert all(o == 16 for _, o in got)


def test_two_tables_longest_match_wins():
    local, _ = _slots_from([[5, 1, 7]], 1, 4)  # knows only "1 -> 7" (order 1)
    glob, _ = _slots_from([[2, 3, 1, 9, 4]], 1, 4)  # knows "2 3 1 -> 9" (order 3)
    got, tiers, _ = _draft(local, [2, 3, 1], 1, 4, 2, slots_b=glob)
    assert got[0] == (9, 3) and tiers[0] == K.TIER_HOT
    # equal orders: the first table wins
    glob2, _ = _slots_from([[1, 8]], 1, 4)
    got, tiers, _ = _draft(local, [2, 3, 1], 1, 4, 1, slots_b=glob2)
    assert got == [(7, 1)] and tiers[0] == K.TIER_LOCAL


def test_two_tables_primary_first():
    a, _ = _slots_from([[1, 2, 3, 4]], 1, 3)
    b, _ = _slots_from([[1, 2, 3, 9, 8, 7]], 1, 3)
    got, tiers, _ = _draft(a, [1, 2, 3], 1, 3, 4, slots_b=b)
    # a knows 1 2 3 -> 4, then nothing after 4: b cannot continue "... 3 4" either
    assert got[0] == (4, 3) and tiers[0] == K.TIER_LOCAL
    got, tiers, _ = _draft(EMPTY, [1, 2, 3], 1, 3, 4, slots_b=b)
    assert [t for t, _ in got] == [9, 8, 7] and (tiers == K.TIER_HOT).all()


def _local_slots(chunks, n_min, n_max, limit=U16_MAX):
    """A request-local table fed ``chunks`` as a generator would: each sequence in two calls."""
    slots = np.zeros((1 << 12, SLOT_WORDS), np.uint32)
    for s in chunks:
        arr = np.array(s, np.uint32)
        half = len(arr) // 2
        assert local_add(slots, 64, arr, 0, half, n_min, n_max, limit) == 0
        assert local_add(slots, 64, arr, half, len(arr), n_min, n_max, limit) == 0
    return slots


def _local_entry(slots, ctx):
    """``(order, total, [[token, count], ...])`` of ``ctx`` in a request-local table."""
    idx = probe(slots, 64, np.uint64(ref.key_hash(ctx)))
    assert idx >= 0
    t3 = np.empty(3, np.uint32)
    c3 = np.empty(3, np.uint32)
    order, total = slot_decode(slots, idx, t3, c3)
    cands = [[int(t), int(c)] for t, c in zip(t3, c3) if t != EMPTY_TOKEN]
    return order, total, cands


# few token ids: contexts soon have more than HOT_K distinct next tokens (eviction, decrement)
local_streams = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=80), min_size=1,
                         max_size=4)


@settings(max_examples=60, deadline=None)
@given(seqs=local_streams, n_max=st.integers(1, 4), limit=st.sampled_from([2, 3, 5, 9, 0xFFFF]))
def test_local_add_matches_reference_in_every_branch(seqs, n_max, limit):
    # every branch of the update: new key, known candidate, free place, replace a weakest
    # count of 1, decrement the weakest, halving (a small ``limit`` reaches it often)
    slots = _local_slots(seqs, 1, n_max, limit)
    want = ref.local_table(seqs, 1, n_max, limit=limit)
    for ctx, (cands, total) in want.items():
        assert _local_entry(slots, ctx) == (len(ctx), total, cands), ctx
    if limit == 0xFFFF:
        # no halving: the total is exact and every count a lower bound, so no share is inflated
        true = ref.count(seqs, 1, n_max)
        for ctx, c in true.items():
            _, total, cands = _local_entry(slots, ctx)
            assert total == sum(c.values())
            assert all(k <= c[t] for t, k in cands), (ctx, cands, c)
            if len(c) <= HOT_K:  # few distinct next tokens: exactly the batch count
                assert sorted((k, t) for t, k in cands) == sorted((v, t) for t, v in c.items())


def test_local_eviction_never_outranks_what_was_seen_more():
    # after "0" came 1, 2, 3 twice each, a 4 seen once must not rank above them (the old rule
    # let it inherit the evicted count 2 and become the best candidate with 3 of 7)
    seq = [0, 1, 0, 2, 0, 3, 0, 1, 0, 2, 0, 3, 0, 4]
    _, total, cands = _local_entry(_local_slots([seq], 1, 1), (0,))
    assert total == 7 and cands == [[1, 2], [2, 2], [3, 1]]
    # a token that turns frequent later still gets in once the weakest has drained
    seq2 = seq + [0, 4] * 3
    _, total, cands = _local_entry(_local_slots([seq2], 1, 1), (0,))
    assert total == 10 and cands[0] == [4, 3]  # 4 was seen 4 times: a lower bound


def test_local_halving_at_the_16_bit_limit():
    # a context that first overflows its candidates, then is seen 70,000 more times: eviction,
    # decrement and halving (the total passes 65535) at the real limit agree with the reference
    seq = [0, 1, 0, 2, 0, 3, 0, 1, 0, 2, 0, 3, 0, 4] + [0] * 70_000 + [5, 0]
    slots = _local_slots([seq], 1, 1)
    want = ref.local_table([seq], 1, 1)
    for ctx, (cands, total) in want.items():
        assert _local_entry(slots, ctx) == (1, total, cands), ctx
    cands, total = want[(0,)]
    assert total < 0xFFFF and cands[0][0] == 0 and [5, 1] in cands


def test_saturating_counts_keep_the_share():
    slots = np.zeros((4, SLOT_WORDS), np.uint32)
    write_slot(slots, 0, np.uint64(7), 3, np.array([1, 2], np.uint32),
               np.array([300_000, 100_000], np.uint32), 500_000)
    t3 = np.empty(3, np.uint32)
    c3 = np.empty(3, np.uint32)
    order, total = slot_decode(slots, 0, t3, c3)
    assert order == 3 and total <= 0xFFFF
    assert c3[0] / total == pytest.approx(0.6, rel=1e-3)
    assert c3[1] / total == pytest.approx(0.2, rel=1e-3)


def test_bounded_probe_drops_rows():
    keys = np.array([1, 5, 9, 13], np.uint64)  # all share home slot 1 in a 4-slot table
    tok = np.zeros((4, 3), np.uint32)
    cnt = np.ones((4, 3), np.uint32)
    slots, placed = build_slots(4, 2, keys, np.ones(4, np.uint8), tok, cnt,
                                np.full(4, 3, np.uint32))
    assert placed.tolist() == [True, True, False, False]
    assert probe(slots, 2, np.uint64(9)) == -1


def test_real_token_stream(qwen_tokens):
    seqs = [qwen_tokens[:3000], qwen_tokens[3000:6000]]
    table = ref.count(seqs, 1, 8)
    slots, agg = _slots_from(seqs, 1, 8)
    assert len(agg["key"]) == len(table)
    rng = np.random.default_rng(0)
    for start in rng.integers(20, 5900, 30):
        ctx = qwen_tokens[start - 20:start]
        assert _draft(slots, ctx, 1, 8, 8)[0] == ref.draft(table, ctx, 1, 8, 8)


def test_empty_tables_miss_without_reading():
    keys = np.array([1, 2, 3], np.uint64)
    out = np.zeros(3, np.int64)
    probe_batch(EMPTY, 16, keys, out)
    assert (out == -1).all()
    assert _draft(EMPTY, [1, 2, 3], 1, 4, 4)[0] == []
