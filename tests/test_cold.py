"""Tests of the cold tier (``ngramd/cold.py``) against a real RocksDB in temporary directories.

Counts are compared with a plain-Python reference (dict of context tuple -> Counter); crash
safety is checked by SIGKILLing a child process that appends and applies in a loop.
"""

from __future__ import annotations

import glob
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocksdict import Options, Rdict

from ngramd import kernels
from ngramd.cold import (
    ColdOptions, ColdStore, decode_values, encode_keys, encode_values,
)
from ngramd.errors import BadInput, IdentityMismatch, StorageError
from ngramd.identity import TableIdentity

REPO = Path(__file__).resolve().parents[1]
EMPTY = int(kernels.EMPTY_TOKEN)
U32_MAX = 2**32 - 1
SMALL = ColdOptions(block_cache_mb=8, write_buffer_mb=4, read_threads=2, sync_log=False)


# ---------------------------------------------------------------------------------------------
# reference implementation and helpers
# ---------------------------------------------------------------------------------------------
def reference(seqs, n_min, n_max) -> dict[tuple[int, tuple], Counter]:
    """(order, context tuple) -> Counter of next tokens, n-grams never crossing sequences."""
    ref: dict[tuple[int, tuple], Counter] = defaultdict(Counter)
    for s in seqs:
        s = [int(t) for t in s]
        for i in range(1, len(s)):
            for n in range(n_min, min(i, n_max) + 1):
                ref[(n, tuple(s[i - n:i]))][s[i]] += 1
    return ref


def topk(counter: Counter, k: int) -> list[tuple[int, int]]:
    return sorted(counter.items(), key=lambda tc: (-tc[1], tc[0]))[:k]


def pack(seqs) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return np.concatenate([np.asarray(s, np.uint32) for s in seqs]), offsets


def table_of(store: ColdStore, chunk: int = 65536) -> dict[tuple[int, tuple], tuple]:
    """Everything in the store, via ``scan``: (order, ctx) -> (total, [(tok, cnt)...])."""
    out = {}
    for ch in store.scan(chunk=chunk):
        for i in range(ch["key"].size):
            o = int(ch["order"][i])
            assert (ch["ctx"][i, o:] == EMPTY).all()
            pairs = [(int(t), int(c)) for t, c in zip(ch["tok"][i], ch["cnt"][i]) if t != EMPTY]
            out[(o, tuple(ch["ctx"][i, :o].tolist()))] = (int(ch["total"][i]), pairs)
    return out


def check_against_reference(store, ref, k, exact_topk=True):
    got = table_of(store)
    assert set(got) == set(ref)
    for key, counter in ref.items():
        total, pairs = got[key]
        assert total == sum(counter.values()), key
        if exact_topk or len(counter) <= k:
            assert pairs == topk(counter, k), key
    assert store.entries() == {o: sum(1 for (n, _) in ref if n == o)
                               for o in range(store.identity.n_min, store.identity.n_max + 1)}
    return got


@pytest.fixture
def ident():
    return TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=50)


@pytest.fixture
def store(tmp_path, ident):
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        yield s


TEXT = textwrap.dedent("""
    the cold tier keeps the full counts of every order on disk and the hot tier keeps what
    changes a draft . the daemon reads the log above the watermark and counts it . the table
    survives restarts and new generators start warm . the cold tier keeps the long tail on
    disk and the hot tier keeps the head in shared memory . a draft is a chained longest match
    and the next step tries the next order first . the table survives restarts .
""").split()
WORDS = {w: i for i, w in enumerate(dict.fromkeys(TEXT))}
TEXT_IDS = np.array([WORDS[w] for w in TEXT], np.uint32)


