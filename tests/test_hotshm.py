"""Tests of the shared-memory transport of the hot tier (``ngramd.hot.shm``): segment format,
publication, readers (also in another process), the recent table.  Real files in a per-test
directory under /dev/shm, removed afterwards.  The selection rules are in test_hotset.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import tempfile

import numpy as np
import pytest

from conftest import wait_until
from ngramd import drafttiers, kernels as K
from ngramd.hot import segments as hotseg
from ngramd.hot import shm as hotshm
from ngramd.kernels.count import count_ngrams
from ngramd.kernels.drafting import draft_source
from ngramd.kernels.local import local_add
from ngramd.kernels.slots import lookup_batch, probe_batch, slots_checksum
from ngramd.wire.constants import EMPTY_TOKEN, HOT_K, SLOT_WORDS
from ngramd.wire import errors
from ngramd.hot.selection import build_hot
from ngramd.hot.shm import HotPublisher, HotReader
from ngramd.wire.identity import TableIdentity
from ngramd.wire.rules import DraftRules

E = int(EMPTY_TOKEN)
IDENT = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=1000)
PHRASE = np.arange(950, 980, dtype=np.uint32)  # never occurs in the noise (ids < 900)


def _rules(reader) -> DraftRules:
    """The reader's orders and the thresholds these tests draft with (count >= 1, no share
    and no p_cum stop)."""
    return DraftRules(n_min=reader.n_min, n_max=reader.n_max, c_min=1, s_min=0.0, p_cum=0.0)


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def shm_dir():
    base = tempfile.mkdtemp(prefix="ngramd-test-", dir="/dev/shm")
    try:
        yield os.path.join(base, "ngramd")  # not created yet: the publisher creates it
    finally:
        shutil.rmtree(base, ignore_errors=True)


def corpus(seed=0, n_noise=6000, tail=()):
    """Noise ids < 900 with PHRASE (+ tail) inserted three times."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 900, n_noise).astype(np.uint32)
    phrase = np.concatenate([PHRASE, np.asarray(tail, np.uint32)])
    parts = [noise[:2000], phrase, noise[2000:4000], phrase, noise[4000:], phrase]
    return np.concatenate(parts)


def rows_of(tokens, n_min=1, n_max=8, k=4):
    return count_ngrams(tokens, np.array([0, len(tokens)]), n_min, n_max, k)


def decode_all(slots):
    """Vectorised decode of every slot: (key, order, total, tok (cap, 3), cnt (cap, 3))."""
    s = slots.astype(np.uint64)
    key = s[:, 0] | (s[:, 1] << np.uint64(32))
    tok = slots[:, 2:5]
    cnt = np.stack([slots[:, 5] & 0xFFFF, slots[:, 5] >> 16, slots[:, 6] & 0xFFFF], axis=1)
    return key, slots[:, 7] & 0xFF, slots[:, 6] >> 16, tok, cnt


@pytest.fixture
def published(shm_dir):
    toks = corpus()
    rows = rows_of(toks)
    slots, info = build_hot(rows, 4 << 20, 1, 0.0, 16)
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=0.0)
    pub.publish(slots, 16, applied_seq=7)
    yield pub, slots, rows, info, toks
    pub.close()


# ---------------------------------------------------------------------------------------------
# publish -> read
# ---------------------------------------------------------------------------------------------
def test_reader_drafts_expected_continuation(published, shm_dir):
    pub, slots, _, _, _ = published
    r = HotReader(shm_dir, "t", identity=IDENT)
    assert r.generation == 1 and r.max_probe == 16 and (r.n_min, r.n_max) == (1, 8)
    d = r.draft(PHRASE[:10], 8, _rules(r))
    assert d.tokens.tolist() == PHRASE[10:18].tolist()
    assert set(d.tiers.tolist()) == {K.TIER_HOT}
    assert np.all(d.conf == 1.0) and d.probes > 0
    # same answer as the kernel on the in-memory (writable) table
    res = K.draft_out(1, 8)
    K.draft(draft_source((slots,), (K.TIER_HOT,), (False,), 16), DraftRules(1, 8, 1, 0.0, p_cum=0.0).kernel,
            PHRASE[:10], np.array([0, 10], np.int64), 8, res)
    assert res[4][0] == 8 and res[0][0].tolist() == d.tokens.tolist()
    assert res[1][0].tolist() == d.orders.tolist()
    assert drafttiers._FAST.entry is not None  # the direct-overload path is in use ...
    ro_ctx = PHRASE[:10].copy()
    ro_ctx.flags.writeable = False  # ... and a read-only context takes the dispatcher path
    assert r.draft(ro_ctx, 8, _rules(r)).tokens.tolist() == PHRASE[10:18].tolist()
    # list input and a long context (only the last n_max tokens matter)
    long_ctx = list(range(500)) + PHRASE[:10].tolist()
    assert r.draft(long_ctx, 8, _rules(r)).tokens.tolist() == PHRASE[10:18].tolist()
    assert r.draft(np.zeros(0, np.uint32), 8, _rules(r)).tokens.size == 0


