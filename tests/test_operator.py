"""What an operator meets following the README word for word (issue 30): a table is never
created inside a model's directory, and the messages of the common mistakes say how to fix
them -- a default endpoint nobody serves, a missing model path (said before torch loads),
binary input named the same way in every line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ngramd.tools import private_data_dir, refuse_foreign_dir
from ngramd.wire.corpus import collect
from ngramd.wire.errors import NgramError


def _model_dir(d: Path) -> Path:
    """A directory as ``ngram_generator.export`` writes one (what vLLM loads)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    return d


def _env(tmp_path: Path, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NGRAMD_ENDPOINT"}
    return dict(env, OMP_NUM_THREADS="1", RUNTIME_DIRECTORY=str(tmp_path / "run"),
                XDG_STATE_HOME=str(tmp_path / "state"), **kw)


def test_ngramd_refuses_to_create_a_table_inside_a_model(tmp_path):
    """The README once gave var/smollm2 to both the walk-through's table and the exported
    model: ``ngramd --name smollm2 --data-dir var`` wrote CURRENT, LOCK and MANIFEST beside
    model.safetensors.  Now it exits 1 at once, naming the directory and the fix, and nothing
    in the model's directory is made or changed."""
    model = _model_dir(tmp_path / "var" / "smollm2")
    before = sorted(p.name for p in model.iterdir()), model.stat().st_mode
    out = subprocess.run([sys.executable, "-m", "ngramd.service", "--name", "smollm2",
                          "--data-dir", str(tmp_path / "var"), "--shm-dir",
                          str(tmp_path / "shm")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_env(tmp_path))
    assert out.returncode == 1, out.stderr
    assert f"{model} holds a model's files" in out.stderr
    assert "--data-dir" in out.stderr and "--name" in out.stderr
    assert (sorted(p.name for p in model.iterdir()), model.stat().st_mode) == before


def test_a_data_dir_holding_a_model_is_refused_and_an_existing_table_still_opens(tmp_path):
    model = _model_dir(tmp_path / "exported")
    with pytest.raises(NgramError, match="model.safetensors"):
        private_data_dir(str(model), "t")  # the table would go to exported/t
    assert not (model / "t").exists()
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(NgramError, match="m.gguf"):
        private_data_dir(str(tmp_path), "gguf")
    # a table that is there already (RocksDB's CURRENT) opens wherever it is
    (gguf / "CURRENT").write_text("MANIFEST-000001\n")
    refuse_foreign_dir(tmp_path, gguf, "gguf")
    # an empty or ngramd-only directory is made as before
    assert private_data_dir(str(tmp_path / "data"), "t") == tmp_path / "data" / "t"


def test_ngramd_warm_refuses_a_model_directory_too(tmp_path):
    _model_dir(tmp_path / "var" / "smollm2")
    text = tmp_path / "ids.npy"  # token ids: no tokenizer needed
    np.save(text, np.arange(1, 200, dtype=np.uint32))
    out = subprocess.run([sys.executable, "-m", "ngramd.service", "warm", "--name", "smollm2",
                          "--data-dir", str(tmp_path / "var"), "--set", 'table.tokenizer="none"',
                          str(text)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=_env(tmp_path))
    assert out.returncode == 1 and "holds a model's files" in out.stderr, out.stderr
    assert not (tmp_path / "var" / "smollm2" / "CURRENT").exists()


def test_generate_names_the_default_endpoint_that_does_not_answer_and_a_missing_model_fast(
        tmp_path):
    """Without --daemon or $NGRAMD_ENDPOINT the generator looks where ngram-client does (the
    default table's socket); nobody there is said as such, naming it (it said "no daemon
    configured").  A missing model path exits 2 before torch, transformers or numba load
    (it took 7.1 s)."""
    code = ("import sys\nfrom ngram_generator.cli import main\n"
            "rc = main(['--model', sys.argv[1], 'hello'])\n"
            "print(rc, [m for m in ('torch', 'transformers', 'numba') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "no-such-model")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_env(tmp_path))
    assert out.stdout.split("\n")[0] == "2 []", (out.stdout, out.stderr)
    sock = tmp_path / "run" / "default.sock"
    assert f"the daemon at ipc://{sock}" in out.stderr and "is not answering" in out.stderr
    assert "no daemon configured" not in out.stderr
    assert f"model path does not exist: {tmp_path / 'no-such-model'}" in out.stderr


def test_binary_input_is_called_binary_in_every_line(tmp_path, caplog):
    """``ngram-client ingest /bin/ls`` said "binary" in the line naming the file and "not
    UTF-8 text" in the line that stopped the run."""
    binary = tmp_path / "prog"
    binary.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    only_binary = collect([binary]).refusal(skip_bad=False)
    assert "1 binary" in only_binary and "UTF-8" not in only_binary
    assert "binary" in caplog.text and "UTF-8" not in caplog.text
    both = collect([binary, latin1]).refusal(skip_bad=False)
    assert "2 file(s) are not text (1 binary, 1 not UTF-8" in both


def test_a_passing_run_leaves_no_temp_dirs_behind(tmp_path):
    """The project's pytest settings remove a passed run's temporary directories (issue 30:
    ``make test`` left 2.5 GB in /tmp/pytest-of-root, three 517 MB SmolLM2 copies among it)."""
    (tmp_path / "t").mkdir()
    (tmp_path / "temproot").mkdir()
    (tmp_path / "t" / "test_x.py").write_text(
        "def test_a(tmp_path, tmp_path_factory):\n"
        "    (tmp_path / 'left').write_bytes(b'x' * 1000)\n"
        "    (tmp_path_factory.mktemp('shared') / 'left').write_bytes(b'x')\n")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(pyproject),
                          "--rootdir", str(tmp_path / "t"), "-p", "no:cacheprovider",
                          "-p", "no:xdist", str(tmp_path / "t" / "test_x.py")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path / "t",
                         env=_env(tmp_path, PYTEST_DEBUG_TEMPROOT=str(tmp_path / "temproot")))
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list((tmp_path / "temproot").rglob("left"))


def test_clear_hot_leaves_no_empty_shm_directory(tmp_path):
    """A clean run of the walk-through ends with ``ngramd clear-hot``: it left an empty
    /dev/shm/ngramd/ behind; a directory that holds another table's tier stays."""
    shm = Path("/dev/shm") / f"flashnest-test-{os.getpid()}-{tmp_path.name}"
    shm.mkdir()
    try:
        (shm / "t.recent").write_bytes(b"\0" * 64)  # as a daemon killed -9 leaves it
        (shm / "other.recent").write_bytes(b"\0" * 64)
        for name, gone in (("t", False), ("other", True)):
            out = subprocess.run([sys.executable, "-m", "ngramd.service", "clear-hot", "--name",
                                  name, "--shm-dir", str(shm)], capture_output=True, text=True,
                                 timeout=120, cwd=tmp_path, env=_env(tmp_path))
            assert out.returncode == 0 and "removed the hot tier" in out.stdout, out.stderr
            assert shm.exists() != gone
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_data_dir_that_is_a_file_is_refused_naming_the_setting_and_what_it_must_be(tmp_path):
    """``ngramd --data-dir F`` where F is a regular file (issue 52: it said ``[Errno 20] Not a
    directory: 'F/<name>'``).  Proves: it exits 2 (a setting to change, as a bad config) before
    anything loads, naming the flag, the file and what the data directory must be; the file is
    left as it was; the same for a path under the file and for ``--check-config``."""
    f = tmp_path / "F"
    f.write_text("not a directory\n")
    for data_dir in (f, f / "below"):
        out = subprocess.run([sys.executable, "-m", "ngramd.service", "--name", "t",
                              "--data-dir", str(data_dir), "--shm-dir", str(tmp_path / "shm")],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env=_env(tmp_path))
        assert out.returncode == 2, out.stderr
        assert "--data-dir" in out.stderr and f"{f} is a file" in out.stderr, out.stderr
        assert "must be a directory, or a path where one can be created" in out.stderr
        assert "Errno" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert f.read_text() == "not a directory\n"
    out = subprocess.run([sys.executable, "-m", "ngramd.service", "--check-config", "--name",
                          "t", "--data-dir", str(f)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_env(tmp_path))
    assert out.returncode == 2 and "bad config" in out.stderr, out.stderr
    assert f"{f} is a file" in out.stderr and "must be a directory" in out.stderr, out.stderr
