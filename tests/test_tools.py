"""``ngramd warm`` and ``ngram-client ingest`` read a corpus by one rule (``ngramd.wire.corpus``):
the same directory gives the same table either way, and what is not text is refused by name
when named, skipped in one summary line when found in a directory (issue 19: ``ngram-client
ingest DIR`` said "not a file"; ``ngramd warm`` printed a WARNING per skipped .pyc and decoded
bad bytes where the client refused them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import QWEN3_TOKENIZER
from ngramd.wire.corpus import collect

needs_tokenizer = pytest.mark.skipif(QWEN3_TOKENIZER is None,
                                     reason="packaged Qwen3 tokenizer not installed")

CODE = "".join(f"def double_{i}(x):\n    return 2 * x + {i}\n\n" for i in range(60))


def make_tree(root):
    """A source tree: text in nested directories, .pyc files, a hidden directory, a Latin-1
    file, an empty file."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / ".git").mkdir()
    (root / "a.py").write_text(CODE)
    (root / "pkg" / "b.py").write_text(CODE.replace("double", "triple"))
    (root / "pkg" / "sub" / "c.txt").write_text("The quick brown fox jumps.\n" * 40)
    (root / "pkg" / "empty.py").write_text("")
    for i in range(5):
        (root / "pkg" / "__pycache__" / f"m{i}.cpython-311.pyc").write_bytes(
            b"\xa7\r\r\n\0\0\0\0" + bytes(range(256)))
    (root / ".git" / "config").write_text("[core]\n\tbare = false\n")
    (root / "pkg" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 10)
    return root


def test_collect_walks_directories_and_refuses_named_files_that_are_not_text(tmp_path):
    tree = make_tree(tmp_path / "tree")
    c = collect([tree])
    assert [f.relative_to(tree).as_posix() for f in c.files] == [
        "a.py", "pkg/b.py", "pkg/empty.py", "pkg/sub/c.txt"]
    assert not c.refused and len(c.skipped) == 6
    summary = c.skipped_summary()
    assert "6 file(s)" in summary and "5 binary (.pyc 5)" in summary
    assert "1 not UTF-8 (.txt 1)" in summary
    named = collect([tree / "a.py", tree / "pkg" / "latin1.txt"])
    assert named.files == [tree / "a.py"] and named.refused[0][0] == tree / "pkg" / "latin1.txt"
    assert "--skip-bad" in named.refusal(skip_bad=False) and named.refusal(skip_bad=True) is None


def _run(args, cwd, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               XDG_STATE_HOME=str(cwd / "state"))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, **kw)


@needs_tokenizer
@pytest.mark.slow
def test_warm_and_ingest_of_a_directory_make_the_same_table(start_daemon, tmp_path):
    tree = make_tree(tmp_path / "tree")
    warmed = start_daemon(name="w")
    warmed.stop()
    out = _run(["-m", "ngramd.service", "warm", "-c", str(warmed.config_path), "--no-progress",
                str(tree)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "from 4 file(s) (6 not text, skipped)" in out.stdout
    # one summary line for the skipped files, not a WARNING for each
    assert out.stderr.count(".pyc") == 1 and "5 binary" in out.stderr, out.stderr
    assert "WARNING" not in out.stderr
    warmed.start()
    fresh = start_daemon(name="i")
    out = _run(["-m", "ngram_client.cli", "--endpoint", fresh.endpoint, "ingest", "--flush",
                "--no-progress", str(tree)], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "from 4 file(s); 6 not text, skipped" in out.stdout
    assert out.stderr.count(".pyc") == 1 and "WARNING" not in out.stderr, out.stderr
    with warmed.client() as a, fresh.client() as b:
        sa, sb = a.checksum(), b.checksum()
    assert sa["rows"] > 100 and sa == sb
    # a file named on the command line that is not text is refused, naming it, by both
    bad = tree / "pkg" / "latin1.txt"
    for args in (["-m", "ngramd.service", "warm", "-c", str(warmed.config_path), str(bad)],
                 ["-m", "ngram_client.cli", "--endpoint", fresh.endpoint, "ingest", str(bad)]):
        out = _run(args, tmp_path)
        assert out.returncode == 2 and str(bad) in out.stderr and "--skip-bad" in out.stderr


def test_a_stopped_daemon_says_how_to_remove_its_hot_tier_and_clear_hot_does(start_daemon,
                                                                            tmp_path):
    """The hot generation stays in shared memory after a clean exit (generators keep
    drafting, a restart serves at once); the daemon says so and how to remove it, and
    ``ngramd clear-hot`` removes it, refusing while a daemon serves the table."""
    d = start_daemon(name="kept")
    with d.client() as c:
        c.ingest([list(range(2, 40))])
        c.flush()
        c.rebuild_hot()
    clear = ["-m", "ngramd.service", "clear-hot", "-c", str(d.config_path)]
    out = _run(clear, tmp_path)
    assert out.returncode == 1 and "already has a publisher" in out.stderr
    assert d.stop() == 0
    assert "ngramd clear-hot --name kept --shm-dir" in d.log()
    assert list(d.shm_dir.glob("kept.gen*"))
    out = _run(clear, tmp_path)
    assert out.returncode == 0 and "removed the hot tier of table 'kept'" in out.stdout
    assert not list(d.shm_dir.glob("kept.*"))
    assert "no hot tier" in _run(clear, tmp_path).stdout


def test_ngramd_snapshot_asks_the_running_daemon(start_daemon, tmp_path):
    """``ngramd snapshot`` is a client of the running daemon that needs no ``ngram_client``
    (``tools.ask_daemon``): ``--to-dir`` writes the snapshot file and prints its manifest;
    without a fleet the object store is refused with the daemon's code; no daemon: a clear
    error within the connect time, not a wait for the op's 600 s."""
    from pathlib import Path

    from ngramd.tools import ask_daemon
    from ngramd.wire.errors import UNAVAILABLE, NgramError

    d = start_daemon()
    with d.client() as c:
        c.ingest([list(range(1, 40))])
        c.flush()
    cfg = ["-m", "ngramd.service", "snapshot", "-c", str(d.config_path)]
    out = _run([*cfg, "--to-dir"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("snapshot ") and " MiB, applied seq " in out.stdout
    assert Path(out.stdout.rsplit("-> ", 1)[1].strip()).is_file()
    out = _run(cfg, tmp_path)
    assert out.returncode == 1 and "ngramd snapshot: bad_input: [fleet] is off" in out.stderr
    with pytest.raises(NgramError, match="no connection to .* in 200 ms") as e:
        ask_daemon(f"ipc://{tmp_path}/nobody.sock", "snapshot", 200, to_dir=True)
    assert e.value.code == UNAVAILABLE
