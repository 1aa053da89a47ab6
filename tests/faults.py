"""Fault injection and measurement for ``tests/test_reliability.py`` (docs/ARCHITECTURE.md §10).

Each helper owns one kind of fault and undoes it in a ``finally``: a loop-mounted ext4 image
(``loop_fs``) that can be filled (``fill``), made read-only (``read_only``), remounted read-only
by the kernel after an error (``emergency_read_only``) or frozen (``frozen``); a FUSE
passthrough whose reads fail (``ReadErrors``); a memory cgroup (``MemoryCgroup``); a probe run
as user ``nobody`` (``probe_as_nobody``).  Helpers that cannot set their fault up on this machine call
``pytest.skip`` with the reason.

Also here: the sizes of the two suites (``size(fast, stress)``, chosen by ``NGRAM_STRESS=1``),
the summary rows the stress run prints (``scenario``), sequences whose count can be read back
one by one (``keyed_seqs``/``counts``) and the client processes of the kill and load tests
(module-level functions: multiprocessing's spawn imports them by name).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
STRESS = os.environ.get("NGRAM_STRESS") == "1"
VOCAB = 151_936


def size(fast, stress):
    """``fast`` in the default run (CI), ``stress`` under ``NGRAM_STRESS=1``."""
    return stress if STRESS else fast


# ---------------------------------------------------------------------------------------------
# summary rows of the stress run
# ---------------------------------------------------------------------------------------------
def report_path() -> Path | None:
    """Where rows go: ``$NGRAM_STRESS_REPORT``, else ``bench/out/stress.jsonl`` under stress;
    the default (fast) run writes none."""
    env = os.environ.get("NGRAM_STRESS_REPORT")
    if env:
        return Path(env)
    return REPO / "bench" / "out" / "stress.jsonl" if STRESS else None


@contextlib.contextmanager
def scenario(name: str, what: str):
    """A summary row for the block: the test fills ``row["counts"]`` (kills, messages, faults)
    and ``row["figures"]``; the result (pass, skip or FAIL with its first line) and the
    seconds are added here, and the row is appended as one JSON line even when the block
    fails."""
    row = {"scenario": name, "what": what, "size": "stress" if STRESS else "fast",
           "counts": {}, "figures": {}}
    t0 = time.monotonic()
    try:
        yield row
        row["result"] = "pass"
    except pytest.skip.Exception as e:
        row["result"] = f"skip: {e.msg}"
        raise
    except BaseException as e:
        first = (str(e).strip().splitlines() or [""])[0]
        row["result"] = f"FAIL: {type(e).__name__}: {first}"[:240]
        raise
    finally:
        row["seconds"] = round(time.monotonic() - t0, 1)
        path = report_path()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# process figures
# ---------------------------------------------------------------------------------------------
def proc_kib(pid: int, field: str = "VmRSS") -> int:
    """A ``/proc/<pid>/status`` figure in KiB (VmRSS now, VmHWM the peak); 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _task_stat(task: Path) -> tuple[str, list[str]]:
    """A thread's name and the fields of its ``stat`` after the name (``fields[0]`` the state,
    ``[9]`` majflt, ``[11]``/``[12]`` utime/stime in clock ticks); OSError if it is gone."""
    text = (task / "stat").read_text()
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def major_faults(pid: int) -> dict[str, int]:
    """Major page faults (pages read back from disk) of each thread of ``pid`` so far, by
    ``"main"`` or ``"<comm>/<tid>"``; empty if it is gone."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):  # nothing when it is gone
        try:
            name, fields = _task_stat(task)
        except OSError:
            continue
        out["main" if task.name == str(pid) else f"{name}/{task.name}"] = int(fields[9])
    return out


class MainThreadWatch:
    """Samples the main thread of process ``pid`` every ``every_s`` on a thread of its own:
    its scheduler state, CPU time, major faults and, in uninterruptible sleep (``D``), its
    kernel stack (root only).  ``during(t0, t1)`` says what that thread did over a window of
    ``time.monotonic()``: computing, waiting for a core, waiting in the kernel (where), or
    asleep.  A stall's cause, read from outside the process it stalls."""

    def __init__(self, pid: int, every_s: float = 0.05):
        self.task = Path(f"/proc/{pid}/task/{pid}")
        self.every_s = every_s
        # (monotonic time, state, CPU seconds so far, major faults so far, kernel stack)
        self.samples: list[tuple[float, str, float, int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                _, f = _task_stat(self.task)
                stack = ""
                if f[0] == "D":
                    with contextlib.suppress(OSError):
                        stack = " <- ".join(ln.split()[1].split("+")[0] for ln in
                                            (self.task / "stack").read_text().splitlines()[:4])
                cpu_s = (int(f[11]) + int(f[12])) / self._tick  # utime + stime
                self.samples.append((time.monotonic(), f[0], cpu_s, int(f[9]), stack))
            except (OSError, IndexError, ValueError):
                return  # the process is gone

    def __enter__(self) -> "MainThreadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def during(self, t0: float, t1: float) -> dict:
        """Over ``[t0, t1]``: samples by state (R running or waiting for a core, S asleep, D in
        the kernel), CPU seconds used, major faults, and the kernel stacks seen in D."""
        win = [s for s in self.samples if t0 <= s[0] <= t1]
        if not win:
            return {"samples": 0}
        states: dict[str, int] = {}
        stacks: dict[str, int] = {}
        for _, st, _, _, stack in win:
            states[st] = states.get(st, 0) + 1
            if stack:
                stacks[stack] = stacks.get(stack, 0) + 1
        return {"samples": len(win), "states": states,
                "cpu_s": round(win[-1][2] - win[0][2], 2), "major_faults": win[-1][3] - win[0][3],
                "kernel_stacks": sorted(stacks.items(), key=lambda kv: -kv[1])[:5]}


def percentiles_ms(lat_s) -> dict:
    a = np.asarray(lat_s, np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 1)}


# ---------------------------------------------------------------------------------------------
# sequences whose count can be read back one by one
# ---------------------------------------------------------------------------------------------
MARK = 7  # starts every keyed sequence and occurs nowhere else in them
_BASE = VOCAB - 100


def full_drafts(client, seqs, ctx: int = 16, n: int = 8, within_s: float = 60.0,
                **draft_kw) -> tuple[int, int]:
    """How many of ``seqs`` draft in full and right (``seq[ctx:ctx + n]`` from ``seq[:ctx]``)
    within ``within_s`` in all, each asked again while it is not: a draft's cold reads are
    bounded by its budget (capped at ``table.MAX_BUDGET_US``), and past it the draft is
    answered from memory (short, or wrong from a shorter context) while the reads go on in the
    background, so on a busy host a context may need a second ask.  Returns (full, asked)."""
    full, asked, t_end = 0, 0, time.monotonic() + within_s
    for s in seqs:
        while True:
            asked += 1
            got = client.draft([s[:ctx]], n, **draft_kw)[0]
            if got.tokens.tolist() == s[ctx:ctx + n].tolist():
                full += 1
                break
            if time.monotonic() > t_end:
                break
            time.sleep(0.05)
    return full, asked


_BYSTANDER = """
import sys, threading, time
stop, late = threading.Event(), 0.0
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    t0 = time.perf_counter()
    time.sleep(0.01)
    late = max(late, time.perf_counter() - t0 - 0.01)
print(late, flush=True)
"""


@contextlib.contextmanager
def bystander():
    """How late the host wakes a thread that does nothing but sleep 10 ms at a time, in a
    process of its own, for as long as the block runs: ``result["late_s"]`` is the longest
    lateness.  A latency bound on the daemon (a draft never waits 1 s for the ingest) is
    checked against it, so a host too busy to run anyone on time fails nobody, while a daemon
    that holds its own threads (the GIL held through a write, a lock) still fails: the
    bystander did not wait."""
    p = subprocess.Popen([sys.executable, "-c", _BYSTANDER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    result = {"late_s": float("inf")}
    try:
        assert p.stdout.readline().strip() == "ready"
        yield result
    finally:
        out, _ = p.communicate("", timeout=60)
        result["late_s"] = float(out.split()[-1])


def keyed_seqs(first: int, n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """Sequences ``first .. first+n-1``: ``[MARK, hi, lo, filler...]`` with ``(hi, lo)`` the
    sequence number in base ``_BASE`` (ids >= 100) and random filler ids >= 100.  The order-3
    context ``(MARK, hi, lo)`` occurs once per sequence and nowhere else, so its ``total`` in
    the table is the number of times that sequence was counted."""
    assert length >= 4
    rng = np.random.default_rng([seed, first])
    out = []
    for q in range(first, first + n):
        s = rng.integers(100, VOCAB, length, dtype=np.uint32)
        s[0], s[1], s[2] = MARK, 100 + q // _BASE, 100 + q % _BASE
        out.append(s)
    return out


def counts(client, ids) -> np.ndarray:
    """How many times each keyed sequence is counted (the order-3 total of its context)."""
    ids = np.asarray(list(ids), np.int64)
    out = np.zeros(ids.size, np.int64)
    for a in range(0, ids.size, 4096):  # the daemon's default max_batch
        q = ids[a:a + 4096]
        ctx = np.stack([np.full(q.size, MARK), 100 + q // _BASE, 100 + q % _BASE], 1)
        out[a:a + q.size] = client.lookup(list(ctx.astype(np.uint32)))["total"][:, 3]
    return out


def settle(client, timeout_ms: int = 60_000) -> None:
    """Count everything acknowledged, then publish a hot generation built from the whole table:
    lookups read the hot tier first, and an older generation could hide a double count.  Each
    step takes well under a second here; a step that hangs raises ``Timeout`` after
    ``timeout_ms`` (the client's default for these ops is 10 minutes)."""
    client.flush(timeout_ms=timeout_ms)
    client.rebuild_hot(full=True, timeout_ms=timeout_ms)


def flush_until_ok(client, within_s: float, errors: tuple = (), **flush_kw) -> float:
    """Ask for a flush until one succeeds, as after a fault is removed (the daemon's own retries
    may be the ones that write the run); returns the seconds it took.  A flush that still fails
    ``within_s`` after the first ask fails the test with its error.  ``errors``: what counts as
    "not yet" beyond ``DaemonError`` (``Timeout``, ``DaemonUnavailable``)."""
    from ngram_client import DaemonError

    t0 = time.monotonic()
    while True:
        try:
            client.flush(**flush_kw)
            return time.monotonic() - t0
        except (DaemonError, *errors) as e:
            assert time.monotonic() - t0 < within_s, f"flush still fails {within_s:.0f} s after: {e}"
            time.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# client processes (spawned)
# ---------------------------------------------------------------------------------------------
def ingest_writer(endpoint: str, ack_path: str, stop, batch: int, length: int,
                  depth: int = 4) -> None:
    """Ingest keyed batches (key = first sequence number), ``depth`` in flight, each sent ONCE,
    until ``stop``; log ``SENT a b``, then ``ACK a b`` or ``LOST a b <error>`` per batch (line
    buffered: the writer is never killed, so no line is torn)."""
    from collections import deque

    from ngram_client import DaemonError, DaemonUnavailable, NgramClient, Timeout

    q = 0
    # 1.5 s: an ack takes milliseconds; the batches a kill cut off hold their slots this long
    with open(ack_path, "a", buffering=1) as log, NgramClient(endpoint, timeout_ms=1500) as c:
        inflight: deque = deque()
        while inflight or not stop.is_set():
            if not stop.is_set() and len(inflight) < depth:
                log.write(f"SENT {q} {q + batch - 1}\n")
                inflight.append((q, c.ingest_async(keyed_seqs(q, batch, length), key=f"q{q}")))
                q += batch
                continue
            a, fut = inflight.popleft()
            try:
                fut.result()
                log.write(f"ACK {a} {a + batch - 1}\n")
            except (Timeout, DaemonUnavailable) as e:  # cut off by a kill: maybe counted
                log.write(f"LOST {a} {a + batch - 1} {type(e).__name__}\n")
            except DaemonError as e:  # an error reply: the test fails on these
                log.write(f"ERR {a} {a + batch - 1} {e.code}\n")


def read_acks(path: Path) -> dict:
    """``{"SENT"|"ACK"|"LOST"|"ERR": [(first, last), ...]}`` from an ``ingest_writer`` log."""
    out: dict = {"SENT": [], "ACK": [], "LOST": [], "ERR": []}
    if path.exists():
        for line in path.read_text().splitlines():
            kind, a, b, *_ = line.split()
            out[kind].append((int(a), int(b)))
    return out


def load_client(endpoint: str, worker: int, shared: list, seconds: float, ingest: bool,
                results) -> None:
    """Draft the shared sequences' contexts for ``seconds`` (checking every draft against the
    sequence), and when ``ingest`` also ingest keyed batches of its own; put a dict of
    latencies (s), errors, wrong drafts and acknowledged sequence numbers on ``results``."""
    from ngram_client import NgramClient

    rng = np.random.default_rng(worker)
    shared = [np.asarray(s, np.uint32) for s in shared]
    lat, errors, bad, acked, inflight = [], [], 0, [], []
    q = 10_000_000 * (worker + 1)
    try:
        with NgramClient(endpoint, timeout_ms=10_000) as c:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                s = shared[rng.integers(len(shared))]
                t0 = time.perf_counter()
                try:
                    d = c.draft([s[:16]], 8, budget_us=1e6)[0]
                except Exception as e:
                    errors.append(f"draft: {e!r}"[:200])
                    continue
                lat.append(time.perf_counter() - t0)
                bad += len(d.tokens) == 0 or d.tokens.tolist() != s[16:16 + len(d.tokens)].tolist()
                if ingest and len(lat) % 20 == 0:
                    inflight.append((q, c.ingest_async(keyed_seqs(q, 16, 32), key=f"L{q}")))
                    q += 16
            for a, fut in inflight:
                try:
                    fut.result()
                    acked.extend(range(a, a + 16))
                except Exception as e:
                    errors.append(f"ingest: {e!r}"[:200])
    except Exception as e:
        errors.append(f"client: {e!r}"[:200])
    results.put({"worker": worker, "lat": lat, "errors": errors, "bad": int(bad),
                 "acked": acked})


# ---------------------------------------------------------------------------------------------
# filesystems
# ---------------------------------------------------------------------------------------------
def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


@contextlib.contextmanager
def loop_fs(root: Path, mb: int = 64, options: str = "errors=remount-ro"):
    """A fresh ext4 image of ``mb`` MiB mounted at ``root/mnt`` (no reserved blocks: the
    daemon runs as root, so "full" must mean full for root; ``errors=remount-ro`` so that
    ``emergency_read_only`` can make the kernel remount it).  Skips if mounting is refused;
    on exit thaws, clears immutable flags, unmounts (lazily if still busy) and deletes it."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("loop-mounted ext4 needs root and mkfs.ext4")
    img, mnt = root / "fs.img", root / "mnt"
    mnt.mkdir()
    _run("truncate", "-s", f"{mb}M", str(img))
    _run("mkfs.ext4", "-q", "-m", "0", str(img))
    r = _run("mount", "-o", f"loop,{options}", str(img), str(mnt), check=False)
    if r.returncode:
        # root with mkfs.ext4 has loop mounts (CI does): a refusal is a failure, not a skip
        pytest.fail(f"mounting a loop device was refused (as root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        _run("fsfreeze", "-u", str(mnt), check=False)
        _run("chattr", "-R", "-i", str(mnt), check=False)
        if _run("umount", str(mnt), check=False).returncode:
            _run("umount", "-l", str(mnt), check=False)
        img.unlink(missing_ok=True)


def fill(mnt: Path) -> Path:
    """Write zeros to ``mnt/filler`` until the filesystem is full (ENOSPC); returns the file."""
    path = mnt / "filler"
    chunk = bytes(1 << 20)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        # the last partial chunk: fill the remaining blocks too
        for n in (1 << 16, 1 << 12):
            try:
                while True:
                    f.write(bytes(n))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return path


@contextlib.contextmanager
def read_only(mnt: Path):
    """Make ``mnt`` refuse every write, reversibly; yields how.

    ``mount -o remount,ro`` is tried first.  The kernel refuses it (EBUSY) while any file is
    open for writing, which a running RocksDB always has (its WAL and LOG), so the fallback
    sets the immutable flag on everything under ``mnt`` (``chattr -R +i``): ext4 then fails
    writes to already open files, creates, renames and unlinks with EPERM, as a read-only
    mount fails them with EROFS.  Undone on exit (remount rw / ``chattr -R -i``)."""
    if _run("mount", "-o", "remount,ro", str(mnt), check=False).returncode == 0:
        try:
            yield "mount -o remount,ro"
        finally:
            _run("mount", "-o", "remount,rw", str(mnt))
        return
    if not shutil.which("chattr"):
        pytest.skip("remount,ro refused (files open for writing) and chattr is missing")
    try:
        _run("chattr", "-R", "+i", str(mnt))
        yield "chattr -R +i (remount,ro refused: EBUSY)"
    finally:
        _run("chattr", "-R", "-i", str(mnt))


def emergency_read_only(mnt: Path) -> str:
    """What a disk error does to an ext4 mounted ``errors=remount-ro``: the kernel aborts the
    journal and remounts it read-only while files are open (every write then fails with
    EROFS).  Injected through ext4's ``trigger_fs_error`` (sysfs); not reversible until the
    filesystem is unmounted (``remount_rw``).  Skips where the kernel offers no trigger."""
    dev = _run("findmnt", "-n", "-o", "SOURCE", str(mnt)).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(dev).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip(f"no {trigger}: cannot inject an ext4 error here")
    trigger.write_text("ngramd reliability test\n")
    deadline = time.monotonic() + 5
    # newer kernels show it as "emergency_ro" beside "rw"
    while not {"ro", "emergency_ro"} & set(
            _run("findmnt", "-n", "-o", "OPTIONS", str(mnt)).stdout.strip().split(",")):
        if time.monotonic() > deadline:
            pytest.fail("the kernel offers trigger_fs_error but did not remount the "
                        "filesystem read-only after an error")
        time.sleep(0.05)
    return "ext4 error (trigger_fs_error) -> emergency remount,ro"


def remount_rw(mnt: Path) -> None:
    """Unmount a filesystem the kernel made read-only and mount its image again, writable
    (the processes that had files open on it must be gone)."""
    img = mnt.parent / "fs.img"
    _run("umount", str(mnt))
    _run("mount", "-o", "loop,errors=remount-ro", str(img), str(mnt))


@contextlib.contextmanager
def frozen(mnt: Path):
    """``fsfreeze -f``: every write to ``mnt`` blocks until the ``finally`` thaws it."""
    if not shutil.which("fsfreeze"):
        pytest.skip("fsfreeze is not installed")
    r = _run("fsfreeze", "-f", str(mnt), check=False)
    if r.returncode:
        pytest.fail(f"fsfreeze is installed but refused: {r.stderr.strip()}")
    try:
        yield
    finally:
        _run("fsfreeze", "-u", str(mnt))


# ---------------------------------------------------------------------------------------------
# memory cgroup
# ---------------------------------------------------------------------------------------------
def pressure_ms(cgroup: Path | None = None) -> dict[str, float]:
    """The host's pressure stall totals (``/proc/pressure/{memory,io}``, the kernel's PSI), or
    a cgroup v2 group's own (its ``{memory,io}.pressure``: its tasks only): ms some (and all:
    ``full``) tasks spent waiting on memory reclaim or on I/O since boot (or since the group was
    made); empty where the kernel keeps none.  Two readings' difference says whether a stall
    seen in a test was the host's reclaim or writeback rather than the product's."""
    out = {}
    for res in ("memory", "io"):
        f = Path(f"/proc/pressure/{res}") if cgroup is None else cgroup / f"{res}.pressure"
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            kind, *fields = line.split()
            total = dict(f.split("=", 1) for f in fields).get("total")
            if total is not None:
                out[f"{res}_{kind}_ms"] = int(total) / 1e3
    return out


class MemoryCgroup:
    """A child memory cgroup of this process's own, limited to ``limit`` bytes (cgroup v2
    ``memory.max``, else v1 ``memory.limit_in_bytes``).  Skips if neither can be set up.
    ``add(pid)`` moves a process in; ``close()`` removes the group (its processes must be gone)."""

    def __init__(self, limit: int):
        self.path: Path | None = None
        self.v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            own[ctrls] = path
        if self.v2:
            parent = Path("/sys/fs/cgroup" + own.get("", "/"))
            files = ("memory.max", "memory.events", "memory.peak")
        else:
            key = next((k for k in own if "memory" in k.split(",")), None)
            if key is None:
                pytest.skip("no memory cgroup controller (neither v2 nor v1)")
            parent = Path("/sys/fs/cgroup/memory" + own[key])
            files = ("memory.limit_in_bytes", "memory.oom_control", "memory.max_usage_in_bytes")
        self._limit_f, self._events_f, self._peak_f = files
        path = parent / f"ngramd-test-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
            self.path = path
            (path / self._limit_f).write_text(str(limit))
            swap = path / ("memory.swap.max" if self.v2 else "memory.memsw.limit_in_bytes")
            if swap.exists():
                with contextlib.suppress(OSError):
                    swap.write_text("0" if self.v2 else str(limit))
        except OSError as e:
            self.close()
            if os.geteuid() != 0:
                pytest.skip(f"creating a memory cgroup under {parent} needs root: {e}")
            pytest.fail(f"cannot create a memory cgroup under {parent} (as root): {e}")
        self.mechanism = f"cgroup {'v2 memory.max' if self.v2 else 'v1 memory.limit_in_bytes'}"

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        for line in (self.path / self._events_f).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    #: ``memory.stat`` figures read, by their v2 names, with v1's name for each
    STAT_KEYS = {"pgmajfault": "pgmajfault", "shmem": "shmem", "file": "cache",
                 "file_dirty": "dirty", "file_writeback": "writeback",
                 "workingset_refault_file": "workingset_refault_file"}

    def memory_stat(self) -> dict[str, int]:
        """The group's ``memory.stat`` figures of ``STAT_KEYS`` (by their v2 names)."""
        try:
            lines = (self.path / "memory.stat").read_text().splitlines()
        except OSError:
            return {}
        stat = dict(line.split() for line in lines)
        return {k: int(stat[name]) for k, v1 in self.STAT_KEYS.items()
                if (name := k if self.v2 else v1) in stat}

    def pressure_ms(self) -> dict[str, float]:
        """The group's own PSI totals (``pressure_ms``); empty on v1."""
        return pressure_ms(self.path) if self.v2 else {}

    def peak(self) -> int:
        """Peak memory charged to the group, bytes (page cache included)."""
        f = self.path / self._peak_f
        return int(f.read_text()) if f.exists() else 0

    def close(self) -> None:
        if self.path is None:
            return
        for _ in range(50):  # the last process may take a moment to leave
            try:
                self.path.rmdir()
                break
            except OSError:
                time.sleep(0.1)
        self.path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# a local user without the daemon's group
# ---------------------------------------------------------------------------------------------
_PROBE = r"""
import errno, json, os, socket, sys
out = {}
for kind, path in json.loads(sys.argv[1]):
    try:
        if kind == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.close()
        elif kind == "list":
            os.listdir(path)
        else:
            open(path, "rb").close()
        out[path] = "OK"
    except OSError as e:
        out[path] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""


def probe_as_nobody(checks: list[tuple[str, str]]) -> dict:
    """Run ``checks`` (``("connect"|"list"|"open", path)``) as user ``nobody`` (no groups) with
    the system Python; returns ``{path: "OK" | errno name}``.  Skips if that is impossible."""
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("user 'nobody' does not exist")
    if os.geteuid() != 0:
        pytest.skip("switching to 'nobody' needs root")
    py = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")
    if py is None:
        pytest.skip("no system python3 that 'nobody' can run")
    r = subprocess.run([py, "-I", "-S", "-c", _PROBE, json.dumps(checks)], cwd="/",
                       user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.fail(f"cannot run a probe as nobody (as root): {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


@contextlib.contextmanager
def disk_full(mnt: Path, leave: int = 0):
    """``fill`` the filesystem but for ``leave`` bytes; the filler is deleted on exit (space
    comes back at once)."""
    path = fill(mnt)
    if leave:
        os.truncate(path, max(path.stat().st_size - leave, 0))
    try:
        yield f"filled to ENOSPC{f' but {leave >> 10} KiB' if leave else ''}"
    finally:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# read errors: a FUSE passthrough that can fail reads
# ---------------------------------------------------------------------------------------------
def _passthrough_main(back: str, mnt: str, flag: str) -> None:
    """The FUSE process of ``ReadErrors``: every call goes to the same path under ``back``;
    while the file ``flag`` exists, ``read`` of a ``.sst`` file fails with EIO."""
    import fuse  # fusepy (the test extra), over libfuse2

    class Passthrough(fuse.Operations):
        def _p(self, path):
            return os.path.join(back, path.lstrip("/"))

        def access(self, path, mode):
            if not os.access(self._p(path), mode):
                raise fuse.FuseOSError(errno.EACCES)

        def getattr(self, path, fh=None):
            st = os.lstat(self._p(path))
            return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode",
                                                "st_mtime", "st_nlink", "st_size", "st_uid")}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._p(path))

        def statfs(self, path):
            sv = os.statvfs(self._p(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                                "f_favail", "f_ffree", "f_files", "f_flag",
                                                "f_frsize", "f_namemax")}

        def chmod(self, path, mode):
            os.chmod(self._p(path), mode)

        def chown(self, path, uid, gid):
            os.chown(self._p(path), uid, gid)

        def mkdir(self, path, mode):
            os.mkdir(self._p(path), mode)

        def rmdir(self, path):
            os.rmdir(self._p(path))

        def unlink(self, path):
            os.unlink(self._p(path))

        def rename(self, old, new):
            os.rename(self._p(old), self._p(new))

        def link(self, target, name):
            os.link(self._p(name), self._p(target))

        def symlink(self, name, target):
            os.symlink(target, self._p(name))

        def readlink(self, path):
            return os.readlink(self._p(path))

        def utimens(self, path, times=None):
            os.utime(self._p(path), times)

        def truncate(self, path, length, fh=None):
            os.truncate(self._p(path), length)

        def open(self, path, flags):
            return os.open(self._p(path), flags)

        def create(self, path, mode, fi=None):
            return os.open(self._p(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            if path.endswith(".sst") and os.path.exists(flag):
                raise fuse.FuseOSError(errno.EIO)
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            os.close(fh)

        def fsync(self, path, datasync, fh):
            (os.fdatasync if datasync else os.fsync)(fh)

    # direct_io: every read reaches this process (no page cache in between)
    fuse.FUSE(Passthrough(), mnt, foreground=True, nothreads=False, direct_io=True)


class ReadErrors:
    """A directory whose ``.sst`` reads can be made to fail with EIO: a FUSE passthrough
    (fusepy over libfuse2, in a process of its own) of ``root/back`` mounted at ``root/fuse``.
    ``failing()`` is a context manager during which reads fail.  Skips where FUSE cannot be
    set up (no /dev/fuse, no fusepy or libfuse2, the mount refused)."""

    def __init__(self, root: Path):
        import multiprocessing as mp

        if not Path("/dev/fuse").exists():
            pytest.skip("FUSE: no /dev/fuse")
        try:
            import fuse  # noqa: F401
        except (ImportError, OSError, EnvironmentError) as e:
            pytest.skip(f"fusepy over libfuse2 is not available: {e}")
        self.back, self.mnt, self.flag = root / "back", root / "fuse", root / "eio"
        self.back.mkdir()
        self.mnt.mkdir()
        self.proc = mp.get_context("spawn").Process(
            target=_passthrough_main, args=(str(self.back), str(self.mnt), str(self.flag)),
            daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mnt):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.close()
                pytest.fail("/dev/fuse, fusepy and libfuse2 are here but the FUSE mount "
                            "failed")
            time.sleep(0.05)

    @contextlib.contextmanager
    def failing(self):
        self.flag.touch()
        try:
            yield "FUSE passthrough: read() of .sst files fails with EIO"
        finally:
            self.flag.unlink(missing_ok=True)

    def close(self) -> None:
        if os.path.ismount(self.mnt):
            if _run("umount", str(self.mnt), check=False).returncode:
                _run("umount", "-l", str(self.mnt), check=False)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# wire protocol fuzz
# ---------------------------------------------------------------------------------------------
def _weird_values():
    import msgpack

    return [None, True, False, -1, 0, 1, 2**31, 2**63 - 1, 2**64 - 1, -2**63, 0.5,
            float("nan"), float("inf"), float("-inf"), "", "x", "ping", "draft", "\x00",
            "é" * 300, "x" * 5000, b"", b"\xff\xfe", [], [1, 2], ["op"], [[[[]]]], {}, {"a": 1},
            {1: 2}, {"inf": 1}, {"-1": 1}, msgpack.ExtType(5, b"ab"),
            msgpack.Timestamp(1, 0)]


_REPORT_KEYS = ["inf", "-inf", "nan", "1e999", "-1", "99", "4", " 4 ", "1_0", "\u0663", "",
                "0x4", 4, -5, 2**64 - 1, 2**63, 1.5, float("inf"), b"4", None, True]
_REPORT_VALUES = [1, 0, -1, 2**48, 2**64 - 1, 1.5, float("nan"), float("inf"), "3", None, [],
                  {}, True]
#: op -> weight; slow ops (flush, rebuild, top) are rare so a run stays bounded in time
_FUZZ_OPS = {"ping": 4, "info": 2, "stats": 2, "draft": 25, "lookup": 15, "ingest": 12,
             "report": 15, "top": 3, "flush": 0.5, "rebuild_hot": 0.3, "shutdown": 1}


def _op_fields(op: str, rng) -> dict:
    if op == "draft":
        f = {"max_len": rng.randint(1, 16)}
        if rng.random() < 0.5:
            f["budget_us"] = rng.choice([0.0, 100.0, 1e5])
        return f
    if op == "ingest":
        return {"key": f"fz{rng.getrandbits(62)}"}
    if op == "report":
        return {"drafted": {4: 3, 8: 1}, "accepted": {4: 1}}
    if op == "top":
        return {"order": rng.randint(1, 16), "n": rng.randint(1, 50)}
    if op == "rebuild_hot":
        return {"full": rng.random() < 0.5}
    return {}


def _batch_frames(rng, max_batch: int, max_tokens: int) -> list[bytes]:
    """Token and offset frames (``rng``: a ``random.Random``), valid or broken in one of many
    ways."""
    lens = [rng.randint(1, 19) for _ in range(rng.randint(1, 4))]
    tok = np.array([rng.randrange(VOCAB) for _ in range(sum(lens))], "<u4")
    off = np.concatenate([[0], np.cumsum(lens)]).astype("<i8")
    kind = rng.randrange(16)
    if kind == 1:  # an id out of range
        tok[rng.randrange(tok.size)] = rng.choice([VOCAB, VOCAB + 1, 2**32 - 1])
    elif kind == 2:  # tokens not a multiple of 4 bytes
        return [tok.tobytes()[:-rng.randint(1, 3)], off.tobytes()]
    elif kind == 3:  # offsets not a multiple of 8 bytes, or fewer than two
        return [tok.tobytes(), off.tobytes()[:rng.choice([0, 3, 8, 12])]]
    elif kind == 4:  # offsets that do not start at 0 or end at the token count
        off[rng.choice([0, -1])] += rng.choice([-1, 1, 2**40])
    elif kind == 5:  # falling, negative or huge offsets
        for j in range(1, off.size):
            off[j] = rng.choice([off[j], -1, -2**63, 2**62, 2**63 - 1])
    elif kind == 6:  # an empty sequence
        off[1] = 0
    elif kind == 7:  # too many sequences
        k = max_batch + rng.randint(1, 100)
        return [np.ones(k, "<u4").tobytes(), np.arange(k + 1, dtype="<i8").tobytes()]
    elif kind == 8:  # too many tokens
        k = max_tokens + rng.randint(1, 1000)
        return [np.ones(k, "<u4").tobytes(), np.array([0, k], "<i8").tobytes()]
    elif kind == 9:  # 64-bit tokens
        return [tok.astype("<u8").tobytes(), off.tobytes()]
    elif kind == 10:  # random bytes
        return [rng.randbytes(rng.randrange(64)) for _ in range(2)]
    elif kind == 11:  # big-endian
        return [tok.astype(">u4").tobytes(), off.astype(">i8").tobytes()]
    return [tok.tobytes(), off.tobytes()]


def fuzz_message(rng, max_msg_bytes: int, max_batch: int, max_tokens: int):
    """One fuzzed request (``rng``: a ``random.Random``): ``(frames, expect_id, may_drop,
    kind)``.

    ``expect_id`` is the id an error reply must carry (the header was a readable map with an
    integer id) or ``None``; ``may_drop``: a frame above libzmq's MAXMSGSIZE (2 x
    max_msg_bytes + 64 KiB), which is dropped with the connection instead of answered."""
    import msgpack

    weird = _weird_values()
    r = rng.random()
    if r < 0.08:  # random frames
        return [rng.randbytes(rng.randrange(300)) for _ in range(rng.randint(1, 9))], \
            None, False, "random frames"
    if r < 0.10:  # valid msgpack that is not a map, deep nesting, a header above 64 KiB
        head = rng.choice([msgpack.packb(rng.choice(weird)), b"\x91" * 20_000 + b"\xc0",
                           b"\xde\xff\xff" + b"\xa1a\x01" * 10,
                           msgpack.packb({"v": 1, "op": "ping", "id": 1, "pad": "x" * 70_000})])
        return [head], None, False, "odd header"
    if r < 0.102:  # above the hard cap: libzmq drops it
        return [msgpack.packb({"v": 1, "op": "ping", "id": 1}),
                bytes(2 * max_msg_bytes + (1 << 17))], None, True, "over the cap"
    op = rng.choices(list(_FUZZ_OPS), weights=list(_FUZZ_OPS.values()))[0]
    req_id = rng.choice([1, 17, 2**31, 2**63 - 1, 2**64 - 1, -5])
    head = {"v": 1, "op": op, "id": req_id, **_op_fields(op, rng)}
    if op == "report" and rng.random() < 0.6:  # keys inf/huge/negative/odd, values likewise
        for which in ("drafted", "accepted"):
            head[which] = {rng.choice(_REPORT_KEYS): rng.choice(_REPORT_VALUES)
                           for _ in range(rng.randrange(4))}
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # fields of the wrong type
        head[rng.choice(list(head) + ["dtype", "key", "extra", 5])] = rng.choice(weird)
    if rng.random() < 0.05:
        del head[rng.choice(list(head))]
    if op in ("draft", "lookup", "ingest"):
        frames = _batch_frames(rng, max_batch, max_tokens)
        if rng.random() < 0.1:  # wrong frame counts
            frames = frames[:rng.randrange(2)] + [b"x"] * rng.choice([0, 1, 7])
    elif op == "report" and rng.random() < 0.5:  # a keys frame of odd size
        frames = [rng.randbytes(rng.choice([8, 13, 800]))]
    else:
        frames = [b"x"] * rng.choice([0, 0, 0, 1, 9])
    kind = f"header {op}"
    if rng.random() < 0.03:  # above max_msg_bytes, below the cap: a too_large reply
        frames = frames + [bytes(max_msg_bytes + 1)]
        kind = "too large"
    try:
        raw = msgpack.packb(head, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        head = {"v": 1, "op": "ping", "id": req_id}
        raw = msgpack.packb(head)
    if rng.random() < 0.1:  # truncated msgpack
        return [raw[:rng.randrange(len(raw))]] + frames, None, False, "truncated"
    rid = head.get("id")
    expect = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
    return [raw] + frames, (None if len(raw) > 64 << 10 else expect), False, kind
