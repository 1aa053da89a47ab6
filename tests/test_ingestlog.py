"""The file ingest log: appends, reads, retention, crash recovery, failures, migration."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from ngramd.cold.store import ColdOptions, ColdStore
from ngramd.wire.errors import StorageError
from ngramd.wire.identity import TableIdentity
from ngramd.cold.ingestlog import IngestLog


def _rec(i: int, n: int = 10) -> bytes:
    return b"\0\0\0\0" + np.arange(i, i + n, dtype="<u4").tobytes()


def test_append_read_release_and_reopen(tmp_path):
    lg = IngestLog(tmp_path, 0, segment_bytes=300)  # a few records a segment
    assert lg.append([_rec(1), _rec(2)]) == (1, 2)
    for i in range(3, 20):
        assert lg.append([_rec(i)]) == (i, i)
    seqs, recs = lg.read(0, 1 << 20)
    assert seqs == list(range(1, 20)) and recs == [_rec(i) for i in range(1, 20)]
    assert lg.read(5, 25)[0] == [6, 7, 8]  # about max_tokens: whole records, 10 tokens each
    assert lg.read(19, 100) == ([], [])
    n_files = len(list(tmp_path.glob("*.log")))
    assert n_files > 3
    assert lg.release(10) >= 1  # segments wholly at or below 10 go
    assert len(list(tmp_path.glob("*.log"))) < n_files
    lg.close()
    again = IngestLog(tmp_path, 10)
    assert again.last_seq() == 19
    assert again.read(10, 1 << 20)[0] == list(range(11, 20))
    assert again.append([_rec(20)]) == (20, 20)  # numbering goes on
    again.close()


def test_a_torn_tail_is_cut_and_damage_elsewhere_refused(tmp_path):
    lg = IngestLog(tmp_path, 0, segment_bytes=200)
    for i in range(1, 8):
        lg.append([_rec(i)])
    lg.close()
    files = sorted(tmp_path.glob("*.log"))
    last = files[-1]
    with open(last, "ab") as f:
        f.write(b"\x09" * 21)  # half a header and payload: a crash in the middle of an append
    lg = IngestLog(tmp_path, 0)
    assert lg.last_seq() == 7 and lg.read(0, 1 << 20)[0] == list(range(1, 8))
    assert lg.append([_rec(8)]) == (8, 8)
    lg.close()
    data = bytearray(files[0].read_bytes())
    data[20] ^= 0xFF  # a flipped bit in a record of the first segment
    files[0].write_bytes(bytes(data))
    with pytest.raises(StorageError, match="damaged record"):
        IngestLog(tmp_path, 0)


def test_a_failed_append_leaves_nothing_and_the_next_one_works(tmp_path, monkeypatch):
    lg = IngestLog(tmp_path, 0)
    lg.append([_rec(1)])
    real = os.write
    calls = {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            real(fd, bytes(data)[:7])  # part of a record reaches the file, then ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(StorageError, match="disk full"):
        lg.append([_rec(2)])
    assert lg.last_seq() == 1
    assert lg.append([_rec(3)]) == (2, 2)  # the seq of the failed append is reused
    monkeypatch.setattr(os, "write", real)
    lg.close()
    again = IngestLog(tmp_path, 0)
    seqs, recs = again.read(0, 1 << 20)
    assert seqs == [1, 2] and recs == [_rec(1), _rec(3)]
    again.close()


def test_a_table_with_the_log_in_rocksdb_is_migrated(tmp_path):
    """Records left in the old ``log`` column family are moved to the file log and counted."""
    from rocksdict import WriteBatch

    ident = TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=1000)
    opts = ColdOptions(block_cache_mb=8, write_buffer_mb=4, sync_log=False)
    path = tmp_path / "t"
    with ColdStore(path, ident, opts) as s:
        s.append_log(np.arange(1, 9, dtype=np.uint32), np.array([0, 8]))
        s.flush()  # seq 1 applied
        db = s.rocks.db
        wb = WriteBatch(raw_mode=True)
        seq_tokens = [np.array([5, 6, 7, 8, 9], np.uint32), np.array([7, 8, 9, 10], np.uint32)]
        for i, t in enumerate(seq_tokens):  # what an older daemon left unapplied
            wb.put((2 + i).to_bytes(8, "big"), b"\0\0\0\0" + t.astype("<u4").tobytes(),
                   s.rocks.h_log)
        db.write(wb)
    with ColdStore(path, ident, opts) as s:
        assert s.last_seq() == 3
        s.flush()
        assert s.counted_seq() == 3
        assert next(iter(s.rocks.log.keys()), None) is None  # the old family is empty
        got = s.reader.get(2, np.array([7, 8], np.uint32))  # 7 8 -> 9 in each migrated record
        assert got is not None and got[0] == 2 and got[1][0] == 9


def test_a_record_that_cannot_be_counted_is_quarantined_not_retried(tmp_path):
    """A log record with token ids outside the vocabulary (damage after it was acknowledged)
    is copied aside with its reason and skipped; the records around it are counted, and a
    reopened store does not meet it again."""
    ident = TableIdentity(n_min=1, n_max=4, cold_k=3, vocab_size=1000)
    opts = ColdOptions(block_cache_mb=8, write_buffer_mb=4, sync_log=False)
    path = tmp_path / "t"
    with ColdStore(path, ident, opts) as s:
        s.append_log(np.array([1, 2, 3], np.uint32), np.array([0, 3]))
        bad = b"\0\0\0\0" + np.array([7, 5000, 9], "<u4").tobytes()
        s.log.ilog.append([bad])  # bypasses checks
        s.log.last = s.log.ilog.last_seq()
        s.append_log(np.array([1, 2, 4], np.uint32), np.array([0, 3]))
        s.flush()
        assert s.counted_seq() == 3 and s.log.quarantined == 1
        assert s.reader.get(2, np.array([1, 2], np.uint32))[0] == 2
        assert s.stats()["quarantined"] == 1
    why = (path / "quarantine" / f"{2:020d}.why").read_text()
    assert "vocab_size" in why and (path / "quarantine" / f"{2:020d}.rec").exists()
    with ColdStore(path, ident, opts) as s:
        s.flush()
        assert s.log.quarantined == 0 and s.reader.get(2, np.array([1, 2], np.uint32))[0] == 2