def text_sequences(n_seqs=12, seed=0):
    """Real-ish text: overlapping windows of a paragraph (shared phrases, repeated contexts)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_seqs):
        a = rng.randrange(0, len(TEXT_IDS) - 10)
        b = rng.randrange(a + 2, len(TEXT_IDS) + 1)
        out.append(TEXT_IDS[a:b])
    return out


# ---------------------------------------------------------------------------------------------
# counting
# ---------------------------------------------------------------------------------------------
seq_lists = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=25), min_size=1,
                     max_size=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=seq_lists, n_min=st.integers(1, 3), span=st.integers(0, 2),
       k=st.integers(3, 4), cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_counts_match_reference_and_merging_matches_counting_once(seqs, n_min, span, k, cuts):
    ident = TableIdentity(n_min=n_min, n_max=n_min + span, cold_k=k, vocab_size=6, hot_k=1)
    ref = reference(seqs, ident.n_min, ident.n_max)
    tokens, offsets = pack(seqs)
    with tempfile.TemporaryDirectory() as d:
        # all at once: one batch, so the stored top-k is exact
        with ColdStore(Path(d) / "once", ident, SMALL) as once:
            assert once.append_log(tokens, offsets) == (1, len(seqs))
            res = once.apply()
            assert once.apply() is None
            assert (res.first_seq, res.last_seq, res.tokens) == (1, len(seqs), tokens.size)
            check_against_reference(once, ref, k)
            whole = table_of(once)
        # the same stream over several appends and small applies (exercising scan and get reads)
        opts = ColdOptions(block_cache_mb=8, write_buffer_mb=4, read_threads=2, sync_log=False,
                           scan_ratio=float(cuts[0] % 3), read_chunk=2)
        with ColdStore(Path(d) / "parts", ident, opts) as parts:
            i = 0
            for j, cut in enumerate(cuts * 4):
                if i >= len(seqs):
                    break
                n = 1 + cut % 3
                part = seqs[i:i + n]
                parts.append_log(*pack(part))
                i += n
                parts.apply(max_tokens=cut)
            if i < len(seqs):
                parts.append_log(*pack(seqs[i:]))
            while parts.apply(max_tokens=cuts[-1]) is not None:
                pass
            assert parts.applied_seq() == parts.last_seq()
            # totals always exact; candidates exact wherever no batch could truncate them
            check_against_reference(parts, ref, k, exact_topk=False)
            split = table_of(parts)
            for key, counter in ref.items():
                if len(counter) <= k:
                    assert split[key] == whole[key]


def test_real_text_counts_get_many_top(tmp_path):
    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=len(WORDS))
    seqs = text_sequences()
    ref = reference(seqs, 1, 16)
    tokens, offsets = pack(seqs)
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        s.append_log(tokens, offsets)
        res = s.apply()
        got = check_against_reference(s, ref, 8)
        assert res.new_entries == len(ref) == len(res)

        # ApplyResult: the same keys kernels.count_ngrams gives, and the values now stored
        c = kernels.count_ngrams(tokens, offsets, 1, 16, 8)
        assert np.array_equal(np.sort(res.key), np.sort(c["key"]))
        assert res.tok.shape == (len(ref), 8) and res.order.dtype == np.uint8
        by_key = {}
        for ch in s.scan(chunk=37):  # odd chunk size: rows split across chunks
            for i in range(ch["key"].size):
                by_key[int(ch["key"][i])] = ch
                o = int(ch["order"][i])
                ctx = ch["ctx"][i, :o]
                assert ch["key"][i] == kernels.key_hash(ctx)
                assert ch["parent"][i] == (kernels.key_hash(ctx[1:]) if o > 1 else 0)
        for i in range(len(res)):
            ch = by_key[int(res.key[i])]
            j = int(np.flatnonzero(ch["key"] == res.key[i])[0])
            assert ch["total"][j] == res.total[i] and ch["parent"][j] == res.parent[i]
            assert (ch["tok"][j] == res.tok[i]).all() and (ch["cnt"][j] == res.cnt[i]).all()

        # get / get_many on every context of the reference, plus misses
        keys = list(ref)
        orders = np.array([o for o, _ in keys] + [3], np.int64)
        ctxs = [np.array([0, 0, 0] + list(ctx), np.uint32) for _, ctx in keys]
        ctxs.append(np.array([1, 1, 1], np.uint32))  # never seen
        many = s.get_many(orders, *pack(ctxs))
        assert many[-1] is None
        for (o, ctx), r, full in zip(keys, many, ctxs):
            total, tok, cnt = s.get(o, full)
            assert (total, list(zip(tok.tolist(), cnt.tolist()))) == got[(o, ctx)]
            assert r[0] == total and np.array_equal(r[1], tok) and np.array_equal(r[2], cnt)
        assert s.get(2, [1, 1]) is None

        # top: largest totals of an order
        top = s.top(1, 5)
        expect = sorted((sum(c.values()) for (o, _), c in ref.items() if o == 1), reverse=True)
        assert [t for _, t, _, _ in top] == expect[:5]
        for ctx, total, tok, cnt in top:
            assert total == sum(ref[(1, tuple(ctx.tolist()))].values())
        assert s.top(16, 10 ** 6) and len(s.top(16, 10 ** 6)) == s.entries()[16]


def test_value_encoding_roundtrip_and_saturation(store):
    rng = np.random.default_rng(3)
    m, k = 200, 5
    npairs = rng.integers(0, k + 1, m)
    tok = np.full((m, k), EMPTY, np.uint32)
    cnt = np.zeros((m, k), np.uint32)
    for i in range(m):
        tok[i, :npairs[i]] = rng.choice(1000, npairs[i], replace=False)
        cnt[i, :npairs[i]] = rng.integers(1, 2**32, npairs[i], dtype=np.uint64)
    total = rng.integers(0, 2**32, m, dtype=np.uint64).astype(np.uint32)
    vals = encode_values(total, tok, cnt)
    assert [len(v) for v in vals] == (4 + 8 * npairs).tolist()
    has, t2, tok2, cnt2 = decode_values(vals + [None], k)
    assert has.tolist() == [True] * m + [False]
    assert (t2[:m] == total).all() and (tok2[:m] == tok).all() and (cnt2[:m] == cnt).all()
    with pytest.raises(StorageError):
        decode_values([b"\x01\x02\x03"], k)

    # counts and totals saturate at 2**32 - 1 when merged
    key = encode_keys(1, np.array([[7]], np.uint32))[0]
    t = np.full((1, 3), EMPTY, np.uint32)
    t[0, 0] = 8
    store._ng[key] = encode_values(np.array([U32_MAX - 1], np.uint32), t,
                                   np.array([[U32_MAX - 1, 0, 0]], np.uint32))[0]
    store._entries[1] += 1  # keep the exact entry count honest after the direct write
    store.append_log(np.array([7, 8, 7, 8, 7, 9], np.uint32), np.array([0, 6]))
    store.apply()
    total, tok, cnt = store.get(1, [7])
    assert total == U32_MAX and tok.tolist() == [8, 9] and cnt.tolist() == [U32_MAX, 1]


# ---------------------------------------------------------------------------------------------
# persistence and options
# ---------------------------------------------------------------------------------------------
def test_close_and_reopen_keeps_everything(tmp_path, ident):
    path = tmp_path / "db"
    seqs = [[1, 2, 3, 4, 5, 1, 2, 3], [2, 3, 4, 2, 3, 5], [9, 9, 9, 9]]
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack(seqs[:2]))
        s.apply()
        s.append_log(*pack(seqs[2:]))  # left in the log: applied after the reopen
        before = table_of(s)
        entries = s.entries()
        assert (s.applied_seq(), s.last_seq()) == (2, 3)
    s.close()  # idempotent
    with ColdStore(path, ident, SMALL) as s:
        assert table_of(s) == before and s.entries() == entries
        assert (s.applied_seq(), s.last_seq()) == (2, 3)
        assert s.stats()["log_lag"] == 1
        s.apply()
        check_against_reference(s, reference(seqs, 1, 4), 3)
    # the log is now empty: sequence numbers must still not be reused after a reopen
    with ColdStore(path, ident, SMALL) as s:
        assert (s.applied_seq(), s.last_seq()) == (3, 3)
        assert s.append_log(*pack([[4, 4]])) == (4, 4)


def test_reopen_with_other_identity_is_refused(tmp_path, ident):
    path = tmp_path / "db"
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack([[1, 2, 3]]))
        s.apply()
    for other in (TableIdentity(n_min=1, n_max=4, cold_k=4, vocab_size=50),
                  TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=50, tokenizer="ab")):
        with pytest.raises(IdentityMismatch, match="table has"):
            ColdStore(path, other, SMALL)
    with ColdStore(path, ident, SMALL) as s:  # the refused opens released the DB lock
        assert s.get(2, [1, 2])[0] == 1
        assert s.identity == ident


def _ngrams_table_options(path) -> str:
    newest = max(glob.glob(str(path / "OPTIONS-*")), key=lambda f: int(f.rsplit("-", 1)[1]))
    text = Path(newest).read_text()
    return text.split('[TableOptions/BlockBasedTable "ngrams"]', 1)[1].split("\n[", 1)[0]


def test_reopen_keeps_table_options(tmp_path, ident):
    path = tmp_path / "db"
    opts = ColdOptions(block_cache_mb=24, bloom_bits_per_key=10, write_buffer_mb=4,
                       sync_log=False)
    with ColdStore(path, ident, opts) as s:
        assert "filter_policy=bloomfilter" in _ngrams_table_options(path)
    # the trap is real: a plain reopen drops the bloom filter ...
    db = Rdict(str(path), Options(raw_mode=True))
    db.close()
    assert "filter_policy=nullptr" in _ngrams_table_options(path)
    # ... and ColdStore's reopen restores bloom filter and block cache
    with ColdStore(path, ident, opts) as s:
        assert "filter_policy=bloomfilter" in _ngrams_table_options(path)
        assert s._ng.property_int_value("rocksdb.block-cache-capacity") == 24 << 20


def test_stats_flush_compact(store):
    seqs = text_sequences(6, seed=1)
    store.append_log(*pack([np.asarray(s) % 50 for s in seqs]))
    st0 = store.stats()
    assert st0["log_lag"] == 6 and st0["entries_total"] == 0
    store.apply()
    store.flush()
    store.compact()
    st1 = store.stats()
    assert st1["log_lag"] == 0 and st1["applied_seq"] == st1["last_seq"] == 6
    assert st1["entries_total"] == sum(st1["entries"].values()) > 0
    assert 0 < st1["sst_bytes"] <= st1["total_bytes"]
    assert 8 < st1["bytes_per_entry"] < 200


# ---------------------------------------------------------------------------------------------
# bad input and lifecycle
# ---------------------------------------------------------------------------------------------
def test_bad_input_raises_and_damages_nothing(store):
    store.append_log(*pack([[1, 2, 3, 4, 1, 2]]))
    store.apply()
    before, stats = table_of(store), store.stats()
    good = np.array([1, 2, 3], np.uint32)
    bad_appends = [
        (np.array([1.0, 2.0]), [0, 2]),  # float ids
        (np.array([1, 50], np.int64), [0, 2]),  # id >= vocab
        (np.array([1, -1], np.int64), [0, 2]),  # negative id
        (np.array([[1, 2]], np.uint32), [0, 2]),  # 2-D
        (np.array([], np.uint32), [0]),  # empty
        (good, [1, 3]),  # offsets not starting at 0
        (good, [0, 2]),  # offsets not covering the tokens
        (good, [0, 0, 3]),  # an empty sequence
        (good, np.array([0.0, 3.0])),  # float offsets
    ]
    for tokens, offsets in bad_appends:
        with pytest.raises(BadInput):
            store.append_log(tokens, np.asarray(offsets))
    for order, ctx in [(3, [1, 2]), (0, [1]), (5, [1, 2, 3, 4, 5]), (True, [1]), (1.0, [1]),
                       (1, [50]), (1, np.array([1.5])), (1, [])]:
        with pytest.raises(BadInput):
            store.get(order, ctx)
    with pytest.raises(BadInput, match="shorter"):
        store.get_many(np.array([1, 3]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.get_many(np.array([1]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.get_many(np.array([1.0, 2.0]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.apply(max_tokens=0)
    with pytest.raises(BadInput):
        list(store.scan(order=9))
    with pytest.raises(BadInput):
        ColdOptions(compression="brotli")
    assert table_of(store) == before
    assert store.stats()["last_seq"] == stats["last_seq"] and store.apply() is None
    assert store.entries() == stats["entries"]


def test_closed_store_raises_storage_error(tmp_path, ident):
    s = ColdStore(tmp_path / "db", ident, SMALL)
    s.append_log(*pack([list(range(20))]))
    s.apply()
    scan = s.scan(chunk=3)
    next(scan)
    s.close()  # ends the live scan: its iterator would otherwise keep the DB locked
    s.close()
    with ColdStore(tmp_path / "db", ident, SMALL) as again:
        assert again.get(1, [3])[0] == 1
    assert next(scan, None) is None
    with pytest.raises(StorageError, match="closed"):
        s.get(1, [1])
    with pytest.raises(StorageError):
        s.append_log(*pack([[1, 2]]))


def test_unopenable_path_is_a_storage_error(tmp_path, ident):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="opening"):
        ColdStore(blocker / "db", ident, SMALL)


def test_reads_run_while_apply_writes(tmp_path):
    ident = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=1000)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 1000, 300) for _ in range(40)]
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        s.append_log(*pack(seqs[:5]))
        s.apply()
        s.append_log(*pack(seqs[5:]))
        errors, reads = [], [0]
        stop = threading.Event()
        probe_ctx = [np.asarray(q[:8]) for q in seqs[:5]]

        def reader():
            try:
                while not stop.is_set():
                    r = s.get_many(np.full(5, 7), *pack(probe_ctx))
                    assert all(x is not None and x[0] >= 1 for x in r)
                    reads[0] += 1
            except Exception as e:  # surfaced below
                errors.append(e)

        th = threading.Thread(target=reader)
        th.start()
        while s.apply(max_tokens=2000) is not None:
            pass
        stop.set()
        th.join()
        assert not errors and reads[0] > 0
        check_against_reference(s, reference(seqs, 1, 8), 4, exact_topk=False)


# ---------------------------------------------------------------------------------------------
# crash safety: SIGKILL a writer at random moments
# ---------------------------------------------------------------------------------------------
CHILD = """
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from ngramd.cold import ColdOptions, ColdStore
from ngramd.identity import TableIdentity