def test_hot_answers_equal_source_rows(published, shm_dir):
    _, _, rows, info, _ = published
    r = HotReader(shm_dir, "t")
    idx = r.probe_batch(rows["key"])
    hit = idx >= 0
    assert int(hit.sum()) == info["placed"] == r.header["entries"]
    key, order, total, tok, cnt = decode_all(r.slots)
    i = idx[hit]
    assert np.array_equal(key[i], rows["key"][hit])
    assert np.array_equal(order[i], rows["order"][hit])
    assert np.array_equal(total[i], rows["total"][hit])  # small counts: no scaling
    assert np.array_equal(tok[i], rows["tok"][hit, :3])
    assert np.array_equal(cnt[i], rows["cnt"][hit, :3])


def test_header_checksum_and_permissions(published, shm_dir):
    pub, slots, _, _, _ = published
    r = HotReader(shm_dir, "t")
    assert r.verify()
    h = r.header
    assert h["magic"] == hotshm.SEGMENT_MAGIC and h["version"] == hotshm.SEGMENT_VERSION
    assert h["generation"] == 1 and h["capacity"] == slots.shape[0]
    assert h["applied_seq"] == 7 and h["vocab_size"] == 1000 and h["hot_k"] == HOT_K
    assert h["checksum"] == int(slots_checksum(slots))
    assert h["identity_sha256"] == hotshm.identity_digest(IDENT)
    assert TableIdentity(**h["identity"]) == IDENT
    assert os.path.getsize(pub.path) == hotshm.HEADER_SIZE + slots.nbytes
    # never world-accessible: dir 0750, files 0640
    assert stat.S_IMODE(os.stat(shm_dir).st_mode) == hotseg.DIR_MODE
    for name in os.listdir(shm_dir):
        assert stat.S_IMODE(os.stat(os.path.join(shm_dir, name)).st_mode) == hotseg.FILE_MODE
    assert not r.slots.flags.writeable


def test_header_roundtrip():
    raw = hotshm.pack_header(generation=5, capacity=1024, max_probe=12, identity=IDENT, entries=700,
                          checksum=2**63 + 5, applied_seq=99, created_ns=123)
    assert len(raw) == hotshm.HEADER_SIZE
    h = hotshm.unpack_header(raw)
    assert (h["generation"], h["capacity"], h["max_probe"], h["entries"], h["checksum"],
            h["applied_seq"], h["created_ns"]) == (5, 1024, 12, 700, 2**63 + 5, 99, 123)
    assert (h["n_min"], h["n_max"], h["slot_bytes"]) == (1, 8, 32)


def test_identity_mismatch(published, shm_dir):
    other = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=151_936)
    with pytest.raises(errors.IdentityMismatch, match="vocab_size") as ei:
        HotReader(shm_dir, "t", identity=other)
    assert ei.value.code == errors.IDENTITY


def test_missing_table(shm_dir):
    os.makedirs(shm_dir)
    with pytest.raises(errors.NgramError, match="'nope' not found") as ei:
        HotReader(shm_dir, "nope")
    assert ei.value.code == errors.UNAVAILABLE
    pub = HotPublisher(shm_dir, "t", IDENT)  # control file exists, nothing published
    with pytest.raises(errors.NgramError, match="no generation published") as ei:
        HotReader(shm_dir, "t")
    assert ei.value.code == errors.UNAVAILABLE
    pub.close()
    with pytest.raises(errors.BadInput):
        HotReader(shm_dir, "../etc")


