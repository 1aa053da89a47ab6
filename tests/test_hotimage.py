"""The hot tier's image on disk (``ngramd.hot.image``, issue 28): a start whose shared memory is
empty (a reboot, a restore, ``ngramd warm``, a new fleet host) serves the image at once; a
damaged or mismatched image is refused with one log line and rebuilt; a crash while writing
leaves the old image or none; a starved tier's rebuild is not throttled.  Real RocksDB and
real shared memory, as in tests/test_table.py."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from corpus import qwen_token_stream
from ngramd import kernels as K
from ngramd.config import load_daemon_config
from ngramd.hot.cycle import HotCycle
from ngramd.hot.image import IMAGE_NAME, HEADER_SIZE, read_image
from ngramd.hot.shm import HotReader


def _batch(*ctxs):
    offs = np.zeros(len(ctxs) + 1, np.int64)
    np.cumsum([len(c) for c in ctxs], out=offs[1:])
    return np.concatenate([np.asarray(c, np.uint32) for c in ctxs]), offs


def _learned(t, seq):
    """``t`` after counting ``seq`` and a rebuild, once the rebuild wrote its image (after
    publishing the generation: ``rebuild_hot`` returns at the publication)."""
    t.writes.ingest(*_batch(seq))
    t.writes.flush()
    t.rebuild_hot()
    _wait_image(t)
    return t


def _wait_image(t, timeout_s=60.0):
    """Until the restart image holds what the hot tier holds (a thread's progress; the bound
    only guards against a hang)."""
    assert wait_until(lambda: t.hotcycle.state()["image"].get("applied_seq")
                      == t.hotcycle.state()["applied_seq"], timeout_s, 0.01), t.hotcycle.state()


def _no_rebuild(monkeypatch) -> list:
    """Rebuilds of tables made from now on only record that they were asked for: what such a
    table serves comes from shared memory or the image."""
    ran = []
    monkeypatch.setattr(HotCycle, "_rebuild", lambda self, stop: ran.append(self))
    return ran


def _reboot(t, shm_dir):
    """Stop ``t`` and empty its shared memory, as a reboot does."""
    t.close()
    shutil.rmtree(shm_dir)


def _drafts_from_hot(shm_dir, identity, seq, at=1234) -> bool:
    """A generator's in-process path (``HotReader``) drafts ``seq``'s continuation at ``at``
    from the hot tier."""
    with HotReader(shm_dir, "t", identity=identity) as r:
        from ngramd.wire.rules import DraftRules

        d = r.draft(seq[at - 20:at].astype(np.uint32), 8, DraftRules())
        n = len(d.tokens)
        return (n >= 1 and d.tokens.tolist() == seq[at:at + n].tolist()
                and K.TIER_HOT in d.tiers.tolist())


def test_a_start_with_empty_shared_memory_serves_the_image_before_any_rebuild(
        make_table, shm_dir, monkeypatch):
    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    entries = t.hotcycle.state()["entries"]
    assert entries > 0 and t.hotcycle.state()["image"]["state"] == "written"
    _reboot(t, shm_dir)
    # no rebuild may run in the restarted table: what it serves comes from the image
    ran = _no_rebuild(monkeypatch)
    t2 = make_table()
    st = t2.stats_dict()["hot"]
    assert st["source"] == "image" and st["entries"] == entries
    assert st["image"]["state"] == "loaded" and st["behind_records"] == 0
    assert t2.hotcycle.rebuild_budget.rebuilds == 0
    assert _drafts_from_hot(shm_dir, t2.identity, seq)
    assert t2.health()["state"] == "ok"
    assert not ran


def test_the_daemon_publishes_the_image_before_numba_and_rocksdb_load(make_table, shm_dir,
                                                                      tmp_path):
    """``ngramd``'s first step (``hotimage.start_publisher``) needs numpy only: generators
    draft from the image while the rest of the daemon loads (~0.3 s quiet, twice that on a busy
    host), and the table then serves the generation it published."""
    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    entries = t.hotcycle.state()["entries"]
    _reboot(t, shm_dir)
    code = textwrap.dedent(f"""
        import sys
        from ngramd.config import TableConfig, table_identity_of
        from ngramd.hot.image import start_publisher

        cfg = TableConfig(name="t", vocab_size=151_936, data_dir={str(tmp_path / "data")!r},
                          shm_dir={str(shm_dir)!r})
        publisher, image = start_publisher(cfg, table_identity_of(cfg))
        print(image["state"], image["entries"], publisher.generation,
              sorted(m for m in ("numba", "rocksdict") if m in sys.modules))
        publisher.close(unlink=False)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["loaded", str(entries), "1", "[]"], out.stdout
    assert _drafts_from_hot(shm_dir, t.identity, seq)  # published: generators draft from it
    t2 = make_table()  # the restarted daemon takes the published generation over, unrebuilt
    assert t2.hotcycle.state()["source"] in ("shm", "image") and \
        t2.hotcycle.state()["entries"] == entries


