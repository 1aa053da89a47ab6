"""The client library's failure handling (against a scripted ROUTER) and the ``ngram-client``
commands (against a real daemon)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from ngram_client import DaemonError, DaemonUnavailable, NgramClient, Timeout
from ngram_client.cli import default_tokenizer_path
from ngram_client.ingestcmd import IngestState, _blocks
from ngramd.wire import protocol as P
from conftest import wait_until

needs_tokenizer = pytest.mark.skipif(default_tokenizer_path() is None,
                                     reason="packaged Qwen3 tokenizer not installed")


# ---------------------------------------------------------------------------------------------
# client library against a scripted ROUTER
# ---------------------------------------------------------------------------------------------
class FakeDaemon:
    """A ROUTER on its own thread; ``policy(op, n_seen)`` -> "reply" | "drop" | "error"."""

    def __init__(self, endpoint: str, policy, delay_s: float = 0.0):
        self.endpoint, self.policy, self.delay_s = endpoint, policy, delay_s
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        self._ready.wait(5)

    def _run(self):
        s = zmq.Context.instance().socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(self.endpoint)
        self._ready.set()
        held = []
        while not self._stop.is_set():
            if not s.poll(20):
                continue
            ident, head, *_ = s.recv_multipart()
            h = msgpack.unpackb(head)
            self.seen.append(h["op"])
            action = self.policy(h["op"], self.seen.count(h["op"]))
            if action == "reply":
                held.append([ident, *P.encode_reply(h["id"], {"first_seq": 1, "last_seq": 1})])
            elif action == "error":
                s.send_multipart([ident, *P.encode_error(h["id"], "bad_input", "no")])
            if action == "reply" and len(held) >= (2 if self.delay_s else 1):
                for m in reversed(held):  # out of order on purpose when batching two
                    s.send_multipart(m)
                held = []
        s.close()

    def close(self):
        self._stop.set()
        self._t.join(5)


@pytest.fixture
def ep(tmp_path):
    return f"ipc://{tmp_path}/fake.sock"


#: per attempt, where every attempt must reach the fake: each silent attempt gets a new socket,
#: which must connect within it (150 ms did not always, beside busy processes); the tests
#: count what the fake received, so a slow connection only costs time
ATTEMPT_MS = 1000


def test_ingest_is_never_resent_but_idempotent_ops_are(ep):
    fake = FakeDaemon(ep, lambda op, n: "drop")
    with NgramClient(ep, timeout_ms=ATTEMPT_MS, retries=2) as c, \
            NgramClient(ep, timeout_ms=ATTEMPT_MS, retries=2) as c2:
        ingest = c.ingest_async([[1, 2, 3]])  # given up on meanwhile: the two at once
        with pytest.raises(DaemonUnavailable, match="no answer .* after 3 tries"):
            c2.ping()
        with pytest.raises(Timeout, match="not resent"):
            ingest.result()
    fake.close()
    assert fake.seen.count("ingest") == 1
    assert fake.seen.count("ping") == 3


def test_a_dropped_request_is_retried_and_succeeds(ep):
    fake = FakeDaemon(ep, lambda op, n: "drop" if n == 1 else "reply")
    with NgramClient(ep, timeout_ms=ATTEMPT_MS, retries=2) as c:
        c.ping()
    fake.close()
    assert fake.seen == ["ping", "ping"]


def test_pipelined_replies_out_of_order_reach_the_right_future(ep):
    fake = FakeDaemon(ep, lambda op, n: "reply", delay_s=1)
    with NgramClient(ep, timeout_ms=2000) as c:
        futs = [c.ingest_async([[i, i + 1]]) for i in range(6)]
        assert [f.result() for f in futs] == [(1, 1)] * 6
        f = c._call("stats")
        g = c._call("stats")
        assert f.result().id != g.result().id
    fake.close()


def test_error_replies_raise_daemon_error_with_code(ep):
    fake = FakeDaemon(ep, lambda op, n: "error")
    with NgramClient(ep, timeout_ms=1000) as c:
        with pytest.raises(DaemonError) as ei:
            c.ping()
        assert ei.value.code == "bad_input" and ei.value.message == "no"
    fake.close()


def test_no_daemon_means_unavailable_quickly_and_nothing_queued(ep):
    with NgramClient(ep, timeout_ms=100, retries=1) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="in 1 tries of 100 ms; .* not sent"):
            c.ingest([[1, 2]])
        with pytest.raises(DaemonUnavailable, match="in 2 tries of 100 ms; .* not sent"):
            c.ping()
        # the messages say each call gave up after its own attempts (3 of 100 ms in all); the
        # wall-clock bound only catches a client that hangs or waits the defaults (3 tries of
        # 1 s for ping alone), with room for a busy host's scheduling
        assert time.monotonic() - t0 < 10
        # a daemon that starts later must not receive the requests given up on (IMMEDIATE).
        # The calls below wait as long as a busy host needs to connect (a new socket connects
        # on libzmq's thread; 100 ms was not always enough at load 6-10): what is asserted is
        # what the fake received, not how fast
        fake = FakeDaemon(ep, lambda op, n: "reply")
        c.ping(timeout_ms=30_000)  # this thread's socket
        c.ingest([[3, 4]], timeout_ms=30_000)  # the I/O thread's: after anything queued on it
        fake.close()
        assert fake.seen == ["ping", "ingest"]
    with pytest.raises(DaemonUnavailable):
        c.ping()  # closed


def test_reconnects_to_a_restarted_daemon(ep):
    first = FakeDaemon(ep, lambda op, n: "reply")
    with NgramClient(ep, timeout_ms=500, retries=4) as c:
        c.ping()
        c.ingest([[1, 2]])  # the I/O thread's socket
        first.close()
        second = FakeDaemon(ep, lambda op, n: "reply")  # the same endpoint, a new socket
        # the same client: both its sockets reconnect underneath, as soon as a busy host lets
        # them (an ingest is sent once, never resent: it waits for the connection)
        c.ping(timeout_ms=5_000)
        c.ingest([[3, 4]], timeout_ms=30_000)
    second.close()
    assert first.seen == ["ping", "ingest"]
    assert second.seen.count("ping") >= 1 and second.seen[-1] == "ingest"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_sockets_of_ended_threads_are_closed(ep):
    """Each calling thread gets its own socket: ended threads' sockets must not pile up."""
    fake = FakeDaemon(ep, lambda op, n: "reply")
    c = NgramClient(ep, timeout_ms=2000)
    c.ping()
    base = _fds()
    for _ in range(10):  # 200 short-lived threads, 20 at a time
        threads = [threading.Thread(target=c.ping) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # libzmq closes a socket's fds on its own thread: wait for that, not for a fixed time
    assert wait_until(lambda: _fds() - base < 100, 30), \
        f"{_fds() - base} more fds after 200 threads ended (~2 per socket left open)"
    c.close()
    assert wait_until(lambda: _fds() - base <= 5, 30), _fds() - base
    fake.close()


def test_a_dead_io_thread_fails_pending_and_later_calls(ep, caplog):
    fake = FakeDaemon(ep, lambda op, n: "reply")
    with NgramClient(ep, timeout_ms=5000) as c:
        def broken(frames, inflight):
            raise RuntimeError("injected bug")

        c._deliver = broken  # the I/O thread dies on the first reply
        pending = c.ingest_async([[1, 2, 3]])
        assert isinstance(pending.exception(timeout=3), DaemonUnavailable)
        later = c.ingest_async([[4, 5, 6]])
        err = later.exception(timeout=1)  # before: never resolved
        assert isinstance(err, DaemonUnavailable) and "injected bug" in str(err)
        assert isinstance(c.report_async({4: 1}, {4: 1}).exception(timeout=1), DaemonUnavailable)
        c.ping()  # synchronous idempotent calls have their own sockets and still work
    fake.close()
    logged = [r for r in caplog.records if "I/O thread failed" in r.getMessage()]
    assert len(logged) == 1


def test_close_leaves_the_wake_pipe_to_an_io_thread_it_could_not_stop(ep, caplog):
    """An I/O thread still polling after close()'s join keeps its pipe: closing the fd under
    it made it fail with EBADF ("client I/O thread failed", seen in a CI log)."""
    c = NgramClient(ep, timeout_ms=200)
    wake, join = c._wake, c._thread.join
    c._wake = lambda: None  # the wake-up is lost ...
    c._thread.join = lambda timeout=None: None  # ... and the join gives up at once
    c.close()
    assert c._thread.is_alive()
    os.fstat(c._wake_r)  # still open
    assert any("still running" in r.getMessage() for r in caplog.records)
    wake()  # the thread wakes now, sees the client closed and ends without an error
    join(30)
    assert not c._thread.is_alive()
    assert not [r for r in caplog.records if "I/O thread failed" in r.getMessage()]
    os.close(c._wake_r)
    os.close(c._wake_w)


# ---------------------------------------------------------------------------------------------
# ingest bookkeeping (no daemon)
# ---------------------------------------------------------------------------------------------
def test_blocks_cut_at_newlines_and_resume_from_an_offset(tmp_path):
    f = tmp_path / "a.txt"
    text = "".join(f"line {i} é\n" for i in range(1000))
    f.write_text(text)
    blocks = list(_blocks(f, 0, 100))
    assert "".join(t for _, t in blocks) == text
    assert all(t.endswith("\n") for _, t in blocks)
    mid = blocks[len(blocks) // 2][0]
    assert "".join(t for _, t in _blocks(f, mid, 100)) == f.read_bytes()[mid:].decode()


def test_ingest_state_survives_and_notices_changed_files(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello\n")
    st = IngestState(tmp_path / "state.json")
    assert st.offset(f) == 0
    st.mark(f, 3, False)
    st.save()
    assert IngestState(tmp_path / "state.json").offset(f) == 3
    st.mark(f, 6, True)
    st.save()
    assert IngestState(tmp_path / "state.json").offset(f) is None
    f.write_text("hello, changed\n")
    assert IngestState(tmp_path / "state.json").offset(f) == 0


# ---------------------------------------------------------------------------------------------
# the CLI against a real daemon
# ---------------------------------------------------------------------------------------------
CODE = "".join(
    f"def fibonacci_{i}(n):\n    if n < 2:\n        return n\n"
    f"    return fibonacci_{i}(n - 1) + fibonacci_{i}(n - 2)\n\n" for i in range(40))
PROSE = "The quick brown fox jumps over the lazy dog near the riverbank.\n" * 30


def cli(daemon, *args, check=True, endpoint=None):
    # per-user state (ingest progress) goes under the test's directory, never the real home
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                          endpoint or daemon.endpoint, *args],
                         capture_output=True, text=True, timeout=120, cwd=daemon.root,
                         env=dict(os.environ, OMP_NUM_THREADS="1",
                                  XDG_STATE_HOME=str(daemon.root / "state")))
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.fixture(scope="module")
def loaded(module_daemon, tmp_path_factory):
    """The shared daemon after ``ngram-client ingest`` of two files."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text(CODE)
    (d / "prose.txt").write_text(PROSE)
    out = cli(module_daemon, "ingest", str(d / "code.py"), str(d / "prose.txt"),
              "--state", str(d / "state.json"), "--flush", "--no-progress")
    module_daemon.corpus = d
    module_daemon.first_ingest = out
    cli(module_daemon, "rebuild-hot")
    return module_daemon


@needs_tokenizer
def test_cli_ingest_reports_tokens_and_resumes(loaded):
    assert "ingested" in loaded.first_ingest.stdout and "from 2 file(s)" in loaded.first_ingest.stdout
    n = int(loaded.first_ingest.stdout.split()[1])
    assert n > 500
    d = loaded.corpus
    again = cli(loaded, "ingest", str(d / "code.py"), str(d / "prose.txt"),
                "--state", str(d / "state.json"), "--no-progress")
    assert again.stdout.strip() == "ingested 0 tokens from 0 file(s); 2 already done"
    # an interrupted run resumes from the recorded offset
    f = d / "more.txt"
    f.write_text(PROSE + CODE)
    st = IngestState(d / "state2.json")
    st.mark(f, len(PROSE.encode()), False)
    st.save()
    out = cli(loaded, "ingest", str(f), "--state", str(d / "state2.json"), "--no-progress")
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(default_tokenizer_path()))
    expect = sum(len(tok.encode(t, add_special_tokens=False).ids) for _, t in
                 _blocks(f, len(PROSE.encode()), 1 << 20))
    assert out.stdout.split()[1] == str(expect)
    assert IngestState(d / "state2.json").offset(f) is None


@needs_tokenizer
@pytest.mark.slow
def test_cli_draft_and_lookup_decode_text(loaded):
    out = json.loads(cli(loaded, "draft", "def fibonacci_3(n):\n    if n", "--max-len", "6",
                         "--json", "--budget-us", "1000000").stdout)
    # every continuation of this context in the corpus is the same text: the draft is its prefix
    assert len(out["tokens"]) >= 2 and len(out["text"]) >= 3
    assert " < 2:\n        return n\n    return fibonacci_3(n - 1)".startswith(out["text"])
    assert len(out["orders"]) == len(out["tiers"]) == len(out["conf"]) == len(out["tokens"])
    readable = cli(loaded, "draft", "The quick brown fox jumps", "--max-len", "4").stdout
    assert "draft:" in readable and "text: ' over" in readable
    assert "order   tier" in readable
    # every tier is named: what the daemon counted since the last hot build is "recent" (the
    # table printed 3 for it)
    tiers = [ln.split()[-2] for ln in readable.splitlines()[3:]]
    assert tiers and set(tiers) <= {"hot", "cold", "recent"}, readable
    lk = cli(loaded, "lookup", "The quick brown fox").stdout
    assert "orders present" in lk and "' jumps' x30" in lk
    js = json.loads(cli(loaded, "lookup", "The quick brown fox", "--json").stdout)
    assert js["orders"] and js["orders"][0]["total"] == 30


@needs_tokenizer
def test_cli_top_stats_info_ping_flush(loaded):
    cli(loaded, "draft", "def fibonacci", "--max-len", "2")  # stats show an "op draft" row
    top = cli(loaded, "top", "--order", "2", "-n", "5").stdout
    assert top.startswith("top 5 contexts of order 2")
    assert len(top.strip().splitlines()) == 7
    st = cli(loaded, "stats").stdout
    for needle in ("order  hot hit cold reads", "latency (µs)", "sizes", "op draft", "requests:",
                   "size: ", "can change a draft", "rebuilds: ", "of a core since start"):
        assert needle in st, st  # the hot tier's size, and why (issue 18)
    js = json.loads(cli(loaded, "stats", "--json").stdout)
    assert js["orders"][0]["order"] == 1 and "server" in js
    info = json.loads(cli(loaded, "info", "--json").stdout)
    assert info["hot"]["table"] == "t"
    assert cli(loaded, "ping").stdout.startswith("pong from ")
    assert "ingest log applied up to seq" in cli(loaded, "flush").stdout
    assert cli(loaded, "rebuild-hot", "--full").stdout.startswith("hot generation ")


def test_cli_saves_and_loads_a_policy_state_through_the_generic_path(module_daemon, tmp_path):
    """``save-policy``/``load-policy`` have no console of their own: options from their fields
    (the blob's names a file, '-' stdin), the value as JSON with the state as base64."""
    import base64

    state = bytes(range(256)) * 3
    f = tmp_path / "state.bin"
    f.write_bytes(state)
    out = json.loads(cli(module_daemon, "save-policy", "--key", "cli:m", "--state", str(f)).stdout)
    assert out["key"] == "cli:m" and out["bytes"] == len(state) and out["states"] >= 1
    got = json.loads(cli(module_daemon, "load-policy", "--key", "cli:m").stdout)
    assert base64.b64decode(got["state"]) == state and got["saved_at"] > 0
    assert json.loads(cli(module_daemon, "load-policy", "--key", "cli:none").stdout) == \
        {"saved_at": None, "state": None}
    bad = cli(module_daemon, "save-policy", "--key", "", "--state", str(f), check=False)
    assert bad.returncode == 1 and "bad_input: key must be 1..128 bytes" in bad.stderr
    missing = cli(module_daemon, "save-policy", "--key", "k", "--state", str(tmp_path / "no"),
                  check=False)
    assert missing.returncode == 2 and "No such file" in missing.stderr


@needs_tokenizer
def test_cli_refuses_another_tokenizer_and_reports_a_missing_daemon(loaded, tmp_path):
    """The fingerprint is of the tokenizer's behaviour: a re-serialised copy of the table's
    tokenizer is accepted, one with a special token changed is refused (exit 3)."""
    data = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_text(json.dumps(data, indent=1), encoding="utf-8")  # same ids, other bytes
    cli(loaded, "draft", "hello", "--tokenizer", str(copy))
    data["added_tokens"][-1]["content"] = "<|another_token|>"
    other = tmp_path / "tokenizer.json"
    other.write_text(json.dumps(data), encoding="utf-8")
    out = cli(loaded, "draft", "hello", "--tokenizer", str(other), check=False)
    assert out.returncode == 3 and "tokenizer mismatch" in out.stderr
    # and how to fix it (issue 30): the table's tokenizer, or a table for this one
    assert f"tokenized with {other} (from --tokenizer)" in out.stderr
    assert "$NGRAM_TOKENIZER" in out.stderr and f"ngramd --name NAME --tokenizer {other}" in out.stderr
    out = cli(loaded, "--timeout-ms", "100", "ping", check=False,
              endpoint=f"ipc://{tmp_path}/nobody.sock")
    assert out.returncode == 4 and out.stdout == ""
    assert f"{tmp_path}/nobody.sock does not exist" in out.stderr and "--endpoint" in out.stderr


@needs_tokenizer
@pytest.mark.slow
def test_ingest_resume_state_is_per_table(start_daemon, tmp_path):
    # progress is kept per table under $XDG_STATE_HOME: table A's progress does not skip the
    # files for a fresh table B, nor for A rebuilt at the same path (as after `make clean`)
    a, b = start_daemon(name="a"), start_daemon(name="b")
    f = tmp_path / "code.py"
    f.write_text(CODE)
    n = int(cli(a, "ingest", str(f), "--no-progress").stdout.split()[1])
    assert n > 500
    again = cli(a, "ingest", str(f), "--no-progress")
    assert again.stdout.strip() == "ingested 0 tokens from 0 file(s); 1 already done"
    assert cli(b, "ingest", str(f), "--no-progress").stdout.split()[1] == str(n)
    a.stop()
    shutil.rmtree(tmp_path / "data" / "a")
    a.start()
    assert cli(a, "ingest", str(f), "--no-progress").stdout.split()[1] == str(n)
    states = list((tmp_path / "state" / "flash-nest" / "ingest").glob("*.json"))
    assert len(states) == 3 and not (tmp_path / ".ngram-ingest.json").exists()
    # an explicit --state recorded for table B starts over on table A (with a warning)
    st = tmp_path / "mine.json"
    cli(b, "ingest", str(f), "--state", str(st), "--no-progress")
    out = cli(a, "ingest", str(f), "--state", str(st), "--no-progress")
    assert out.stdout.split()[1] == str(n) and "records another table" in out.stderr


def test_cli_bad_endpoint_and_absent_daemon_fail_fast_and_clearly(tmp_path, monkeypatch, capsys):
    from ngram_client import cli as client_cli

    monkeypatch.delenv("NGRAMD_ENDPOINT", raising=False)
    assert client_cli.main(["--endpoint", "localhost:5555", "ping"]) == 2
    err = capsys.readouterr().err
    assert "bad endpoint 'localhost:5555'" in err and "from --endpoint" in err
    monkeypatch.setenv("NGRAMD_ENDPOINT", "tcp://127.0.0.1")
    assert client_cli.main(["ping"]) == 2
    assert "tcp://HOST:PORT" in (err := capsys.readouterr().err) and "$NGRAMD_ENDPOINT" in err
    # no daemon: exit 4 at once (not after 3 tries of 2 s), naming the path and the variable
    monkeypatch.setenv("NGRAMD_ENDPOINT", f"ipc://{tmp_path}/none.sock")
    t0 = time.monotonic()
    assert client_cli.main(["ping"]) == 4
    err = capsys.readouterr().err
    assert f"{tmp_path}/none.sock does not exist" in err and "$NGRAMD_ENDPOINT" in err
    stale = tmp_path / "stale.sock"  # a socket file nobody listens on (a daemon killed -9)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    assert client_cli.main(["--endpoint", f"ipc://{stale}", "stats"]) == 4
    assert "nothing listens" in capsys.readouterr().err
    # "at once" against the client's 3 tries of 2 s (6 s a call, 12 s for the two): the bound
    # leaves a busy host room and still fails a CLI that tries before it looks at the path
    assert time.monotonic() - t0 < 5
    # bad option values are usage errors (exit 2), not tracebacks
    for bad in (["--timeout-ms", "0", "ping"], ["--timeout-ms", "abc", "ping"],
                ["ingest", "--chunk-tokens", "0", "x"], ["stats", "--watch", "nan"]):
        with pytest.raises(SystemExit) as e:
            client_cli.main(bad)
        assert e.value.code == 2, bad
    assert "must be at least 1" in capsys.readouterr().err


def test_unrecorded_tokenizer_is_warned_once_per_process(ep, caplog):
    reply = lambda: P.Reply(id=1, ok=True, fields={"identity": {"tokenizer": ""}}, arrays={})
    for _ in range(2):
        with NgramClient(ep, timeout_ms=100, retries=0) as c:
            c.tokenizer_fingerprint = "f" * 64
            for _ in range(3):
                c._check_identity(reply())
    assert sum("records no tokenizer fingerprint" in r.message for r in caplog.records) == 1


@needs_tokenizer
def test_cli_ingest_refuses_binary_and_non_utf8_files_naming_them(loaded, tmp_path):
    """A NUL in the first 8 KiB or bytes that are not UTF-8: the run is refused before anything
    is sent (exit 2, each file named); ``--skip-bad`` ingests the text files and names the
    skipped ones.  (Before: ``/bin/ls`` went in as 118k tokens of NUL contexts.)"""
    good = tmp_path / "good.txt"
    good.write_text(PROSE)
    binary = tmp_path / "prog.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64) + b"text\n" * 100)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(("caf\u00e9 au lait\n" * 2000).encode("latin-1"))
    files = [str(good), str(binary), str(latin1)]
    st = str(tmp_path / "state.json")
    out = cli(loaded, "ingest", *files, "--state", st, "--no-progress", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(binary) in out.stderr and str(latin1) in out.stderr and "--skip-bad" in out.stderr
    assert "binary" in out.stderr and "not UTF-8" in out.stderr and out.stdout == ""
    out = cli(loaded, "ingest", *files, "--state", st, "--no-progress", "--skip-bad")
    assert "from 1 file(s)" in out.stdout and "2 not text, skipped" in out.stdout
    assert int(out.stdout.split()[1]) > 100 and str(binary) in out.stderr


def test_stats_hot_hit_column_is_filled_for_a_table_that_only_served_drafts():
    from ngram_client.cli import format_stats

    # the daemon counts hot lookups only for `lookup` requests: a table that served drafts
    # has none, and the column showed "-" whatever the hot tier did
    row = {"order": 4, "hot_lookups": 0, "hot_hits": 0, "hot_hit_rate": None, "hot_drafted": 30,
           "cold_drafted": 10, "local_drafted": 0, "recent_drafted": 0, "reported_drafted": 50,
           "reported_accepted": 20, "reported_acceptance": 0.4, "cold_lookups": 12,
           "cold_hit_rate": 0.5, "degrades": 0}
    assert format_stats({"orders": [row]}).splitlines()[1].split()[1] == "75.0%"
    looked_up = dict(row, hot_lookups=10, hot_hits=4, hot_hit_rate=0.4)
    assert format_stats({"orders": [looked_up]}).splitlines()[1].split()[1] == "40.0%"
    nothing = dict(row, hot_drafted=0, cold_drafted=0)
    assert format_stats({"orders": [nothing]}).splitlines()[1].split()[1] == "-"


def test_stats_shows_the_generators_draft_length_policy():
    from ngram_client.cli import format_stats

    assert "draft lengths" not in format_stats({"policy": {}})  # none reported yet
    text = format_stats({"policy": {"steps": 165, "plain_share": 0.49, "vs_plain": 1.14,
                                    "vs_full": 1.42, "vs_oracle": 0.73}})
    assert ("draft lengths (generators' reports): 165 steps with a draft, plain chosen in 49%; "
            "tokens/s on the same steps by their cost models: 1.14x plain, 1.42x full drafts, "
            "0.73x the oracle") in text
    assert "policy states" not in text + format_stats({"policy_states": {"keys": 0, "bytes": 0}})
    assert "  policy states  2 keys, 1.0 MiB" in format_stats(
        {"policy_states": {"keys": 2, "bytes": (1 << 20) + 3}})


def test_the_client_imports_without_numba_or_rocksdb():
    """A generator host needs the client, not the table engine: ``import ngram_client`` (and
    its CLI module) must not load numba or RocksDB (seconds of import, compile caches)."""
    code = ("import sys, ngram_client, ngram_client.cli; "
            "print(sorted(m for m in ('numba', 'rocksdict') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_stats_has_a_recent_tier_column():
    from ngram_client.cli import format_stats

    row = {"order": 3, "hot_drafted": 5, "recent_drafted": 7, "cold_drafted": 2}
    head, line = format_stats({"orders": [row]}).splitlines()[:2]
    assert "drafted h/r/c" in head  # hot, recent, cold
    assert line.split()[5] == "5/7/2"


def _help_texts(prog_module: str, subcommands) -> dict:
    out = {}
    for sub in [[]] + [[s] for s in subcommands]:
        r = subprocess.run([sys.executable, "-m", prog_module, *sub, "--help"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[" ".join(sub) or "-"] = r.stdout
    return out


def test_help_has_no_raw_rst_backticks():
    """--help is read in a terminal: ``name`` and `name` were printed as typed in the
    docstrings."""
    from ngram_client.cli import build_parser

    subs = [a for a in build_parser()._subparsers._group_actions[0].choices]
    texts = _help_texts("ngram_client.cli", subs)
    texts.update({f"ngramd {k}": v for k, v in _help_texts(
        "ngramd.service", ["warm", "compact", "snapshot", "restore", "keygen"]).items()})
    texts.update({f"ngram-generate {k}": v for k, v in _help_texts(
        "ngram_generator.cli", []).items()})
    texts.update({f"ngram-demo {k}": v for k, v in _help_texts(
        "ngram_generator.demo", []).items()})
    assert len(texts) > 15
    bad = {k: [ln for ln in v.splitlines() if "`" in ln] for k, v in texts.items() if "`" in v}
    assert not bad, bad


@needs_tokenizer
def test_cli_tokenizer_from_the_environment_and_draft_of_a_huge_stdin(loaded, tmp_path):
    """$NGRAM_TOKENIZER serves every command that tokenizes (here: a table of another
    tokenizer refuses it, exit 3); ``draft -`` tokenizes only the end of its input and sends
    at most the table's n_max tokens (90 MB took 111 s to tokenize before a size error)."""
    data = json.loads(default_tokenizer_path().read_text(encoding="utf-8"))
    data["added_tokens"][-1]["content"] = "<|another_token|>"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data), encoding="utf-8")
    env = dict(os.environ, NGRAM_TOKENIZER=str(other), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                          loaded.endpoint, "draft", "hello"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 3 and "tokenizer mismatch" in out.stderr
    env["NGRAM_TOKENIZER"] = str(tmp_path / "missing.json")
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                          loaded.endpoint, "draft", "hello"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "$NGRAM_TOKENIZER" in out.stderr
    # 40 MB of text, then a context the table knows: the draft continues it
    big = "".join(f"line {i} of filler text, nothing to learn here\n" for i in range(800_000))
    big += "The quick brown fox jumps"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                          loaded.endpoint, "draft", "-", "--json"], input=big,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    assert js["context_tokens"] == 16 and js["text"].startswith(" over"), (js, took)


def test_tail_tokens_are_the_last_tokens_of_the_whole_text():
    from tokenizers import Tokenizer

    from ngram_client.cli import _encode, tail_tokens

    path = default_tokenizer_path()
    if path is None:
        pytest.skip("packaged Qwen3 tokenizer not installed")
    tok = Tokenizer.from_file(str(path))
    texts = [CODE, PROSE, "x" * 5000, "    " * 3000 + "end", "a\n" * 10, "short", CODE + "  ",
             "a  \n\n\n   b\r\n" * 300, "\n" * 3000 + "z", "naïve café — 東京\n" * 200]
    for text in texts:
        for n in (1, 4, 16):
            assert tail_tokens(tok, text, n).tolist() == _encode(tok, text)[-n:].tolist()


@needs_tokenizer
@pytest.mark.slow
def test_ping_waits_for_a_daemon_that_starts_later_and_says_so(start_daemon, tmp_path):
    """``ping --wait``: a script can start ngramd and wait for it (the first start compiles
    kernels); a wait over 2 s says what it waits for on stderr."""
    d = start_daemon(name="late", wait=False)
    d.stop()
    waiter = subprocess.Popen([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                               d.endpoint, "ping", "--wait", "120"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    # the daemon starts once the waiter has said it waits (its line after 2 s with no daemon;
    # a blocking read: a waiter that never says so ends at its 120 s and the assert fails)
    said = waiter.stderr.readline()
    assert said.startswith(f"waiting for ngramd at {d.endpoint}: waiting, "), said
    assert waiter.poll() is None
    d.start()
    out, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0 and out.startswith("pong from"), said + err
    gone = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint",
                           f"ipc://{tmp_path}/none.sock", "ping", "--wait", "0.5"],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 4 and "within 0.5 s" in gone.stderr


def test_ping_wait_stops_when_the_daemon_it_waits_for_exits(tmp_path):
    """``ping --wait 120 --pid PID``: a daemon that refused its settings (exit 2) ends the wait
    at once with exit 4 and the reason, instead of after the whole 120 s; ``--pid`` without
    ``--wait`` is a usage error."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[table]\nbogus_key = 1\n")
    sock = f"ipc://{tmp_path}/d.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "ngramd.service", "--config", str(bad),
                               "--endpoint", sock], stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint", sock, "ping",
                            "--wait", "120", "--pid", str(daemon.pid)],
                           capture_output=True, text=True, timeout=100)
        waited = time.monotonic() - t0
        # not reaped yet: the daemon is a zombie while ping looks, and a zombie has exited
        assert daemon.poll() == 2
    finally:
        daemon.kill()
        daemon.wait()
    assert r.returncode == 4, r.stderr
    assert f"process {daemon.pid} exited before it answered" in r.stderr
    assert waited < 100
    usage = subprocess.run([sys.executable, "-m", "ngram_client.cli", "--endpoint", sock, "ping",
                            "--pid", "1"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "--pid needs --wait" in usage.stderr


def test_progress_says_what_a_long_wait_waits_for():
    import concurrent.futures as cf
    import io

    from ngramd.wire import progress

    now = [0.0]
    fut = cf.Future()

    class Clock:
        def __call__(self):
            now[0] += 0.5  # every look at the clock: half a second later
            if now[0] > 30 and not fut.done():
                fut.set_result(7)
            return now[0]

    stream = io.StringIO()
    states = iter(range(100))
    assert progress.wait(fut, "flush", lambda: f"lag {next(states)}", stream=stream,
                         clock=Clock(), tick_s=0.001) == 7
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("flush: waiting, ") and "; lag 0" in lines[0]
    assert 2 <= len(lines) <= 5 and lines[-1].startswith("flush: ")  # a line per 10 s, a total
    quick = cf.Future()
    quick.set_result(1)
    stream = io.StringIO()
    assert progress.wait(quick, "flush", stream=stream) == 1 and stream.getvalue() == ""


def test_flush_progress_outlives_a_daemon_too_busy_for_stats(monkeypatch):
    """The progress bar of a long flush reads ``stats``; a daemon too busy to answer it in
    time (a fresh install compiling its kernels held the GIL past 3 x 2 s in CI) must not fail
    the flush, which still answers: the bar skips that reading."""
    import concurrent.futures as cf

    from ngram_client import ingestcmd

    monkeypatch.setattr(ingestcmd, "FLUSH_QUIET_S", 0.05)
    done = cf.Future()
    calls = []

    class Busy:
        def flush_async(self):
            return done

        def stats(self):
            calls.append(1)
            if len(calls) == 1:
                raise Timeout("stats: no answer")
            if len(calls) == 3:
                threading.Timer(0.1, done.set_result, (42,)).start()
            return {"cold": {"counted_seq": len(calls), "last_seq": 10}, "log_lag_s": 1.0}

    assert ingestcmd.flush_with_progress(Busy(), progress=False) == 42
    assert len(calls) >= 3