def test_segment_format_version_checked(published, shm_dir):
    pub = published[0]
    with open(pub.path, "r+b") as f:  # fault injection: a segment from a future format
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    with pytest.raises(errors.NgramError) as ei:
        HotReader(shm_dir, "t")
    assert ei.value.code == errors.VERSION


def test_kernels_on_readonly_mapping(published, shm_dir):
    """numba types read-only arrays separately; every helper must work on the mapping itself
    (no copy) and agree with the kernels on a writable copy."""
    _, _, _, _, toks = published
    r = HotReader(shm_dir, "t")
    ro = r.slots
    assert not ro.flags.writeable and ro.base is not None
    rw = np.array(ro)
    offs = np.arange(0, 64 * 40 + 1, 40, dtype=np.int64)
    ctxs = toks[: offs[-1]]
    bd = r.draft_batch(ctxs, offs, 6, _rules(r))
    for b in range(64):  # per-context draft agrees with the batch
        d = r.draft(ctxs[offs[b]:offs[b + 1]], 6, _rules(r))
        assert d.tokens.tolist() == bd.tokens[b, :bd.lengths[b]].tolist()
    t, c, tot, hits = r.lookup_batch(ctxs, offs)
    ref = (np.empty((64, 9, 3), np.uint32), np.empty((64, 9, 3), np.uint32),
           np.empty((64, 9), np.int64))
    assert hits == lookup_batch(rw, 16, ctxs, offs, 1, 8, *ref) and hits > 0
    # (the kernel writes orders n_min..n_max; the reader keeps order 0 as a miss)
    assert np.array_equal(t[:, 1:], ref[0][:, 1:]) and np.array_equal(c[:, 1:], ref[1][:, 1:])
    assert np.array_equal(tot[:, 1:], ref[2][:, 1:]) and not tot[:, 0].any()
    keys = np.random.default_rng(1).choice(published[2]["key"], 500)
    out = np.empty(500, np.int64)
    probe_batch(rw, 16, keys, out)
    assert np.array_equal(r.probe_batch(keys), out)
    mm = np.memmap(os.path.join(shm_dir, "t.gen1"), np.uint32, mode="r", offset=hotshm.HEADER_SIZE)
    out2 = np.empty(500, np.int64)
    probe_batch(mm.reshape(-1, 8), 16, keys, out2)  # np.memmap(mode="r") works as well
    assert np.array_equal(out2, out)
    with pytest.raises(errors.BadInput):
        r.draft_batch(ctxs, np.array([0, 10**6]), 4, _rules(r))  # offsets beyond the tokens


def test_local_table_first(published, shm_dir):
    r = HotReader(shm_dir, "t")
    # earlier in this request 960 was followed by 961, 962, 7 (local table); the hot table
    # knows PHRASE (960 -> 961 -> ...) and the noise (7 -> something)
    local = np.zeros((256, 8), np.uint32)
    local_add(local, 8, np.array([960, 961, 962, 7], np.uint32), 0, 4, 1, 8)
    d = r.draft(PHRASE[:11], 6, _rules(r), local_slots=local, local_max_probe=8)
    assert d.tokens[:3].tolist() == [961, 962, 7]
    assert d.tiers[:3].tolist() == [K.TIER_LOCAL] * 3  # local first, even at a lower order
    assert d.tiers[3] == K.TIER_HOT  # local knows nothing after 7


