"""Tests of ``ngramd.wire.validate``'s offset and threshold rules, and that every caller applies the
same offset rule (the wire, the cold store and the hot reader had three different ones)."""

from __future__ import annotations

import numpy as np
import pytest

from ngramd.wire import protocol as P
from ngramd.wire.errors import BadInput
from ngramd.wire.validate import as_offsets, per_order


# ---------------------------------------------------------------------------------------------
# as_offsets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("big", [False, True], ids=["python-path", "numpy-path"])
def test_as_offsets_accepts_a_valid_batch_without_copying(big):
    offs = np.arange(0, 3 * (100 if big else 4) + 1, 3, dtype=np.int64)
    got = as_offsets(offs, int(offs[-1]))
    assert got is offs
    # other integer types and lists come back as C-contiguous int64
    got = as_offsets(offs.astype(np.uint32).tolist(), int(offs[-1]))
    assert got.dtype == np.int64 and got.flags.c_contiguous and got.tolist() == offs.tolist()
    assert as_offsets(offs[::1].astype(np.uint64), int(offs[-1])).dtype == np.int64


@pytest.mark.parametrize("bad, match", [
    (np.array([0.0, 3.0]), "1-D integer"),
    (np.array([[0, 3]]), "1-D integer"),
    (np.array([0]), "1-D integer"),
    (np.array([], np.int64), "1-D integer"),
    (np.array([True, False]), "1-D integer"),
])
def test_as_offsets_rejects_wrong_shapes_and_types(bad, match):
    with pytest.raises(BadInput, match=match):
        as_offsets(bad, 3)


@pytest.mark.parametrize("big", [False, True], ids=["python-path", "numpy-path"])
def test_as_offsets_rules(big):
    pad = list(range(0, 200, 2)) if big else [0]  # a long valid head for the numpy path
    n = pad[-1]

    def offs(*tail):
        return np.array(pad + [n + t for t in tail], np.int64)

    # start at 0
    with pytest.raises(BadInput, match="start at 0"):
        as_offsets(offs(3) + 1, n + 4)
    # end exactly at the token count: neither short of it (trailing tokens) nor past it
    with pytest.raises(BadInput, match="end at the token count"):
        as_offsets(offs(3), n + 4)
    with pytest.raises(BadInput, match="end at the token count"):
        as_offsets(offs(3, 10**6), n + 3)
    # non-decreasing, whatever min_len says
    with pytest.raises(BadInput, match="non-decreasing"):
        as_offsets(offs(5, 2, 6), n + 6)
    with pytest.raises(BadInput, match="non-decreasing"):
        as_offsets(offs(5, 2, 6), n + 6, min_len=-1)
    # empty sequences: allowed by default, refused with min_len=1
    assert as_offsets(offs(3, 3, 5), n + 5).tolist() == offs(3, 3, 5).tolist()
    with pytest.raises(BadInput, match=rf"sequence {len(pad)} has 0 tokens, fewer than the mini"):
        as_offsets(offs(3, 3, 5), n + 5, min_len=1)
    # a minimum length per sequence
    assert as_offsets(offs(3, 6), n + 6, min_len=2).size == len(pad) + 2
    with pytest.raises(BadInput, match="fewer than the minimum 4"):
        as_offsets(offs(3, 6), n + 6, min_len=4)


def test_as_offsets_uint64_bounds_do_not_wrap():
    for size in (3, 100):  # both paths
        o = np.zeros(size, np.uint64)
        o[1] = 2**63 + 5  # wraps to a negative int64
        o[-1] = 10
        with pytest.raises(BadInput):
            as_offsets(o, 10)


def test_as_offsets_names_what_it_checks():
    with pytest.raises(BadInput, match="^batch offsets must start"):
        as_offsets([1, 2], 2, what="batch offsets")


# ---------------------------------------------------------------------------------------------
# every caller applies it
# ---------------------------------------------------------------------------------------------
def _frames(tokens, offsets):
    return [np.asarray(tokens, "<u4").tobytes(), np.asarray(offsets, "<i8").tobytes()]


def test_the_wire_applies_the_rule():
    kw = dict(max_batch=10, max_tokens=100)
    tok, off = P.unpack_batch(_frames([1, 2, 3], [0, 1, 3]), 10, **kw)
    assert off.tolist() == [0, 1, 3]
    for bad in ([0, 1, 2], [0, 2, 1, 3], [1, 3]):  # trailing token, decreasing, no start at 0
        with pytest.raises(BadInput, match="offsets"):
            P.unpack_batch(_frames([1, 2, 3], bad), 10, **kw)
    with pytest.raises(BadInput, match="fewer than the minimum 1"):  # min_len defaults to 1
        P.unpack_batch(_frames([1, 2, 3], [0, 0, 3]), 10, **kw)
    assert P.unpack_batch(_frames([1, 2, 3], [0, 0, 3]), 10, min_len=0, **kw)[1].tolist() == \
        [0, 0, 3]


def test_the_hot_reader_applies_the_rule():
    from ngramd.hot.shm import _as_batch
    tok, off = _as_batch([1, 2, 3], [0, 0, 3])  # an empty context drafts nothing: allowed
    assert off.tolist() == [0, 0, 3] and tok.dtype == np.uint32
    for bad in ([0, 2], [0, 2, 1, 3], [0, 10**6]):  # trailing token, decreasing, past the end
        with pytest.raises(BadInput, match="batch offsets"):
            _as_batch([1, 2, 3], bad)
    with pytest.raises(BadInput, match="tokens must be 1-D"):
        _as_batch([[1, 2, 3]], [0, 3])


# ---------------------------------------------------------------------------------------------
# per_order
# ---------------------------------------------------------------------------------------------
def test_per_order_conventions():
    # a scalar: every order
    assert per_order(2, 4, np.int64).tolist() == [2] * 5
    # indexed by order (drafters): length >= n_max + 1
    assert per_order([0, 1, 2, 3, 4], 4, np.int64).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(BadInput, match="one value per order 0..4"):
        per_order([1, 2, 3], 4, np.int64)
    # one value per order n_min..n_max (config files); orders below n_min get 0
    assert per_order([5, 6, 7], 4, np.int64, n_min=2).tolist() == [0, 0, 5, 6, 7]
    with pytest.raises(BadInput, match="one value per order 2..4"):
        per_order([5, 6, 7, 8, 9], 4, np.int64, n_min=2)
    # counts round up, shares stay; the result is a fresh writable array
    assert per_order(1.5, 2, np.uint32).tolist() == [2, 2, 2]
    assert per_order(0.25, 2, np.float32).tolist() == [0.25] * 3
    src = np.arange(5, dtype=np.int64)
    out = per_order(src, 4, np.int64)
    assert out is not src and out.flags.writeable
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(BadInput, match="finite and >= 0"):
            per_order(bad, 2, np.float64)


def test_config_per_order_uses_the_shared_rule():
    from ngramd.config import TableConfig
    c = TableConfig(n_min=2, n_max=4, c_min=[1, 2, 2.5], s_min=0.3)
    assert c.rules.by_order("c_min")[:5].tolist() == [0, 0, 1, 2, 3]
    assert c.rules.by_order("s_min")[:5].tolist() == pytest.approx([0.3] * 5)
