"""``ngram-demo``: the README's SmolLM2 walk-through, run as written, with nothing downloaded.

``make demo`` runs the shell commands of the README's section "A daemon's table for the
embedded model, learning" -- exactly those (``COMMANDS`` below; tests/test_readme.py fails when
the README's block and this one differ, and runs the README's in a temporary directory):

1. ``ngramd`` on a fresh table that records SmolLM2's tokenizer, read from its GGUF file;
2. ``ngram-client ingest`` of CPython standard-library source, tokenized as the model does;
3. round 1: ``ngram-generate --compare``, each prompt with plain and speculative decoding back
   to back (the speculative runs feed their outputs back to the table);
4. round 2: the same prompts, now drafting from a table that learned round 1's outputs;
5. the daemon stopped with SIGTERM and its hot tier removed from shared memory.

Each ``--compare`` prints its speed-up measured pair by pair (the geometric mean of the
per-prompt ratios, and their range), so a change in the machine's load between the plain and
the speculative totals cannot pass for a speed-up.  It exits 1 when a greedy output differs
(speculation must be lossless), and so does the demo.

Each run works in a directory of its own (``var/demo/run-*``; ``--keep`` keeps it), so round 1
always drafts from a table warmed from the corpus only; the daemon's log is ``var/smollm2.log``
in it.  Whatever happens, the commands' processes (the daemon included) are stopped at the end:
they run in a process group of their own.  Ctrl-C stops them within ``INTERRUPT_S`` seconds (the
group gets SIGINT, what is left SIGKILL), says "interrupted", and removes the hot tier the run
made (``ngramd clear-hot``), rather than staying silent, reporting "a command failed (exit
130)" and leaving its segments in /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

#: seconds the commands get to exit after Ctrl-C before they are killed (the issue's bound is
#: 3 s from the key to the prompt; clear-hot takes the rest)
INTERRUPT_S = 1.0

#: the README's walk-through, verbatim (tests/test_readme.py keeps the two equal)
COMMANDS = r"""
MODEL=$(ngram-generate --print-model)                          # the embedded SmolLM2-135M-Instruct (GGUF)
export NGRAM_TOKENIZER=$MODEL                                  # ngram-client tokenizes as the model does
export NGRAMD_ENDPOINT=ipc://$PWD/var/smollm2.sock             # where ngramd and its clients meet
mkdir -p var
ngramd --name smollm2 --tokenizer "$MODEL" --data-dir var --endpoint "$NGRAMD_ENDPOINT" 2> var/smollm2.log &
DAEMON=$!
ngram-client ping --wait 300 --pid $DAEMON                     # until it serves; gives up if it exits
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
ngram-client ingest --flush "$STDLIB"/{argparse,functools,textwrap,shlex,fileinput,csv,dataclasses,contextlib,string,glob}.py
ngram-client rebuild-hot                                       # publish the counts to shared memory
printf '%s\n' "Write a Python function that parses command line options with argparse and returns them." \
  "Write a Python class that wraps a file and counts the lines read from it." \
  "Explain what Python's functools.lru_cache does, with a short example." > var/prompts.txt
ngram-generate --compare --prompts var/prompts.txt --max-new-tokens 96   # round 1
ngram-client flush && ngram-client rebuild-hot                 # round 1's outputs, fed back: counted, hot
ngram-generate --compare --prompts var/prompts.txt --max-new-tokens 96   # round 2
ngram-client stats                                             # hits, drafts and acceptance per order
kill $DAEMON && wait $DAEMON                                   # SIGTERM: a clean exit
ngramd clear-hot --name smollm2                                # its hot tier, left for a restart, removed
""".strip("\n")


def script(commands: str) -> str:
    """``commands`` as a bash script that stops at the first failure and shows each command
    (a line ending in a backslash continues on the next) before it runs."""
    out = ["set -euo pipefail"]
    pending = ""
    for line in commands.splitlines():
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        shown = pending.rstrip("\n")
        out.append(f"printf '\\n$ %s\\n' {shlex.quote(shown)}")
        out.append(shown)
        pending = ""
    return "\n".join(out) + "\n"


def run(commands: str, cwd: Path, env: dict | None = None, timeout_s: float | None = None,
        stdout=None, wrap: list[str] | None = None) -> int:
    """Run ``commands`` (:func:`script`) with bash in ``cwd``; returns its exit code.  The
    commands run in a process group of their own, killed at the end whatever happened, so a
    step that fails never leaves the daemon it started running.  ``wrap``: an argv that runs
    the bash command line it is given (tests/test_readme.py's private /dev/shm)."""
    proc = subprocess.Popen([*(wrap or []), "bash", "-c", script(commands)], cwd=cwd, env=env,
                            start_new_session=True, stdout=stdout, stderr=subprocess.STDOUT
                            if stdout is not None else None)
    grace = 30.0
    try:
        return proc.wait(timeout=timeout_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        grace = INTERRUPT_S  # a user waits at the prompt: no 30 s drain
        raise
    finally:
        _stop_group(proc.pid, signal.SIGTERM if grace > INTERRUPT_S else signal.SIGINT, grace)
        proc.wait()


def _stop_group(pgid: int, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """Signal the commands' process group (SIGTERM or SIGINT: the daemon drains and exits 0,
    a generator stops), then SIGKILL what is left after ``grace_s`` seconds."""
    import time

    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ngram-demo", description=__doc__.splitlines()[0]
                                 .replace("``", ""))
    ap.add_argument("--root", default="var/demo",
                    help="where each run's directory goes (default: var/demo)")
    ap.add_argument("--keep", action="store_true",
                    help="keep this run's directory (table, prompts, the daemon's log)")
    ap.add_argument("--print", action="store_true", dest="print_only",
                    help="print the commands and exit")
    args = ap.parse_args(argv)
    if args.print_only:
        print(COMMANDS)
        return 0
    root = Path(args.root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    # the venv's commands first; per-user state (ingest progress) inside the run
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
               f"{os.environ.get('PATH', '')}", XDG_STATE_HOME=str(run_dir / "state"),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"== ngram-demo in {run_dir}: the README's commands", flush=True)
    try:
        rc = run(COMMANDS, run_dir, env)
    except KeyboardInterrupt:
        _clear_hot(run_dir, env)
        print(f"== ngram-demo: interrupted; the commands are stopped and the hot tier this "
              f"run made is removed (its directory: {run_dir})", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        return 130
    if rc:
        print(f"== ngram-demo: a command failed (exit {rc}); the daemon's log: "
              f"{run_dir / 'var' / 'smollm2.log'}", file=sys.stderr)
    if args.keep or rc:
        print(f"== kept {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc


def _clear_hot(run_dir: Path, env: dict) -> None:
    """The last command of the walk-through, ``ngramd clear-hot --name smollm2``, for a run
    cut short: the daemon is gone (stopped or killed), its hot tier is not (a daemon leaves it
    for a restart).  A command, not an import: the generator loads no daemon module
    (tests/test_layering.py)."""
    try:
        subprocess.run([str(Path(sys.executable).parent / "ngramd"), "clear-hot", "--name",
                        "smollm2"], cwd=run_dir, env=env, timeout=30)
    except (OSError, subprocess.SubprocessError, KeyboardInterrupt):
        print("== ngram-demo: the hot tier may be left; remove it with: ngramd clear-hot "
              "--name smollm2", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