# ---------------------------------------------------------------------------------------------
# generations
# ---------------------------------------------------------------------------------------------
def test_generations_refresh_and_grace(shm_dir):
    now = [100.0]  # the publisher's clock (monotonic s): the grace period without sleeping
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=0.5, clock=lambda: now[0])
    s1, _ = build_hot(rows_of(corpus(1, tail=[1, 2, 3])), 1 << 20, 1, 0.0)
    s2, _ = build_hot(rows_of(corpus(2, tail=[4, 5, 6])), 1 << 20, 1, 0.0)
    assert pub.publish(s1, 16) == 1
    r = HotReader(shm_dir, "t")
    old = r.slots
    assert r.draft(PHRASE, 3, _rules(r)).tokens.tolist() == [1, 2, 3]
    assert not r.refresh()
    assert pub.publish(s2, 16) == 2
    assert r.generation == 1  # no remap until the next refresh / helper call
    assert r.refresh() and r.generation == 2 and not r.refresh()
    assert r.draft(PHRASE, 3, _rules(r)).tokens.tolist() == [4, 5, 6]
    assert pub.collect() == 0 and os.path.exists(os.path.join(shm_dir, "t.gen1"))
    now[0] += 0.25
    assert pub.collect() == 0 and os.path.exists(os.path.join(shm_dir, "t.gen1"))
    now[0] += 0.25
    assert pub.collect() == 1 and not os.path.exists(os.path.join(shm_dir, "t.gen1"))
    # the unlinked generation stays readable through a mapping that still holds it
    assert int(slots_checksum(old)) == int(slots_checksum(s1))
    pub.close()


def _minor_faults(read) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    read()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_remapped_generation_is_faulted_in_before_drafts_probe_it(shm_dir):
    """A reader that maps a generation has its pages mapped in the background
    (``hotseg.PREFAULT``), so the drafts' random probes into it take no page faults; the same
    reads through a mapping of its own fault (the measure tells them apart)."""
    import mmap

    cap = 1 << 20  # 32 MiB of slots: 8192 pages
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=60.0)
    slots = np.zeros((cap, SLOT_WORDS), np.uint32)
    slots[:, 0] = np.arange(cap, dtype=np.uint32)
    pub.publish(slots[:16].copy(), 16)
    r = HotReader(shm_dir, "t", warm=False)
    pub.publish(slots, 16)
    assert r.refresh() and r.generation == 2  # the remap of a new generation
    idx = np.random.default_rng(0).integers(0, cap, 4000)
    assert hotseg.PREFAULT.wait(30.0)
    faults = _minor_faults(lambda: int(r.slots[idx, 0].sum()))
    with open(os.path.join(shm_dir, "t.gen2"), "rb") as f:  # the same file, not prefaulted
        own = np.frombuffer(mmap.mmap(f.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ), np.uint32,
                            count=cap * SLOT_WORDS, offset=hotseg.HEADER_SIZE)
    cold = _minor_faults(lambda: int(own.reshape(cap, SLOT_WORDS)[idx, 0].sum()))
    # the kernel maps up to 16 pages around a faulting read (fault_around_bytes): a cold
    # mapping of 8192 pages takes up to 512 faults for these reads
    assert faults < 50 and cold > 250, (faults, cold)
    assert int(r.slots[idx, 0].sum()) == int(idx.sum())
    r.close()
    pub.close()


def test_vanished_segment_retries_from_ctl(shm_dir, monkeypatch):
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=0.0)
    tabs = [build_hot(rows_of(corpus(i, tail=[i])), 1 << 20, 1, 0.0)[0] for i in range(3)]
    pub.publish(tabs[0], 16)
    r = HotReader(shm_dir, "t")
    pub.publish(tabs[1], 16)
    real, calls = r._open_segment, []

    def stalled(gen):  # the reader stalls between reading the ctl and opening gen 2 ...
        calls.append(gen)
        if len(calls) == 1:
            pub.publish(tabs[2], 16)  # ... meanwhile gen 3 goes live and gen 2 is unlinked
            pub.collect(force=True)
        return real(gen)

    monkeypatch.setattr(r, "_open_segment", stalled)
    assert r.refresh()
    assert calls == [2, 3] and r.generation == 3 and r.verify()
    assert r.draft(PHRASE, 1, _rules(r)).tokens.tolist() == [2]
    pub.close()