def test_what_was_counted_after_the_image_reaches_drafts_through_the_next_rebuild(
        make_table, shm_dir, monkeypatch):
    seq = qwen_token_stream(3000)
    later = qwen_token_stream(6000)[3000:]
    t = _learned(make_table(), seq)
    t.writes.ingest(*_batch(later))
    t.writes.flush()  # counted and in runs, but the image is older
    _reboot(t, shm_dir)
    go, rebuild = threading.Event(), HotCycle._rebuild
    monkeypatch.setattr(HotCycle, "_rebuild",
                        lambda self, stop: go.wait(60) and rebuild(self, stop))
    t2 = make_table()
    assert t2.hotcycle.state()["source"] == "image"
    assert t2.hotcycle.state()["applied_seq"] < t2.cold.counted_seq()
    # the daemon answers from every tier meanwhile, and rebuilds at once (requested at start)
    # (a draft's cold reads are capped at table.MAX_BUDGET_US: on a loaded host one may come
    # back from memory alone, and its reads go on in the background; ask again, bounded)
    def right() -> bool:
        out = t2.draft(*_batch(later[1214:1234]), max_len=8, budget_us=1e6)
        n = int(out.lengths[0])
        return n >= 1 and out.tokens[0, :n].tolist() == later[1234:1234 + n].tolist()
    assert wait_until(right, 60, 0.01), t2.hotcycle.state()
    # requested at the start: the rebuilder takes it up (on a loaded host, not at once) and
    # waits for ``go``
    assert wait_until(lambda: t2.maint.busy["rebuild"], 60, 0.01), t2.hotcycle.state()
    go.set()
    t2.rebuild_hot()
    st = t2.hotcycle.state()
    assert st["source"] == "rebuild" and st["behind_records"] == 0
    assert _drafts_from_hot(shm_dir, t2.identity, later)


def _damage(path, damage):
    with open(path, "r+b") as f:
        if damage.startswith("payload"):  # a byte of slot 100, or the payload's last byte
            f.seek(HEADER_SIZE + 32 * 100 + 4 if damage == "payload" else -1,
                   os.SEEK_SET if damage == "payload" else os.SEEK_END)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        elif damage == "header":
            f.seek(40)  # the pruned filter's size
            f.write(b"\x01")
        else:
            f.truncate(os.path.getsize(path) - 4096)


@pytest.mark.parametrize("damage", ["payload", "payload-end", "header", "truncated", "identity",
                                    "ahead"])
def test_a_damaged_or_mismatched_image_is_refused_in_one_line_and_rebuilt(
        make_table, shm_dir, tmp_path, caplog, monkeypatch, damage):
    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    path = t.cold.path / IMAGE_NAME
    _reboot(t, shm_dir)
    kw = {}
    if damage in ("identity", "ahead"):  # another table's image in this table's directory:
        # orders 1..8, or this identity but a table that holds no log record yet
        kw = {"data_dir": str(tmp_path / "other")} | ({"n_max": 8} if damage == "identity"
                                                      else {})
        (tmp_path / "other" / "t").mkdir(parents=True)
        shutil.copy(path, tmp_path / "other" / "t" / IMAGE_NAME)
        path = tmp_path / "other" / "t" / IMAGE_NAME
    else:
        _damage(path, damage)
    caplog.set_level(logging.INFO)
    go, rebuild = threading.Event(), HotCycle._rebuild  # the start's rebuild waits for ``go``
    monkeypatch.setattr(HotCycle, "_rebuild",
                        lambda self, stop: go.wait(60) and rebuild(self, stop))
    t2 = make_table(**kw)
    t2.writes.ingest(*_batch(seq))
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "hot image" in refused[0], refused
    assert ("identity" in refused[0]) == (damage == "identity"), refused
    assert ("ahead" in refused[0]) == (damage == "ahead"), refused
    assert t2.hotcycle.state()["image"]["state"] == "refused"
    assert t2.hotcycle.state()["source"] == "empty"
    t2.writes.flush()
    go.set()
    t2.rebuild_hot()
    _wait_image(t2)
    st = t2.hotcycle.state()
    assert st["source"] == "rebuild" and st["entries"] > 0
    assert st["image"]["state"] == "written"  # and a good image replaced the refused one
    assert read_image(path, t2.identity, t2.cold.last_seq()) is not None