path, marker = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(marker)
ident = TableIdentity(n_min=1, n_max=3, cold_k=3, vocab_size=1 << 24)
with ColdStore(path, ident, ColdOptions(block_cache_mb=8, write_buffer_mb=4, sync_log=True)) as s:
    print("READY", flush=True)
    while True:
        n = int(rng.integers(1, 6))
        seqs = [[marker + i, 1, 2, 3] for i in range(n)]  # a unique marker, then filler
        offsets = np.arange(n + 1, dtype=np.int64) * 4
        first, last = s.append_log(np.array(seqs, np.uint32).ravel(), offsets)
        print("ACK", first, last, marker, marker + n - 1, flush=True)
        marker += n
        if rng.random() < 0.6:
            print("APPLY", flush=True)  # lets the parent aim its kill at an apply
            s.apply(max_tokens=int(rng.integers(4, 120)))
"""


def test_sigkill_never_loses_or_doubles_an_acked_sequence(tmp_path):
    path = tmp_path / "db"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    ident = TableIdentity(n_min=1, n_max=3, cold_k=3, vocab_size=1 << 24)
    rng = random.Random(1234)
    acked_markers, seq_ranges = [], []
    for rnd in range(6):
        proc = subprocess.Popen([sys.executable, str(script), str(path), str(1000 + rnd * 10**6)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()
        assert ready == "READY\n", proc.stderr.read()
        # kill shortly after the n-th apply started (inside it, or in the next append), or at
        # a plain random moment: every phase of the loop gets hit over the rounds
        lines, aim = [], rng.randrange(1, 12)
        while aim:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line)
            aim -= line.startswith("APPLY")
        time.sleep(rng.choice([0, rng.uniform(0, 0.003), rng.uniform(0, 0.05)]))
        assert proc.poll() is None, proc.stderr.read()  # still running: killed mid-work
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        for line in ("".join(lines) + out).split("\n")[:-1]:  # the last piece may be torn
            if line.startswith("ACK "):
                _, first, last, m0, m1 = line.split()
                seq_ranges.append((int(first), int(last)))
                acked_markers.extend(range(int(m0), int(m1) + 1))
    assert len(acked_markers) > 4
    # sequence numbers were never reused across restarts
    flat = [q for a, b in seq_ranges for q in range(a, b + 1)]
    assert flat == sorted(set(flat))

    with ColdStore(path, ident, SMALL) as s:
        while s.apply(max_tokens=50) is not None:
            pass
        assert s.stats()["log_lag"] == 0
        markers = {}
        for ch in s.scan(order=1):
            for ctx, total in zip(ch["ctx"][:, 0].tolist(), ch["total"].tolist()):
                if ctx >= 1000:
                    markers[ctx] = total
        # every acked sequence counted exactly once; unacked ones that made it: once too
        assert all(markers.get(m) == 1 for m in acked_markers), \
            [(m, markers.get(m)) for m in acked_markers if markers.get(m) != 1][:5]
        assert set(markers.values()) == {1}
        # the filler context (1,) -> 2 is seen once per counted sequence: no double counting
        total, tok, cnt = s.get(1, [1])
        assert total == len(markers) and tok.tolist() == [2]
        assert s.get(3, [1, 2, 3]) is None and s.get(2, [1, 2])[0] == len(markers)