def test_restart_continues_generations_and_cleans_up(shm_dir):
    s, _ = build_hot(rows_of(corpus()), 1 << 20, 1, 0.0)
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=60)
    pub.publish(s, 16)
    pub.publish(s, 16)
    with pytest.raises(errors.StorageError, match="already has a publisher"):
        HotPublisher(shm_dir, "t", IDENT)
    pub.close(unlink=False)  # e.g. the daemon restarts
    r = HotReader(shm_dir, "t")
    assert r.generation == 2
    junk = os.path.join(shm_dir, ".t.gen3.tmp")  # a crashed write
    open(junk, "wb").close()
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=0.0)
    assert not os.path.exists(junk) and pub.generation == 2
    assert pub.publish(s, 16) == 3
    assert r.refresh() and r.generation == 3
    pub.collect()
    assert sorted(os.listdir(shm_dir)) == ["t.ctl", "t.gen3"]
    pub.close()
    assert os.listdir(shm_dir) == []


def test_close_unlink_reader_survives_and_reattaches(shm_dir):
    s1, _ = build_hot(rows_of(corpus(1, tail=[1])), 1 << 20, 1, 0.0)
    s2, _ = build_hot(rows_of(corpus(2, tail=[2])), 1 << 20, 1, 0.0)
    pub = HotPublisher(shm_dir, "t", IDENT)
    pub.publish(s1, 16)
    r = HotReader(shm_dir, "t")
    r.reattach_interval_s = 0.0
    pub.close(unlink=True)
    assert os.listdir(shm_dir) == []
    assert not r.refresh()  # keeps drafting from its mapping
    assert r.draft(PHRASE, 1, _rules(r)).tokens.tolist() == [1] and r.verify()
    pub = HotPublisher(shm_dir, "t", IDENT)  # a new daemon: new control file
    assert not r.refresh()  # nothing published there yet
    pub.publish(s2, 16)
    assert r.refresh() and r.draft(PHRASE, 1, _rules(r)).tokens.tolist() == [2]
    pub.close()


# ---------------------------------------------------------------------------------------------
# a reader in another process while generations swap
# ---------------------------------------------------------------------------------------------
def _gen_tail(g):
    return [100 + g, 200 + g, 300 + g, 400 + g]


def _reader_child(shm_dir, stop, seen, drafts, q):
    """Draft continuously; verify the checksum of every generation seen and check the draft is
    the one that generation's table gives (no mixing of two generations)."""
    try:
        r = HotReader(shm_dir, "t")
        verified, bad, n = {}, [], 0
        while not stop.is_set():
            d = r.draft(PHRASE, 4, _rules(r))
            g = r.generation  # draft() refreshed first, so g is the table it drafted from
            if g not in verified:
                verified[g] = r.verify() and r.header["generation"] == g
                seen.value = g
            if d.tokens.tolist() != _gen_tail(g):
                bad.append((g, d.tokens.tolist()))
            n += 1
            drafts.value = n
        q.put(dict(verified=verified, bad=bad[:5], n_bad=len(bad), drafts=n))
    except BaseException as e:  # report, the parent asserts
        q.put(dict(error=repr(e)))


def _wait(cond, timeout, proc):
    """``conftest.wait_until(cond)``, ending at once if the reader process dies."""
    got = wait_until(lambda: cond() or ("reader process died" if not proc.is_alive() else ""),
                     timeout, 0.002)
    assert got is True, got or "timed out waiting for the reader process"


def test_reader_in_other_process_sees_whole_generations(shm_dir):
    n_gen, grace = 8, 0.5  # s, exact in binary: the fake clock adds it up without rounding
    tables = {g: build_hot(rows_of(corpus(g, n_noise=3000 * (1 + g % 3), tail=_gen_tail(g))),
                           4 << 20, 1, 0.0)[0] for g in range(1, n_gen + 1)}
    assert len({t.shape[0] for t in tables.values()}) > 1  # sizes differ between generations
    now = [100.0]  # the publisher's clock: one grace period passes per generation
    pub = HotPublisher(shm_dir, "t", IDENT, grace_s=grace, clock=lambda: now[0])
    pub.publish(tables[1], 16)
    ctx = mp.get_context("spawn")
    stop, q = ctx.Event(), ctx.Queue()
    seen, drafts = ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False)
    p = ctx.Process(target=_reader_child, args=(shm_dir, stop, seen, drafts, q), daemon=True)
    p.start()
    try:
        _wait(lambda: seen.value == 1, 60, p)
        for g in range(2, n_gen + 1):
            now[0] += grace  # one period since the last publication: g - 2 goes, g - 1 stays
            assert pub.publish(tables[g], 16) == g
            assert [os.path.exists(os.path.join(shm_dir, f"t.gen{k}")) for k in (g - 2, g - 1)] \
                == [False, True]
            if g % 2 == 0:  # odd ones go out back to back with the next
                _wait(lambda: seen.value == g, 10, p)
            pub.collect()
        now[0] += grace
        assert pub.collect() > 0
        assert sorted(os.listdir(shm_dir)) == ["t.ctl", f"t.gen{n_gen}"]
        n0 = drafts.value
        _wait(lambda: drafts.value > n0 + 200, 10, p)  # still drafting after the unlinks
    finally:
        stop.set()
        res = q.get(timeout=60)
        p.join(10)
        pub.close()
    assert "error" not in res, res.get("error")
    assert res["n_bad"] == 0, res["bad"]
    assert all(res["verified"].values()), res["verified"]
    assert {1, 2, 4, 6, n_gen} <= set(res["verified"])
    assert res["drafts"] > 200


