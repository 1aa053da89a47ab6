"""Config errors name the section as the file spells it and the key (issue 19: "[table]: a
value has the wrong type ('<=' not supported ...)" and "unknown config key(s) in
[DaemonConfig]: tabel"), and ``--check-config`` checks the files a config names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ngramd.config import load_daemon_config
from ngramd.wire.errors import BadInput


@pytest.mark.parametrize("override, message", [
    ('table.n_min="3"', "[table] n_min: expected an integer, got a string ('3')"),
    ("tabel.n_min=3", "unknown section(s) in the config: 'tabel' (did you mean 'table'?)"),
    ("table.nmax=3", "unknown key(s) in [table]: 'nmax' (did you mean 'n_max'?)"),
    ("table.cold.delta_mb=true", "[table.cold] delta_mb: expected an integer, got a boolean"),
    ("server.endpoints=3", "[server] endpoints: expected a list (or one string), got an integer"),
    ('table.c_min=[1, "a"]', "[table] c_min: expected a number or a list of numbers"),
    ("fleet.enabled=1", "[fleet] enabled: expected true or false, got an integer"),
    ("server.max_batch=inf", "[server] max_batch: expected an integer, got a number (inf)"),
    ("table.zzz=1", "unknown key(s) in [table]: 'zzz'; known: name, data_dir"),
])
def test_a_config_error_names_the_section_and_the_key(override, message):
    with pytest.raises(BadInput) as e:
        load_daemon_config(None, (override,))
    assert message in str(e.value)


def test_a_config_file_error_names_the_key_too(tmp_path):
    cfg = tmp_path / "x.toml"
    cfg.write_text('[table]\nn_max = "16"\n')
    with pytest.raises(BadInput, match=r"\[table\] n_max: expected an integer"):
        load_daemon_config(str(cfg))
    cfg.write_text("table = 3\n")
    with pytest.raises(BadInput, match=r"\[table\]: expected a table of settings"):
        load_daemon_config(str(cfg))
    # good values of every kind still load: an int where a float goes, a list per order
    ok = load_daemon_config(None, ("table.hot_budget_mb=64", "table.c_min=[1, 2, 2, 2]",
                                   "table.n_min=4", "table.n_max=7", 'server.endpoints="ipc:///x"'))
    assert ok.table.hot_budget_mb == 64 and ok.server.endpoints == ("ipc:///x",)


def _check(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "ngramd.service", "--check-config",
                           "--runtime-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)


def test_check_config_checks_the_tokenizer_and_key_files(tmp_path):
    out = _check(tmp_path, "--tokenizer", str(tmp_path / "nope.json"))
    assert out.returncode == 2 and "[table] tokenizer: tokenizer file not found" in out.stderr
    tcp = 'server.endpoints=["tcp://127.0.0.1:5555"]'
    out = _check(tmp_path, "--tokenizer", "none", "--set", tcp, "--set",
                 f'server.curve_secret_key="{tmp_path}/server.key_secret"')
    assert out.returncode == 2 and "curve_secret_key" in out.stderr and "no such file" in out.stderr
    keys = subprocess.run([sys.executable, "-m", "ngramd.service", "keygen", str(tmp_path / "k")],
                          capture_output=True, text=True, timeout=60)
    assert keys.returncode == 0, keys.stderr
    secret = f'server.curve_secret_key="{tmp_path}/k/server.key_secret"'
    out = _check(tmp_path, "--tokenizer", "none", "--set", tcp, "--set", secret, "--set",
                 f'server.curve_authorized_dir="{tmp_path}/clients"')
    assert out.returncode == 2 and "curve_authorized_dir" in out.stderr
    (tmp_path / "clients").mkdir()
    out = _check(tmp_path, "--tokenizer", "none", "--set", tcp, "--set", secret, "--set",
                 f'server.curve_authorized_dir="{tmp_path}/clients"')
    assert out.returncode == 0, out.stderr
    assert "# [server] curve_secret_key" in out.stdout