def test_an_image_of_format_1_is_still_served(make_table, shm_dir, monkeypatch):
    """Format 1 (the payload checked by crc32) is read by this daemon: an upgrade that comes
    with a reboot serves the old image instead of ranking the table again."""
    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    path, entries = t.cold.path / IMAGE_NAME, t.hotcycle.state()["entries"]
    _reboot(t, shm_dir)
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 8, 1)  # format 1
    struct.pack_into("<I", raw, 72, zlib.crc32(raw[HEADER_SIZE:]))  # its payload crc32
    struct.pack_into("<Q", raw, 128, 0)  # format 1 had no payload sum
    struct.pack_into("<I", raw, 116, 0)
    struct.pack_into("<I", raw, 116, zlib.crc32(raw[:HEADER_SIZE]))
    path.write_bytes(raw)
    ran = _no_rebuild(monkeypatch)
    t2 = make_table()
    st = t2.hotcycle.state()
    assert st["source"] == "image" and st["entries"] == entries and not ran
    assert _drafts_from_hot(shm_dir, t2.identity, seq)
    t2.close()
    shutil.rmtree(shm_dir)
    raw[-1] ^= 0xFF  # and its crc32 still refuses damage
    path.write_bytes(raw)
    t3 = make_table()
    assert t3.hotcycle.state()["image"]["state"] == "refused"


