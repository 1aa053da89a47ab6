"""The systemd unit verifies and the example config loads (skipped where systemd-analyze is
missing, e.g. in containers without systemd)."""

from __future__ import annotations

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
    text = UNIT.read_text().replace("/usr/local/bin/ngramd", exe)
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
