"""Where the threads of a process (and its children) wait in the kernel: every ``--every-ms``
each thread's state and kernel stack (``/proc/<pid>/task/<tid>/stack``, root only) is read;
threads in uninterruptible sleep (``D``) are tallied by the syscall and the frames they wait
in.  How the daemon's 1-31 s stalls during a huge ingest were traced to RocksDB's per-MiB
``posix_fadvise`` inside an ``SstFileWriter`` call (bench/RESULTS.md, "A huge ingest beside
the vLLM tests"; issue 31).

Usage (as root): ``python bench/kernel_waits.py --match 'ngramd.service' [--seconds 120]``
follows every process whose command line contains the text, started before or during the
run, until the time is up or Ctrl-C; prints one line per D-state episode (thread, how long,
where) and a tally.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from pathlib import Path


def _pids(match: str) -> set[int]:
    """Processes whose command line contains ``match``, and their children."""
    out = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            if match in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                out.add(int(p.name))
        except OSError:
            continue
    for pid in list(out):
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                out.update(int(c) for c in (t / "children").read_text().split())
            except OSError:
                pass
    return out


def _where(task: Path) -> str | None:
    """``syscall: frame <- frame`` for a thread in D state, else None."""
    try:
        stat = (task / "stat").read_text()
        if stat[stat.rindex(")") + 2] != "D":
            return None
        frames = [ln.split()[1].split("+")[0] for ln in (task / "stack").read_text().splitlines()]
    except (OSError, IndexError):
        return None
    sysc = next((f for f in frames if f.startswith(("__x64_sys_", "ksys_"))), "?")
    return f"{sysc}: {' <- '.join(frames[:3])}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", required=True, help="text in the command line of the processes")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--every-ms", type=float, default=20.0)
    args = ap.parse_args()
    tally: collections.Counter = collections.Counter()
    open_eps: dict[tuple[int, int], tuple[float, str]] = {}
    dt = args.every_ms / 1e3
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            now = time.monotonic()
            seen = set()
            for pid in _pids(args.match):
                for task in Path(f"/proc/{pid}/task").glob("*"):
                    where = _where(task)
                    if where is None:
                        continue
                    key = (pid, int(task.name))
                    seen.add(key)
                    tally[where] += 1
                    if key not in open_eps or open_eps[key][1] != where:
                        open_eps[key] = (now, where)
            for key in [k for k in open_eps if k not in seen]:
                t0, where = open_eps.pop(key)
                if now - t0 >= 0.1:
                    print(f"{time.strftime('%H:%M:%S')} pid {key[0]} tid {key[1]}: "
                          f"{now - t0:.2f} s in {where}", flush=True)
            time.sleep(dt)
    except KeyboardInterrupt:
        pass
    print(f"\nD-state samples ({args.every_ms:g} ms each), by where:")
    for where, n in tally.most_common(12):
        print(f"{n:7d}  {where}")


if __name__ == "__main__":
    main()