# ---------------------------------------------------------------------------------------------
# the recent table
# ---------------------------------------------------------------------------------------------
def _rowset(seq, n_max=4):
    from ngramd.cold.rows import Counter
    ident = TableIdentity(n_min=1, n_max=n_max, cold_k=3, vocab_size=1000)
    return Counter(ident).count(np.asarray(seq, np.uint32), np.array([0, len(seq)]),
                                np.zeros(1, np.int64))


def test_recent_table_is_read_in_place_and_rolls_epochs(tmp_path):
    ident = TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=1000)
    with HotPublisher(tmp_path, "t", ident, grace_s=0.0) as pub:
        pub.publish(np.zeros((64, SLOT_WORDS), np.uint32), 8)
        rec = hotshm.RecentTable(pub, 256, 8, grace_s=0.0)
        reader = HotReader(tmp_path, "t", identity=ident)
        # an empty epoch reads as an empty table (drafts do not probe 256 empty slots)
        assert [r.shape[0] for r in reader.recent] == [0, 0]
        assert len(reader.draft(np.array([5, 6, 7], np.uint32), 4, _rules(reader)).tokens) == 0
        rs = _rowset([5, 6, 7, 8, 9, 10])
        assert rec.add(rs.key, rs.order, rs.total, rs.poff, rs.tok, rs.cnt) == len(rs)
        assert [r.shape[0] for r in reader.recent] == [256, 0]  # read in place, no refresh
        d = reader.draft(np.array([5, 6, 7], np.uint32), 4, _rules(reader))
        assert d.tokens.tolist() == [8, 9, 10] and set(d.tiers.tolist()) == {K.TIER_RECENT}
        # counts add up in place
        rec.add(rs.key, rs.order, rs.total, rs.poff, rs.tok, rs.cnt)
        i = reader.probe_batch(rs.key[:1])[0]
        assert i < 0  # probe_batch looks at the hot generation only
        e1 = rec.epoch
        rec._roll()  # e1 is now the previous epoch: still drafted from
        assert reader.draft(np.array([5, 6, 7], np.uint32), 4, _rules(reader)).tokens.tolist() == \
            [8, 9, 10]
        rec._roll()  # e1 is dropped, and unlinked after the grace period (0 here)
        assert len(reader.draft(np.array([5, 6, 7], np.uint32), 4, _rules(reader)).tokens) == 0
        rec._roll()
        assert not (tmp_path / f"t.recent{e1}").exists()
        # filling an epoch past its load factor starts a new one
        e2, rows0, offered = rec.epoch, rec.rows + rec.dropped, 0
        for start in range(100, 400, 20):
            more = _rowset(list(range(start, start + 20)))
            offered += len(more)
            rec.add(more.key, more.order, more.total, more.poff, more.tok, more.cnt)
            # a row that finds no slot within max_probe marks the epoch full (used = capacity)
            assert rec.used <= hotshm.RECENT_LOAD * rec.capacity or rec.used == rec.capacity
        assert rec.epoch > e2 and rec.rows + rec.dropped - rows0 == offered
        rec.close()
        assert reader.refresh() and [r.shape[0] for r in reader.recent] == [0, 0]