def test_a_kill_during_the_image_write_leaves_the_old_image(make_table, shm_dir, tmp_path):
    """kill -9 of a process writing an image (a large one, killed once its temp file holds
    data) leaves the old image under the name; the next start serves it and removes the
    temp file."""
    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    path, identity, entries = t.cold.path / IMAGE_NAME, t.identity, t.hotcycle.state()["entries"]
    _reboot(t, shm_dir)
    tmp = path.with_name(f".{IMAGE_NAME}.tmp")
    script = textwrap.dedent(f"""
        import numpy as np
        from ngramd.hot.image import write_image
        from ngramd.table import table_identity_of
        from ngramd.config import TableConfig
        ident = table_identity_of(TableConfig(name="t", vocab_size=151_936))
        slots = np.ones((1 << 24, 8), np.uint32)  # 512 MiB: the kill lands mid-write
        write_image({str(path)!r}, ident, slots, 16, 1)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        while not (tmp.exists() and tmp.stat().st_size > HEADER_SIZE):
            assert p.poll() is None, "the writer ended before it was killed"
            threading.Event().wait(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    assert tmp.exists() and read_image(path, identity, 10).entries == entries
    t2 = make_table()
    assert t2.hotcycle.state()["source"] == "image" and t2.hotcycle.state()["entries"] == entries
    assert not tmp.exists()
    assert _drafts_from_hot(shm_dir, t2.identity, seq)


def test_the_image_write_is_paced(tmp_path, monkeypatch):
    """The write hands its pages to the disk every SYNC_BYTES as it goes and keeps to its
    rate (a lower bound on its time: a busy host only makes it slower)."""
    from ngramd.hot import image as hotimage
    from ngramd.config import TableConfig
    from ngramd.table import table_identity_of

    started = []
    monkeypatch.setattr(hotimage, "_start_writeback", lambda fd, at, n: started.append((at, n)))
    slots = np.zeros((1 << 21, 8), np.uint32)  # 64 MiB
    ident = table_identity_of(TableConfig(name="t", vocab_size=151_936))
    w = hotimage.write_image(tmp_path / IMAGE_NAME, ident, slots, 16, 1, bytes_per_s=128 << 20)
    assert w["seconds"] >= 0.49  # 64 MiB at 128 MiB/s
    # contiguous ranges from the file's start, each at least SYNC_BYTES
    assert [at for at, _ in started] == [sum(n for _, n in started[:i])
                                         for i in range(len(started))]
    assert len(started) == 2 and all(n >= hotimage.SYNC_BYTES for _, n in started)
    img = read_image(tmp_path / IMAGE_NAME, ident, 1)
    img.verify()
    img.close()


def test_a_restored_snapshot_carries_the_image(make_table, shm_dir, tmp_path, monkeypatch):
    from ngramd.fleet import snapshot_to_dir
    from ngramd.snapshots import restore_snapshot

    seq = qwen_token_stream(3000)
    t = _learned(make_table(), seq)
    entries = t.hotcycle.state()["entries"]
    m = snapshot_to_dir(t, tmp_path / "snaps")
    assert m["hot_image"] is True
    _reboot(t, shm_dir)
    cfg = load_daemon_config(None, (f'table.name="t"', f'table.data_dir="{tmp_path / "new"}"',
                                    f'table.shm_dir="{shm_dir}"', "table.vocab_size=151936",
                                    "table.hot_rebuild_s=0"))
    restore_snapshot(m["stored"], cfg)
    assert (tmp_path / "new" / "t" / IMAGE_NAME).exists()
    ran = _no_rebuild(monkeypatch)
    t2 = make_table(data_dir=str(tmp_path / "new"))
    assert t2.hotcycle.state()["source"] == "image" and t2.hotcycle.state()["entries"] == entries
    assert _drafts_from_hot(shm_dir, t2.identity, seq)
    assert not ran


def test_ngramd_warm_writes_the_image(tmp_path, shm_dir, monkeypatch, make_table):
    from ngramd import tools

    seq = qwen_token_stream(3000)
    np.save(tmp_path / "a.npy", seq.astype(np.int64))
    rc = tools.main(["warm", "--name", "t", "--data-dir", str(tmp_path / "data"),
                     "--set", "table.vocab_size=151936", "--no-progress",
                     str(tmp_path / "a.npy")])
    assert rc == 0
    ran = _no_rebuild(monkeypatch)
    t = make_table()
    assert t.hotcycle.state()["source"] == "image" and t.hotcycle.state()["entries"] > 0
    assert _drafts_from_hot(shm_dir, t.identity, seq)
    assert not ran


def test_a_starved_tier_rebuilds_first_and_merges_wait(make_table, monkeypatch):
    """Empty tier, table with rows: the rebuild is urgent (merges wait for it, no CPU budget);
    once the tier reflects the table, rebuilds are not.  Every rebuild runs at the serving
    thread's nice value (a niced thread holding the GIL stalled the daemon on a busy host,
    ngramd.maintenance)."""
    seen, tables = [], []
    rebuild = HotCycle._rebuild

    def spy(self, stop):
        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                     tables[0].maint.urgent.is_set()))
        rebuild(self, stop)

    monkeypatch.setattr(HotCycle, "_rebuild", spy)
    t = make_table()
    tables.append(t)  # a new table: no rebuild runs before its first ingest
    base = os.getpriority(os.PRIO_PROCESS, 0)
    t.writes.ingest(*_batch(qwen_token_stream(3000)))
    t.writes.flush()
    assert t.hotcycle.starved()
    t.rebuild_hot()
    assert seen[-1] == (base, True)
    assert not t.hotcycle.starved()
    t.writes.ingest(*_batch(qwen_token_stream(3100)[3000:]))
    t.writes.flush()
    t.rebuild_hot()
    assert seen[-1] == (base, False)


def test_health_is_degraded_while_a_big_table_serves_an_empty_hot_tier(make_table,
                                                                        monkeypatch):
    from ngramd.hot import cycle as hotcycle

    monkeypatch.setattr(hotcycle, "HOT_EMPTY_ROWS", 1000)  # a test-sized "big" table
    go, rebuild = threading.Event(), HotCycle._rebuild
    monkeypatch.setattr(HotCycle, "_rebuild",
                        lambda self, stop: go.wait(60) and rebuild(self, stop))
    t = make_table()
    t.writes.ingest(*_batch(qwen_token_stream(3000)))
    t.writes.flush()
    h = t.health()
    assert h["state"] == "degraded" and "hot tier" in h["faults"], h
    assert t.stats_dict()["hot"]["starved"]
    fut = threading.Thread(target=t.rebuild_hot)
    fut.start()
    go.set()
    fut.join()
    assert t.health()["state"] == "ok"


def test_a_daemon_restarted_with_its_shm_dir_wiped_drafts_from_the_image(start_daemon):
    """The real daemon: stop it, wipe its shm dir (a reboot), start it again: the stats op
    and ``ngram-client stats`` say the tier came from the image, and a generator's
    in-process reader drafts from tier hot with no rebuild since the start."""
    from ngram_client.cli import format_stats
    from ngramd.wire.identity import TableIdentity

    seq = qwen_token_stream(3000)
    d = start_daemon()
    with d.client() as c:
        c.ingest([seq.tolist()])
        c.flush()
        c.rebuild_hot()
        info = c.info()
    image = Path(d.config["table"]["data_dir"]) / "t" / IMAGE_NAME
    while not image.exists():  # written right after the generation is published
        threading.Event().wait(0.01)
    assert d.stop() == 0
    shutil.rmtree(d.shm_dir)
    d.start()
    with d.client() as c:
        s = c.stats()
    assert s["hot"]["source"] == "image" and s["hot"]["entries"] > 0, s["hot"]
    assert s["hot"]["rebuilds"]["rebuilds"] == 0
    assert "from: image, 0 log records behind" in format_stats(s)
    assert _drafts_from_hot(d.shm_dir, TableIdentity(**info["identity"]), seq)
    assert "serving hot generation 1 from the image on disk" in d.log()
