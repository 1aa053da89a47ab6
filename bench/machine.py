"""What machine and software a benchmark ran on, recorded beside its figures (STYLE habit 12).

Imported by the scripts in bench/ (they run as ``python bench/bench_x.py``, so this folder is
on ``sys.path``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def git_state() -> tuple[str, bool | None]:
    """(short commit, whether the working tree has uncommitted changes)."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "", None
    return commit, dirty


def numa_nodes() -> dict[int, set[int]]:
    """NUMA node -> its CPUs (``/sys/devices/system/node``); empty where the kernel says
    nothing."""
    out = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = set()
        try:
            for part in (d / "cpulist").read_text().strip().split(","):
                a, _, b = part.partition("-")
                if a:
                    cpus.update(range(int(a), int(b or a) + 1))
        except OSError:
            continue
        out[int(d.name[4:])] = cpus
    return out


def machine_info(packages: tuple[str, ...] = ()) -> dict:
    """CPU, cores, RAM, kernel, Python, the given packages' versions, git commit, load and
    thread settings, date."""
    vers = {}
    for pkg in packages:
        try:
            vers[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            vers[pkg] = None
    commit, dirty = git_state()
    return {"cpu": cpu_model(), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "ram_bytes": ram_bytes(),
            "numa_nodes": len(numa_nodes()) or 1,
            "kernel": platform.release(), "python": platform.python_version(), **vers,
            "git_commit": commit, "uncommitted_changes": dirty, "loadavg_start": os.getloadavg(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
